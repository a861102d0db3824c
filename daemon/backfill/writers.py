"""Phase 2 of the backfill: the tasks that write files from the rows Spark's shuffle brings them.

Rows arrive as Arrow batches, partitioned and sorted by Spark's JVM shuffle; nothing is sorted or
spilled in Python, and each task holds one batch at a time.

* ConsumeQueue: runs of units partitioned by (topic, queue id) and sorted by physical offset, then by the
  row sequence of the task that decoded them (a name repeated in one record starts a second run at the
  same offset), so a task sees each of its queues whole and in put order and hands them to
  `ConsumeQueue.put_packed`, the broker's rules (pre-blank, repeats, out-of-order appends, offset-0
  appends of multi-dispatch units) included. LMQ queues (`%LMQ%name`, queue 0) are queues like any other.
* IndexFile: key runs partitioned by file number and sorted by global key number, each file's plan row
  first. A run that crosses a file boundary, or ends at one, goes to both files: the later file reads its
  seed (the end values of the one before: physical offset and store time of the previous key) and the
  store time of the record that creates it from the previous key, then puts its own keys with
  `IndexFile.put_keys`. The file is staged under its number; the driver names it.
* Catalog: (topic, day) groups partitioned by (topic, day) and sorted in CommitLog order: one Parquet
  file per partition value and task.

Every task writes into its attempt's staging directory; the driver commits (`commit.py`) once every task
has succeeded and the output has been checked.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from daemon.backfill.commit import file_counts
from daemon.backfill.plan import BackfillError, IndexFilePlan
from daemon.backfill.ranges import NO_CREATOR, arrow_column
from indexcore.consumequeue import CQ_UNIT_DTYPE, ConsumeQueueStore
from indexcore.indexfile import RELEASE_AFTER_KEYS, IndexFile
from indexcore.indexservice import INDEX_DIR

PLAN_ROW = -1  # the g0 of a file's plan row: sorts before its keys


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
    arrow_bytes: int = 0  # Arrow batches received from the JVM
    seconds: float = 0.0  # task time
    files: dict[str, int] = field(default_factory=file_counts)

    def add(self, other: WriteStats) -> None:
        for name in ("queues", "units", "already_built", "gap_blanks", "index_files", "keys", "arrow_bytes",
                     "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.files.items():
            self.files[k] = self.files.get(k, 0) + v


# --- ConsumeQueue ---------------------------------------------------------------------------------

@dataclass(slots=True)
class StagedQueue:
    topic: str
    queue_id: int
    directory: str
    first_phy: int  # CommitLog offset of the queue's first unit in this backfill


def write_queues(batches: Iterable, *, stage_dir: str, file_size: int, attempt: Attempt,
                 fault: Fault | None = None) -> tuple[WriteStats, list[StagedQueue]]:
    """Build the queues of one sorted partition (rows: topic, queue, pos, seq, aux, count, data; sorted by
    the first four) in `stage_dir`."""
    stats = WriteStats()
    store = ConsumeQueueStore(stage_dir, file_size)
    staged: list[StagedQueue] = []
    cq = None
    started = time.perf_counter()
    for rb in batches:
        stats.arrow_bytes += rb.nbytes
        cols = rb.to_pydict()
        for topic, queue_id, phy, first_qo, count, data in zip(cols["topic"], cols["queue"], cols["pos"], cols["aux"],
                                                               cols["count"], cols["data"], strict=True):
            if cq is None or (cq.topic, cq.queue_id) != (topic, queue_id):
                if cq is not None:
                    _done_with(store, cq)
                cq = store.queue(topic, queue_id)
                staged.append(StagedQueue(topic, queue_id, cq.directory, phy))
            units = np.frombuffer(data, dtype=CQ_UNIT_DTYPE, count=count)
            ends = units["commit_log_offset"].astype(np.int64) + units["msg_size"]
            put = cq.put_packed(np.arange(first_qo, first_qo + count, dtype=np.int64), units, ends)
            stats.units += put.written
            stats.already_built += put.already_built
            stats.gap_blanks += put.gap_blanks
    if cq is not None:
        _done_with(store, cq)
    store.close()
    stats.queues = len(staged)
    stats.seconds = time.perf_counter() - started
    if fault is not None:
        fault.check("consumequeue", "staged", attempt.attempt_number)
    return stats, staged


def _done_with(store: ConsumeQueueStore, cq) -> None:
    """A queue's runs are contiguous: once the next queue starts, this one is closed and forgotten, so a
    task holds one queue's descriptors and state at a time, however many (LMQ) queues its partition has."""
    cq.close()
    del store.queues[(cq.topic, cq.queue_id)]


# --- IndexFile ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class StagedIndexFile:
    number: int
    path: str
    creator_ts: int
    keys: int


def _key_columns(data: bytes, count: int) -> tuple[np.ndarray, ...]:
    """hash, physical offset, store time and creator time of each key of a run."""
    hashes = np.frombuffer(data, dtype="<i4", count=count)
    rest = np.frombuffer(data, dtype="<i8", count=3 * count, offset=4 * count).reshape(3, count)
    return hashes, rest[0], rest[1], rest[2]


def write_index_files(batches: Iterable, *, stage_dir: str, hash_slot_num: int, index_num: int,
                      attempt: Attempt, fault: Fault | None = None) -> tuple[WriteStats, list[StagedIndexFile]]:
    """Build the IndexFiles of one sorted partition (rows: file, g0, count, data; each file's plan row
    first) in `stage_dir`, each under its number."""
    stats = WriteStats()
    stage = os.path.join(stage_dir, INDEX_DIR)
    os.makedirs(stage, exist_ok=True)
    staged: list[StagedIndexFile] = []
    current: IndexFile | None = None
    plan: IndexFilePlan | None = None
    put = since_release = 0
    started = time.perf_counter()

    def finish() -> None:
        if plan is None:
            return
        if current is None:
            raise BackfillError(f"index task {attempt.partition}: IndexFile {plan.number} received no seed key")
        if put != plan.key_end - plan.key_start:
            raise BackfillError(f"{current.path}: {put} keys put, the plan has {plan.key_end - plan.key_start}")
        current.sync()  # as IndexService leaves it: only a put writes the header (indexCount 0 before one)
        current.close()
        staged[-1].keys = put

    def create(seed_phy: int, seed_ts: int, creator_ts: int) -> IndexFile:
        path = os.path.join(stage, f"{plan.number:010d}")
        staged.append(StagedIndexFile(plan.number, path, creator_ts, 0))
        return IndexFile(path, hash_slot_num, index_num, create=True, end_phy_offset=seed_phy,
                         end_timestamp=seed_ts)

    for rb in batches:
        stats.arrow_bytes += rb.nbytes
        cols = rb.to_pydict()
        for number, g0, count, data in zip(cols["file"], cols["g0"], cols["count"], cols["data"], strict=True):
            if g0 == PLAN_ROW:
                finish()
                plan, current, put = pickle.loads(data), None, 0
                if plan.key_start == 0:
                    current = create(0, 0, plan.creator_ts)
                continue
            if plan is None or number != plan.number:
                raise BackfillError(f"index task {attempt.partition}: keys of file {number} arrived without its plan")
            hashes, phy, ts, creators = _key_columns(data, count)
            if current is None:
                e = plan.key_start - 1 - g0  # the previous file's last key, in this run
                if not 0 <= e < count:
                    raise BackfillError(f"index task {attempt.partition}: file {number} did not get key "
                                        f"{plan.key_start - 1} first")
                creator = int(creators[e])
                current = create(int(phy[e]), int(ts[e]), plan.creator_ts if creator == NO_CREATOR else creator)
            lo = max(g0, plan.key_start + put) - g0
            hi = min(g0 + count, plan.key_end) - g0
            if lo >= hi:
                continue
            if g0 + lo != plan.key_start + put:
                raise BackfillError(f"index task {attempt.partition}: keys from {g0 + lo} of file {number} arrived "
                                    f"out of order")
            done = current.put_keys(hashes[lo:hi], phy[lo:hi], ts[lo:hi])
            if done != hi - lo:
                raise BackfillError(f"{current.path}: full after {put + done} keys, the plan has "
                                    f"{plan.key_end - plan.key_start}")
            put += done
            stats.keys += done
            since_release += done
            if since_release >= RELEASE_AFTER_KEYS:
                current.release()  # written pages leave the worker's RSS; the page cache keeps them
                since_release = 0
    finish()
    stats.index_files = len(staged)
    stats.seconds = time.perf_counter() - started
    if fault is not None:
        fault.check("index", "staged", attempt.attempt_number)
    return stats, staged


# --- catalog ------------------------------------------------------------------------------------------

def write_catalog(batches: Iterable, *, stage: str, filesystem, attempt: Attempt) -> list[tuple[str, str, int]]:
    """One Parquet file per (topic, day) of a sorted partition, under `stage` (a catalog staging path);
    (staged path, path relative to the catalog, rows) of each."""
    import pyarrow as pa  # noqa: PLC0415

    from daemon.backfill.catalog import partition_dir, read_group, write_parquet  # noqa: PLC0415

    out: list[tuple[str, str, int]] = []
    key, tables = None, []

    def flush() -> None:
        if not tables:
            return
        table = pa.concat_tables(tables)
        relative = f"{partition_dir(*key)}/part-{attempt.partition:05d}.parquet"
        path = f"{stage}/{relative}"
        write_parquet(filesystem, path, table)
        out.append((path, relative, table.num_rows))

    for rb in batches:
        cols = rb.to_pydict()
        for topic, day, data in zip(cols["topic"], cols["aux"], cols["data"], strict=True):
            if (topic, day) != key:
                flush()
                key, tables = (topic, day), []
            tables.append(read_group(data))
    flush()
    return out


def result_rows(kind: str, value) -> Iterator:
    """A task's result as one Arrow row (kind, pickled value)."""
    import pyarrow as pa  # noqa: PLC0415

    yield pa.RecordBatch.from_arrays(
        [arrow_column([kind], pa.string()), arrow_column([pickle.dumps(value)], pa.binary())],
        schema=pa.schema([("kind", pa.string()), ("value", pa.binary())]))
