"""A decode task's output, staged as files: the JVM never carries the output's bytes.

Each decode attempt of a range writes into a directory of its own under the job's staging tree
(`OUT/.reputd-backfill/JOB/rNNNNN-aATTEMPT/`, on the output's file system, which every executor sees):

    units.data    the range's ConsumeQueue units (20 bytes each), queue after queue in the order of their
                  buckets (`queue_bucket`), each queue's in put order
    units.meta    flat arrays (`StagedUnits`): the range's topics, then per queue its bucket, topic, queue id
                  and first unit, per run of consecutive queue offsets its first unit and queue offset
    keys.data     the range's IndexFile keys in `buildIndex` order, KEY_DTYPE records: hash, physical offset
                  and store time of the owning record, and the store time of the record that would create
                  the next IndexFile if one filled at this key (NO_CREATOR: the first record of the next range)
    catalog.data  Arrow IPC record batch messages of catalog rows, one a window, its rows grouped by (topic, UTC
                  day) (their schema is `catalogstage.read_groups`'s)
    catalog.meta  (topic, UTC day) -> that group's rows in each message, in CommitLog order: (the message's
                  byte offset and length, the group's first row in it and rows, the columns left out,
                  `catalog.StagedForm`)

The task returns only its `RangeOutcome` (a few hundred bytes, with the units per queue bucket and the rows
per catalog group the driver balances the writers with: buckets, not queues, so that a CommitLog with
hundreds of thousands of LMQ queues does not fill the driver's memory with their names). A range's units
are grouped once, when it ends, from the columns of all its windows (`consume_queue_units_flat`: one
counting sort in C): nothing is held or written per queue and window, and a writer given a span of buckets
reads one slice of each range.
"""

from __future__ import annotations

import mmap
import os
import pickle
import zlib
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass

import numpy as np

from indexcore.consumequeue import CQ_UNIT_DTYPE, CQ_UNIT_SIZE
from indexcore.dispatch import DispatchBatch
from indexcore.queuestore import consume_queue_units_flat

KEY_DTYPE = np.dtype([("hash", "<i4"), ("phy", "<i8"), ("ts", "<i8"), ("creator", "<i8")])
UNITS_DATA, UNITS_META, KEYS_DATA, CATALOG_DATA, CATALOG_META = (
    "units.data", "units.meta", "keys.data", "catalog.data", "catalog.meta")


QUEUE_BUCKETS = 4096
UNIT_BYTES = np.dtype(f"V{CQ_UNIT_SIZE}")  # a unit as opaque bytes: gathered and concatenated without a field cast


def topic_hash(topic: str) -> int:
    return zlib.crc32(topic.encode("utf-8", "surrogatepass"))


def queue_bucket(topic: str, queue_id: int) -> int:
    """Which of QUEUE_BUCKETS a queue is counted and written in (the same in every process): the topic's hash
    plus the queue id, so a range's buckets come from one hash per topic (`queue_buckets`)."""
    return (topic_hash(topic) + queue_id) % QUEUE_BUCKETS


def queue_buckets(topic_hashes: np.ndarray, queue_id: np.ndarray) -> np.ndarray:
    """`queue_bucket` of many queues: each one's topic hash and queue id."""
    return (topic_hashes.astype(np.int64) + queue_id) % QUEUE_BUCKETS


@dataclass(slots=True)
class StagedUnits:
    """units.meta: the queues of a range in bucket order and the runs of consecutive queue offsets in them.
    Queue i holds units start[i]:start[i + 1] of units.data; a run holds units run_start[j]:run_start[j + 1]
    (the last to the end) at queue offsets run_qo[j] on."""

    topics: list[str]
    bucket: np.ndarray  # int64 per queue, ascending
    topic: np.ndarray  # int64 per queue, into topics
    queue_id: np.ndarray  # int64 per queue
    start: np.ndarray  # int64, queues + 1
    run_start: np.ndarray  # int64 per run, ascending
    run_qo: np.ndarray  # int64 per run

    def queue_offsets(self, lo: int, hi: int) -> np.ndarray:
        """The queue offset of each unit lo:hi (queue boundaries among them)."""
        a = int(np.searchsorted(self.run_start, lo, side="right")) - 1
        b = int(np.searchsorted(self.run_start, hi, side="left"))
        edges = np.append(self.run_start[a:b], hi)
        edges[0] = lo
        return np.repeat(self.run_qo[a:b] - self.run_start[a:b], np.diff(edges)) + np.arange(lo, hi)


DENSE_QUEUE_KEYS = 1 << 22  # topics x span of queue ids numbered by a table rather than a sort


def queue_numbers(topic: np.ndarray, queue_id: np.ndarray, topics: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct queues among (topic, queue_id) pairs, ordered by topic then queue id, and each pair's number
    among them: (their topics, their queue ids, the numbers). A table of topics x span of queue ids when it
    is small (linear: 1.7 against 15 ms for a range's 176,000 groups of 16,000 queues), else a sort."""
    qmin = int(queue_id.min())
    span = int(queue_id.max()) - qmin + 1
    if topics * span <= DENSE_QUEUE_KEYS:
        key = topic * span + (queue_id - qmin)
        present = np.zeros(topics * span, dtype=bool)
        present[key] = True
        used = np.flatnonzero(present)
        return used // span, used % span + qmin, (np.cumsum(present) - 1)[key]
    keys, number = np.unique((topic << 32) | (queue_id & 0xFFFFFFFF), return_inverse=True)
    return keys >> 32, (keys & 0xFFFFFFFF).astype(np.uint32).view(np.int32).astype(np.int64), number.reshape(-1)


def regroup(units: np.ndarray, qo: np.ndarray, group_queue: np.ndarray, group_units: np.ndarray,
            queues: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Units that come in groups (group g: the next group_units[g] units, all of queue group_queue[g], a number
    below `queues`), queue after queue in the order of those numbers, each queue's in the order of its groups;
    their queue offsets alike, and where each queue starts (queues + 1). One scatter: the units are not sorted."""
    start = np.zeros(queues + 1, dtype=np.int64)
    np.cumsum(np.bincount(group_queue, weights=group_units, minlength=queues).astype(np.int64), out=start[1:])
    # a group's place: the units of the queues before its own, and of its own queue's groups before it
    by_queue = np.argsort(group_queue.astype(np.uint16) if queues <= 1 << 16 else group_queue, kind="stable")
    dest = np.empty(len(group_units), dtype=np.int64)
    dest[by_queue] = np.cumsum(group_units[by_queue]) - group_units[by_queue]
    src = np.zeros(len(group_units), dtype=np.int64)
    np.cumsum(group_units[:-1], out=src[1:])
    at = np.repeat(dest - src, group_units) + np.arange(len(units))
    grouped, grouped_qo = np.empty_like(units), np.empty_like(qo)
    grouped[at], grouped_qo[at] = units, qo
    return grouped, grouped_qo, start


class RangeColumns:
    """The columns `consume_queue_units_flat` reads, of every window of a range, the windows' topics numbered
    as the range's (`RangeStage.add_units`): the range's units are grouped in one pass, not window by window."""

    def __init__(self, windows: list[tuple[np.ndarray, ...]], topics: list[str]):
        cols = [np.concatenate([w[i] for w in windows]) for i in range(11)]
        (self.mask, self.topic_id, self.queue_id, self.queue_offset, self.phy_offset, self.msg_size, self.tags_code,
         self.multi_owner, self.multi_topic_id, self.multi_queue_id, self.multi_queue_offset) = cols
        self.topics = topics

    def consume_queue_mask(self) -> np.ndarray:
        return self.mask


def _group_range(windows: list[tuple[np.ndarray, ...]], topics: list[str]) -> tuple[np.ndarray, StagedUnits]:
    """A range's units queue after queue, buckets ascending, each queue's in put order: the range's columns
    grouped by `consume_queue_units_flat` (the rule rebuild follows) in one pass, its groups then put in
    bucket order (one gather)."""
    flat = consume_queue_units_flat(RangeColumns(windows, topics))
    counts = np.diff(flat.bounds)
    hashes = np.fromiter(map(topic_hash, topics), dtype=np.int64, count=len(topics))
    bucket = queue_buckets(hashes[flat.topic_index], flat.queue_id)
    order = np.argsort(bucket, kind="stable")  # the groups, by topic and queue id, in bucket order
    start = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(counts[order], out=start[1:])
    take = np.repeat(flat.bounds[:-1][order] - start[:-1], counts[order]) + np.arange(len(flat.units))
    grouped, grouped_qo = flat.units.view(UNIT_BYTES)[take], flat.queue_offset[take]
    cut = np.ones(len(grouped_qo), dtype=bool)  # where a run of consecutive queue offsets starts
    cut[1:] = np.diff(grouped_qo) != 1
    cut[start[:-1]] = True
    run_start = np.flatnonzero(cut)
    meta = StagedUnits(topics, bucket[order], flat.topic_index[order], flat.queue_id[order], start, run_start,
                       grouped_qo[run_start])
    return grouped, meta


def range_dir(stage_root: str, number: int, attempt_id: int) -> str:
    return os.path.join(stage_root, f"r{number:05d}-a{attempt_id}")


class RangeStage:
    """The files of one range's decode attempt, appended to window by window."""

    def __init__(self, directory: str, catalog: bool):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.units = open(os.path.join(directory, UNITS_DATA), "wb")  # noqa: SIM115 - closed by close()
        self.keys = open(os.path.join(directory, KEYS_DATA), "wb")  # noqa: SIM115
        self.catalog = None
        if catalog:  # pyarrow: only for a run that writes a catalog
            from daemon.backfill.catalogstage import StagedMessages  # noqa: PLC0415

            self.catalog = StagedMessages(os.path.join(directory, CATALOG_DATA))
        self.topics: dict[str, int] = {}  # the range's topics, numbered as first met
        self.windows: list[tuple[np.ndarray, ...]] = []  # each window's columns for the units (`add_units`)
        self.records = 0  # in the windows so far
        self.unit_meta: StagedUnits | None = None
        self.catalog_runs: dict[tuple[str, int], list[tuple[int, int, int, int, tuple]]] = {}
        self.unit_bytes = self.key_count = self.catalog_bytes = 0

    def add_units(self, batch: DispatchBatch) -> None:
        """A window's columns for its ConsumeQueue units, held until the range ends (a few MB a range): then the
        range's units are grouped at once (`_group_range`) and written as one piece (`close`)."""
        if not len(batch):
            return
        topics = self.topics
        for name in batch.topics:
            if name not in topics:
                topics[name] = len(topics)
        to_range = np.fromiter(map(topics.__getitem__, batch.topics), dtype=np.int32, count=len(batch.topics))
        self.windows.append((batch.consume_queue_mask(), to_range[batch.topic_id], batch.queue_id, batch.queue_offset,
                             batch.phy_offset, batch.msg_size, batch.tags_code, batch.multi_owner + self.records,
                             to_range[batch.multi_topic_id], batch.multi_queue_id, batch.multi_queue_offset))
        self.records += len(batch)

    def _write_units(self) -> None:
        if not self.windows:
            empty = np.zeros(0, dtype=np.int64)
            self.unit_meta = StagedUnits([], empty, empty, empty, np.zeros(1, dtype=np.int64), empty, empty)
            return
        grouped, self.unit_meta = _group_range(self.windows, list(self.topics))
        self.windows = []
        self.units.write(memoryview(grouped.view(np.uint8)))
        self.unit_bytes = grouped.nbytes

    def add_keys(self, records: np.ndarray) -> None:
        self.keys.write(memoryview(records.view(np.uint8)))  # not tobytes(): no copy
        self.key_count += len(records)

    def add_catalog(self, rows, groups: list[tuple[str, int, int, int, tuple]]) -> None:
        """A window's catalog rows (a record batch) and (topic, day, first row, rows, form) of each of its
        groups (`catalog.catalog_window`)."""
        at, length = self.catalog.write(rows)
        runs = self.catalog_runs
        for topic, day, first, count, form in groups:
            runs.setdefault((topic, day), []).append((at, length, first, count, form))
        self.catalog_bytes = at + length

    def close(self, abandoned: bool = False) -> None:
        if self.unit_meta is None and not abandoned:
            self._write_units()
        for f in (self.units, self.keys, self.catalog):
            if f is not None:
                f.close()
        if self.unit_meta is not None:
            with open(os.path.join(self.directory, UNITS_META), "wb") as f:
                pickle.dump(self.unit_meta, f, protocol=pickle.HIGHEST_PROTOCOL)
        if self.catalog is not None:
            with open(os.path.join(self.directory, CATALOG_META), "wb") as f:
                pickle.dump(self.catalog_runs, f, protocol=pickle.HIGHEST_PROTOCOL)

    def abandon(self) -> None:
        with suppress(OSError):
            self.close(abandoned=True)

    def bucket_units(self) -> dict[int, int]:
        """Units staged per queue bucket."""
        m = self.unit_meta
        if m is None or not len(m.bucket):
            return {}
        counts = np.bincount(m.bucket, weights=np.diff(m.start), minlength=QUEUE_BUCKETS).astype(np.int64)
        used = np.flatnonzero(counts)
        return dict(zip(used.tolist(), counts[used].tolist(), strict=True))

    def catalog_rows(self) -> dict[tuple[str, int], int]:
        return {g: sum(r[3] for r in runs) for g, runs in self.catalog_runs.items()}


def _map(path: str):
    """A read-only map of a staged file (None when empty: mmap refuses length 0)."""
    size = os.path.getsize(path)
    if size == 0:
        return None
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)


class StagedRange:
    """A writer's view of one range's staged files."""

    def __init__(self, directory: str):
        self.directory = directory
        self._maps: dict[str, object] = {}
        self._meta: dict[str, dict] = {}

    def _data(self, name: str):
        if name not in self._maps:
            self._maps[name] = _map(os.path.join(self.directory, name))
        return self._maps[name]

    def meta(self, name: str) -> dict:
        if name not in self._meta:
            with open(os.path.join(self.directory, name), "rb") as f:
                self._meta[name] = pickle.load(f)
        return self._meta[name]

    def unit_table(self) -> StagedUnits:
        return self.meta(UNITS_META)

    def units(self, lo: int, hi: int) -> np.ndarray:
        """Units [lo, hi) of units.data (UNIT_BYTES: as they lie in the file), a view of the map."""
        data = self._data(UNITS_DATA)
        if data is None or hi <= lo:
            return np.zeros(0, dtype=UNIT_BYTES)
        return np.frombuffer(data, dtype=UNIT_BYTES, count=hi - lo, offset=lo * CQ_UNIT_SIZE)

    def queue_units(self) -> Iterator[tuple[tuple[str, int], np.ndarray, np.ndarray]]:
        """Every queue of the range with its units (CQ_UNIT_DTYPE) and their queue offsets, in bucket order:
        for tests and tools (a writer reads slices of many queues at once)."""
        m = self.unit_table()
        for i in range(len(m.bucket)):
            lo, hi = int(m.start[i]), int(m.start[i + 1])
            yield ((m.topics[m.topic[i]], int(m.queue_id[i])), self.units(lo, hi).view(CQ_UNIT_DTYPE),
                   m.queue_offsets(lo, hi))

    def keys(self, lo: int, hi: int) -> np.ndarray:
        """Keys [lo, hi) of the range (KEY_DTYPE)."""
        data = self._data(KEYS_DATA)
        if data is None or hi <= lo:
            return np.zeros(0, dtype=KEY_DTYPE)
        return np.frombuffer(data, dtype=KEY_DTYPE, count=hi - lo, offset=lo * KEY_DTYPE.itemsize)

    def catalog_pieces(self, group: tuple[str, int]) -> Iterator[tuple[int, memoryview, int, int, tuple]]:
        """Each of a group's pieces for `catalogstage.read_groups`: (the message's offset, the message, the group's
        first row in it, rows, form)."""
        runs = self.meta(CATALOG_META).get(group)
        if not runs:
            return
        data = memoryview(self._data(CATALOG_DATA))
        for at, length, first, rows, form in runs:
            yield at, data[at : at + length], first, rows, form

    def release(self) -> None:
        """Unmap the pages of the staged files read so far (they stay in the page cache, and a view still
        held faults them in again): a writer reading a whole job's staged rows through maps it keeps counts
        them all in its RSS, which a resource manager may hold against it (2 GB for the 16M store's catalog)."""
        for m in self._maps.values():
            if m is not None:
                m.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._meta.clear()
        for m in self._maps.values():
            if m is not None:
                with suppress(BufferError):  # a view still held by a caller: the map goes with it
                    m.close()
        self._maps.clear()
