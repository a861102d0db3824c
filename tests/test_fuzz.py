"""Fuzzing the CommitLog decoders: mutated valid records through the public API.

The only exception a decoder may raise (or return) is `CorruptRecordError`, a `StoreError` naming the
field and the offset. A record a decoder accepts must be a real record: inside the buffer, re-encoding
to the very bytes it was decoded from, with a body that matches its CRC. The two public decoders —
`MessageRecord.decode` (one record) and `decode_segment` (the batch path the reader and the daemon use) —
must agree on every record.

(a) hypothesis: bit flips, byte overwrites, truncations, length-field tampering, inserted bytes;
(b) a seeded `random.Random` loop over many mutated records, `scale(fast, stress)` of them, laid out
    back to back in one segment buffer per `decode_segment` call and resumed after each rejection;
(c) when atheris is installed, the stress mode also runs tests/fuzz_atheris.py for a fixed number of runs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import random
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexcore.commitlog import BLANK_MAGIC_CODE, MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2, Host, MessageRecord
from indexcore.dispatch import DelayLevelTable
from indexcore.errors import CorruptRecordError, StoreError
from indexcore.reader import Stop, decode_segment
from tests.stress import report, scale

PHY_AT = 28  # PHYSICALOFFSET
SYS_FLAG_AT = 36
BODY_LENGTH_AT = {0: 84, 0x10: 96, 0x20: 96, 0x30: 108}  # by the two host bits of SYSFLAG
HOST_BITS = 0x30
INTERESTING = (0, 1, -1, 2, 7, 8, 90, 91, 92, 127, 128, 255, 256, 32767, -32768, 65535, 4 * 1024 * 1024,
               4 * 1024 * 1024 + 1, 2**31 - 1, -(2**31))
DELAYS = DelayLevelTable()


# --- valid records ----------------------------------------------------------------------------------

SAFE_TOPIC = st.text(alphabet="abcXYZ019_-%|订单😀", min_size=1, max_size=40)
PROP_TEXT = st.text(alphabet=st.characters(blacklist_characters="\x00\x01\x02", blacklist_categories=("Cs",)),
                    max_size=20)


@st.composite
def valid_records(draw) -> MessageRecord:
    v6_born = draw(st.booleans())
    v6_store = draw(st.booleans())
    long_topic = draw(st.integers(0, 9)) == 0
    topic = "T" * draw(st.integers(128, 255)) if long_topic else draw(SAFE_TOPIC)
    props = draw(st.dictionaries(st.sampled_from(["KEYS", "TAGS", "UNIQ_KEY", "DELAY", "WAIT", "X"]), PROP_TEXT,
                                 max_size=5))
    raw_props = "\x02".join(f"{k}\x01{v}" for k, v in props.items()).encode()
    if draw(st.booleans()) and raw_props:
        raw_props += b"\x02"
    body = draw(st.binary(max_size=200))
    return make_record(topic, raw_props, body, v6_born, v6_store, draw(st.integers(0, 3)) << 2,
                       MESSAGE_MAGIC_CODE_V2 if long_topic or draw(st.booleans()) else MESSAGE_MAGIC_CODE)


def make_record(topic: str, properties: bytes, body: bytes, v6_born: bool = False, v6_store: bool = False,
                tx_bits: int = 0, magic: int = MESSAGE_MAGIC_CODE) -> MessageRecord:
    born = Host(bytes(range(16)) if v6_born else bytes([10, 0, 0, 1]), 50000)
    store = Host(bytes(range(16, 32)) if v6_store else bytes([10, 0, 0, 2]), 10911)
    sys_flag = tx_bits | (0x10 if v6_born else 0) | (0x20 if v6_store else 0)
    return MessageRecord(topic=topic, queue_id=3, flag=0, queue_offset=7, physical_offset=0, sys_flag=sys_flag,
                         born_timestamp=1_700_000_000_000, born_host=born, store_timestamp=1_700_000_000_123,
                         store_host=store, reconsume_times=0, prepared_transaction_offset=0, body=body,
                         properties=properties, body_crc=zlib.crc32(body) & 0x7FFFFFFF, magic=magic)


# --- the properties every accepted record must have ------------------------------------------------

def check_record_decode(buf: bytes, pos: int = 0) -> MessageRecord | None:
    """`MessageRecord.decode` at `pos`: a CorruptRecordError at `pos`, or a record that re-encodes to the
    bytes it came from. Any other exception fails the test."""
    error = None
    try:
        rec = MessageRecord.decode(buf, pos)
    except CorruptRecordError as e:
        error = e
    if error is not None:
        assert error.offset == pos, error
        assert error.field, error
        return None
    size = rec.total_size
    assert pos + size <= len(buf)
    assert rec.encode() == buf[pos : pos + size]
    if rec.body:
        assert rec.body_crc == zlib.crc32(rec.body) & 0x7FFFFFFF  # §3.7, computed here, not by indexcore
    return rec


def segment_of(records: list[bytes]) -> tuple[bytes, list[int]]:
    """Records back to back, then a BLANK filling the rest; the start of each."""
    starts, pos = [], 0
    for r in records:
        starts.append(pos)
        pos += len(r)
    blank = struct.pack(">ii", 8, BLANK_MAGIC_CODE)
    return b"".join(records) + blank, starts


def check_segment_decode(buf: bytes, start: int) -> tuple[Stop, int, list[tuple[int, int]], CorruptRecordError | None]:
    res = decode_segment(buf, start, segment_offset=0, segment_size=len(buf), max_bytes=len(buf) - start,
                         delay_table=DELAYS)
    assert res.stop in (Stop.END, Stop.ERROR, Stop.BLANK, Stop.LIMIT)
    assert start <= res.position <= len(buf)
    b = res.batch
    n = len(b)
    for column in (b.msg_size, b.queue_id, b.queue_offset, b.sys_flag, b.store_timestamp, b.tags_code,
                   b.prepared_transaction_offset, b.topic_id):
        assert len(column) == n
    assert len(b.keys) == len(b.uniq_key) == n
    spans = list(zip(b.phy_offset.tolist(), b.msg_size.tolist(), strict=True))
    at = start
    for phy, size in spans:  # back to back, inside the buffer, each decodable on its own
        assert phy == at
        assert size > 0
        at += size
        assert at <= len(buf)
    assert at == res.position
    if res.stop is Stop.ERROR:
        assert isinstance(res.error, CorruptRecordError), res.error
        assert res.error.offset == res.position
    return res.stop, res.position, spans, res.error


# --- (a) hypothesis ---------------------------------------------------------------------------------

def tamper_length(data: bytearray, which: int, value: int) -> None:
    """Set TOTALSIZE, BODYLENGTH, TOPICLENGTH or PROPERTIESLENGTH of the record in `data` to `value`."""
    sys_flag = struct.unpack_from(">i", data, SYS_FLAG_AT)[0]
    body_at = BODY_LENGTH_AT[sys_flag & HOST_BITS]
    magic = struct.unpack_from(">i", data, 4)[0]
    if which == 0:
        struct.pack_into(">i", data, 0, value)
    elif which == 1:
        struct.pack_into(">i", data, body_at, value)
    else:
        body = struct.unpack_from(">i", data, body_at)[0]
        topic_at = body_at + 4 + body
        if which == 2:
            if magic == MESSAGE_MAGIC_CODE_V2:
                struct.pack_into(">h", data, topic_at, (value + 2**15) % 2**16 - 2**15)
            else:
                data[topic_at] = value % 256
        else:
            t = 2 if magic == MESSAGE_MAGIC_CODE_V2 else 1
            topic_len = struct.unpack_from(">h", data, topic_at)[0] if t == 2 else data[topic_at]
            struct.pack_into(">h", data, topic_at + t + topic_len, (value + 2**15) % 2**16 - 2**15)


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.integers(0, 10**6), min_size=1, max_size=8)),
    st.tuples(st.just("overwrite"), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                                             max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("length"), st.tuples(st.integers(0, 3), st.one_of(st.sampled_from(INTERESTING),
                                                                        st.integers(-(2**31), 2**31 - 1)))),
    st.tuples(st.just("insert"), st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=16))),
)


def mutate(data: bytes, mutation) -> bytes:
    kind, arg = mutation
    out = bytearray(data)
    if kind == "flip":
        for bit in arg:
            out[(bit // 8) % len(out)] ^= 1 << (bit % 8)
    elif kind == "overwrite":
        for at, value in arg:
            out[at % len(out)] = value
    elif kind == "truncate":
        del out[arg % len(out):]
    elif kind == "length":
        with contextlib.suppress(struct.error, IndexError, KeyError):  # an earlier mutation moved the field
            tamper_length(out, *arg)
    else:
        at, extra = arg
        out[at % (len(out) + 1):at % (len(out) + 1)] = extra
    return bytes(out)


@settings(max_examples=scale(300, 20_000), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(valid_records(), st.lists(MUTATIONS, min_size=1, max_size=3))
def test_mutated_record_is_refused_with_a_typed_error_or_decodes_consistently(record, mutations):
    valid = record.encode()
    assert check_record_decode(valid) == record
    data = valid
    for m in mutations:
        if not data:
            break
        data = mutate(data, m)
    # the batch path on the same bytes: the record at the start of a segment (PHYSICALOFFSET 0 fits)
    buf, _ = segment_of([data])
    stop, position, spans, error = check_segment_decode(buf, 0)
    compare_decoders(buf, 0, stop, position, spans, error)


def compare_decoders(buf: bytes, pos: int, stop: Stop, position: int, spans, error) -> str:
    """What `decode_segment` did at `pos`, checked against `MessageRecord.decode` there. Returns the outcome:
    "accepted", "rejected:<field>", "end" or "blank"."""
    rec = check_record_decode(buf, pos)
    here = [s for s in spans if s[0] == pos]
    if here:
        assert rec is not None, f"decode_segment accepted {here[0]} at {pos}; MessageRecord.decode refused it"
        assert rec.total_size == here[0][1]
        assert rec.physical_offset == pos
        return "accepted"
    if position == pos and stop is Stop.ERROR:
        if rec is not None:  # decode_segment's own checks: the position, the DELAY of the schedule topic
            assert error.field in ("physical_offset", "properties.DELAY"), (error, rec)
        return f"rejected:{error.field}"
    if position == pos and stop is Stop.END:
        assert struct.unpack_from(">i", buf, pos)[0] == 0
        return "end"
    if position == pos and stop is Stop.BLANK:
        return "blank"
    raise AssertionError(f"decode_segment stopped at {position} ({stop}), not at {pos}")


# --- (b) a fast seeded loop -------------------------------------------------------------------------

FUZZ_SEED = int(os.environ.get("REPUTD_FUZZ_SEED", "20261121"))
FUZZ_INPUTS = scale(4_000, 1_000_000)
RECORDS_PER_BUFFER = 2_000


def base_records(rng: random.Random, n: int = 300) -> list[bytes]:
    """Valid records of every shape: v1/v2, IPv4/IPv6 hosts, empty and full parts, 4.9/5.x properties."""
    out = []
    for i in range(n):
        long_topic = i % 17 == 0
        topic = "T" * rng.randint(128, 200) if long_topic else rng.choice(["TopicA", "订单Topic", "t", "%RETRY%g",
                                                                          "SCHEDULE_TOPIC_XXXX"])
        props = {k: rng.choice(["", "a", "k1 k2", "TagA", "3", "x" * 40, "😀"]) for k in
                 rng.sample(["KEYS", "TAGS", "UNIQ_KEY", "DELAY", "WAIT", "REAL_TOPIC"], rng.randint(0, 4))}
        raw = b"\x02".join(f"{k}\x01{v}".encode() for k, v in props.items())
        if raw and rng.random() < 0.3:
            raw += b"\x02"
        body = rng.randbytes(rng.choice([0, 1, 5, 64, 200]))
        magic = MESSAGE_MAGIC_CODE_V2 if long_topic or rng.random() < 0.2 else MESSAGE_MAGIC_CODE
        rec = make_record(topic, raw, body, rng.random() < 0.2, rng.random() < 0.2, rng.randint(0, 3) << 2, magic)
        out.append(rec.encode())
    return out


def random_mutation(rng: random.Random, data: bytearray) -> str:
    kind = rng.randrange(6)
    n = len(data)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(n)] ^= 1 << rng.randrange(8)
        return "flip"
    if kind == 1:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(n)] = rng.randrange(256)
        return "overwrite"
    if kind == 2:
        del data[rng.randrange(1, n):]
        return "truncate"
    if kind == 3:
        value = rng.choice(INTERESTING) if rng.random() < 0.7 else rng.randint(-(2**31), 2**31 - 1)
        tamper_length(data, rng.randrange(4), value)
        return "length"
    if kind == 4:
        at = rng.randrange(n + 1)
        data[at:at] = rng.randbytes(rng.randint(1, 16))
        return "insert"
    at = rng.randrange(n)
    del data[at : at + rng.randint(1, 16)]
    return "delete"


def fuzz_loop(seed: int, inputs: int) -> dict:
    rng = random.Random(seed)
    bases = base_records(rng)
    outcomes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    calls = 0
    done = 0
    while done < inputs:
        records = []
        pos = 0
        for _ in range(min(RECORDS_PER_BUFFER, inputs - done)):
            data = bytearray(rng.choice(bases))
            struct.pack_into(">q", data, PHY_AT, pos)  # a valid record here, before the damage
            kinds[random_mutation(rng, data)] += 1
            if not data:
                data = bytearray(b"\0")
            records.append(bytes(data))
            pos += len(data)
        buf, starts = segment_of(records)
        slot = {s: i for i, s in enumerate(starts)}
        seen = [False] * len(starts)
        i = 0
        while i < len(starts):  # decode from slot i, then from the first slot not yet decoded from its start
            calls += 1
            stop, position, spans, error = check_segment_decode(buf, starts[i])
            for at in [phy for phy, _ in spans] + [position]:
                k = slot.get(at)
                if k is not None and not seen[k]:
                    seen[k] = True
                    outcomes[compare_decoders(buf, at, stop, position, spans, error)] += 1
            # a slot swallowed by an accepted record whose TOTALSIZE spans it is decoded from its own start next
            while i < len(starts) and seen[i]:
                i += 1
        done += len(records)
    return {"outcomes": outcomes, "mutations": kinds, "calls": calls, "inputs": done}


def test_seeded_mutation_loop():
    started = time.perf_counter()
    result = fuzz_loop(FUZZ_SEED, FUZZ_INPUTS)
    seconds = time.perf_counter() - started
    outcomes = result["outcomes"]
    decoded = sum(outcomes.values())
    accepted = outcomes["accepted"]
    rejected = {k.split(":", 1)[1]: v for k, v in sorted(outcomes.items()) if k.startswith("rejected:")}
    report("fuzz_decoder", seed=FUZZ_SEED, inputs_tried=result["inputs"], decoded_from_own_start=decoded,
           accepted=accepted, rejected=sum(rejected.values()), end=outcomes["end"], blank=outcomes["blank"],
           rejected_by_field=dict(rejected), mutations=dict(result["mutations"]),
           decode_segment_calls=result["calls"], seconds=round(seconds, 1))
    assert result["inputs"] == FUZZ_INPUTS
    assert decoded == FUZZ_INPUTS, "every input is decoded from its own start"
    assert rejected, "nothing was rejected: the mutations are not reaching the decoder"


def test_fuzz_loop_is_reproducible():
    a = fuzz_loop(7, 300)
    b = fuzz_loop(7, 300)
    assert a == b


# --- (c) atheris, when installed --------------------------------------------------------------------

ATHERIS_RUNS = scale(2_000, 200_000)


@pytest.mark.stress_only
def test_atheris_harness(tmp_path):
    pytest.importorskip("atheris")
    harness = Path(__file__).with_name("fuzz_atheris.py")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    res = subprocess.run([sys.executable, str(harness), f"-runs={ATHERIS_RUNS}", "-seed=1",
                          f"-artifact_prefix={tmp_path}/", str(corpus)],
                         capture_output=True, text=True, timeout=3600, check=False)
    tail = res.stderr[-3000:]
    assert res.returncode == 0, tail
    done = [ln for ln in res.stderr.splitlines() if ln.startswith("Done ")]
    report("fuzz_atheris", runs=ATHERIS_RUNS, result=done[-1] if done else tail[-200:])


def test_host_flags_longer_than_a_short_record_are_a_typed_error():
    """Found by atheris: a record of 92 bytes whose SYSFLAG claims IPv6 hosts (fixed part 112 bytes), at the
    end of the buffer (as `CommitLog.read_record`, used by the queries, passes it: exactly TOTALSIZE bytes)."""
    data = bytearray(make_record("T", b"", b"").encode())
    assert len(data) == 92
    struct.pack_into(">i", data, SYS_FLAG_AT, 0x30)
    with pytest.raises(CorruptRecordError):
        MessageRecord.decode(bytes(data))


def test_store_error_is_the_base_of_every_decoder_error():
    """The contract the fuzz tests rely on."""
    assert issubclass(CorruptRecordError, StoreError)
    rec = make_record("TopicA", b"KEYS\x01k", b"body")
    with pytest.raises(StoreError):
        MessageRecord.decode(rec.encode()[:50])
    assert dataclasses.replace(rec) == MessageRecord.decode(rec.encode())
