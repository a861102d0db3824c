"""indexcore._kernels, the C loops: its layout constants, its UTF-8 Java hash, its output growth and its
argument checks. (Its decoded fields are compared with the single-record decoder in
test_commitlog_codec.py, and its files with the broker's in test_conformance.py.)"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from indexcore import _kernels, _spans, commitlog, indexfile
from indexcore.batchdecode import CATALOG_FIELD_ROWS, CATALOG_FIELDS, DecodeScratch, decode_window
from indexcore.commitlog import END_FILE_MIN_BLANK_LENGTH, Host, MessageRecord, body_crc32, encode_properties
from indexcore.dispatch import index_keys_of
from indexcore.javahash import index_key_hash, java_string_hash
from indexcore.reader import Stop, decode_segment


@pytest.mark.parametrize("name", [
    "MAGIC_CODE_OFFSET", "BODY_CRC_OFFSET", "QUEUE_ID_OFFSET", "QUEUE_OFFSET_OFFSET", "PHYSICAL_OFFSET_OFFSET",
    "SYS_FLAG_OFFSET", "BORN_HOST_OFFSET", "HOST_V4_LENGTH", "HOST_V6_LENGTH", "MIN_RECORD_SIZE",
    "END_FILE_MIN_BLANK_LENGTH", "MESSAGE_MAGIC_CODE", "MESSAGE_MAGIC_CODE_V2", "BLANK_MAGIC_CODE",
    "BORNHOST_V6_FLAG", "STOREHOSTADDRESS_V6_FLAG", "ERR_NO_BLANK", "ERR_PARTS", "ERR_FIXED_PART"])
def test_c_record_layout_is_commitlog_py_s(name: str) -> None:
    assert getattr(_kernels, name) == getattr(commitlog, name)


@pytest.mark.parametrize("name", ["INDEX_HEADER_SIZE", "HASH_SLOT_SIZE", "INDEX_ENTRY_SIZE", "MAX_TIME_DIFF"])
def test_c_index_layout_is_indexfile_py_s(name: str) -> None:
    assert getattr(_kernels, name) == getattr(indexfile, name)


def test_c_error_codes_are_the_ones_commitlog_describes() -> None:
    assert set(range(_kernels.ERR_NO_BLANK, _kernels.ERR_FIXED_PART + 1)) == set(commitlog.RECORD_ERRORS)


JAVA_UTF8_HASHES = Path(__file__).resolve().parent / "fixtures" / "java" / "utf8_hash_code.txt"


def _java_oracle() -> list[tuple[bytes, int]]:
    lines = JAVA_UTF8_HASHES.read_text().splitlines()
    return [(bytes.fromhex(h), int(v)) for h, v in (line.split() for line in lines if not line.startswith("#"))]


def test_utf8_java_hash_of_malformed_bytes_is_what_the_jdk_gives() -> None:
    """3,018 byte strings, mostly malformed UTF-8 (encoded surrogates, overlong forms, cut sequences),
    hashed by OpenJDK 17's `new String(bytes, UTF_8).hashCode()`. Where Java and Python disagree (an
    encoded surrogate is one U+FFFD for Java, three for Python), the broker's reading is the one kept."""
    oracle = _java_oracle()
    wrong = [(raw.hex(), java) for raw, java in oracle if _kernels.java_hash_utf8(raw) != java]
    assert not wrong, f"{len(wrong)} of {len(oracle)} differ from Java, e.g. {wrong[:5]}"


@settings(max_examples=500)
@given(st.binary(max_size=64).filter(lambda raw: b"\xed" not in raw))
@example(b"\xf0\x9f\x98")  # a 4-byte sequence cut short: one replacement
@example(b"\xe0\x80\xaf")  # overlong
@example(b"\xf4\x90\x80\x80")  # above U+10FFFF
def test_utf8_java_hash_matches_decode_then_hash(raw: bytes) -> None:
    """Without the lead byte 0xED (surrogates, where only Java's reading counts), Python's replacement rule
    is Java's: the kernel equals decode-then-hash."""
    assert _kernels.java_hash_utf8(raw) == java_string_hash(raw.decode("utf-8", "replace"))


@given(st.text(max_size=40))
@example("订单-😀-키")
def test_utf8_java_hash_of_text_is_string_hash_code(text: str) -> None:
    assert _kernels.java_hash_utf8(text.encode("utf-8", "surrogatepass")) == java_string_hash(text)


def _segment(records: list[MessageRecord], size: int) -> bytes:
    buf = bytearray(size)
    pos = 0
    for r in records:
        assert r.physical_offset == pos
        raw = r.encode()
        buf[pos : pos + len(raw)] = raw
        pos += len(raw)
    assert pos + END_FILE_MIN_BLANK_LENGTH <= size
    return bytes(buf)


def _record(topic: str, pos: int, props: dict[str, str]) -> MessageRecord:
    body = b"b"
    return MessageRecord(topic=topic, queue_id=0, flag=0, queue_offset=0, physical_offset=pos, sys_flag=0,
                         born_timestamp=1, born_host=Host.parse("127.0.0.1:1"), store_timestamp=2,
                         store_host=Host.parse("127.0.0.1:2"), reconsume_times=0, prepared_transaction_offset=0,
                         body=body, properties=encode_properties(props), body_crc=body_crc32(body))


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_the_records_table_costs_only_the_pages_a_window_writes() -> None:
    """The records table is sized for the most records a window could hold and a window fills a fraction
    of each of its rows: its memory is what the decode writes, 4 KiB pages, not a 2 MiB transparent huge
    page per row (clearing those cost a rebuild's first window up to 160 ms)."""
    from indexcore.batchdecode import _sparse_table

    rows, columns = 16, 1 << 20  # 128 MiB of address space
    before = _rss_anon_kib()
    table = _sparse_table(rows, columns)
    assert table.shape == (rows, columns)
    assert table.dtype == np.int64
    assert not table[:, ::4096].any()  # zero, as a fresh mapping is (this reads one page per 32 KiB)
    table[:, :1024] = 7  # 8 KiB of each row: two pages
    grown = _rss_anon_kib() - before
    assert grown < 8 * 1024, f"{grown} KiB for 128 KiB written"
    assert int(table[:, :1024].sum()) == 7 * rows * 1024


def test_outputs_grow_past_every_first_guess() -> None:
    """More records, keys, text and topics than the first buffers hold: the kernel stops, the wrapper
    grows what is full and the decode goes on, with the same result as one record at a time."""
    records, pos = [], 0
    for i in range(400):
        keys = " ".join(f"k{i}-{j}" for j in range(i % 7)) + " " + "x" * (i % 50)
        r = _record(f"topic-{i % 150}", pos, {"UNIQ_KEY": f"U{i:030d}", "KEYS": keys, "TAGS": f"t{i}"})
        records.append(r)
        pos += r.total_size
    image = _segment(records, 1 << 20)
    scratch = DecodeScratch()
    scratch.keys = np.empty((2, 1), dtype=np.int64)
    scratch.text = np.empty(1, dtype=np.uint8)
    w = decode_window(image, 0, len(image), len(image), 0, 1 << 20, True, scratch)
    assert w.records.shape[1] == 400
    assert len(w.topics) == 150
    expected = []
    for i, r in enumerate(records):
        props = r.property_map()
        expected += [(index_key_hash(k), i) for k in index_keys_of(r.topic, props["UNIQ_KEY"], props["KEYS"])]
    assert [tuple(k) for k in w.keys.T.tolist()] == expected
    batch = decode_segment(image, 0, segment_offset=0, segment_size=len(image), max_bytes=len(image)).batch
    assert list(batch.keys) == [r.property_map()["KEYS"] for r in records]
    assert [batch.topic_of(i) for i in range(400)] == [r.topic for r in records]


def test_catalog_fields_are_each_records_own_and_change_nothing_else() -> None:
    """With CATALOG_FIELDS the kernel also hands over the born time, the body's place and the TAGS, REAL_TOPIC,
    REAL_QID and store host bytes (copied into the text, which grows past its first guess for them): each
    record's own, as read one record at a time; every other output is the same as without the flag."""
    records, pos = [], 0
    for i in range(300):
        props = {"UNIQ_KEY": f"U{i:030d}", "KEYS": f"k{i} k{i + 1}", "TAGS": f"t{i}" * (i % 4)}
        if i % 3 == 0:
            props |= {"REAL_TOPIC": f"real-{i}", "REAL_QID": str(i % 11)}
        r = _record(f"topic-{i % 5}", pos, props)
        r = dataclasses.replace(r, born_timestamp=1_000 + i, body=bytes(i % 9),
                                store_host=Host(bytes(range(16)), 7) if i % 2 else Host(bytes([10, 0, 0, i % 3]), 9),
                                sys_flag=commitlog.STOREHOSTADDRESS_V6_FLAG if i % 2 else 0)
        r = dataclasses.replace(r, body_crc=body_crc32(r.body))
        records.append(r)
        pos += r.total_size
    image = _segment(records, 1 << 20)
    plain = decode_segment(image, 0, segment_offset=0, segment_size=len(image), max_bytes=len(image)).batch
    scratch = DecodeScratch()
    scratch.text = np.empty(1, dtype=np.uint8)
    batch = decode_segment(image, 0, segment_offset=0, segment_size=len(image), max_bytes=len(image),
                           scratch=scratch, multi_flags=CATALOG_FIELDS).batch
    assert plain.catalog_fields is None
    for name in ("phy_offset", "msg_size", "queue_id", "queue_offset", "sys_flag", "store_timestamp", "tags_code",
                 "topic_id", "key_hash", "key_owner"):
        assert np.array_equal(getattr(batch, name), getattr(plain, name)), name
    assert list(batch.keys) == list(plain.keys)
    assert list(batch.uniq_key) == list(plain.uniq_key)
    text = batch.keys.arrays()[0]
    fields = batch.catalog_fields
    assert fields.shape == (CATALOG_FIELD_ROWS.stop - CATALOG_FIELD_ROWS.start, len(records))
    assert fields.shape[0] == _spans.F_COUNT  # the catalog's pass reads the rows in the kernel's order
    spans = {name: _kernels.__dict__[f"R_{name}_AT"] - CATALOG_FIELD_ROWS.start
             for name in ("TAGS", "REAL_TOPIC", "REAL_QID", "HOST")}
    assert spans == {"TAGS": _spans.F_TAGS_AT, "REAL_TOPIC": _spans.F_REAL_TOPIC_AT, "REAL_QID": _spans.F_REAL_QID_AT,
                     "HOST": _spans.F_HOST_AT}

    def span(name: str, i: int) -> bytes | None:
        at, length = fields[spans[name], i], fields[spans[name] + 1, i]
        return None if at < 0 else bytes(text[at : at + length])

    for i, r in enumerate(records):
        props = r.property_map()
        assert fields[_spans.F_BORN_TIME, i] == r.born_timestamp
        at, length = fields[_spans.F_BODY_AT, i], fields[_spans.F_BODY_LEN, i]
        assert image[at : at + length] == r.body
        assert length == len(r.body)
        assert span("TAGS", i) == (props.get("TAGS", "").encode() or None)
        assert span("REAL_TOPIC", i) == (props["REAL_TOPIC"].encode() if "REAL_TOPIC" in props else None)
        assert span("REAL_QID", i) == (props["REAL_QID"].encode() if "REAL_QID" in props else None)
        assert span("HOST", i) == r.store_host.address + r.store_host.port.to_bytes(4, "big")


@given(st.lists(st.text(alphabet="ab%-_", min_size=1, max_size=40), min_size=1, max_size=60),
       st.lists(st.integers(0, 10_000), min_size=1, max_size=120))
@settings(max_examples=60, deadline=None)
@example(["a" * 16, "a" * 16 + "b", "a" * 15, "a" * 17, "a" * 8, "a" * 7, "a" * 24 + "b", "a" * 24 + "c"],
         list(range(8)))
def test_every_record_gets_its_own_topic_whatever_the_names_share(names: list[str], picks: list[int]) -> None:
    """The kernel's name table tells names apart by hash, length, first 16 bytes and the rest: names that
    share a prefix of any length, or all but their last byte, or are a byte longer, each keep their own
    id, and a repeated name gets the one it had."""
    records, pos = [], 0
    for p in picks:
        r = _record(names[p % len(names)], pos, {})
        records.append(r)
        pos += r.total_size
    image = _segment(records, pos + 4096)
    batch = decode_segment(image, 0, segment_offset=0, segment_size=len(image), max_bytes=len(image)).batch
    assert [batch.topic_of(i) for i in range(len(records))] == [r.topic for r in records]
    assert len(batch.topics) == len({r.topic for r in records})


def test_kernel_stops_before_a_record_its_tables_cannot_hold() -> None:
    """STOP_FULL leaves the record for the next call: position and counters stay at the record before."""
    records = [_record("t", 0, {"KEYS": "a"})]
    records.append(_record("t", records[0].total_size, {"KEYS": "b"}))
    image = _segment(records, 4096)
    rec = np.empty((_kernels.RECORD_COLUMNS, 1), dtype=np.int64)
    keys = np.empty((2, 8), dtype=np.int64)
    state = np.zeros(_kernels.STATE_COLUMNS, dtype=np.int64)
    stop, pos, _, full, _, _ = _kernels.decode_window(
        image, 0, 4096, 4096, 0, 1 << 20, True, 0, rec, keys, np.empty(64, np.uint8),
        np.empty((4, _kernels.TOPIC_COLUMNS), np.int64), np.empty(16, np.int64),
        np.empty((_kernels.MULTI_COLUMNS, 0), np.int64), state)
    assert (stop, pos, full) == (_kernels.STOP_FULL, records[0].total_size, _kernels.FULL_RECORDS)
    assert state.tolist()[:2] == [1, 1]


def test_batch_stops_before_the_first_record_of_an_unsafe_topic() -> None:
    good = _record("ok", 0, {"KEYS": "a"})
    bad = _record("../x", good.total_size, {"KEYS": "b"})
    image = _segment([good, bad], 4096)
    result = decode_segment(image, 0, segment_offset=0, segment_size=4096, max_bytes=4096)
    assert result.stop is Stop.ERROR
    assert result.error.field == "topic"
    assert result.error.offset == good.total_size
    assert len(result.batch) == 1
    assert len(result.batch.key_hash) == 1


def test_names_checked_once_are_looked_up_in_one_call_and_unsafe_ones_never_kept(monkeypatch) -> None:
    """With a reader's `names`, a window's topics checked in an earlier window come from one `known_names`
    call (not checked again); an unsafe name is never kept, so it stops the batch in every window."""
    from indexcore import reader

    records, pos = [], 0
    for topic in ["ok", "other", "ok", "../x"]:
        records.append(_record(topic, pos, {}))
        pos += records[-1].total_size
    image = _segment(records, pos + 4096)
    checked = []
    real = reader.check_topic
    monkeypatch.setattr(reader, "check_topic", lambda raw, magic: checked.append(raw) or real(raw, magic))
    names: dict[bytes, str] = {}
    for _ in range(2):
        checked.clear()
        result = decode_segment(image, 0, segment_offset=0, segment_size=len(image), max_bytes=len(image),
                                names=names)
        assert [result.batch.topic_of(i) for i in range(len(result.batch))] == ["ok", "other", "ok"]
        assert result.error.field == "topic"
    assert checked == [b"../x"]  # the second window checked only the name it could not keep
    assert names == {b"ok": "ok", b"other": "other"}
    assert _kernels.known_names(b"okay", np.array([0, 2]), np.array([2, 2]), {b"ok": 1}) == [1, None]
    with pytest.raises(ValueError, match="outside the image"):
        _kernels.known_names(b"ok", np.array([1]), np.array([2]), {})


@pytest.mark.parametrize(("change", "message"), [
    (dict(entries_at=41), "do not fit"),
    (dict(index_count=0), "do not fit"),
    (dict(index_count=4), "do not fit"),
    (dict(key_hash=np.array([-1], np.int64)), "negative key hash"),
    (dict(phy=np.zeros(2, np.int64)), "differ in length"),
])
def test_put_keys_refuses_what_would_write_out_of_bounds(change: dict, message: str) -> None:
    slots, entries = 4, 4
    args = dict(file=bytearray(indexfile.index_file_size(slots, entries)), entries_at=40 + 4 * slots, slots=slots,
                index_count=1, index_num=entries, begin=0, begin_phy=0, key_hash=np.array([5], np.int64),
                phy=np.array([0], np.int64), ts=np.array([0], np.int64))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _kernels.put_keys(*args.values())
    assert not any(args["file"])


def test_decode_window_refuses_a_window_outside_the_image() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        decode_window(bytes(100), 0, 200, 200, 0, 1 << 20, True)


@settings(max_examples=300)
@given(st.binary(max_size=700), st.integers(0, 15))
@example(bytes(64), 0)
@example(b"\xff" * 4096, 3)
def test_folded_body_crc_is_zlib_crc32(data: bytes, offset: int) -> None:
    """The carry-less-multiply CRC (any length, any alignment) against zlib's own."""
    view = memoryview(bytes(offset) + data)[offset:]
    assert _kernels.crc32(view) == zlib.crc32(data)
    assert _kernels.crc32(view, False) == zlib.crc32(data)


def test_folded_crc_is_in_use_where_the_cpu_has_carry_less_multiply() -> None:
    """Otherwise the CRC test above compares zlib with itself."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    has_clmul = " pclmulqdq" in flags and " sse4_1" in flags
    assert int(has_clmul) == _kernels.FOLDED_CRC
