"""Golden bytes for every on-disk layout: `encode(x) == fixture` and `decode(fixture) == x`.

Fixtures live in `tests/fixtures/*.hex`: hex digits with free whitespace, `#` comments to the end of the
line, and `@name` lines that start a named section. The STORE_FORMAT.md §16 vectors were produced by the
real RocketMQ 4.9.3 code; the `pattern` fixtures give every field its own byte pattern, so a field
written at the wrong offset or with the wrong width cannot go unnoticed.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest

from indexcore.checkpoint import CHECKPOINT_FIELDS, CHECKPOINT_FILE_SIZE, StoreCheckpoint
from indexcore.commitlog import (
    BLANK_MAGIC_CODE,
    BODY_CRC_OFFSET,
    BORN_HOST_OFFSET,
    BORN_TIMESTAMP_OFFSET,
    BORNHOST_V6_FLAG,
    CRC32_RESERVED_LENGTH,
    FLAG_OFFSET,
    HOST_V4_LENGTH,
    HOST_V6_LENGTH,
    MAGIC_CODE_OFFSET,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    MULTI_TAGS_FLAG,
    PHYSICAL_OFFSET_OFFSET,
    QUEUE_ID_OFFSET,
    QUEUE_OFFSET_OFFSET,
    RECORD_PREFIX,
    STOREHOSTADDRESS_V6_FLAG,
    SYS_FLAG_OFFSET,
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_PREPARED_TYPE,
    Host,
    MessageRecord,
    body_crc32,
    decode_crc32_digits,
    encode_blank,
    encode_crc32_property,
    fixed_part_struct,
    parse_properties,
)
from indexcore.consumequeue import BLANK_UNIT, CQ_UNIT_SIZE, ConsumeQueueUnit
from indexcore.errors import CorruptRecordError, StoreLayoutError
from indexcore.indexfile import (
    HASH_SLOT_SIZE,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER_SIZE,
    IndexEntry,
    IndexFile,
    IndexHeader,
    index_file_size,
)
from indexcore.javahash import index_key_hash
from indexcore.msgid import create_offset_msg_id
from indexcore.reader import Stop, decode_segment

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BROKER_CHECKPOINT = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "visible" / "store" / "checkpoint"


def load_hex_sections(name: str) -> dict[str, bytes]:
    """The bytes of each `@section` of `fixtures/<name>.hex` (key "" for bytes before the first section)."""
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in (FIXTURES / f"{name}.hex").read_text(encoding="utf-8").splitlines():
        text = line.split("#", 1)[0].strip()
        if text.startswith("@"):
            current = text[1:].strip()
            sections[current] = []
        elif text:
            sections[current].append(text)
    return {k: bytes.fromhex("".join(v)) for k, v in sections.items() if v or k}


def load_hex(name: str) -> bytes:
    """All bytes of `fixtures/<name>.hex`, sections concatenated in file order."""
    return b"".join(load_hex_sections(name).values())


# --- CommitLog records --------------------------------------------------------------------------------

PROPS_16_1 = b"KEYS\x01key1 key2\x02TAGS\x01TagA\x02UNIQ_KEY\x01C0A8010A12342A9F0000000000000001\x02WAIT\x01true"
RECORD_16_1 = MessageRecord(
    topic="TopicA", queue_id=1, flag=0, queue_offset=5, physical_offset=0, sys_flag=0,
    born_timestamp=1700000000000, born_host=Host(bytes([192, 168, 1, 10]), 54321),
    store_timestamp=1700000000123, store_host=Host(bytes([192, 168, 1, 20]), 10911),
    reconsume_times=0, prepared_transaction_offset=0, body=b"test", properties=PROPS_16_1,
    body_crc=1484750348, magic=MESSAGE_MAGIC_CODE,
)

RECORD_V1_IPV6 = MessageRecord(
    topic="E" * 8, queue_id=0x11111111, flag=0x22222222, queue_offset=0x3333333333333333,
    physical_offset=0x4444444444444444,
    sys_flag=STOREHOSTADDRESS_V6_FLAG | BORNHOST_V6_FLAG | TRANSACTION_COMMIT_TYPE | MULTI_TAGS_FLAG,
    born_timestamp=0x5555555555555555, born_host=Host(b"\x66" * 16, 0x7777),
    store_timestamp=0x0888888888888888, store_host=Host(b"\x99" * 16, 0xAAAA),
    reconsume_times=0x0BBBBBBB, prepared_transaction_offset=0x0CCCCCCCCCCCCCCC, body=b"\xdd" * 6,
    properties=b"KEYS\x01k1 k2\x02TAGS\x01TagF", body_crc=0x739CC7A6, magic=MESSAGE_MAGIC_CODE,
)

RECORD_V2 = MessageRecord(
    topic="E" * 200, queue_id=0x11111111, flag=0x22222222, queue_offset=0x3333333333333333,
    physical_offset=0x4444444444444444, sys_flag=STOREHOSTADDRESS_V6_FLAG | TRANSACTION_PREPARED_TYPE,
    born_timestamp=0x5555555555555555, born_host=Host(b"\x66" * 4, 0x7777),
    store_timestamp=0x0888888888888888, store_host=Host(b"\x99" * 16, 0xAAAA),
    reconsume_times=0x0BBBBBBB, prepared_transaction_offset=0x0CCCCCCCCCCCCCCC, body=b"\xdd" * 5,
    properties=b"KEYS\x01k1\x02TAGS\x01TagF\x02", body_crc=0x2ADC9EE9, magic=MESSAGE_MAGIC_CODE_V2,
)

RECORD_CASES = [
    pytest.param("commitlog_record_16_1", RECORD_16_1, id="16_1_v1_ipv4"),
    pytest.param("commitlog_record_v1_ipv6", RECORD_V1_IPV6, id="v1_ipv6_ipv6"),
    pytest.param("commitlog_record_v2", RECORD_V2, id="v2_ipv4_ipv6"),
]


@pytest.mark.parametrize(("fixture", "record"), RECORD_CASES)
def test_message_record_encodes_to_fixture(fixture: str, record: MessageRecord) -> None:
    """MessageRecord.encode() gives the golden bytes, and total_size is their length."""
    data = load_hex(fixture)
    assert record.encode() == data
    assert record.total_size == len(data)


@pytest.mark.parametrize(("fixture", "record"), RECORD_CASES)
def test_message_record_decodes_from_fixture(fixture: str, record: MessageRecord) -> None:
    """MessageRecord.decode(golden bytes) gives back every field, with the CRC checked."""
    assert MessageRecord.decode(load_hex(fixture), check_crc=True) == record


@pytest.mark.parametrize(("fixture", "record"), RECORD_CASES)
def test_message_record_decodes_inside_a_larger_buffer(fixture: str, record: MessageRecord) -> None:
    """Decoding at a non-zero position with other bytes after the record gives the same record."""
    data = load_hex(fixture)
    lead = b"\xa5" * 13
    assert MessageRecord.decode(lead + data + b"\x5a" * 40, len(lead)) == record


@pytest.mark.parametrize(("fixture", "record"), RECORD_CASES)
def test_fixture_body_crc_is_masked_crc32(fixture: str, record: MessageRecord) -> None:
    """The BODYCRC stored in every fixture is crc32(body) with the top bit cleared (§3.7)."""
    stored = struct.unpack_from(">i", load_hex(fixture), BODY_CRC_OFFSET)[0]
    assert stored == record.body_crc == body_crc32(record.body)


def test_record_16_1_body_crc_value() -> None:
    """crc32(b"test") is 0xD87F7E0C raw and 1484750348 (0x587F7E0C) as stored (§16.5)."""
    assert zlib.crc32(b"test") == 0xD87F7E0C
    assert body_crc32(b"test") == 1484750348


def test_named_offsets_point_at_their_fields() -> None:
    """The layout constants locate each field in the pattern fixture (IPv6 hosts, so nothing lines up by luck)."""
    data = load_hex("commitlog_record_v1_ipv6")
    assert data[QUEUE_ID_OFFSET : QUEUE_ID_OFFSET + 4] == b"\x11" * 4
    assert data[FLAG_OFFSET : FLAG_OFFSET + 4] == b"\x22" * 4
    assert data[QUEUE_OFFSET_OFFSET : QUEUE_OFFSET_OFFSET + 8] == b"\x33" * 8
    assert data[PHYSICAL_OFFSET_OFFSET : PHYSICAL_OFFSET_OFFSET + 8] == b"\x44" * 8
    assert struct.unpack_from(">i", data, SYS_FLAG_OFFSET)[0] == RECORD_V1_IPV6.sys_flag
    assert data[BORN_TIMESTAMP_OFFSET : BORN_TIMESTAMP_OFFSET + 8] == b"\x55" * 8
    assert data[BORN_HOST_OFFSET : BORN_HOST_OFFSET + 16] == b"\x66" * 16
    assert struct.unpack_from(">i", data, MAGIC_CODE_OFFSET)[0] == MESSAGE_MAGIC_CODE


@pytest.mark.parametrize(
    ("sys_flag", "born", "store"),
    [
        (0, HOST_V4_LENGTH, HOST_V4_LENGTH),
        (BORNHOST_V6_FLAG, HOST_V6_LENGTH, HOST_V4_LENGTH),
        (STOREHOSTADDRESS_V6_FLAG, HOST_V4_LENGTH, HOST_V6_LENGTH),
        (BORNHOST_V6_FLAG | STOREHOSTADDRESS_V6_FLAG, HOST_V6_LENGTH, HOST_V6_LENGTH),
    ],
)
def test_fixed_part_ends_at_body(sys_flag: int, born: int, store: int) -> None:
    """The fixed part (fields 1 to BODYLENGTH) is 72 + B + S bytes for each host combination (§3.2)."""
    assert fixed_part_struct(sys_flag).size == BORN_HOST_OFFSET + born + 8 + store + 4 + 8 + 4


def test_record_16_1_dispatch_request() -> None:
    """Decoding the §16.1 record as a segment gives the DispatchRequest the spec lists (tagsCode 2598919)."""
    segment_size = 4096
    buf = bytearray(segment_size)
    data = load_hex("commitlog_record_16_1")
    buf[: len(data)] = data
    result = decode_segment(bytes(buf), 0, segment_offset=0, segment_size=segment_size, max_bytes=segment_size)
    assert result.stop is Stop.END
    assert result.position == len(data)
    batch = result.batch
    assert len(batch) == 1
    assert batch.topic_of(0) == "TopicA"
    assert int(batch.queue_id[0]) == 1
    assert int(batch.phy_offset[0]) == 0
    assert int(batch.msg_size[0]) == 177
    assert int(batch.tags_code[0]) == 2598919
    assert int(batch.store_timestamp[0]) == 1700000000123
    assert int(batch.queue_offset[0]) == 5
    assert batch.keys == ["key1 key2"]
    assert batch.uniq_key == ["C0A8010A12342A9F0000000000000001"]
    assert int(batch.sys_flag[0]) == 0
    assert int(batch.prepared_transaction_offset[0]) == 0


def test_record_16_1_offset_msg_id() -> None:
    """The offset msgId of the §16.1 record is store host + port + offset in upper-case hex (§13.1)."""
    assert create_offset_msg_id(RECORD_16_1.store_host, 0) == "C0A8011400002A9F0000000000000000"


# --- BLANK --------------------------------------------------------------------------------------------

def test_blank_encodes_to_fixture() -> None:
    """encode_blank(1234) is TOTALSIZE 1234 followed by the BLANK magic (§16.1)."""
    assert encode_blank(1234) == load_hex("commitlog_blank")


def test_blank_fixture_decodes_as_end_of_segment() -> None:
    """A segment with the BLANK fixture 1234 bytes before its end stops there with Stop.BLANK."""
    segment_size = 4096
    blank = load_hex("commitlog_blank")
    total, magic = RECORD_PREFIX.unpack(blank)
    assert (total, magic) == (1234, BLANK_MAGIC_CODE)
    buf = bytearray(segment_size)
    at = segment_size - total
    buf[at : at + len(blank)] = blank
    result = decode_segment(bytes(buf), at, segment_offset=0, segment_size=segment_size, max_bytes=segment_size)
    assert result.stop is Stop.BLANK
    assert result.position == at
    assert len(result.batch) == 0
    assert result.error is None


def test_blank_is_not_a_message_record() -> None:
    """MessageRecord.decode refuses the BLANK record with field magic_code at its position."""
    with pytest.raises(CorruptRecordError) as info:
        MessageRecord.decode(load_hex("commitlog_blank") + bytes(1234 - RECORD_PREFIX.size))
    assert info.value.field == "magic_code"
    assert info.value.offset == 0


# --- ConsumeQueue units -------------------------------------------------------------------------------

CQ_CASES = [
    pytest.param("record_16_1", ConsumeQueueUnit(0, 177, 2598919), id="record_16_1"),
    pytest.param("order_paid_event", ConsumeQueueUnit(0x40000000, 200, -2065122400), id="negative_tag_hash"),
    pytest.param("schedule_delay_3", ConsumeQueueUnit(1073745920, 250, 1700000000123 + 10_000), id="schedule"),
    pytest.param("pre_blank", ConsumeQueueUnit(0, 0x7FFFFFFF, 0), id="pre_blank"),
    pytest.param("pattern", ConsumeQueueUnit(0x1111111111111111, 0x22222222, 0x3333333333333333), id="pattern"),
]


@pytest.mark.parametrize(("section", "unit"), CQ_CASES)
def test_cq_unit_encodes_to_fixture(section: str, unit: ConsumeQueueUnit) -> None:
    """ConsumeQueueUnit.encode() gives the 20 golden bytes."""
    data = load_hex_sections("consumequeue_units")[section]
    assert len(data) == CQ_UNIT_SIZE
    assert unit.encode() == data


@pytest.mark.parametrize(("section", "unit"), CQ_CASES)
def test_cq_unit_decodes_from_fixture(section: str, unit: ConsumeQueueUnit) -> None:
    """ConsumeQueueUnit.decode(golden bytes) gives back the three fields."""
    assert ConsumeQueueUnit.decode(load_hex_sections("consumequeue_units")[section]) == unit


def test_cq_units_decode_at_unit_positions() -> None:
    """The whole fixture file is a run of units; unit n decodes at position n * CQ_UNIT_SIZE."""
    data = load_hex("consumequeue_units")
    units = [param.values[1] for param in CQ_CASES]
    assert len(data) == len(units) * CQ_UNIT_SIZE
    assert [ConsumeQueueUnit.decode(data, i * CQ_UNIT_SIZE) for i in range(len(units))] == units


def test_pre_blank_unit_constant_matches_fixture() -> None:
    """BLANK_UNIT, used to pre-blank a queue, is the §16.2 pre-blank row and counts as a valid unit."""
    assert load_hex_sections("consumequeue_units")["pre_blank"] == BLANK_UNIT
    assert ConsumeQueueUnit.decode(BLANK_UNIT).is_valid


# --- IndexFile ----------------------------------------------------------------------------------------

HEADER_CASES = [
    pytest.param("after_two_puts_16_3", IndexHeader(1700000000123, 1700000005999, 0, 305, 2, 3), id="16_3"),
    pytest.param("after_chain_16_4", IndexHeader(1700000000123, 1700000010500, 0, 610, 2, 4), id="16_4"),
    pytest.param("rolled_before_put_16_6", IndexHeader(1700000000000, 1700000000000, 1000, 1000, 0, 0),
                 id="16_6_before_put"),
    pytest.param("rolled_flushed_before_put_16_6", IndexHeader(1700000000000, 1700000000000, 1000, 1000, 0, 1),
                 id="16_6_flushed_before_put"),
    pytest.param("rolled_first_put_16_6", IndexHeader(1700000003000, 1700000003000, 1200, 1200, 1, 2),
                 id="16_6_first_put"),
    pytest.param("pattern", IndexHeader(0x1111111111111111, 0x2222222222222222, 0x3333333333333333,
                                        0x4444444444444444, 0x55555555, 0x66666666), id="pattern"),
]

ENTRY_CASES = [
    pytest.param("entry_1_16_3", IndexEntry(641858179, 0, 0, 0), id="16_3_entry_1"),
    pytest.param("entry_2_16_3", IndexEntry(1130853405, 305, 5, 0), id="16_3_entry_2"),
    pytest.param("entry_3_16_4", IndexEntry(641858179, 610, 10, 1), id="16_4_entry_3"),
    pytest.param("entry_1_16_6", IndexEntry(641858179, 1200, 3, 0), id="16_6_entry_1"),
    pytest.param("pattern", IndexEntry(0x11111111, 0x2222222222222222, 0x33333333, 0x44444444), id="pattern"),
]


@pytest.mark.parametrize(("section", "header"), HEADER_CASES)
def test_index_header_encodes_to_fixture(section: str, header: IndexHeader) -> None:
    """IndexHeader.encode() gives the 40 golden bytes."""
    data = load_hex_sections("index_header")[section]
    assert len(data) == INDEX_HEADER_SIZE
    assert header.encode() == data


@pytest.mark.parametrize(("section", "header"), HEADER_CASES)
def test_index_header_decodes_from_fixture(section: str, header: IndexHeader) -> None:
    """IndexHeader.decode(golden bytes) gives back the six fields."""
    assert IndexHeader.decode(load_hex_sections("index_header")[section]) == header


@pytest.mark.parametrize(("section", "entry"), ENTRY_CASES)
def test_index_entry_encodes_to_fixture(section: str, entry: IndexEntry) -> None:
    """IndexEntry.encode() gives the 20 golden bytes."""
    data = load_hex_sections("index_entry")[section]
    assert len(data) == INDEX_ENTRY_SIZE
    assert entry.encode() == data


@pytest.mark.parametrize(("section", "entry"), ENTRY_CASES)
def test_index_entry_decodes_from_fixture(section: str, entry: IndexEntry) -> None:
    """IndexEntry.decode(golden bytes) gives back the four fields."""
    assert IndexEntry.decode(load_hex_sections("index_entry")[section]) == entry


def _slot_pos(slot: int) -> int:
    return INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slot


def _entry_pos(hash_slot_num: int, n: int) -> int:
    return INDEX_HEADER_SIZE + HASH_SLOT_SIZE * hash_slot_num + INDEX_ENTRY_SIZE * n


def test_index_file_16_3_and_16_4_bytes(tmp_path: Path) -> None:
    """IndexFile puts reproduce the whole 628-byte file of §16.3, then the chained third put of §16.4."""
    slots, entries = 97, 10
    path = str(tmp_path / "20231114221320123")
    headers = load_hex_sections("index_header")
    golden = load_hex_sections("index_entry")
    key1, emoji = index_key_hash("TopicA#key1"), index_key_hash("TopicA#k😀")
    assert (key1 % slots, emoji % slots) == (61, 51)
    f = IndexFile(path, slots, entries, create=True)
    try:
        assert f.put_key(key1, 0, 1700000000123)
        assert f.put_key(emoji, 305, 1700000005999)
        f.flush()
        expected = bytearray(index_file_size(slots, entries))
        assert len(expected) == 628
        expected[0:INDEX_HEADER_SIZE] = headers["after_two_puts_16_3"]
        expected[_slot_pos(51) : _slot_pos(51) + HASH_SLOT_SIZE] = struct.pack(">i", 2)
        expected[_slot_pos(61) : _slot_pos(61) + HASH_SLOT_SIZE] = struct.pack(">i", 1)
        expected[_entry_pos(slots, 1) : _entry_pos(slots, 2)] = golden["entry_1_16_3"]
        expected[_entry_pos(slots, 2) : _entry_pos(slots, 3)] = golden["entry_2_16_3"]
        assert Path(path).read_bytes() == expected

        assert f.put_key(key1, 610, 1700000010500)
        f.flush()
        expected[0:INDEX_HEADER_SIZE] = headers["after_chain_16_4"]
        expected[_slot_pos(61) : _slot_pos(61) + HASH_SLOT_SIZE] = struct.pack(">i", 3)
        expected[_entry_pos(slots, 3) : _entry_pos(slots, 4)] = golden["entry_3_16_4"]
        assert Path(path).read_bytes() == expected
    finally:
        f.close()


def test_index_file_16_6_rolled_header_and_first_entry(tmp_path: Path) -> None:
    """A file created from a full predecessor pre-sets its header and measures the first timeDiff from it."""
    slots, entries = 97, 10
    path = str(tmp_path / "20231114221320123")
    headers = load_hex_sections("index_header")
    f = IndexFile(path, slots, entries, create=True, end_phy_offset=1000, end_timestamp=1700000000000)
    try:
        assert Path(path).read_bytes()[:INDEX_HEADER_SIZE] == headers["rolled_before_put_16_6"]
        assert f.put_key(index_key_hash("TopicA#key1"), 1200, 1700000003000)
        f.flush()
        data = Path(path).read_bytes()
        assert data[:INDEX_HEADER_SIZE] == headers["rolled_first_put_16_6"]
        assert data[_entry_pos(slots, 1) : _entry_pos(slots, 2)] == load_hex_sections("index_entry")["entry_1_16_6"]
    finally:
        f.close()


def test_index_file_16_6_flushed_before_first_put(tmp_path: Path) -> None:
    """Flushing a new file before any put writes the in-memory indexCount 1 into the header (§16.6)."""
    path = str(tmp_path / "20231114221320123")
    f = IndexFile(path, 97, 10, create=True, end_phy_offset=1000, end_timestamp=1700000000000)
    try:
        f.flush()
        header = Path(path).read_bytes()[:INDEX_HEADER_SIZE]
    finally:
        f.close()
    assert header == load_hex_sections("index_header")["rolled_flushed_before_put_16_6"]


# --- checkpoint ---------------------------------------------------------------------------------------

CHECKPOINT_CASES = [
    pytest.param("broker_4_9_3", StoreCheckpoint(1795250325042, 1795250328434, 1795250327380, 0, 0), id="broker"),
    pytest.param("pattern", StoreCheckpoint(0x1111111111111111, 0x2222222222222222, 0x3333333333333333,
                                            0x4444444444444444, 0x5555555555555555), id="pattern"),
]


@pytest.mark.parametrize(("section", "checkpoint"), CHECKPOINT_CASES)
def test_checkpoint_encodes_to_fixture_page(section: str, checkpoint: StoreCheckpoint) -> None:
    """StoreCheckpoint.encode() is the five golden int64s, zero-padded to one 4096-byte page."""
    fields = load_hex_sections("checkpoint")[section]
    assert len(fields) == CHECKPOINT_FIELDS.size
    assert checkpoint.encode() == fields + bytes(CHECKPOINT_FILE_SIZE - CHECKPOINT_FIELDS.size)


@pytest.mark.parametrize(("section", "checkpoint"), CHECKPOINT_CASES)
def test_checkpoint_decodes_from_fixture_page(section: str, checkpoint: StoreCheckpoint) -> None:
    """StoreCheckpoint.decode(golden page) gives back the five fields."""
    page = load_hex_sections("checkpoint")[section].ljust(CHECKPOINT_FILE_SIZE, b"\0")
    assert StoreCheckpoint.decode(page) == checkpoint


def test_checkpoint_fixture_matches_broker_file() -> None:
    """The broker fixture is the real 4.9.3 checkpoint file, whose bytes after the fields are all zero."""
    real = BROKER_CHECKPOINT.read_bytes()
    fields = load_hex_sections("checkpoint")["broker_4_9_3"]
    assert real == fields + bytes(CHECKPOINT_FILE_SIZE - len(fields))
    assert StoreCheckpoint.decode(real).encode() == real


def test_checkpoint_page_of_wrong_size_is_a_layout_error() -> None:
    """A checkpoint that is not exactly one 4096-byte page is a StoreLayoutError naming the file."""
    page = load_hex_sections("checkpoint")["pattern"].ljust(CHECKPOINT_FILE_SIZE - 1, b"\0")
    with pytest.raises(StoreLayoutError) as info:
        StoreCheckpoint.decode(page, path=os.path.join("store", "checkpoint"))
    assert info.value.path == os.path.join("store", "checkpoint")


# --- [5.x] CRC32 property -----------------------------------------------------------------------------

def test_crc32_property_encodes_to_fixture() -> None:
    """encode_crc32_property(1484750348) is the 20 bytes of §16.5, digits least significant first."""
    data = load_hex("crc32_property")
    assert len(data) == CRC32_RESERVED_LENGTH
    assert encode_crc32_property(1484750348) == data


def test_crc32_property_decodes_from_fixture() -> None:
    """The fixture parses as one `__CRC32#` property whose reversed digits give back 1484750348."""
    props = parse_properties(load_hex("crc32_property"))
    assert props == {"__CRC32#": "8430574841"}
    assert decode_crc32_digits(props["__CRC32#"]) == 1484750348
