"""CommitLogWriter lays records out as the broker does, and CommitLogReader reads them back.

Covers the BLANK roll rule (§3.6: a record of n bytes goes to the next segment iff n + 8 > bytes left),
queue offsets by transaction type (§3.9), DELAY rewriting to SCHEDULE_TOPIC_XXXX and the resulting
tagsCode (§5.4), resuming after a reopen, and the 5.x options (trailing separator, `__CRC32#`, v2 magic).
"""

from __future__ import annotations

import itertools
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from indexcore.commitlog import (
    BLANK_MAGIC_CODE,
    CRC32_RESERVED_LENGTH,
    END_FILE_MIN_BLANK_LENGTH,
    MAGIC_CODE_OFFSET,
    MAX_TOPIC_LENGTH_V1,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    PROPERTY_CRC32,
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    QUEUE_OFFSET_OFFSET,
    RECORD_PREFIX,
    SCHEDULE_TOPIC,
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_PREPARED_TYPE,
    TRANSACTION_ROLLBACK_TYPE,
    Host,
    MessageRecord,
    decode_crc32_digits,
    encode_blank,
    encode_crc32_property,
    fixed_part_struct,
    parse_properties,
    record_size,
)
from indexcore.javahash import java_string_hash
from indexcore.mappedfile import offset_to_file_name
from indexcore.reader import CommitLog, CommitLogReader, ReadResult, ReadStatus
from indexcore.writer import CommitLogWriter, Message

SEGMENT = 4096
TOPIC = "TopicA"
STORE_TS = 1700000000123
MAX_DELAY_LEVEL = 18  # entries of the default messageDelayLevel (§5.4)
DELAY_MS = {1: 1000, 3: 10_000, 18: 7_200_000}  # §5.4 table
TAG_A_HASH = 2598919  # hash("TagA"), §5.3


def fixed_clock(ts: int = STORE_TS):
    return lambda: ts


def ticking_clock(start: int = STORE_TS):
    return itertools.count(start).__next__


def open_writer(path: Path, **kwargs) -> CommitLogWriter:
    kwargs.setdefault("clock", ticking_clock())
    return CommitLogWriter(str(path), SEGMENT, **kwargs)


def read_all(path: Path, start: int = 0) -> tuple[list[dict], ReadResult]:
    """Every record from `start` until the reader stops, as dicts of the batch columns, and the last result."""
    reader = CommitLogReader(CommitLog(str(path), SEGMENT))
    rows: list[dict] = []
    offset = start
    try:
        while True:
            res = reader.read(offset)
            b = res.batch
            for i in range(len(b)):
                rows.append({
                    "phy": int(b.phy_offset[i]), "size": int(b.msg_size[i]), "topic": b.topic_of(i),
                    "queue_id": int(b.queue_id[i]), "queue_offset": int(b.queue_offset[i]),
                    "sys_flag": int(b.sys_flag[i]), "store_ts": int(b.store_timestamp[i]),
                    "tags_code": int(b.tags_code[i]), "keys": b.keys[i], "uniq_key": b.uniq_key[i],
                })
            offset = res.next_offset
            if res.status is not ReadStatus.OK:
                return rows, res
    finally:
        reader.close()


def segment_bytes(path: Path, start: int) -> bytes:
    return (path / offset_to_file_name(start)).read_bytes()


def raw_record(path: Path, phy: int, size: int) -> bytes:
    pos = phy % SEGMENT
    return segment_bytes(path, phy - pos)[pos : pos + size]


def stored(path: Path, phy: int) -> MessageRecord:
    return CommitLog(str(path), SEGMENT).read_record(phy)


def message_of_size(n: int, queue_id: int = 0) -> Message:
    """A message whose record is exactly n bytes: TOPIC, IPv4 hosts, no properties."""
    body_len = n - record_size(0, MESSAGE_MAGIC_CODE, 0, len(TOPIC.encode()), 0)
    assert body_len >= 0
    return Message(TOPIC, queue_id, body=bytes([0xA5]) * body_len)


# --- BLANK roll rule ----------------------------------------------------------------------------------

def test_message_leaving_exactly_blank_room_stays_in_segment(tmp_path: Path) -> None:
    """A record with n + 8 == bytes left is written in place; the next record rolls after an 8-byte BLANK."""
    first = 1000
    left = SEGMENT - first
    with open_writer(tmp_path) as w:
        a = w.append(message_of_size(first))
        b = w.append(message_of_size(left - END_FILE_MIN_BLANK_LENGTH))
        c = w.append(message_of_size(200))
    assert (a.phy_offset, b.phy_offset) == (0, first)
    assert b.phy_offset + b.msg_size == SEGMENT - END_FILE_MIN_BLANK_LENGTH
    assert c.phy_offset == SEGMENT
    blank_at = SEGMENT - END_FILE_MIN_BLANK_LENGTH
    assert segment_bytes(tmp_path, 0)[blank_at:] == encode_blank(END_FILE_MIN_BLANK_LENGTH)
    rows, last = read_all(tmp_path)
    assert [r["phy"] for r in rows] == [0, first, SEGMENT]
    assert last.status is ReadStatus.END
    assert last.next_offset == SEGMENT + c.msg_size


@pytest.mark.parametrize("excess", [1, 4, END_FILE_MIN_BLANK_LENGTH], ids=["one_byte_over", "half_blank", "fills"])
def test_message_without_blank_room_rolls_to_next_segment(tmp_path: Path, excess: int) -> None:
    """A record with n + 8 > bytes left goes to the next segment; a BLANK of the bytes left ends this one."""
    first = 1000
    left = SEGMENT - first
    n = left - END_FILE_MIN_BLANK_LENGTH + excess
    with open_writer(tmp_path) as w:
        w.append(message_of_size(first))
        b = w.append(message_of_size(n))
    assert b.phy_offset == SEGMENT
    assert b.msg_size == n
    seg0 = segment_bytes(tmp_path, 0)
    assert len(seg0) == SEGMENT
    assert seg0[first : first + RECORD_PREFIX.size] == encode_blank(left)
    assert RECORD_PREFIX.unpack_from(seg0, first) == (left, BLANK_MAGIC_CODE)
    assert len(segment_bytes(tmp_path, SEGMENT)) == SEGMENT

    reader = CommitLogReader(CommitLog(str(tmp_path), SEGMENT))
    try:
        res = reader.read(0)
        assert res.status is ReadStatus.OK
        assert res.rolled
        assert res.next_offset == SEGMENT
        assert res.batch.phy_offset.tolist() == [0]
        res = reader.read(SEGMENT)
        assert res.batch.phy_offset.tolist() == [SEGMENT]
        assert res.status is ReadStatus.END
    finally:
        reader.close()


def test_many_messages_fill_several_segments_by_the_rule(tmp_path: Path) -> None:
    """Over many varied appends every roll happens exactly when n + 8 > bytes left, and all read back."""
    sizes = [150 + (i * 37) % 700 for i in range(60)]
    pos, expected = 0, []
    with open_writer(tmp_path) as w:
        for i, n in enumerate(sizes):
            left = SEGMENT - pos % SEGMENT
            if n + END_FILE_MIN_BLANK_LENGTH > left:
                pos += left
            expected.append(pos)
            assert w.append(message_of_size(n, queue_id=i % 3)).phy_offset == pos
            pos += n
    rows, last = read_all(tmp_path)
    assert [r["phy"] for r in rows] == expected
    assert [r["size"] for r in rows] == sizes
    assert last.status is ReadStatus.END
    assert last.next_offset == pos


def test_message_filling_an_empty_segment_but_the_blank_stays(tmp_path: Path) -> None:
    """The largest record a segment takes is segment size - 8: written at 0, the next record rolls."""
    with open_writer(tmp_path) as w:
        a = w.append(message_of_size(SEGMENT - END_FILE_MIN_BLANK_LENGTH))
        b = w.append(message_of_size(200))
    assert (a.phy_offset, b.phy_offset) == (0, SEGMENT)
    rows, last = read_all(tmp_path)
    assert [r["phy"] for r in rows] == [0, SEGMENT]
    assert last.status is ReadStatus.END


@pytest.mark.parametrize("written_before", [0, 1000], ids=["empty_log", "mid_segment"])
def test_message_that_can_never_fit_a_segment_is_refused(tmp_path: Path, written_before: int) -> None:
    """A record with n + 8 > segment size fits no segment: ValueError, and nothing (not even a BLANK) is written."""
    with open_writer(tmp_path) as w:
        if written_before:
            w.append(message_of_size(written_before))
        with pytest.raises(ValueError, match="segment"):
            w.append(message_of_size(SEGMENT - END_FILE_MIN_BLANK_LENGTH + 1))
        assert w.max_offset == written_before
        after = w.append(message_of_size(200))
    assert after.phy_offset == written_before
    rows, last = read_all(tmp_path)
    assert [r["phy"] for r in rows] == ([0] if written_before else []) + [written_before]
    assert last.status is ReadStatus.END
    assert sorted(os.listdir(tmp_path)) == [offset_to_file_name(0)]


# --- queue offsets ------------------------------------------------------------------------------------

def test_queue_offsets_by_transaction_type(tmp_path: Path) -> None:
    """NOT and COMMIT take the next queue offset; PREPARED (0x4) and ROLLBACK (0xC) get 0 and take none."""
    kinds = [0, 0, TRANSACTION_PREPARED_TYPE, TRANSACTION_ROLLBACK_TYPE, TRANSACTION_COMMIT_TYPE,
             TRANSACTION_PREPARED_TYPE, 0]
    with open_writer(tmp_path) as w:
        results = [w.append(Message(TOPIC, 3, body=b"b", sys_flag=k)) for k in kinds]
    assert [r.queue_offset for r in results] == [0, 1, 0, 0, 2, 0, 3]
    rows, _ = read_all(tmp_path)
    assert [r["queue_offset"] for r in rows] == [0, 1, 0, 0, 2, 0, 3]
    assert [r["sys_flag"] & 0xC for r in rows] == kinds
    for r in results:
        raw = raw_record(tmp_path, r.phy_offset, r.msg_size)
        assert struct.unpack_from(">q", raw, QUEUE_OFFSET_OFFSET)[0] == r.queue_offset


def test_queue_offsets_are_per_topic_and_queue(tmp_path: Path) -> None:
    """Each topic-queueId pair has its own counter."""
    keys = [(TOPIC, 0), (TOPIC, 1), ("TopicB", 0), (TOPIC, 0), ("TopicB", 0), (TOPIC, 1), (TOPIC, 0)]
    with open_writer(tmp_path) as w:
        offsets = [w.append(Message(t, q, body=b"x")).queue_offset for t, q in keys]
    assert offsets == [0, 0, 0, 1, 1, 1, 2]


# --- DELAY --------------------------------------------------------------------------------------------

def test_delay_moves_message_to_schedule_topic(tmp_path: Path) -> None:
    """DELAY=3 on TopicA queue 5 is stored in SCHEDULE_TOPIC_XXXX queue 2 with REAL_TOPIC and REAL_QID."""
    with open_writer(tmp_path) as w:
        r = w.append(Message(TOPIC, 5, body=b"later", properties={"DELAY": "3", "KEYS": "k1", "TAGS": "TagA"}))
    assert (r.topic, r.queue_id, r.queue_offset) == (SCHEDULE_TOPIC, 3 - 1, 0)
    rec = stored(tmp_path, r.phy_offset)
    assert (rec.topic, rec.queue_id) == (SCHEDULE_TOPIC, 2)
    assert rec.property_map() == {PROPERTY_DELAY_TIME_LEVEL: "3", PROPERTY_REAL_TOPIC: TOPIC,
                                  PROPERTY_REAL_QUEUE_ID: "5", "KEYS": "k1", "TAGS": "TagA"}


def test_delay_level_is_clamped_to_max(tmp_path: Path) -> None:
    """DELAY=25 is clamped to the highest level, 18: queue 17 and DELAY rewritten to "18"."""
    with open_writer(tmp_path) as w:
        r = w.append(Message(TOPIC, 1, properties={"DELAY": "25"}))
    assert (r.topic, r.queue_id) == (SCHEDULE_TOPIC, MAX_DELAY_LEVEL - 1)
    assert stored(tmp_path, r.phy_offset).property_map()[PROPERTY_DELAY_TIME_LEVEL] == str(MAX_DELAY_LEVEL)


def test_delay_on_commit_message_is_rewritten(tmp_path: Path) -> None:
    """A COMMIT-typed message with a DELAY level moves to the schedule topic like a NOT-typed one."""
    with open_writer(tmp_path) as w:
        r = w.append(Message(TOPIC, 0, properties={"DELAY": "1"}, sys_flag=TRANSACTION_COMMIT_TYPE))
    assert (r.topic, r.queue_id) == (SCHEDULE_TOPIC, 0)


@pytest.mark.parametrize(
    ("delay", "sys_flag"),
    [("3", TRANSACTION_PREPARED_TYPE), ("3", TRANSACTION_ROLLBACK_TYPE), ("0", 0), ("-2", 0)],
    ids=["prepared", "rollback", "level_0", "negative"],
)
def test_delay_not_applied(tmp_path: Path, delay: str, sys_flag: int) -> None:
    """PREPARED/ROLLBACK messages and levels <= 0 stay on their own topic and queue."""
    with open_writer(tmp_path) as w:
        r = w.append(Message(TOPIC, 4, properties={"DELAY": delay}, sys_flag=sys_flag))
    assert (r.topic, r.queue_id) == (TOPIC, 4)
    props = stored(tmp_path, r.phy_offset).property_map()
    assert PROPERTY_REAL_TOPIC not in props
    assert props[PROPERTY_DELAY_TIME_LEVEL] == delay


def test_schedule_queue_offsets_do_not_touch_the_real_queue(tmp_path: Path) -> None:
    """Delayed messages count in their schedule queue; the real topic's queue keeps its own sequence."""
    with open_writer(tmp_path) as w:
        a = w.append(Message(TOPIC, 0))
        b = w.append(Message(TOPIC, 0, properties={"DELAY": "3"}))
        c = w.append(Message(TOPIC, 0, properties={"DELAY": "3"}))
        d = w.append(Message(TOPIC, 0))
    assert [(r.topic, r.queue_id, r.queue_offset) for r in (a, b, c, d)] == [
        (TOPIC, 0, 0), (SCHEDULE_TOPIC, 2, 0), (SCHEDULE_TOPIC, 2, 1), (TOPIC, 0, 1)]


def test_schedule_tags_code_is_store_time_plus_delay_16_2(tmp_path: Path) -> None:
    """DELAY=3 stored at 1700000000123 reads back with tagsCode 1700000010123, not hash(TAGS) (§16.2)."""
    with open_writer(tmp_path, clock=fixed_clock(STORE_TS)) as w:
        r = w.append(Message(TOPIC, 2, body=b"x", properties={"DELAY": "3", "TAGS": "TagA"}))
    assert r.store_timestamp == STORE_TS
    rows, _ = read_all(tmp_path)
    assert rows[0]["tags_code"] == 1700000010123 == STORE_TS + DELAY_MS[3]
    assert rows[0]["store_ts"] == STORE_TS


def test_schedule_tags_codes_per_level(tmp_path: Path) -> None:
    """Each schedule record's tagsCode is its own store time plus its level's delay, clamped levels included."""
    levels = ["1", "3", "25"]
    with open_writer(tmp_path) as w:
        results = [w.append(Message(TOPIC, 0, properties={"DELAY": lv, "TAGS": "TagA"})) for lv in levels]
    rows, _ = read_all(tmp_path)
    expected = [r.store_timestamp + DELAY_MS[lv] for r, lv in zip(results, [1, 3, MAX_DELAY_LEVEL], strict=True)]
    assert [row["tags_code"] for row in rows] == expected
    assert [row["queue_id"] for row in rows] == [0, 2, MAX_DELAY_LEVEL - 1]


def test_delay_property_outside_schedule_topic_keeps_tag_hash(tmp_path: Path) -> None:
    """A DELAY property on a record that stayed on its topic (PREPARED) gives tagsCode = hash(TAGS)."""
    with open_writer(tmp_path) as w:
        w.append(Message(TOPIC, 0, properties={"DELAY": "3", "TAGS": "TagA"}, sys_flag=TRANSACTION_PREPARED_TYPE))
    rows, _ = read_all(tmp_path)
    assert rows[0]["topic"] == TOPIC
    assert rows[0]["tags_code"] == TAG_A_HASH == java_string_hash("TagA")


# --- resume after reopen ------------------------------------------------------------------------------

def test_reopen_resumes_at_end_of_written_data(tmp_path: Path) -> None:
    """A reopened writer appends right after the last record and continues every queue's offsets."""
    with open_writer(tmp_path) as w:
        first = [w.append(Message(TOPIC, i % 2, body=bytes([i]) * 50)) for i in range(5)]
    end = first[-1].phy_offset + first[-1].msg_size
    with open_writer(tmp_path, clock=ticking_clock(STORE_TS + 1000)) as w:
        assert w.max_offset == end
        a = w.append(Message(TOPIC, 0, body=b"again"))
        b = w.append(Message(TOPIC, 1, body=b"again"))
    assert a.phy_offset == end
    assert (a.queue_offset, b.queue_offset) == (3, 2)
    rows, last = read_all(tmp_path)
    assert [r["phy"] for r in rows] == [r.phy_offset for r in (*first, a, b)]
    assert last.status is ReadStatus.END
    assert last.error is None


def test_reopen_resumes_in_a_later_segment(tmp_path: Path) -> None:
    """After rolls, a reopened writer continues in the newest segment at the right position."""
    with open_writer(tmp_path) as w:
        first = [w.append(message_of_size(900, queue_id=0)) for _ in range(9)]
    assert first[-1].phy_offset >= 2 * SEGMENT
    end = first[-1].phy_offset + first[-1].msg_size
    with open_writer(tmp_path) as w:
        assert w.max_offset == end
        r = w.append(message_of_size(300, queue_id=0))
    assert r.phy_offset == end
    assert r.queue_offset == len(first)


def test_reopen_ignores_prepared_and_rollback_for_queue_offsets(tmp_path: Path) -> None:
    """Recovery rebuilds counters from NOT/COMMIT records only, so trailing PREPARED/ROLLBACK take nothing."""
    with open_writer(tmp_path) as w:
        w.append(Message(TOPIC, 0))
        w.append(Message(TOPIC, 0))
        w.append(Message(TOPIC, 0, sys_flag=TRANSACTION_PREPARED_TYPE))
        w.append(Message(TOPIC, 0, sys_flag=TRANSACTION_ROLLBACK_TYPE))
    with open_writer(tmp_path) as w:
        assert w.append(Message(TOPIC, 0)).queue_offset == 2
        assert w.append(Message(TOPIC, 0, properties={"DELAY": "3"})).queue_offset == 0


def test_reopen_overwrites_a_torn_tail(tmp_path: Path) -> None:
    """A last record torn by a crash is not data: the reopened writer appends where it started."""
    with open_writer(tmp_path) as w:
        results = [w.append(Message(TOPIC, 0, body=bytes(range(1, 201)))) for _ in range(3)]
    torn = results[-1]
    keep = fixed_part_struct(0).size + 100
    seg = tmp_path / offset_to_file_name(0)
    data = bytearray(seg.read_bytes())
    data[torn.phy_offset + keep : torn.phy_offset + torn.msg_size] = bytes(torn.msg_size - keep)
    seg.write_bytes(bytes(data))
    with open_writer(tmp_path) as w:
        assert w.max_offset == torn.phy_offset
        r = w.append(Message(TOPIC, 0, body=b"after crash"))
    assert r.phy_offset == torn.phy_offset
    assert r.queue_offset == 2
    rows, last = read_all(tmp_path)
    assert [row["phy"] for row in rows] == [results[0].phy_offset, results[1].phy_offset, r.phy_offset]
    assert last.status is ReadStatus.END
    assert last.pending is None


# --- 5.x options --------------------------------------------------------------------------------------

def test_trailing_separator_is_written_and_read(tmp_path: Path) -> None:
    """With trailing_separator the properties end with \\x02; the reader still finds KEYS, TAGS, UNIQ_KEY."""
    props = {"KEYS": "k1 k2", "TAGS": "TagA", "UNIQ_KEY": "C0A8010A12342A9F0000000000000001"}
    with open_writer(tmp_path, trailing_separator=True) as w:
        r = w.append(Message(TOPIC, 0, body=b"x", properties=props))
    rec = stored(tmp_path, r.phy_offset)
    assert rec.properties.endswith(b"\x02")
    assert not rec.properties.endswith(b"\x02\x02")
    rows, _ = read_all(tmp_path)
    assert rows[0]["keys"] == "k1 k2"
    assert rows[0]["uniq_key"] == props["UNIQ_KEY"]
    assert rows[0]["tags_code"] == TAG_A_HASH


@pytest.mark.parametrize(
    ("props", "trailing", "before_crc"),
    [({"KEYS": "k1"}, False, b"KEYS\x01k1\x02"), ({"KEYS": "k1"}, True, b"KEYS\x01k1\x02"), ({}, False, b""),
     ({"KEYS": "k1", PROPERTY_CRC32: "1234567890"}, False, b"KEYS\x01k1\x02")],
    ids=["separator_inserted", "trailing_kept", "no_properties", "incoming_crc_dropped"],
)
def test_crc32_property_covers_record_minus_last_20_bytes(tmp_path: Path, props: dict[str, str], trailing: bool,
                                                          before_crc: bytes) -> None:
    """`__CRC32#` ends the properties; its digits, read last to first, are crc32(record[:size-20]) & 0x7FFFFFFF."""
    with open_writer(tmp_path, append_crc_property=True, trailing_separator=trailing) as w:
        r = w.append(Message(TOPIC, 0, body=b"payload", properties=props))
    raw = raw_record(tmp_path, r.phy_offset, r.msg_size)
    crc = zlib.crc32(raw[: r.msg_size - CRC32_RESERVED_LENGTH]) & 0x7FFFFFFF
    assert raw[r.msg_size - CRC32_RESERVED_LENGTH :] == encode_crc32_property(crc)
    rec = MessageRecord.decode(raw)
    assert rec.properties == before_crc + encode_crc32_property(crc)
    assert rec.properties.count(PROPERTY_CRC32.encode()) == 1
    assert decode_crc32_digits(parse_properties(rec.properties)[PROPERTY_CRC32]) == crc


def test_crc32_property_record_reads_back(tmp_path: Path) -> None:
    """Records carrying `__CRC32#` read back through CommitLogReader with their keys and tags."""
    with open_writer(tmp_path, append_crc_property=True) as w:
        w.append(Message(TOPIC, 0, body=b"a", properties={"KEYS": "k1", "TAGS": "TagA"}))
        w.append(Message(TOPIC, 0, body=b"b"))
    rows, last = read_all(tmp_path)
    assert [(r["keys"], r["tags_code"]) for r in rows] == [("k1", TAG_A_HASH), (None, 0)]
    assert last.status is ReadStatus.END


def test_v2_magic_for_a_200_byte_topic(tmp_path: Path) -> None:
    """With allow_v2 a 200-byte topic is written with magic v2 and a 2-byte topic length, and reads back."""
    topic = "T" * 200
    with open_writer(tmp_path, allow_v2=True) as w:
        r = w.append(Message(topic, 1, body=b"body", properties={"KEYS": "k1", "TAGS": "TagA"}))
    raw = raw_record(tmp_path, r.phy_offset, r.msg_size)
    assert struct.unpack_from(">i", raw, MAGIC_CODE_OFFSET)[0] == MESSAGE_MAGIC_CODE_V2
    topic_length_at = fixed_part_struct(0).size + len(b"body")
    assert struct.unpack_from(">h", raw, topic_length_at)[0] == 200
    assert r.msg_size == record_size(0, MESSAGE_MAGIC_CODE_V2, 4, 200, len(b"KEYS\x01k1\x02TAGS\x01TagA"))
    rows, _ = read_all(tmp_path)
    assert (rows[0]["topic"], rows[0]["keys"], rows[0]["tags_code"]) == (topic, "k1", TAG_A_HASH)
    assert stored(tmp_path, r.phy_offset).topic == topic


def test_v1_magic_up_to_127_bytes(tmp_path: Path) -> None:
    """A topic of exactly 127 bytes still gets magic v1, even when v2 is allowed; 128 bytes gets v2."""
    with open_writer(tmp_path, allow_v2=True) as w:
        a = w.append(Message("a" * MAX_TOPIC_LENGTH_V1, 0))
        b = w.append(Message("b" * (MAX_TOPIC_LENGTH_V1 + 1), 0))
    assert struct.unpack_from(">i", raw_record(tmp_path, a.phy_offset, a.msg_size), MAGIC_CODE_OFFSET)[0] == (
        MESSAGE_MAGIC_CODE)
    assert struct.unpack_from(">i", raw_record(tmp_path, b.phy_offset, b.msg_size), MAGIC_CODE_OFFSET)[0] == (
        MESSAGE_MAGIC_CODE_V2)
    rows, _ = read_all(tmp_path)
    assert [r["topic"] for r in rows] == ["a" * MAX_TOPIC_LENGTH_V1, "b" * (MAX_TOPIC_LENGTH_V1 + 1)]


def test_long_topic_without_v2_is_refused(tmp_path: Path) -> None:
    """Without allow_v2 (4.9.3) a topic over 127 bytes is refused and nothing is written."""
    with open_writer(tmp_path) as w:
        with pytest.raises(ValueError, match="127"):
            w.append(Message("T" * (MAX_TOPIC_LENGTH_V1 + 1), 0))
        assert w.append(Message(TOPIC, 0)).phy_offset == 0


def test_5x_writer_log_reads_back_across_segments(tmp_path: Path) -> None:
    """All 5.x options at once, over several segments, IPv6 hosts included: every record reads back right."""
    store_v6 = Host(bytes.fromhex("20010db8000000000000000000000001"), 10911)
    born_v6 = Host(bytes.fromhex("20010db8000000000000000000000064"), 50000)
    long_topic = "L" * 200
    expected = []
    with open_writer(tmp_path, trailing_separator=True, append_crc_property=True, allow_v2=True,
                     store_host=store_v6) as w:
        for i in range(40):
            topic = long_topic if i % 3 == 0 else TOPIC
            props = {"KEYS": f"k{i} x{i}", "TAGS": f"tag{i % 4}", "UNIQ_KEY": f"{i:032X}"}
            msg = Message(topic, i % 2, body=bytes([i]) * (100 + i * 7), properties=props,
                          born_host=born_v6 if i % 2 else Host(bytes([192, 0, 2, 7]), 4000))
            r = w.append(msg)
            expected.append((r.phy_offset, topic, i % 2, r.queue_offset, f"k{i} x{i}", f"{i:032X}",
                             java_string_hash(f"tag{i % 4}")))
    assert expected[-1][0] >= 2 * SEGMENT
    rows, last = read_all(tmp_path)
    assert [(r["phy"], r["topic"], r["queue_id"], r["queue_offset"], r["keys"], r["uniq_key"], r["tags_code"])
            for r in rows] == expected
    assert last.status is ReadStatus.END
    assert np.all(np.diff([r["phy"] for r in rows]) > 0)
    assert sorted(os.listdir(tmp_path)) == [offset_to_file_name(s) for s in range(0, last.next_offset, SEGMENT)]


# --- new segments appear complete, under their own name only (issue 28 §6) -------------------------------

def test_a_new_segment_is_built_outside_the_commitlog_directory(tmp_path: Path, monkeypatch) -> None:
    """At every step of creating a segment (the fail points of `create_file`), the CommitLog directory holds
    only 20-digit names: a daemon following it never meets the writer's temporary file (before: `….tmp`
    inside `commitlog/`, which `reputd run` took for a stray file and reported down). The temporary file is
    beside the directory, and gone once renamed in."""
    from indexcore import _failpoints

    log_dir = tmp_path / "store" / "commitlog"
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(_failpoints, "hook", lambda point: seen.append((point, sorted(os.listdir(log_dir)))))
    with CommitLogWriter(str(log_dir), 4096) as w:
        while w.max_offset < 3 * 4096 + 100:
            w.append(Message("T", 0, b"x" * 300))
    steps = [point for point, _ in seen]
    assert steps.count("file.after_rename") == 4
    assert "file.after_allocate" in steps
    assert all(len(name) == 20 and name.isdigit() for _, names in seen for name in names), seen
    assert sorted(os.listdir(tmp_path / "store")) == ["commitlog"]


def test_a_segment_creation_a_kill_cut_short_is_cleaned_up_on_reopen(tmp_path: Path) -> None:
    log_dir = tmp_path / "store" / "commitlog"
    with CommitLogWriter(str(log_dir), 4096) as w:
        w.append(Message("T", 0, b"x"))
    stale = tmp_path / "store" / f".commitlog.{offset_to_file_name(4096)}.tmp"
    stale.write_bytes(bytes(4096))
    other = tmp_path / "store" / ".other.tmp"  # not the writer's: left alone
    other.write_bytes(b"")
    with CommitLogWriter(str(log_dir), 4096) as w:
        assert w.max_offset > 0
    assert not stale.exists()
    assert other.exists()
