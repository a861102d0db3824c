"""`ConsumeQueueStore`: every ConsumeQueue of an output, created on first use, and a dispatch batch's units
grouped by queue for it (`consume_queue_units_flat` as flat arrays, `consume_queue_units` queue by queue),
put into every queue at once (`dispatch`, over the queues' `QueueTable`); appends gathered within
HELD_BYTES_BUDGET."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from indexcore import _kernels
from indexcore.consumequeue import (
    BLANK_UNIT,
    CONSUME_QUEUE_DIR,
    CQ_UNIT_DTYPE,
    CQ_UNIT_SIZE,
    CREATE_LABEL,
    DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE,
    PRIVATE_OPEN_FILES,
    PutStats,
    _streak_breaks,
    pack_units,
)
from indexcore.dispatch import DispatchBatch
from indexcore.errors import StoreLayoutError
from indexcore.mappedfile import (
    CREATE_CLOSED,
    CREATE_EXISTED,
    CREATE_KEEP_OPEN,
    CREATE_MAKE_PARENT,
    create_in_place_many,
    offset_to_file_name,
)
from indexcore.openfiles import OpenFiles
from indexcore.queuefiles import ConsumeQueue
from indexcore.queuetable import QueueTable, SlotIndex

_RADIX_KEYS = 1 << 16
MAX_QUEUE_KEYS = 1 << 22  # queue keys (topics x span of queue ids) of a batch counted in C
MAX_OPEN_QUEUE_FILES = 65536
# ConsumeQueue files a writing store keeps open by default (the queues written last): what a queue outside the
# set costs is an open(2) and a close(2) when it is next written, and a rebuild writes each queue's gathered
# appends rarely, while a process with one descriptor per queue needs 100,000 of them at 100,000 queues
# (measured in bench/many_queues.py)
OPEN_QUEUE_FILES = 512
# Appends a store gathers (`ConsumeQueueStore.hold_bytes`) are all written once the batches' arrays of units
# they keep alive come to this many bytes (a piece is a slice of its batch's array, never a copy).
HELD_BYTES_BUDGET = 64 * 1024 * 1024


class QueueUnits(NamedTuple):
    """The units one queue gets from a batch, in the order the broker puts them, with each unit's CommitLog
    end. `one_streak`: their queue offsets are consecutive and their ends grow from first to last, so
    `place_units` places them without an array operation when they continue the queue."""

    topic: str
    queue_id: int
    queue_offset: np.ndarray
    units: np.ndarray  # CQ_UNIT_DTYPE
    ends: np.ndarray
    one_streak: bool = False


class NewQueue(NamedTuple):
    """A queue a batch creates: its key, its directory, the start of its first file and the pre-blank units
    that file is created with (its first unit's place in it); `make_parent`: its topic's directory is not
    known to exist."""

    key: tuple[str, int]
    directory: str
    first_file: int
    blanks: int
    make_parent: bool = False
    path: str = ""  # its first file's: made once (`_new_queues`), read three times

    @property
    def header(self) -> bytes:
        return BLANK_UNIT * self.blanks


def _queue_order(topic_id: np.ndarray, queue_id: np.ndarray, topics: int) -> tuple[np.ndarray, np.ndarray]:
    """The permutation that groups units queue by queue, keeping their order inside a queue, and where
    each queue's run starts in it.

    A stable sort; when the queues of a batch number at most 2**16, their keys fit 16 bits and numpy's
    stable sort of them is a radix sort, linear in the batch.
    """
    qmin = int(queue_id.min())
    span = int(queue_id.max()) - qmin + 1
    if topics * span <= _RADIX_KEYS:
        key = (topic_id.astype(np.int64) * span + (queue_id - qmin)).astype(np.uint16)
    else:
        key = (topic_id.astype(np.int64) << 32) | (queue_id.astype(np.int64) & 0xFFFFFFFF)
    order = np.argsort(key, kind="stable")
    key = key[order]
    return order, np.flatnonzero(key[1:] != key[:-1]) + 1


class FlatUnits(NamedTuple):
    """A batch's ConsumeQueue units grouped by queue, as flat arrays (what `_kernels.group_units` makes): group g
    is queue (topics[topic_index[g]], queue_id[g]) and holds units bounds[g]:bounds[g + 1], in put order. A
    decode that keeps a window's units as these arrays holds four arrays, not a Python object per queue."""

    topics: Sequence[str]
    topic_index: np.ndarray  # int64, per group
    queue_id: np.ndarray  # int64, per group
    bounds: np.ndarray  # int64, groups + 1
    one_streak: np.ndarray  # bool, per group (`QueueUnits.one_streak`)
    queue_offset: np.ndarray  # int64, per unit
    units: np.ndarray  # CQ_UNIT_DTYPE, per unit
    ends: np.ndarray  # int64, per unit: the unit's CommitLog end

    def __len__(self) -> int:
        return len(self.topic_index)


def _no_units(topics: Sequence[str]) -> FlatUnits:
    empty = np.zeros(0, dtype=np.int64)
    return FlatUnits(topics, empty, empty, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=bool), empty,
                     np.zeros(0, dtype=CQ_UNIT_DTYPE), empty)


def consume_queue_units(batch: DispatchBatch) -> Iterator[QueueUnits]:
    """`consume_queue_units_flat`, queue by queue: a QueueUnits per queue, its arrays views of the flat ones."""
    flat = consume_queue_units_flat(batch)
    topics, qo, units, ends = flat.topics, flat.queue_offset, flat.units, flat.ends
    bounds = flat.bounds.tolist()
    for t, q, lo, hi, streak in zip(flat.topic_index.tolist(), flat.queue_id.tolist(), bounds[:-1], bounds[1:],
                                    flat.one_streak.tolist(), strict=True):
        yield QueueUnits(topics[t], q, qo[lo:hi], units[lo:hi], ends[lo:hi], streak)


def consume_queue_units_flat(batch: DispatchBatch) -> FlatUnits:
    """`CommitLogDispatcherBuildConsumeQueue` for a batch: which units go to which queue, grouped queue by
    queue, in put order, packed as they lie in the file. What rebuild, run and backfill write and verify
    expects.

    Every NOT_TYPE and COMMIT_TYPE record puts a unit into its own queue at its QUEUEOFFSET and then,
    when the batch carries multi-dispatch targets, one into each target queue at the target's offset
    (`putMessagePositionInfoWrapper`). Each queue receives its units in CommitLog order and a record's own
    unit before its targets, as the broker's sequential dispatch gives them. What the queue does with each
    (written, skipped as a repeat, appended out of order) is `place_units`'s business. `batch` is a
    DispatchBatch or anything with its columns. The groups come in the order of their queue keys (topic
    index, then queue id).
    """
    mask = batch.consume_queue_mask()
    if len(mask) == 0:
        return _no_units(batch.topics)
    qids, multi_qids = batch.queue_id, batch.multi_queue_id
    qmin = min(int(qids.min()), int(multi_qids.min()) if len(multi_qids) else 0)
    span = max(int(qids.max()), int(multi_qids.max()) if len(multi_qids) else 0) - qmin + 1
    if len(batch.topics) * span > MAX_QUEUE_KEYS:
        return _group_units_sorting(batch, mask)
    # queue keys topic * span + queue: a counting sort in C (_kernels.group_units) groups them, linear in
    # the units and the keys
    keys = len(batch.topics) * span
    owner = np.ascontiguousarray(batch.multi_owner, dtype=np.int64)
    total = int(np.count_nonzero(mask)) + (int(np.count_nonzero(mask[owner])) if len(owner) else 0)
    if total == 0:
        return _no_units(batch.topics)
    units = np.empty(total, dtype=CQ_UNIT_DTYPE)
    qo, ends = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
    counts, state, cursor = np.empty(keys, np.int64), np.empty(keys, np.uint8), np.empty(keys, np.int64)
    _kernels.group_units(
        np.ascontiguousarray(mask, dtype=np.bool_), batch.topic_id.astype(np.int64) * span + (qids - qmin),
        *(np.ascontiguousarray(c, dtype=np.int64) for c in (batch.queue_offset, batch.phy_offset, batch.msg_size,
                                                            batch.tags_code)),
        owner, batch.multi_topic_id.astype(np.int64) * span + (multi_qids - qmin),
        np.ascontiguousarray(batch.multi_queue_offset, dtype=np.int64), units.view(np.uint8), qo, ends, counts, state,
        cursor)
    used = np.flatnonzero(counts)
    bounds = np.zeros(len(used) + 1, dtype=np.int64)
    np.cumsum(counts[used], out=bounds[1:])
    return FlatUnits(batch.topics, used // span, used % span + qmin, bounds, state[used] == 1, qo, units, ends)


def _group_units_sorting(batch: DispatchBatch, mask: np.ndarray) -> FlatUnits:
    """`consume_queue_units_flat` for a batch whose queue keys are too many to count (topics x queue id span
    over MAX_QUEUE_KEYS): a stable sort instead."""
    rows = np.flatnonzero(mask)
    topic_id, queue_id, queue_offset = batch.topic_id[rows], batch.queue_id[rows], batch.queue_offset[rows]
    owner = batch.multi_owner
    taken = mask[owner] if len(owner) else None  # targets of records that get no unit get none either
    multi = [c[taken] for c in (owner, batch.multi_topic_id, batch.multi_queue_id, batch.multi_queue_offset)] \
        if taken is not None else None
    if multi is not None and len(multi[0]):
        owner = multi[0]
        # merge the record's own units and the targets by record, own unit first: record r's units start
        # after those of the records before it (the kernel lists targets in record order)
        own = mask.astype(np.int64)
        targets = np.bincount(owner, minlength=len(mask))
        start = np.cumsum(own + targets) - (own + targets)
        at_own = start[rows]
        at_multi = start[owner] + own[owner] + np.arange(len(owner)) - (np.cumsum(targets) - targets)[owner]
        n = len(rows) + len(owner)
        rows, topic_id, queue_id, queue_offset = (
            _merge(at_own, a, at_multi, b, n)
            for a, b in zip((rows, topic_id, queue_id, queue_offset), multi, strict=True))
    if len(rows) == 0:
        return _no_units(batch.topics)
    order, starts = _queue_order(topic_id, queue_id, len(batch.topics))
    rows, queue_offset = rows[order], queue_offset[order].astype(np.int64, copy=False)
    first = order[np.concatenate(([0], starts))]
    phy = batch.phy_offset[rows]
    size = batch.msg_size[rows]
    ends = (phy + size).astype(np.int64, copy=False)
    units = pack_units(phy, size, batch.tags_code[rows])
    bounds = np.concatenate(([0], starts, [len(rows)])).astype(np.int64)
    return FlatUnits(batch.topics, topic_id[first].astype(np.int64), queue_id[first].astype(np.int64), bounds,
                     _one_streak(queue_offset, ends, bounds), queue_offset, units, ends)


def _one_streak(queue_offset: np.ndarray, ends: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per run: no streak break inside it (what `place_units` would find, for the whole batch at once)."""
    breaks = _streak_breaks(queue_offset, ends)
    inside = np.searchsorted(breaks, bounds[1:], side="left") - np.searchsorted(breaks, bounds[:-1], side="right")
    return inside == 0


def _merge(at_a: np.ndarray, a: np.ndarray, at_b: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.result_type(a, b))
    out[at_a], out[at_b] = a, b
    return out


def open_queue_files_limit() -> int:
    """The most queue files a process should keep open (or mapped, `indexcore.verify`): half the descriptor
    limit, at most MAX_OPEN_QUEUE_FILES; a writing store keeps at most OPEN_QUEUE_FILES of them open."""
    import resource  # noqa: PLC0415 - POSIX only, and only a store that writes needs it

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(PRIVATE_OPEN_FILES, min(MAX_OPEN_QUEUE_FILES, (soft if soft > 0 else 1024) // 2))


class ConsumeQueueStore:
    """Every ConsumeQueue under `{root}/consumequeue/`, created on first use."""

    def __init__(self, root: str, file_size: int = DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE, *,
                 readonly: bool = False, open_files_limit: int | None = None):
        self.root = os.path.join(root, CONSUME_QUEUE_DIR)
        self.file_size = file_size
        self.readonly = readonly
        self.open_files = OpenFiles(open_files_limit or min(OPEN_QUEUE_FILES, open_queue_files_limit()))
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        # where every queue writes next, and what `dispatch` put units to (`touched`, for the flusher to take)
        self.table = QueueTable(64)
        # Appends to a queue are gathered in memory until they reach this many bytes (0: none are), within
        # HELD_BYTES_BUDGET for the store: a rebuild of an LMQ store puts a few kilobytes per batch into each of
        # a thousand queues, and the kernel writes 160 MB to 1,064 files in 4.6 KiB pieces in 0.20-0.28 s, in
        # 16-64 KiB ones in 0.07-0.09 s (ext4 here); `run` over 10,000 queues would make a write per queue a
        # batch. What is gathered is written before any sync, read, or close.
        self.hold_bytes = 0
        # ... and, when set, for at most this many seconds (`run`: so that each active queue is written about once
        # in that time, and its file lags its dispatch by no more)
        self.hold_seconds: float | None = None
        # a new queue's first file created by its first write (`OpenFiles.create_later`): a rebuild's, read by none
        self.create_on_write = False
        self._topic_dirs: set[str] = set()  # topics whose directory this store has seen or made
        self.slot_index = SlotIndex()  # the slots of the queues batches met, by topic and queue id
        self.last_put = float("-inf")  # when `dispatch` last put units (time.monotonic)

    def load(self) -> None:
        """Open and recover every queue directory that exists (`DefaultMessageStore.loadConsumeQueue`)."""
        if not os.path.isdir(self.root):
            return
        for topic in sorted(os.listdir(self.root)):
            tdir = os.path.join(self.root, topic)
            if not os.path.isdir(tdir):
                raise StoreLayoutError(tdir, "not a topic directory")
            self._topic_dirs.add(topic)
            for qid in sorted(os.listdir(tdir)):
                if not qid.isdigit():
                    raise StoreLayoutError(os.path.join(tdir, qid), "queue directory name is not a queue id")
                self.queue(topic, int(qid))

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        key = (topic, queue_id)
        cq = self.queues.get(key)
        if cq is None:
            directory = self._queue_dir(topic, queue_id)
            cq = self.queues[key] = ConsumeQueue(directory, topic, queue_id, self.file_size, readonly=self.readonly,
                                                 open_files=self.open_files, new=self._made_topic_dir(topic),
                                                 table=self.table)
        return cq

    def _queue_dir(self, topic: str, queue_id: int) -> str:
        directory = f"{self.root}{os.sep}{topic}{os.sep}{queue_id}"
        if os.sep in topic or topic in ("", os.curdir, os.pardir):  # anything else is a name in consumequeue/
            raise StoreLayoutError(directory, "topic would leave the consumequeue directory")
        return directory

    def _new_queues(self, firsts: Iterable[tuple[tuple[str, int], int]]) -> list[NewQueue]:
        """The queues of (queue, its first unit's queue offset) this store does not hold yet, each with the file its
        first unit creates: `create_queue_files` creates them, `made_queues` takes them in (as `_create` does)."""
        out, queues, topic_dirs, size = [], self.queues, self._topic_dirs, self.file_size
        parents: set[str] = set()  # a new topic's directory is made by its first queue only (not a mkdir each)
        names: dict[int, str] = {}  # first files' names: most are 00000000000000000000
        for key, first in firsts:
            if key not in queues:
                expect = first * CQ_UNIT_SIZE
                first_file = expect - expect % size
                make_parent = key[0] not in topic_dirs and key[0] not in parents
                parents.add(key[0])
                name = names.get(first_file) or names.setdefault(first_file, offset_to_file_name(first_file))
                directory = self._queue_dir(*key)
                out.append(NewQueue(key, directory, first_file, (expect - first_file) // CQ_UNIT_SIZE, make_parent,
                                    f"{directory}{os.sep}{name}"))
        return out

    def create_queue_files(self, new: list[NewQueue], keep_open: int = 0) -> list[int]:
        """Create the directory and first file of each of `new` (`create_in_place_many`: in place, in one call
        without the GIL), a new topic's directory first; the first `keep_open` keep their descriptor: hand what
        it gives for each to `made_queues`."""
        return create_in_place_many(
            [(q.directory, q.path, q.header, (CREATE_MAKE_PARENT if q.make_parent else 0) |
              (CREATE_KEEP_OPEN if i < keep_open else 0)) for i, q in enumerate(new)],
            self.file_size, label=CREATE_LABEL)

    def made_queues(self, made: Iterable[tuple[NewQueue, int]]) -> None:
        """Queues whose directory and first file (sparse, full size, its pre-blank units as the header:
        `create_queue_files`) the caller created, each with what `create_in_place_many` gave for it: a descriptor,
        CREATE_CLOSED, or CREATE_EXISTED (made by someone else since the load: left to `queue` to load)."""
        queues, size, files = self.queues, self.file_size, self.open_files
        for q, fd in made:
            self._topic_dirs.add(q.key[0])
            if fd == CREATE_EXISTED:
                continue
            path = q.path
            queues[q.key] = ConsumeQueue.made(q.directory, q.key[0], q.key[1], size, files, q.first_file, q.blanks,
                                              self.table, path)
            if fd >= 0:
                files.adopt(path, fd)

    def _create(self, firsts: Iterable[tuple[tuple[str, int], int]], stats: PutStats | None = None) -> int:
        """Add the queues of (queue, its first unit's queue offset) the store does not hold yet, their first files
        created in one call (`create_queue_files`) or by their first writes (`create_on_write`); how many. The
        pre-blank units the files are created with are counted in `stats` (`PutStats.pre_blanks`)."""
        new = self._new_queues(firsts)
        if new and self.create_on_write:
            self.open_files.create_later([(q.directory, q.path, q.header, CREATE_MAKE_PARENT if q.make_parent else 0)
                                          for q in new], self.file_size, label=CREATE_LABEL)
        if new:
            made = [CREATE_CLOSED] * len(new) if self.create_on_write else self.create_queue_files(new)
            self.made_queues(zip(new, made, strict=True))
            if stats is not None:
                stats.pre_blanks += sum(q.blanks for q in new)
        return len(new)

    def _made_topic_dir(self, topic: str) -> bool:
        """Create the topic's directory if it is missing (a writing store only): then its queue has no file
        to recover, which spares a directory listing per queue of a store with 100,000 LMQ queues."""
        if self.readonly or topic in self._topic_dirs:
            return False
        try:
            os.mkdir(os.path.join(self.root, topic))
        except FileExistsError:
            self._topic_dirs.add(topic)
            return False
        except FileNotFoundError:  # no consumequeue/ yet
            os.makedirs(os.path.join(self.root, topic), exist_ok=True)
        self._topic_dirs.add(topic)
        return True

    def dispatch(self, batch: DispatchBatch, units: FlatUnits | None = None) -> PutStats:
        """Put the units of the batch (`consume_queue_units_flat`, or `units` grouped already) into every queue, the
        queues it meets first created together (`_create`). The units that continue their queue inside its
        last file, the common case, are placed for all queues at once and gathered (`hold_bytes`) or written at
        the end, in one call (`OpenFiles.write_later`); the others queue by queue (`ConsumeQueue.put_packed`)."""
        stats = PutStats()
        g = consume_queue_units_flat(batch) if units is None else units
        if not len(g):
            return stats
        try:
            self._put_grouped(g, stats)
        finally:
            if self.table.holding and (not self.hold_bytes or self.table.pinned > HELD_BYTES_BUDGET):
                self.table.release()
            self.open_files.submit_writes()  # made now, or by `run`'s writer thread (`OpenFiles.write_behind`)
        return stats

    def _put_grouped(self, g: FlatUnits, stats: PutStats) -> None:
        slots = self.slot_index.lookup(g.topics, g.topic_index, g.queue_id)
        missing = np.flatnonzero(slots < 0)
        if len(missing):  # queues the index has not met: by key, created first if the store does not hold them
            get, ti, qi = self.queues.get, g.topic_index[missing].tolist(), g.queue_id[missing].tolist()
            keys = [(g.topics[t], q) for t, q in zip(ti, qi, strict=True)]
            cqs = [get(key) for key in keys]
            if None in cqs:
                first = g.queue_offset[g.bounds[:-1][missing]].tolist()
                self._create([(keys[i], first[i]) for i, cq in enumerate(cqs) if cq is None], stats)
                cqs = [cq or self.queue(*key) for cq, key in zip(cqs, keys, strict=True)]
            slots[missing] = [self.slot_index.add(*key, cq._slot) for key, cq in zip(keys, cqs, strict=True)]
        t, size = self.table, self.file_size
        lo, hi = g.bounds[:-1], g.bounds[1:]
        start, at = t.last_start[slots], t.write_pos[slots]
        # the one placement place_units gives a streak that continues its queue inside its last file
        fast = g.one_streak & (start >= 0) & (g.ends[lo] > t.max_phy[slots]) & \
            (g.queue_offset[lo] * CQ_UNIT_SIZE == start + at) & ((hi - lo) * CQ_UNIT_SIZE <= size - at)
        t.touched[slots] = True
        slow = np.flatnonzero(~fast).tolist()
        if slow:
            if t.held[slots[slow]].any():  # what these queues gathered goes first
                t.release()
            qo, units, ends, streak = g.queue_offset, g.units, g.ends, g.one_streak
            queues = t.queues
            for i, a, b in zip(slow, lo[slow].tolist(), hi[slow].tolist(), strict=True):
                queues[slots.item(i)].put_packed(qo[a:b], units[a:b], ends[a:b], bool(streak[i]), later=True,
                                                 stats=stats)
        fs = slots[fast]
        now, since = time.monotonic(), self.last_put
        self.last_put = now
        stats.written += t.append(g.units, g.ends, fs, lo[fast], hi[fast], at[fast], now)
        if self.hold_bytes:
            full = fs[t.held[fs] >= self.hold_bytes]
            if len(full):
                t.release(full)
            if self.hold_seconds is not None:
                t.release_due(now, since, self.hold_seconds)

    @property
    def touched(self) -> np.ndarray:
        """The slots of the queues `dispatch` put units to since `take_touched`."""
        return np.flatnonzero(self.table.touched[: len(self.table)])

    def take_touched(self) -> np.ndarray:
        """`touched`, and forget them: the flusher's candidates."""
        touched = self.touched
        self.table.touched[touched] = False
        return touched

    def release_held(self) -> None:
        """Hand every queue's gathered appends to the deferred writes (`QueueTable.release`)."""
        self.table.release()

    def write_held(self) -> None:
        """Write every gathered append now: before the files are synced or read by anyone else."""
        self.release_held()
        self.open_files.flush_writes()

    def drop_torn_tails(self, from_phy: int) -> list[str]:
        """`ConsumeQueue.drop_torn_tail` for every queue; the files a unit was removed from."""
        dropped = []
        for cq in self.queues.values():
            path = cq.writing_path
            if cq.drop_torn_tail(from_phy) is not None:
                dropped.append(path)
        return dropped

    def max_physic_offset(self) -> int:
        """Max over all queues of the end of the last unit: where the broker restarts its reput."""
        return max((cq.max_physic_offset for cq in self.queues.values()), default=-1)

    def truncate_to(self, phy_offset: int) -> None:
        for cq in self.queues.values():
            if cq.max_physic_offset > phy_offset or cq.max_physic_offset == -1:
                cq.truncate_to(phy_offset)

    def __iter__(self) -> Iterator[ConsumeQueue]:
        return iter(self.queues.values())

    def flush(self, sync_paths: Callable[[list[str]], None] | None = None) -> None:
        """Sync every queue written since its last sync; `sync_paths`, when given, syncs the list of
        their files itself (in parallel, say: each sync of a file waits for a journal commit)."""
        self.write_held()
        table = self.table
        dirty = [table.queues[slot] for slot in np.flatnonzero(table.dirty[: len(table)]).tolist()]
        if sync_paths is None:
            for cq in dirty:
                cq.flush()
            return
        sync_paths([cq.writing_path for cq in dirty])
        for cq in dirty:
            cq.mark_synced()

    def close(self) -> None:
        try:
            self.write_held()
        finally:
            for cq in self.queues.values():
                cq.close()
            self.open_files.close()
