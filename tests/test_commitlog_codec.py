"""Property tests of the CommitLog codec and the Java string hash.

MessageRecord must round-trip through its bytes for every host kind and magic; `find_properties` must
agree with the full `parse_properties` walk on arbitrary bytes; `java_string_hash` must give the JDK
values of STORE_FORMAT.md §5.3/§6.2, and `hash_many` must equal it element by element.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from indexcore.commitlog import (
    BORNHOST_V6_FLAG,
    END_FILE_MIN_BLANK_LENGTH,
    MAX_PROPERTIES_LENGTH,
    MAX_TOPIC_LENGTH_V1,
    MAX_TOPIC_NAME_BYTES,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    STOREHOSTADDRESS_V6_FLAG,
    Host,
    MessageRecord,
    body_crc32,
    check_topic,
    encode_properties,
    find_properties,
    fixed_part_struct,
    parse_properties,
    record_size,
)
from indexcore.dispatch import index_keys_of
from indexcore.errors import CorruptRecordError
from indexcore.javahash import (
    INT32_MIN,
    hash_many,
    index_key_hash,
    index_key_hash_many,
    java_string_hash,
)
from indexcore.reader import Stop, decode_segment

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
SEGMENT_SIZE = 16384

# --- strategies ---------------------------------------------------------------------------------------

hosts = st.builds(Host, st.one_of(st.binary(min_size=4, max_size=4), st.binary(min_size=16, max_size=16)), INT32)

# Topic characters check_topic accepts: no path separators, no C0 control characters or DEL. Dots are
# allowed anywhere; only "." and ".." as the whole name are not.
topic_chars = st.characters(exclude_characters="/\\", exclude_categories=("Cs", "Cc"))


def _topic_ok(topic: str, limit: int | None) -> bool:
    n = len(topic.encode("utf-8"))
    return n > 0 and (limit is None or n <= limit) and topic not in (".", "..")


topics_v1 = st.text(topic_chars, min_size=1, max_size=MAX_TOPIC_LENGTH_V1).filter(
    lambda t: _topic_ok(t, MAX_TOPIC_LENGTH_V1))
topics_v2 = st.text(topic_chars, min_size=1, max_size=255).filter(lambda t: _topic_ok(t, MAX_TOPIC_NAME_BYTES))

# Property names never hold \x01 or \x02; values never hold \x02 but may hold \x01 (§4.2).
prop_names = st.text(st.characters(exclude_characters="\x01\x02", exclude_categories=("Cs",)), min_size=1,
                     max_size=12)
prop_values = st.text(st.characters(exclude_characters="\x02", exclude_categories=("Cs",)), min_size=1,
                      max_size=40)
prop_maps = st.dictionaries(prop_names, prop_values, max_size=6)


@st.composite
def properties_bytes(draw) -> bytes:
    """Either well-formed properties (4.9 or 5.x separator style) or arbitrary bytes, under 32767."""
    if draw(st.booleans()):
        raw = encode_properties(draw(prop_maps), trailing_separator=draw(st.booleans()))
    else:
        raw = draw(st.binary(max_size=300))
    return raw[:MAX_PROPERTIES_LENGTH]


@st.composite
def message_records(draw) -> MessageRecord:
    """Any record the codec must carry: v1 or v2, each host IPv4 or IPv6, any body and properties."""
    magic = draw(st.sampled_from([MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2]))
    topic = draw(topics_v2 if magic == MESSAGE_MAGIC_CODE_V2 else topics_v1)
    born, store = draw(hosts), draw(hosts)
    sys_flag = draw(INT32) & ~(BORNHOST_V6_FLAG | STOREHOSTADDRESS_V6_FLAG)
    sys_flag |= (BORNHOST_V6_FLAG if born.is_v6 else 0) | (STOREHOSTADDRESS_V6_FLAG if store.is_v6 else 0)
    body = draw(st.binary(max_size=2048))
    return MessageRecord(
        topic=topic, queue_id=draw(INT32), flag=draw(INT32), queue_offset=draw(INT64),
        physical_offset=draw(INT64), sys_flag=sys_flag, born_timestamp=draw(INT64), born_host=born,
        store_timestamp=draw(INT64), store_host=store, reconsume_times=draw(INT32),
        prepared_transaction_offset=draw(INT64), body=body, properties=draw(properties_bytes()),
        body_crc=body_crc32(body), magic=magic,
    )


# --- MessageRecord round trips ------------------------------------------------------------------------

@given(message_records())
def test_message_record_round_trips(record: MessageRecord) -> None:
    """decode(encode(r)) == r for every host kind, magic, body and properties, with the CRC checked."""
    data = record.encode()
    assert MessageRecord.decode(data, check_crc=True) == record


@given(message_records())
def test_encoded_length_is_record_size(record: MessageRecord) -> None:
    """The encoded length equals TOTALSIZE, which equals calMsgLength of the parts (§3.3)."""
    data = record.encode()
    assert len(data) == record.total_size == int.from_bytes(data[:4], "big")
    assert len(data) == record_size(record.sys_flag, record.magic, len(record.body), len(record.topic_bytes),
                                    len(record.properties))


@given(message_records(), st.binary(max_size=64), st.binary(max_size=64))
def test_message_record_decodes_between_other_bytes(record: MessageRecord, lead: bytes, tail: bytes) -> None:
    """A record decodes at any position of a larger buffer, whatever surrounds it."""
    assert MessageRecord.decode(lead + record.encode() + tail, len(lead)) == record


@given(message_records(), st.data())
def test_flipped_body_byte_is_a_body_crc_error(record: MessageRecord, data: st.DataObject) -> None:
    """Changing any body byte makes decode raise field body_crc at the record's position."""
    if not record.body:
        record = dataclasses.replace(record, body=b"x", body_crc=body_crc32(b"x"))
    raw = bytearray(record.encode())
    body_at = fixed_part_struct(record.sys_flag).size
    i = data.draw(st.integers(0, len(record.body) - 1))
    raw[body_at + i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptRecordError) as info:
        MessageRecord.decode(bytes(raw))
    assert info.value.field == "body_crc"
    assert info.value.offset == 0
    assert MessageRecord.decode(bytes(raw), check_crc=False).body != record.body


@settings(deadline=None)
@given(st.lists(message_records(), min_size=1, max_size=4), st.integers(0, 3))
def test_segment_decoder_agrees_with_record_decoder(records: list[MessageRecord], segment_index: int) -> None:
    """decode_segment (the reader's fast path) gives the same dispatch fields as MessageRecord.decode."""
    base = segment_index * SEGMENT_SIZE
    buf = bytearray(SEGMENT_SIZE)
    placed, pos = [], 0
    for drawn in records:
        if pos + drawn.total_size + END_FILE_MIN_BLANK_LENGTH > SEGMENT_SIZE:
            break
        record = dataclasses.replace(drawn, physical_offset=base + pos)
        buf[pos : pos + record.total_size] = record.encode()
        placed.append(record)
        pos += record.total_size
    result = decode_segment(bytes(buf), 0, segment_offset=base, segment_size=SEGMENT_SIZE, max_bytes=SEGMENT_SIZE)
    assert result.error is None
    assert result.stop is Stop.END
    assert result.position == pos
    b = result.batch
    assert len(b) == len(placed)
    for i, r in enumerate(placed):
        assert b.topic_of(i) == r.topic
        assert int(b.phy_offset[i]) == r.physical_offset
        assert int(b.msg_size[i]) == r.total_size
        assert int(b.queue_id[i]) == r.queue_id
        assert int(b.queue_offset[i]) == r.queue_offset
        assert int(b.sys_flag[i]) == r.sys_flag
        assert int(b.store_timestamp[i]) == r.store_timestamp
        assert int(b.prepared_transaction_offset[i]) == r.prepared_transaction_offset
        props = r.property_map()
        assert b.keys[i] == props.get("KEYS")
        assert b.uniq_key[i] == props.get("UNIQ_KEY")
        tags = props.get("TAGS")
        assert int(b.tags_code[i]) == (java_string_hash(tags) if tags else 0)
    expected = [(index_key_hash(k), i) for i, r in enumerate(placed)
                for k in index_keys_of(r.topic, r.property_map().get("UNIQ_KEY"), r.property_map().get("KEYS"))]
    assert list(zip(b.key_hash.tolist(), b.key_owner.tolist(), strict=True)) == expected


@given(prop_maps, st.booleans())
def test_properties_round_trip_in_both_separator_styles(props: dict[str, str], trailing: bool) -> None:
    """parse_properties inverts encode_properties with and without the 5.x trailing separator."""
    raw = encode_properties(props, trailing_separator=trailing)
    assert parse_properties(raw) == props
    assert raw.endswith(b"\x02") == (trailing and bool(props))


def test_trailing_separator_is_the_only_difference() -> None:
    """4.9 writers drop the last \\x02, 5.x writers keep it; both parse to the same map (§4.1)."""
    props = {"KEYS": "k1 k2", "TAGS": "TagA"}
    assert encode_properties(props) == b"KEYS\x01k1 k2\x02TAGS\x01TagA"
    assert encode_properties(props, trailing_separator=True) == b"KEYS\x01k1 k2\x02TAGS\x01TagA\x02"


# --- find_properties == parse_properties().get() ------------------------------------------------------

FRAGMENTS = [b"\x01", b"\x02", b"KEYS", b"KEY", b"K", b"EYS", b"S", b"TAGS", b"UNIQ_KEY", b"v", b"\xe8\xae\xa2",
             b"\xff", b" "]
NAMES = [b"KEYS", b"TAGS", b"UNIQ_KEY", b"K", b"KEY", b"S"]
fragment_strings = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map(b"".join)


@given(fragment_strings, st.sampled_from(NAMES))
@example(b"KEYS\x01", b"KEYS")
@example(b"KEYS\x01a\x02KEYS\x01", b"KEYS")
@example(b"XKEYS\x01a", b"KEYS")
@example(b"A\x01KEYS\x01v", b"KEYS")
@example(b"KEYS\x01KEYS\x01v", b"KEYS")
@example(b"\x02KEYS\x01\x01\x02", b"KEYS")
@example(b"KEYS\x01a\x02KEYS\x01b", b"KEYS")
def test_find_properties_agrees_with_parse_properties(raw: bytes, name: bytes) -> None:
    """find_properties(raw, names) is what parse_properties(raw) maps each name to, for any bytes."""
    names = {n: i for i, n in enumerate(dict.fromkeys([name, *NAMES]))}
    found = find_properties(raw, names)
    parsed = parse_properties(raw)
    for n, slot in names.items():
        value = found[slot]
        assert (None if value is None else value.decode("utf-8", "replace")) == parsed.get(n.decode("ascii"))


# --- topics -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "raw",
    [b"../x", b"a/b", b"a\\b", b"..", b".", b"a\x00b", b"a\x07b", b"\x1f", b"a\x7fb", b"", b"\xff\xfe",
     b"E" * (MAX_TOPIC_LENGTH_V1 + 1)],
    ids=["dotdot", "slash", "backslash", "only_dotdot", "dot", "nul", "bell", "unit_separator", "del", "empty",
         "bad_utf8", "v1_too_long"],
)
def test_check_topic_refuses_unsafe_names(raw: bytes) -> None:
    """Topics that are unsafe as a directory name, or over 127 bytes in a v1 record, are field topic."""
    with pytest.raises(CorruptRecordError) as info:
        check_topic(raw, MESSAGE_MAGIC_CODE)
    assert info.value.field == "topic"


@pytest.mark.parametrize("name", ["%LMQ%v2..double.dot", "...", "a..", "..a", ".hidden", "a.b.c", "%LMQ%p%q"])
def test_check_topic_takes_dots_inside_a_name(name: str) -> None:
    """Only `.` and `..` as the whole name are a directory's own entries: a real 4.9.3 broker dispatched
    `%LMQ%v2..double.dot` into `consumequeue/%LMQ%v2..double.dot/0/` (a ConformanceWriter store)."""
    assert check_topic(name.encode(), MESSAGE_MAGIC_CODE_V2) == name


def test_check_topic_allows_long_v2_topics() -> None:
    """Over 127 bytes is fine with magic v2 ([5.x]), but not with v1."""
    raw = b"E" * (MAX_TOPIC_LENGTH_V1 + 1)
    assert check_topic(raw, MESSAGE_MAGIC_CODE_V2) == raw.decode()
    assert check_topic(b"E" * MAX_TOPIC_LENGTH_V1, MESSAGE_MAGIC_CODE) == "E" * MAX_TOPIC_LENGTH_V1


@given(topics_v1)
def test_check_topic_accepts_generated_topics(topic: str) -> None:
    """Every topic the round-trip strategy generates decodes unchanged (so the round trips mean something)."""
    assert check_topic(topic.encode("utf-8")) == topic


# --- Java String.hashCode -----------------------------------------------------------------------------

HASH_VECTORS = [
    # (string, hashCode, index hash) from STORE_FORMAT.md §5.3, §6.2 and §16.1
    pytest.param("TopicA#key1", 641858179, 641858179, id="ascii_key"),
    pytest.param("TopicA#key2", 641858180, 641858180, id="ascii_key2"),
    pytest.param("TopicA#订单-123", -1111418391, 1111418391, id="cjk"),
    pytest.param("TopicA#k😀", 1130853405, 1130853405, id="emoji_surrogate_pair"),
    pytest.param("polygenelubricants", INT32_MIN, 0, id="int_min"),
    pytest.param("TagA", 2598919, 2598919, id="tag"),
    pytest.param("OrderPaidEvent", -2065122400, 2065122400, id="negative_tag"),
    pytest.param("TopicA#C0A8010A12342A9F0000000000000001", 35989318, 35989318, id="uniq_key"),
    pytest.param("", 0, 0, id="empty"),
]


@pytest.mark.parametrize(("s", "hash_code", "index_hash"), HASH_VECTORS)
def test_java_string_hash_vectors(s: str, hash_code: int, index_hash: int) -> None:
    """java_string_hash and index_key_hash give the JDK 17 values of the spec."""
    assert java_string_hash(s) == hash_code
    assert index_key_hash(s) == index_hash


@pytest.mark.parametrize(("s", "hash_code", "index_hash"), HASH_VECTORS)
def test_vectorised_hash_vectors(s: str, hash_code: int, index_hash: int) -> None:
    """hash_many and index_key_hash_many give the same spec values, as int32 arrays."""
    assert hash_many([s]).dtype == np.int32
    assert hash_many([s]).tolist() == [hash_code]
    assert index_key_hash_many([s]).tolist() == [index_hash]


@pytest.mark.parametrize(
    ("key", "slot_97", "slot_5m"),
    [("TopicA#key1", 61, 1858179), ("TopicA#订单-123", 54, 1418391), ("TopicA#k😀", 51, 853405),
     ("polygenelubricants", 0, 0), ("TopicA#C0A8010A12342A9F0000000000000001", 87, 989318),
     ("TopicA#key2", 62, 1858180)],
)
def test_index_slots_of_spec_keys(key: str, slot_97: int, slot_5m: int) -> None:
    """Slots are index_key_hash % hashSlotNum, for 97 and the default 5,000,000 slots (§6.2, §16.1)."""
    assert index_key_hash(key) % 97 == slot_97
    assert index_key_hash(key) % 5_000_000 == slot_5m


def test_emoji_hash_is_over_utf16_units() -> None:
    """The emoji key hashes its surrogate pair; code points or UTF-8 bytes give the spec's wrong values."""
    key = "TopicA#k😀"

    def over(units: list[int]) -> int:
        h = 0
        for u in units:
            h = (31 * h + u) & 0xFFFFFFFF
        return h - (1 << 32) if h & 0x80000000 else h

    assert over([ord(c) for c in key]) == -1903112186
    assert over(list(key.encode("utf-8"))) == -1573052143
    assert java_string_hash(key) == 1130853405


# Text including astral characters (surrogate pairs in UTF-16), lone surrogates and empty strings.
any_chars = st.characters()
astral_chars = st.characters(min_codepoint=0x10000)
lone_surrogates = st.sampled_from(["\ud83d", "\ude00", "\udbff", "\udc00"])
hash_texts = st.text(st.one_of(any_chars, astral_chars, lone_surrogates, st.sampled_from("Aa BB#订😀")), max_size=40)


@settings(deadline=None)
@given(st.lists(hash_texts, max_size=30))
@example([])
@example(["", "", ""])
@example(["polygenelubricants", "", "TopicA#k😀"])
def test_hash_many_equals_java_string_hash(strings: list[str]) -> None:
    """hash_many(strings) == [java_string_hash(s) for s in strings] for any text, empty strings included."""
    assert hash_many(strings).tolist() == [java_string_hash(s) for s in strings]


@settings(deadline=None)
@given(st.lists(st.text(st.characters(max_codepoint=0x7F), max_size=60), max_size=30))
def test_hash_many_ascii_path_equals_java_string_hash(strings: list[str]) -> None:
    """The all-ASCII fast path of hash_many gives the same values as the scalar hash."""
    assert hash_many(strings).tolist() == [java_string_hash(s) for s in strings]


@settings(deadline=None)
@given(st.lists(hash_texts, max_size=30))
def test_index_key_hash_many_equals_index_key_hash(strings: list[str]) -> None:
    """index_key_hash_many(strings) == [index_key_hash(s) for s in strings], MIN_VALUE mapped to 0."""
    assert index_key_hash_many(strings).tolist() == [index_key_hash(s) for s in strings]


@settings(deadline=None)
@given(st.text(st.characters(max_codepoint=0x7F), min_size=2000, max_size=5000))
def test_hash_many_on_long_strings(s: str) -> None:
    """Long strings, where the powers of 31 wrap many times, hash as the scalar loop does."""
    assert hash_many([s, s[::-1], ""]).tolist() == [java_string_hash(s), java_string_hash(s[::-1]), 0]
