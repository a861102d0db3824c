"""Phase 2 of the backfill: the tasks that write the output's files from the ranges' staged runs.

Every decode task staged its range's output as files (`stage.py`); a writer task is given its share of
the work by the driver and reads those files range after range in CommitLog order, so nothing is
shuffled, sorted or spilled, and the JVM never sees the bytes.

* ConsumeQueue (`queuewriter.QueueWork`): the whole queues of a span of buckets, balanced by units over the
  tasks (`queuewriter.py`).
* IndexFile (`IndexWork`): one file. It reads its seed (the end values of the one before: physical offset
  and store time of the previous key) and the store time of the record that creates it from the previous
  key, then puts its own keys with `IndexFile.put_keys`. The file is staged under its number; the driver
  names it.
* Catalog (`CatalogWork`): a group of (topic, day) partitions, one Parquet file each, its streams
  concatenated in CommitLog order.

Every task writes into its attempt's staging directory; the driver commits (`commit.py`) once every task
has succeeded and the output has been checked.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from daemon.backfill.commit import file_counts
from daemon.backfill.plan import BackfillError, IndexFilePlan
from daemon.backfill.ranges import NO_CREATOR
from daemon.backfill.stage import KEY_DTYPE, StagedRange
from indexcore.indexfile import (
    FIRST_INDEX,
    HASH_SLOT_SIZE,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER_SIZE,
    RELEASE_AFTER_KEYS,
    IndexFile,
    IndexHeader,
    index_file_size,
)
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import pwrite_all


class InjectedFault(RuntimeError):
    """Raised by a task attempt on purpose (`Fault`), to show that a retry leaves nothing partial."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Fail the first attempt of a task at a point: phase 'decode' at 'started' (before its first row), or
    phase 'consumequeue' or 'index' at 'staged' (all its files staged). With a `marker`, only the first
    task to get there fails (the marker records that it did)."""

    phase: str  # "decode", "consumequeue" or "index"
    point: str
    marker: str | None = None

    def check(self, phase: str, point: str, attempt_number: int) -> None:
        if (phase, point, attempt_number) != (self.phase, self.point, 0):
            return
        if self.marker is not None:
            try:
                with open(self.marker, "x"):
                    pass
            except FileExistsError:
                return
        raise InjectedFault(f"injected failure of a {phase} task at '{point}'")


@dataclass(frozen=True, slots=True)
class Attempt:
    """Who is running: the task's partition, Spark's attempt id (unique in the application) and number."""

    partition: int
    attempt_id: int
    attempt_number: int


@dataclass(slots=True)
class WriteStats:
    queues: int = 0
    units: int = 0
    already_built: int = 0
    gap_blanks: int = 0  # blank units written into gaps of a queue's offsets
    index_files: int = 0
    keys: int = 0
    seconds: float = 0.0  # task time
    files: dict[str, int] = field(default_factory=file_counts)

    def add(self, other: WriteStats) -> None:
        for name in ("queues", "units", "already_built", "gap_blanks", "index_files", "keys", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.files.items():
            self.files[k] = self.files.get(k, 0) + v


@dataclass(frozen=True, slots=True)
class IndexWork:
    plan: IndexFilePlan
    sources: tuple[tuple[str, int, int], ...]  # (staging directory, global number of its first key, keys)
    chunk: tuple[int, int] | None = None  # the plan's keys [lo, hi) this task puts; None: the whole file
    shared_path: str = ""  # a chunk's file: the one every chunk of the IndexFile writes its entries into


@dataclass(frozen=True, slots=True)
class CatalogWork:
    ranges: tuple[str, ...]
    groups: tuple[tuple[str, int], ...]  # (topic, UTC day)
    name: str  # the file name each partition's file gets
    covered: tuple[tuple[int, int], ...] = ()  # CommitLog ranges the catalog holds already: rows there are left out


# --- IndexFile ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class StagedIndexFile:
    number: int
    path: str
    creator_ts: int
    keys: int


def _keys(work: IndexWork, lo: int, hi: int, ranges: dict[str, StagedRange]) -> Iterator[np.ndarray]:
    """Global keys [lo, hi) from the ranges that hold them, range by range (KEY_DTYPE): views of the staged
    files, whose pages are unmapped once the caller asks for the next range's (`StagedRange.release`: a task
    putting an IndexFile's 20,000,000 keys otherwise ends with 560 MB of them in its RSS)."""
    for directory, base, count in work.sources:
        a, b = max(lo, base), min(hi, base + count)
        if a < b:
            yield ranges[directory].keys(a - base, b - base)
            ranges[directory].release()


def write_index_files(work: IndexWork, *, stage_dir: str, hash_slot_num: int, index_num: int,
                      attempt: Attempt, fault: Fault | None = None) -> tuple[WriteStats, list[StagedIndexFile]]:
    """Build IndexFile `work.plan.number` in `stage_dir` under its number."""
    stats = WriteStats()
    stage = os.path.join(stage_dir, INDEX_DIR)
    os.makedirs(stage, exist_ok=True)
    plan = work.plan
    started = time.perf_counter()
    ranges = {d: StagedRange(d) for d, _, _ in work.sources}
    path = os.path.join(stage, f"{plan.number:010d}")
    try:
        if plan.key_start == 0:
            seed_phy = seed_ts = 0
            creator = plan.creator_ts
        else:
            seed = [k for k in _keys(work, plan.key_start - 1, plan.key_start, ranges) if len(k)]
            if not seed:
                raise BackfillError(f"index task {attempt.partition}: IndexFile {plan.number} found no key "
                                    f"{plan.key_start - 1} to seed it")
            key = seed[0][0]
            seed_phy, seed_ts = int(key["phy"]), int(key["ts"])
            creator = plan.creator_ts if int(key["creator"]) == NO_CREATOR else int(key["creator"])
        current = IndexFile(path, hash_slot_num, index_num, create=True, end_phy_offset=seed_phy,
                            end_timestamp=seed_ts)
        put = since_release = 0
        for keys in _keys(work, plan.key_start, plan.key_end, ranges):
            done = current.put_keys(keys["hash"], keys["phy"], keys["ts"])
            if done != len(keys):
                raise BackfillError(f"{current.path}: full after {put + done} keys, the plan has "
                                    f"{plan.key_end - plan.key_start}")
            put += done
            since_release += done
            if since_release >= RELEASE_AFTER_KEYS:
                current.release()  # written pages leave the worker's RSS; the page cache keeps them
                since_release = 0
        if put != plan.key_end - plan.key_start:
            raise BackfillError(f"{current.path}: {put} keys put, the plan has {plan.key_end - plan.key_start}")
        current.sync()  # as IndexService leaves it: only a put writes the header (indexCount 0 before one)
        current.close()
    finally:
        for r in ranges.values():
            r.close()
    stats.keys = put
    stats.index_files = 1
    stats.seconds = time.perf_counter() - started
    if fault is not None:
        fault.check("index", "staged", attempt.attempt_number)
    return stats, [StagedIndexFile(plan.number, path, creator, put)]


# --- IndexFile chunks ---------------------------------------------------------------------------------
#
# A large IndexFile is put by several tasks, each a chunk of its keys: the entries of key i depend only on
# the keys before it through the slot it hashes to (the previous entry of that slot), so a chunk puts its keys
# with the broker's loop into slots of its own (empty), writes its entries into the shared file at their
# place, and records where its chain of each slot starts (entries whose previous entry is in an earlier
# chunk) and ends. The driver links the chains (`assemble_index_file`): a chunk's first entry of a slot gets
# the last entry of that slot in the chunks before it, and the slots and header take the final values.

PUT_PIECE_KEYS = 1 << 18  # keys a chunk's put writes into the file at a time (5 MiB of entries, reused)


@dataclass(slots=True)
class StagedIndexChunk:
    number: int
    lo: int
    hi: int
    path: str  # the shared file
    meta: str  # the chunk's chain ends (`write_chain_ends`)
    begin_ts: int
    begin_phy: int
    end_ts: int
    end_phy: int
    creator_ts: int


def write_index_chunk(work: IndexWork, *, stage_dir: str, hash_slot_num: int, index_num: int,
                      attempt: Attempt, fault: Fault | None = None) -> tuple[WriteStats, list[StagedIndexChunk]]:
    """Put keys [lo, hi) of an IndexFile into its shared file (`work.shared_path`), as entries
    FIRST_INDEX + lo - key_start on, with slots of the chunk's own. The staged key records go to the kernel as
    they lie in the staged files, its entries into the file a piece at a time, and it records the chains'
    first entries as it puts them."""
    from indexcore import _kernels  # noqa: PLC0415

    stats = WriteStats()
    plan = work.plan
    lo, hi = work.chunk
    started = time.perf_counter()
    ranges = {d: StagedRange(d) for d, _, _ in work.sources}
    try:
        creator = plan.creator_ts
        if lo == plan.key_start:  # the file's first chunk: seeded by the key before it, as the file is
            begin_ts = begin_phy = 0
            if plan.key_start > 0:
                seed = np.concatenate(list(_keys(work, lo - 1, lo, ranges)) or [np.zeros(0, dtype=KEY_DTYPE)])
                if len(seed) != 1:
                    raise BackfillError(f"index task {attempt.partition}: IndexFile {plan.number} found no key "
                                        f"{lo - 1} to seed it")
                begin_ts, begin_phy = max(0, int(seed["ts"][0])), max(0, int(seed["phy"][0]))
                if int(seed["creator"][0]) != NO_CREATOR:
                    creator = int(seed["creator"][0])
        else:  # after the first put, the file's begin values are its first key's
            first = np.concatenate(list(_keys(work, plan.key_start, plan.key_start + 1, ranges)))
            begin_ts, begin_phy = int(first["ts"][0]), int(first["phy"][0])
        entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * hash_slot_num
        slots = np.zeros(hash_slot_num, dtype=np.int32)  # the chunk's own: entry numbers, native
        # where each slot's chain in the chunk starts: one per slot the chunk uses, so at most one per key or slot
        firsts_room = min(hi - lo, hash_slot_num)
        first_entry, first_slot = np.empty(firsts_room, dtype=np.int32), np.empty(firsts_room, dtype=np.int32)
        entries = np.empty(INDEX_ENTRY_SIZE * min(hi - lo, PUT_PIECE_KEYS), dtype=np.uint8)
        count = FIRST_INDEX + lo - plan.key_start
        firsts = 0
        last = None
        fd = os.open(work.shared_path, os.O_WRONLY)
        try:
            for run in _keys(work, lo, hi, ranges):
                for at in range(0, len(run), PUT_PIECE_KEYS):
                    piece = run[at : at + PUT_PIECE_KEYS]
                    was = count
                    count, firsts, begin_ts, begin_phy = _kernels.put_key_records(
                        slots, entries, piece, count, index_num, begin_ts, begin_phy, first_entry, first_slot, firsts)
                    pwrite_all(fd, memoryview(entries)[: INDEX_ENTRY_SIZE * len(piece)],
                               entries_at + INDEX_ENTRY_SIZE * was, work.shared_path)
                    last = piece[-1]
        finally:
            os.close(fd)
        put = count - (FIRST_INDEX + lo - plan.key_start)
        if put != hi - lo:
            raise BackfillError(f"index task {attempt.partition}: IndexFile {plan.number} got {put} of its "
                                f"keys [{lo}, {hi})")
        os.makedirs(stage_dir, exist_ok=True)
        meta = os.path.join(stage_dir, f"index-{plan.number:010d}-{lo}.ends")
        used = first_slot[:firsts]  # every slot the chunk used, once (where its chain in the chunk starts)
        write_chain_ends(meta, first_entry[:firsts], used, slots[used])
    finally:
        for r in ranges.values():
            r.close()
    stats.keys = put
    stats.seconds = time.perf_counter() - started
    if fault is not None:
        fault.check("index", "staged", attempt.attempt_number)
    return stats, [StagedIndexChunk(plan.number, lo, hi, work.shared_path, meta, begin_ts, begin_phy,
                                    int(last["ts"]), int(last["phy"]), creator)]


# per slot the chunk used: the entry where its chain in the chunk starts, the slot, the entry where it ends
_CHAIN_ENDS = ("first_entry", "slot", "last_entry")


def write_chain_ends(path: str, *columns: np.ndarray) -> None:
    """A chunk's chain ends (`_CHAIN_ENDS`, each int32: entries and slots are below 2**31): their lengths,
    then the columns."""
    arrays = [np.ascontiguousarray(c, dtype="<i4") for c in columns]
    head = np.array([len(a) for a in arrays], dtype="<i8")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        position = 0
        for data in (head, *arrays):
            pwrite_all(fd, data, position, path)
            position += data.nbytes
    finally:
        os.close(fd)


def read_chain_ends(path: str) -> dict[str, np.ndarray]:
    """What `write_chain_ends` wrote, as native int32 columns: read once into one array whose parts they are (not
    read into bytes and copied again per column: the driver reads some 10 bytes a key this way)."""
    with open(path, "rb") as f:
        lengths = np.fromfile(f, dtype="<i8", count=len(_CHAIN_ENDS)).tolist()
        data = np.fromfile(f, dtype="<i4", count=sum(lengths)).astype(np.int32, copy=False)
    if len(data) != sum(lengths):
        raise ValueError(f"{path}: {len(data)} of {sum(lengths)} chain ends")
    out, at = {}, 0
    for name, n in zip(_CHAIN_ENDS, lengths, strict=True):
        out[name] = data[at : at + n]
        at += n
    return out


def create_shared_index_file(path: str, hash_slot_num: int, index_num: int) -> None:
    """The file the chunks of one IndexFile write their entries into (sparse until they do)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(index_file_size(hash_slot_num, index_num))


def assemble_index_file(chunks: list[StagedIndexChunk], hash_slot_num: int, index_num: int,
                        key_start: int) -> StagedIndexFile:
    """Link the chunks' slot chains in key order (`_kernels.link_chains`) and write the slots and the header:
    the file one put of all its keys makes."""
    from indexcore import _kernels  # noqa: PLC0415

    chunks = sorted(chunks, key=lambda c: c.lo)
    path = chunks[0].path
    entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * hash_slot_num
    last = np.zeros(hash_slot_num, dtype=np.int32)  # per slot, the last entry of the chunks so far
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        for c in chunks:
            d = read_chain_ends(c.meta)
            _kernels.link_chains(mm, entries_at, index_num, last, d["first_entry"], d["slot"], d["last_entry"])
        slots = np.ndarray((hash_slot_num,), dtype=">i4", buffer=mm, offset=INDEX_HEADER_SIZE)
        slots[:] = last
        keys = chunks[-1].hi - key_start
        header = IndexHeader(chunks[0].begin_ts, chunks[-1].end_ts, chunks[0].begin_phy, chunks[-1].end_phy,
                             int(np.count_nonzero(last)), FIRST_INDEX + keys)
        mm[:INDEX_HEADER_SIZE] = header.encode()
        del slots
        mm.flush()
    return StagedIndexFile(chunks[0].number, path, chunks[0].creator_ts, keys)


# --- catalog ------------------------------------------------------------------------------------------

def write_catalog(work: CatalogWork, *, stage: str, filesystem, attempt: Attempt,
                  with_body: bool = False) -> list[tuple[str, str, int]]:
    """One Parquet file per (topic, day) of `work`, under `stage` (the catalog's staging path), its rows in
    CommitLog order; (staged path, path relative to the catalog, rows) of each."""
    import pyarrow as pa  # noqa: PLC0415

    from daemon.backfill.catalog import ParquetOut, partition_dir, uncovered  # noqa: PLC0415
    from daemon.backfill.catalogstage import read_groups  # noqa: PLC0415

    out: list[tuple[str, str, int]] = []
    ranges = [StagedRange(d) for d in work.ranges]
    parsed: dict = {}  # the messages read so far, by (range, offset), for the next group
    reading = [0]  # the range whose pieces are being read

    def pieces(group):
        """The group's pieces, range after range: read as one (a table per range and group cost ~0.2 ms)."""
        for number, r in enumerate(ranges):
            reading[0] = number
            for at, *piece in r.catalog_pieces(group):
                yield (number, at), *piece

    try:
        for topic, day in work.groups:
            relative = f"{partition_dir(topic, day)}/{work.name}"
            writer = ParquetOut(filesystem, f"{stage}/{relative}", topic, day)
            rows = released = flushes = 0
            for staged, staged_bytes in read_groups(pieces((topic, day)), with_body, parsed):
                table, nbytes = staged, staged_bytes
                if work.covered:  # a group wholly outside the ranges the catalog holds is taken as it is
                    keep = uncovered(table, work.covered)
                    if not keep.any():
                        continue
                    if not keep.all():
                        nbytes = nbytes * int(keep.sum()) // table.num_rows
                        table = table.filter(pa.array(keep))
                if table.num_rows:
                    writer.write(table, nbytes)
                    rows += table.num_rows
                if writer.flushes > flushes:  # a row group written: the ranges read before are done with
                    flushes = writer.flushes
                    for r in ranges[released : reading[0]]:
                        r.release()
                    released = max(released, reading[0])
            writer.close()
            for r in ranges[released:]:
                r.release()
            if rows:
                out.append((writer.path, relative, rows))
            else:
                writer.discard()
    finally:
        parsed.clear()
        for r in ranges:
            r.close()
    return out

