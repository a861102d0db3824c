"""CommitLogs that make splitting segments into byte ranges hard, shared by the backfill tests.

`write_forged_store` writes messages whose bodies hold records that validate themselves: a header with the
right MAGICCODE and PHYSICALOFFSET for where it lies, followed by another one, and, in one body out of
three, a complete record (body CRC and all) that ends exactly where the real record ends, because its
topic and properties are the real record's own tail. A range that starts inside such a body finds the
forgery first; only the chain check tells it apart. Also: BLANK records (many segments), v2 records
(topics over 127 bytes), transactions, delays, records without keys.
"""

from __future__ import annotations

import random
from pathlib import Path

from indexcore.commitlog import (
    END_FILE_MIN_BLANK_LENGTH,
    MAGIC_CODE_OFFSET,
    MESSAGE_MAGIC_CODE,
    MessageRecord,
    body_crc32,
    encode_properties,
)
from indexcore.writer import DEFAULT_BORN_HOST, DEFAULT_STORE_HOST, CommitLogWriter, Message

BODY_AT = 88  # a v4-host record's body starts here
LONG_TOPIC = "V2Topic-" + "x" * 130  # over 127 bytes: a v2 record


def _fake(topic: str, props: dict, body: bytes, at: int, queue_id: int = 99) -> bytes:
    properties = encode_properties(props)
    return MessageRecord(topic=topic, queue_id=queue_id, flag=0, queue_offset=7, physical_offset=at, sys_flag=0,
                         born_timestamp=1, born_host=DEFAULT_BORN_HOST, store_timestamp=2,
                         store_host=DEFAULT_STORE_HOST, reconsume_times=0, prepared_transaction_offset=0, body=body,
                         properties=properties, body_crc=body_crc32(body)).encode()


def _size(topic: str, props: dict, body_len: int) -> int:
    return len(_fake(topic, props, bytes(body_len), 0))


def _body(rng: random.Random, topic: str, props: dict, prefix: bytes, body_len: int, at: int, complete: bool) -> bytes:
    """The body of a record written at `at`: forged headers right after `prefix`."""
    if complete:
        # a complete record inside the body, ending where the real record ends
        inner = rng.randbytes(rng.randrange(0, 300))
        tail_len = len(_fake(topic, props, b"", 0)) - BODY_AT
        return prefix + _fake(topic, props, inner, at + BODY_AT + len(prefix))[:-tail_len]
    # a header chain: two self-validating headers, then garbage
    body = bytearray(prefix + rng.randbytes(body_len))
    first = at + BODY_AT + len(prefix)
    hop = rng.randrange(100, 200)
    for k, where in enumerate((first, first + hop)):
        rel = where - at - BODY_AT
        if rel + 36 <= len(body):
            body[rel : rel + 4] = (hop if k == 0 else 120).to_bytes(4, "big")
            body[rel + MAGIC_CODE_OFFSET : rel + 8] = MESSAGE_MAGIC_CODE.to_bytes(4, "big", signed=True)
            body[rel + 28 : rel + 36] = where.to_bytes(8, "big")
    return bytes(body)


def write_forged_store(commitlog: Path, segment_size: int, n: int, *, seed: int = 3, big_every: int = 0,
                       big_body: int = 0) -> list:
    """`n` messages, most of them carrying forged records in their bodies; every `big_every`-th message has
    a body of `big_body` bytes (to fill large segments quickly)."""
    rng = random.Random(seed)
    ticks = iter(range(n))
    results = []
    with CommitLogWriter(str(commitlog), segment_size, clock=lambda: 1_700_000_000_000 + next(ticks) * 7,
                         allow_v2=True) as w:
        for i in range(n):
            topic = LONG_TOPIC if i % 11 == 5 else ("FTopicA", "FTopicB", "FTopicC")[i % 3]
            props = {"TAGS": f"t{i % 4}"}
            if i % 4:
                props["KEYS"] = f"fk{i} fk{i}-b"
            if i % 5:
                props["UNIQ_KEY"] = f"{seed:08X}{i:024X}"
            if i % 23 == 0:
                props["DELAY"] = "3"
            sys_flag = 0x8 if i % 19 == 0 else 0
            prefix = rng.randbytes(rng.randrange(0, 64))
            body_len = big_body if big_every and i % big_every == big_every - 1 else rng.randrange(40, 900)
            stored_topic, _, stored_props = w._delayed(Message(topic, i % 4, b"", props, sys_flag=sys_flag))
            size_guess = _size(stored_topic, stored_props, body_len + len(prefix))
            for _ in range(2):  # the body's length decides whether the writer rolls, which moves the record
                at = w.max_offset
                if size_guess + END_FILE_MIN_BLANK_LENGTH > segment_size - at % segment_size:
                    at += segment_size - at % segment_size
                body = _body(random.Random(seed * 1_000_003 + i), stored_topic, stored_props, prefix, body_len, at,
                             complete=i % 3 == 0 and stored_topic != LONG_TOPIC)
                size_guess = _size(stored_topic, stored_props, len(body))
            r = w.append(Message(topic, i % 4, body, props, sys_flag=sys_flag))
            assert r.phy_offset == at, (r.phy_offset, at)
            results.append(r)
    return results


def tear_tail(commitlog: Path, segment_size: int, last) -> None:
    """Zero the second half of the last record: an incomplete record at the end of the written data."""
    path = commitlog / f"{last.phy_offset - last.phy_offset % segment_size:020d}"
    with open(path, "r+b") as f:
        f.seek(last.phy_offset % segment_size + last.msg_size // 2)
        f.write(bytes(last.msg_size - last.msg_size // 2))


def corrupt_record(commitlog: Path, segment_size: int, victim) -> None:
    """A bad MAGICCODE in a record in the middle of its segment."""
    path = commitlog / f"{victim.phy_offset - victim.phy_offset % segment_size:020d}"
    with open(path, "r+b") as f:
        f.seek(victim.phy_offset % segment_size + MAGIC_CODE_OFFSET)
        f.write(b"\x00\x00\x00\x01")


__all__ = ["LONG_TOPIC", "corrupt_record", "tear_tail", "write_forged_store"]
