"""Torn writes: `reputd run` follows a CommitLog whose records are copied in a few bytes at a time.

A broker copies each record into its mapping with memcpy, which does not fill a record front to back in
one step: the copy is cut by page faults and preemption, and glibc's larger copies store the middle first
and the head (TOTALSIZE) last. Here a writer copies every record in random-size chunks with random small
pauses (seeded), in the orders a real copy can take, while the daemon tails the log. The daemon must
never dispatch a record before its last byte is written: every ConsumeQueue unit must point at a
complete, CRC-valid record of its topic, queue and queue offset with its tagsCode, the IndexFiles must
hold exactly the keys of the CommitLog, and the output must equal a clean rebuild.

The helpers here (a chunked copier, a CommitLog walker and the unit/entry checks) are shared with
tests/test_crash.py.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexcore.commitlog import (
    BLANK_MAGIC_CODE,
    RECORD_PREFIX,
    MessageRecord,
    encode_blank,
    parse_properties,
)
from indexcore.consumequeue import BLANK_UNIT, CQ_UNIT, CQ_UNIT_SIZE
from indexcore.indexfile import INDEX_ENTRY, INDEX_HEADER, INDEX_HEADER_SIZE
from indexcore.javahash import index_key_hash, java_string_hash
from indexcore.mappedfile import offset_to_file_name
from indexcore.writer import CommitLogWriter, Message
from tests import stress
from tests.test_daemon import SEGMENT, START_MS, TOPICS, Store, events, output_files, stop, wait_for

HASH_SLOTS, INDEX_NUM = 97, 400  # tests.test_daemon.Store's IndexFile geometry
ROOT = Path(__file__).resolve().parent.parent

# How a record's bytes reach the mapping. Each chunk is itself one memcpy.
#   forward         front to back (a copy cut by page faults or preemption)
#   size-last       everything but TOTALSIZE front to back, then TOTALSIZE
#   backward        back to front (memmove's backward loop)
#   tail-head-last  glibc's large-copy loop: the middle front to back, then the last 4 vectors, then the first
#                   vector in one store (16 bytes with SSE2: TOTALSIZE, MAGICCODE, BODYCRC, QUEUEID)
# A piece of the head smaller than one store is not a copy any memcpy makes: TOTALSIZE and BODYCRC written
# before QUEUEID would pass every check the format allows (QUEUEID is not covered by the body CRC).
VEC = 16
ORDERS = ("forward", "size-last", "backward", "tail-head-last")


# --- a writer that copies records in pieces ---------------------------------------------------------

def message(i: int, body_size: int = 160) -> Message:
    """The i-th sample message: TAGS, two KEYS tokens (one CJK and emoji) and a UNIQ_KEY."""
    props = {"TAGS": f"Tag{i % 3}", "KEYS": f"order-{i} 订单😀{i % 11}", "UNIQ_KEY": f"{i:032X}"}
    return Message(TOPICS[i % len(TOPICS)], i % 4, bytes([i % 251 + 1]) * (body_size + i % 50), props)


def chunk_plan(size: int, order: str, rng: random.Random, max_chunk: int = 48) -> list[tuple[int, int]]:
    """The [start, end) pieces of a `size`-byte record in the order they are copied."""

    def pieces(lo: int, hi: int) -> list[tuple[int, int]]:
        out = []
        while lo < hi:
            step = rng.randint(1, max_chunk)
            out.append((lo, min(hi, lo + step)))
            lo += step
        return out

    if order == "forward":
        return pieces(0, size)
    if order == "size-last":
        return [*pieces(4, size), (0, 4)]
    if order == "backward":
        return pieces(0, size)[::-1]
    if order == "tail-head-last":  # the head is one vector store, the last of the copy
        head = min(VEC, size)
        tail = max(head, size - 4 * VEC)
        return [*pieces(head, tail), *pieces(tail, size), (0, head)]
    raise ValueError(order)


class LiveLog:
    """Writes into the segments of a live CommitLog through shared mappings, as a broker does. A new
    segment is created at full size in one step (the daemon ignores a newest segment that is short)."""

    def __init__(self, directory: Path, segment_size: int = SEGMENT):
        self.directory = directory
        self.segment_size = segment_size
        self._maps: dict[int, mmap.mmap] = {}

    def _map(self, start: int) -> mmap.mmap:
        mm = self._maps.get(start)
        if mm is None:
            path = self.directory / offset_to_file_name(start)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size < self.segment_size:
                    os.ftruncate(fd, self.segment_size)
                mm = self._maps[start] = mmap.mmap(fd, self.segment_size)
            finally:
                os.close(fd)
        return mm

    def write(self, offset: int, data: bytes) -> None:
        start = offset - offset % self.segment_size
        pos = offset - start
        self._map(start)[pos : pos + len(data)] = data

    def read(self, offset: int, size: int) -> bytes:
        start = offset - offset % self.segment_size
        return self._map(start)[offset - start : offset - start + size]

    def close(self) -> None:
        for mm in self._maps.values():
            mm.flush()
            mm.close()
        self._maps.clear()


@dataclass
class Piece:
    """A byte range of the CommitLog to copy: a message record or the BLANK that ends a segment."""

    offset: int
    data: bytes


class RecordSource:
    """Lays records out with the library's writer in a scratch copy of the CommitLog, so a test knows the
    exact bytes (and offsets) a broker would write next, then copies them into the live log itself."""

    def __init__(self, live_dir: Path, scratch_dir: Path, clock_start: int, resume_at: int | None = None):
        if scratch_dir.exists():
            shutil.rmtree(scratch_dir)
        shutil.copytree(live_dir, scratch_dir)
        if resume_at is not None:  # a restarted broker: the log ends at resume_at, whatever lies past it
            seg = scratch_dir / offset_to_file_name(resume_at - resume_at % SEGMENT)
            with open(seg, "r+b") as f:
                f.seek(resume_at % SEGMENT)
                f.write(bytes(SEGMENT - resume_at % SEGMENT))
        self._clock = iter(range(clock_start, clock_start + 10**12, 137))
        self.writer = CommitLogWriter(str(scratch_dir), SEGMENT, clock=lambda: next(self._clock))
        self.scratch = LiveLog(scratch_dir)

    @property
    def end(self) -> int:
        return self.writer.max_offset

    def next(self, msg: Message) -> list[Piece]:
        """The pieces appending `msg` writes: a BLANK first when it rolls the segment, then the record."""
        before = self.writer.max_offset
        res = self.writer.append(msg)
        pieces = []
        if res.phy_offset != before:  # rolled: a BLANK fills the rest of the old segment
            pieces.append(Piece(before, encode_blank(res.phy_offset - before)))
        self.writer.flush()
        pieces.append(Piece(res.phy_offset, bytes(self.scratch.read(res.phy_offset, res.msg_size))))
        return pieces

    def close(self) -> None:
        self.scratch.close()
        self.writer.close()


@dataclass
class CopyStats:
    records: int = 0
    chunks: int = 0
    pauses: int = 0


def copy_record(live: LiveLog, piece: Piece, order: str, rng: random.Random, stats: CopyStats,
                max_pause_s: float = 0.003, pause_chance: float = 0.3) -> None:
    """Copy one piece in chunks, in `order`, pausing now and then."""
    for lo, hi in chunk_plan(len(piece.data), order, rng):
        live.write(piece.offset + lo, piece.data[lo:hi])
        stats.chunks += 1
        if rng.random() < pause_chance:
            stats.pauses += 1
            time.sleep(rng.uniform(0, max_pause_s))
    stats.records += 1


def torn_writer_main(argv: list[str]) -> None:
    """A writer process killed mid-record (tests/test_crash.py): copy the next record's first chunks in
    ORDER, say where the record starts, then hang until killed.
    argv: commitlog_dir scratch_dir order seed index"""
    live_dir, scratch_dir, order, seed, index = argv
    rng = random.Random(int(seed))
    source = RecordSource(Path(live_dir), Path(scratch_dir), START_MS + 10**9)
    (piece,) = source.next(message(int(index), body_size=400))
    source.close()
    plan = chunk_plan(len(piece.data), order, rng)
    upto = rng.randint(1, len(plan) - 1)  # never the whole record
    live = LiveLog(Path(live_dir))
    for lo, hi in plan[:upto]:
        live.write(piece.offset + lo, piece.data[lo:hi])
    written = sum(hi - lo for lo, hi in plan[:upto])
    print(f"TORN {piece.offset} {len(piece.data)} {written}", flush=True)
    while True:
        time.sleep(60)


def spawn_torn_writer(store: Store, order: str, seed: int, index: int) -> tuple[subprocess.Popen, int, int, int]:
    """Start a torn writer; returns the process, the torn record's offset, its size and the bytes written."""
    code = "import sys; from tests.test_torn_writes import torn_writer_main; torn_writer_main(sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", code, str(store.tmp / "store" / "commitlog"),
                             str(store.tmp / "torn-scratch"), order, str(seed), str(index)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("TORN "):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"torn writer failed: {line!r} {err}")
    _, offset, size, written = line.split()
    return proc, int(offset), int(size), int(written)


# --- what the CommitLog holds, and what the output must hold for it ----------------------------------

@dataclass(frozen=True)
class Rec:
    offset: int
    size: int
    topic: str
    queue_id: int
    queue_offset: int
    store_timestamp: int
    tags: str | None
    keys: str | None
    uniq_key: str | None


def commitlog_records(commitlog_dir: Path, segment_size: int = SEGMENT) -> list[Rec]:
    """Every message record of a quiescent CommitLog, decoded whole (body CRC checked), in order."""
    out: list[Rec] = []
    starts = sorted(int(p.name) for p in commitlog_dir.iterdir() if p.name.isdigit())
    for start in starts:
        data = (commitlog_dir / offset_to_file_name(start)).read_bytes()
        pos = 0
        while pos + RECORD_PREFIX.size <= len(data):
            total, magic = RECORD_PREFIX.unpack_from(data, pos)
            if total == 0:
                assert not any(data[pos:]), f"data after the end of the log in segment {start}"
                break
            if magic == BLANK_MAGIC_CODE:
                break
            rec = MessageRecord.decode(data, pos)
            assert rec.physical_offset == start + pos
            props = parse_properties(rec.properties)
            out.append(Rec(start + pos, total, rec.topic, rec.queue_id, rec.queue_offset, rec.store_timestamp,
                           props.get("TAGS"), props.get("KEYS"), props.get("UNIQ_KEY")))
            pos += total
    return out


def index_keys(rec: Rec) -> list[str]:
    keys = [f"{rec.topic}#{rec.uniq_key}"] if rec.uniq_key is not None else []
    return keys + [f"{rec.topic}#{k}" for k in (rec.keys or "").split(" ") if k]


def consume_queue_units(out: Path) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
    """Every written unit of every queue, by queue offset (a queue here starts at offset 0)."""
    queues = {}
    for qdir in sorted((out / "consumequeue").glob("*/*")):
        data = b"".join((qdir / name).read_bytes() for name in sorted(os.listdir(qdir)))
        units = [data[i : i + CQ_UNIT_SIZE] for i in range(0, len(data), CQ_UNIT_SIZE)]
        while units and not any(units[-1]):
            units.pop()
        queues[(qdir.parent.name, int(qdir.name))] = [CQ_UNIT.unpack(u) for u in units]
    return queues


def index_entries(out: Path) -> list[tuple[int, int]]:
    """(key hash, CommitLog offset) of every entry of every IndexFile, oldest file first."""
    entries = []
    for path in sorted((out / "index").glob("*")):
        data = path.read_bytes()
        count = INDEX_HEADER.unpack_from(data)[5]
        base = INDEX_HEADER_SIZE + 4 * HASH_SLOTS
        for n in range(1, count):
            key_hash, phy, _, _ = INDEX_ENTRY.unpack_from(data, base + n * INDEX_ENTRY.size)
            entries.append((key_hash, phy))
    return entries


def check_output_against_commitlog(out: Path, commitlog_dir: Path) -> dict[str, int]:
    """No ConsumeQueue unit and no index entry lost, doubled or pointing at anything but a complete record
    with its topic, queue, queue offset and tagsCode. Returns the counts checked."""
    recs = commitlog_records(commitlog_dir)
    by_offset = {r.offset: r for r in recs}
    expected_units: dict[tuple[str, int], list[Rec]] = {}
    for r in recs:
        expected_units.setdefault((r.topic, r.queue_id), []).append(r)
    queues = consume_queue_units(out)
    assert sorted(queues) == sorted(expected_units), "queues differ from the CommitLog's"
    units = 0
    for q, expected in expected_units.items():
        got = queues[q]
        assert [r.queue_offset for r in expected] == list(range(len(expected))), f"{q}: writer's queue offsets"
        assert len(got) == len(expected), f"{q}: {len(got)} units for {len(expected)} records (lost or doubled)"
        for qoff, (phy, size, tags_code) in enumerate(got):
            assert CQ_UNIT.pack(phy, size, tags_code) != BLANK_UNIT, f"{q}: blank unit at {qoff}"
            rec = by_offset.get(phy)
            assert rec is not None, f"{q}: unit {qoff} points at {phy}, not the start of a record"
            assert (rec.size, rec.topic, rec.queue_id, rec.queue_offset) == (size, *q, qoff), f"{q}: unit {qoff}"
            assert tags_code == (java_string_hash(rec.tags) if rec.tags else 0), f"{q}: tagsCode of unit {qoff}"
            units += 1
    expected_entries = Counter((index_key_hash(k), r.offset) for r in recs for k in index_keys(r))
    actual_entries = Counter(index_entries(out))
    lost = expected_entries - actual_entries
    doubled = actual_entries - expected_entries
    assert not lost, f"index entries lost: {sorted(lost)[:5]}, unexpected: {sorted(doubled)[:5]}"
    assert not doubled, f"index entries doubled or unexpected: {sorted(doubled)[:5]}"
    return {"records": len(recs), "units": units, "index_entries": sum(actual_entries.values())}


# --- the test ----------------------------------------------------------------------------------------

TORN_SEED = int(os.environ.get("STRESS_TORN_SEED", "20261122"))
TORN_RECORDS = int(os.environ.get("STRESS_TORN_RECORDS", str(stress.scale(60, 1200))))


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.writer.close()


def test_torn_writes_are_never_dispatched(store):
    """Records copied in pieces, in every order, while the daemon follows: nothing partial is dispatched."""
    started = time.monotonic()
    rng = random.Random(TORN_SEED)
    while store.end < SEGMENT - 12_000:  # the copied records roll into a second segment, BLANK included
        store.append(50)
    store.writer.close()
    commitlog = store.tmp / "store" / "commitlog"
    source = RecordSource(commitlog, store.tmp / "scratch", START_MS + 10**9)
    live = LiveLog(commitlog)
    stats = CopyStats()
    per_order = Counter()
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == source.end, what="catch-up")
        for i in range(TORN_RECORDS):
            order = ORDERS[i % len(ORDERS)] if i < len(ORDERS) else rng.choice(ORDERS)
            # an odd body size now and then: records of every length, and segment rolls (BLANK records)
            for piece in source.next(message(store.count + i, body_size=rng.choice((60, 160, 900)))):
                copy_record(live, piece, order, rng, stats)
            per_order[order] += 1
        wait_for(lambda: store.health().get("reputFromOffset") == source.end, what="the last record")
        health = store.health()
    finally:
        code, out, err = stop(proc)
        source.close()
        live.close()
    corrupt = [e for e in events(out) if e["event"] == "corrupt_commitlog"]
    problem = None
    try:
        figures = check_output_against_commitlog(store.out, commitlog)
    except AssertionError as e:
        problem, figures = str(e), {}
    identical = output_files(store.out) == output_files(store.rebuild())
    stress.report("torn_writes", records_copied=TORN_RECORDS, chunks=stats.chunks, pauses=stats.pauses,
                  orders=dict(per_order), segments=source.end // SEGMENT + 1, units_checked=figures.get("units"),
                  index_entries=figures.get("index_entries"), units_and_entries_ok=int(problem is None),
                  identical=int(identical),
                  seconds=round(time.monotonic() - started, 1), seed=TORN_SEED)
    assert code == 0, err
    assert problem is None, problem
    assert not corrupt, f"a record in flight was declared corrupt: {corrupt[0]}"
    assert health["status"] == "healthy", health
    assert figures["records"] == store.count + TORN_RECORDS
    assert figures["index_entries"] == 3 * figures["records"]
    assert source.end > SEGMENT, "no segment roll"
    assert identical, "the daemon's files differ from a clean rebuild"


def test_chunk_plans_cover_every_byte_once():
    rng = random.Random(1)
    for order in ORDERS:
        for size in (8, 33, 100, 161, 700):
            plan = chunk_plan(size, order, rng)
            covered = sorted(b for lo, hi in plan for b in range(lo, hi))
            assert covered == list(range(size)), (order, size)
    assert chunk_plan(200, "size-last", rng)[-1] == (0, 4)
    assert chunk_plan(200, "tail-head-last", rng)[-1] == (0, VEC)


@pytest.mark.parametrize("ended", ["corrupt", "rolled"])
def test_a_torn_record_is_held_back_whatever_ended_the_read(tmp_path, ended):
    """A read that decoded a front-to-back torn record (its properties still ending in zeros) and then
    stopped for another reason — the writer's next bytes looked corrupt a moment later, or the segment
    rolled — still has its torn record cut off: `hold_torn_tail` looks at every read with late records,
    whatever its status. Deterministic: the torn image is read, then the record is completed."""
    from types import SimpleNamespace

    from daemon.engine.head import hold_torn_tail
    from indexcore.errors import CorruptRecordError
    from indexcore.reader import CommitLog, CommitLogReader, ReadStatus

    writer = CommitLogWriter(str(tmp_path / "commitlog"), SEGMENT)
    appended = [writer.append(message(i)) for i in range(3)]
    writer.close()
    segment = tmp_path / "commitlog" / offset_to_file_name(0)
    complete = segment.read_bytes()
    torn_at = appended[2].phy_offset
    end = torn_at + appended[2].msg_size
    segment.write_bytes(complete[:end - 6] + bytes(len(complete) - end + 6))  # UNIQ_KEY's last bytes not in yet

    log = CommitLog(str(tmp_path / "commitlog"), SEGMENT, follow=True)
    session = SimpleNamespace(commit_log=log, reader=CommitLogReader(log, batch_bytes=SEGMENT))
    read = session.reader.read(0, verify_end=False)
    assert len(read.batch) == 3
    assert "\0" in read.batch.uniq_key[2]
    if ended == "corrupt":
        read = dataclasses.replace(read, status=ReadStatus.CORRUPT,
                                   error=CorruptRecordError("totalSize", "zero TOTALSIZE with data after it",
                                                            path=str(segment), offset=end))
    else:
        read = dataclasses.replace(read, rolled=True, next_offset=SEGMENT)
    segment.write_bytes(complete)  # the writer finishes the record while the read ran

    held = hold_torn_tail(session, 0, read, written=torn_at)
    assert len(held.batch) == 2
    assert held.next_offset == torn_at
    assert held.error is None
    assert not held.rolled
    assert held.status is not ReadStatus.CORRUPT
    again = session.reader.read(held.next_offset, verify_end=False)
    assert again.batch.uniq_key[0] == f"{2:032X}"
    session.reader.close()


def _rows_alike_by_row(a, b, first: int, n: int) -> int:
    """The row-by-row rule `_rows_alike` replaced: the first row of `a` that differs from b's row first + j."""
    for j in range(n):
        i = first + j
        if j >= len(a) or not (
                a.topic_of(j) == b.topic_of(i) and a.keys[j] == b.keys[i] and a.uniq_key[j] == b.uniq_key[i]
                and all(int(getattr(a, c)[j]) == int(getattr(b, c)[i]) for c in (
                    "phy_offset", "msg_size", "queue_id", "queue_offset", "sys_flag", "store_timestamp", "tags_code",
                    "prepared_transaction_offset"))):
            return j
    return n


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_rows_alike_finds_the_first_row_that_differs(data):
    """hold_torn_tail compares a read again column by column: the first differing row is the one a
    row-by-row comparison finds, whatever field differs (KEYS, UNIQ_KEY, None against a value, the topic,
    a number), and a shorter second read stops the run."""
    from daemon.engine.head import _rows_alike
    from tests.conftest import DispatchRec, make_dispatch_batch

    text = st.one_of(st.none(), st.text(max_size=6))
    n = data.draw(st.integers(1, 12))
    recs = [DispatchRec(topic=data.draw(st.sampled_from(["TopicA", "订单Topic"])), queue_id=i % 3, queue_offset=i,
                        phy_offset=100 * i, msg_size=100, sys_flag=0, store_timestamp=1, tags_code=i,
                        keys=data.draw(text), uniq_key=data.draw(text)) for i in range(n)]
    first = data.draw(st.integers(0, n - 1))
    again = list(recs[first:])
    if again and data.draw(st.booleans()):
        j = data.draw(st.integers(0, len(again) - 1))
        field = data.draw(st.sampled_from(["topic", "keys", "uniq_key", "tags_code", "queue_offset"]))
        value = {"topic": "TopicB", "keys": data.draw(text), "uniq_key": data.draw(text), "tags_code": -1,
                 "queue_offset": -1}[field]
        again[j] = again[j]._replace(**{field: value})
    again = again[: data.draw(st.integers(0, len(again)))]
    a, b = make_dispatch_batch(again), make_dispatch_batch(recs)
    assert _rows_alike(a, b, first, n - first) == _rows_alike_by_row(a, b, first, n - first)
