"""Phases 2 and 3 of the backfill: the pieces rows are shuffled as, and the tasks that write files.

Phase 2 keys each chunk's ConsumeQueue units by `(topic, queue id, first physical offset)`; pieces are
partitioned by queue and sorted, so a task sees each of its queues whole and in CommitLog order and
hands them to `ConsumeQueue.put_units`, the broker's rules (pre-blank, repeats, out-of-order appends)
included. Phase 3 keys index keys by `(file number, global key number)`, the files having been fixed
beforehand (`plan.plan_index_files`); each file's task creates it as `IndexService` would have (seeded
with its predecessor's end values) and puts its keys with `IndexFile.put_keys`. Both stream their sorted
partition, so memory holds one piece at a time, whatever the size of a queue or a file.

Every task writes into its attempt's staging directory and commits (`commit.py`) only once all its
files are written.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from daemon.backfill.commit import commit_index_file, commit_queue_dir, file_counts
from daemon.backfill.plan import BackfillError, IndexFilePlan
from daemon.backfill.rows import RowChunk
from indexcore.consumequeue import CONSUME_QUEUE_DIR, ConsumeQueueStore
from indexcore.indexfile import IndexFile
from indexcore.indexservice import INDEX_DIR

QueueKey = tuple[str, int, int]  # topic, queue id, physical offset of the piece's first unit
IndexKey = tuple[int, int]  # file number, global number of the piece's first key (-1: the file's plan)
FILE_PLAN = -1


class InjectedFault(RuntimeError):
    """Raised by a task attempt on purpose (`Fault`), to show that a retry leaves nothing partial."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Fail the first attempt of one task at a point: 'staged' (all files staged, none committed) or
    'committing' (after committing the first file)."""

    phase: str  # "consumequeue" or "index"
    point: str
    partition: int = 0
    marker: str | None = None  # a file created when the fault fires, for tests to see that it did

    def check(self, phase: str, point: str, partition: int, attempt_number: int) -> None:
        if (phase, point, partition, attempt_number) == (self.phase, self.point, self.partition, 0):
            if self.marker is not None:
                with open(self.marker, "a"):
                    pass
            raise InjectedFault(f"injected failure of {phase} task {partition} at '{point}'")


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
    out_of_order: int = 0
    index_files: int = 0
    keys: int = 0
    files: dict[str, int] = field(default_factory=file_counts)

    def add(self, other: WriteStats) -> None:
        for name in ("queues", "units", "already_built", "out_of_order", "index_files", "keys"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.files.items():
            self.files[k] = self.files.get(k, 0) + v


# --- phase 2: ConsumeQueue -------------------------------------------------------------------------

def queue_pieces(chunk: RowChunk) -> Iterator[tuple[QueueKey, tuple[np.ndarray, ...]]]:
    """The units of a chunk, one piece per queue: (queue offsets, phy offsets, sizes, tags codes)."""
    idx = np.flatnonzero(chunk.consume_queue)
    if len(idx) == 0:
        return
    group = (chunk.topic_id[idx].astype(np.int64) << 32) | (chunk.queue_id[idx].astype(np.int64) & 0xFFFFFFFF)
    order = np.argsort(group, kind="stable")
    idx, group = idx[order], group[order]
    for part in np.split(idx, np.flatnonzero(np.diff(group)) + 1):
        first = int(part[0])
        key = (chunk.topics[chunk.topic_id[first]], int(chunk.queue_id[first]), int(chunk.phy_offset[first]))
        yield key, (chunk.queue_offset[part], chunk.phy_offset[part], chunk.msg_size[part], chunk.tags_code[part])


def queue_partition(key: QueueKey) -> int:
    """A stable hash of (topic, queue id): every piece of a queue goes to the same task."""
    return zlib.crc32(f"{key[0]}\0{key[1]}".encode("utf-8", "surrogatepass"))


def write_queues(items: Iterable[tuple[QueueKey, tuple[np.ndarray, ...]]], *, output_dir: str, stage_dir: str,
                 file_size: int, attempt: Attempt, fault: Fault | None = None) -> WriteStats:
    """Build the queues of one sorted partition in `stage_dir`, then commit them into `output_dir`."""
    stats = WriteStats()
    store = ConsumeQueueStore(stage_dir, file_size)
    cq = None
    for (topic, queue_id, _), (queue_offset, phy, size, tags) in items:
        if cq is None or (cq.topic, cq.queue_id) != (topic, queue_id):
            if cq is not None:
                cq.close()  # a queue's pieces are contiguous: one file mapped at a time
            cq = store.queue(topic, queue_id)
        put = cq.put_units(queue_offset, phy, size, tags)
        stats.units += put.written
        stats.already_built += put.already_built
        stats.out_of_order += put.out_of_order
    if cq is not None:
        cq.close()
    stats.queues = len(store.queues)
    if fault is not None:
        fault.check("consumequeue", "staged", attempt.partition, attempt.attempt_number)
    for i, staged in enumerate(store):
        final = os.path.join(output_dir, CONSUME_QUEUE_DIR, staged.topic, str(staged.queue_id))
        for k, v in commit_queue_dir(staged.directory, final).items():
            stats.files[k] += v
        if i == 0 and fault is not None:
            fault.check("consumequeue", "committing", attempt.partition, attempt.attempt_number)
    return stats


# --- phase 3: IndexFile ----------------------------------------------------------------------------

def index_pieces(chunk: RowChunk, key_base: Mapping[tuple[int, int], int], capacity: int
                 ) -> Iterator[tuple[IndexKey, tuple[np.ndarray, ...]]]:
    """The keys of a chunk with the offset and store time of their records, cut at file boundaries."""
    n = len(chunk.key_hash)
    if n == 0:
        return
    base = key_base[chunk.chunk_id]
    owners = np.repeat(np.arange(chunk.records), chunk.key_count)
    phy, ts = chunk.phy_offset[owners], chunk.store_timestamp[owners]
    g, end = base, base + n
    while g < end:
        stop = min(end, (g // capacity + 1) * capacity)
        a, b = g - base, stop - base
        yield (g // capacity, g), (chunk.key_hash[a:b], phy[a:b], ts[a:b])
        g = stop


def index_partition(key: IndexKey) -> int:
    return key[0]


def write_index_files(items: Iterable[tuple[IndexKey, object]], *, output_dir: str, stage_dir: str,
                      hash_slot_num: int, index_num: int, attempt: Attempt, fault: Fault | None = None) -> WriteStats:
    """Build the IndexFiles of one sorted partition (each file's plan first, then its keys in order) in
    `stage_dir`, then commit them into `output_dir`."""
    stats = WriteStats()
    stage = os.path.join(stage_dir, INDEX_DIR)
    os.makedirs(stage, exist_ok=True)
    staged: list[str] = []
    current: IndexFile | None = None
    plan: IndexFilePlan | None = None
    put = 0

    def finish() -> None:
        if current is None:
            return
        if put != plan.key_end - plan.key_start:
            raise BackfillError(f"{current.path}: {put} keys put, the plan has {plan.key_end - plan.key_start}")
        current.sync()  # as IndexService leaves it: only a put writes the header (indexCount 0 before one)
        current.close()

    for (number, first_key), value in items:
        if first_key == FILE_PLAN:
            finish()
            plan = value
            current = IndexFile(os.path.join(stage, plan.name), hash_slot_num, index_num, create=True,
                                end_phy_offset=plan.seed_phy_offset, end_timestamp=plan.seed_timestamp)
            staged.append(plan.name)
            put = 0
            continue
        hashes, phy, ts = value
        if plan is None or number != plan.number or first_key != plan.key_start + put:
            raise BackfillError(f"index task {attempt.partition}: keys from {first_key} of file {number} arrived "
                                f"out of order")
        done = current.put_keys(hashes, phy, ts)
        if done != len(hashes):
            raise BackfillError(f"{current.path}: full after {put + done} keys, the plan has "
                                f"{plan.key_end - plan.key_start}")
        put += done
        stats.keys += done
    finish()
    stats.index_files = len(staged)
    if fault is not None:
        fault.check("index", "staged", attempt.partition, attempt.attempt_number)
    for i, name in enumerate(staged):
        stats.files[commit_index_file(os.path.join(stage, name), os.path.join(output_dir, INDEX_DIR, name))] += 1
        if i == 0 and fault is not None:
            fault.check("index", "committing", attempt.partition, attempt.attempt_number)
    return stats


# --- optional catalog -------------------------------------------------------------------------------

CATALOG_COLUMNS = (("phy_offset", "long"), ("msg_size", "int"), ("topic", "string"), ("queue_id", "int"),
                   ("queue_offset", "long"), ("tags_code", "long"), ("store_timestamp", "long"),
                   ("sys_flag", "int"), ("keys", "string"), ("uniq_key", "string"), ("date", "string"))


def catalog_rows(chunk: RowChunk) -> Iterator[tuple]:
    """One tuple per record, in CATALOG_COLUMNS order; `date` is the UTC day of the store time."""
    days = chunk.store_timestamp.astype("datetime64[ms]").astype("datetime64[D]").astype(str)
    keys = chunk.keys or [None] * chunk.records
    uniq = chunk.uniq_key or [None] * chunk.records
    columns = zip(chunk.phy_offset.tolist(), chunk.msg_size.tolist(), chunk.topic_id.tolist(),
                  chunk.queue_id.tolist(), chunk.queue_offset.tolist(), chunk.tags_code.tolist(),
                  chunk.store_timestamp.tolist(), chunk.sys_flag.tolist(), keys, uniq, days.tolist(), strict=True)
    for phy, size, tid, qid, qoff, tags, ts, flag, k, u, day in columns:
        yield phy, size, chunk.topics[tid], qid, qoff, tags, ts, flag, k, u, day
