"""`QueueTable`: where each of a store's ConsumeQueues writes next, in arrays with a row (slot) per queue, and
the appends gathered for them until they are written.

A batch of a store with 10,000 or 100,000 queues puts a few units into each of thousands of them. Placed
queue by queue in Python that cost some 4 us a queue a batch, more than decoding the records; so a
`ConsumeQueue` keeps its write position in its store's table (`indexcore.queuefiles`), and the store decides
and places the common case, a queue's units that continue it inside its last file, for every queue of a
batch with array operations (`ConsumeQueueStore.dispatch`). What a queue's units are and where they go is
the queue's business as before (`consumequeue.place_units`): the table only holds its state.

Columns, per slot: `last_start` (the start offset of the queue's last file, -1 without a file), `write_pos`
(where its next unit goes in that file), `max_phy` (the CommitLog end of its last real unit, -1 before
one), `dirty` (the last file holds writes not synced), `touched` (units put since the flusher last looked),
`held` (bytes of appends gathered, not written yet: the last ones before `write_pos`) and `held_phy` (the
CommitLog offset of the first of them). The appends are gathered as the batches' own arrays with, for each
queue, the slice it takes (never copies: copying costs a fresh page per 4 KiB), one entry per queue and
batch in the order gathered, and written queue by queue, each queue's pieces with one vectored write, by
`release`.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import numpy as np

from indexcore import _kernels
from indexcore.consumequeue import CQ_UNIT_SIZE


class QueueWriter(Protocol):
    """What the table needs of a queue (`ConsumeQueue`): a write of its gathered pieces to its last file."""

    def write_later(self, data, position: int) -> None: ...

NOT_HELD = np.iinfo(np.int64).max  # `held_phy` of a queue that holds nothing
# `release` copies the pieces it writes back to back into one buffer when they are more than one per queue and
# smaller than this many bytes on average (`_write_joined`); larger pieces are written from the batches' arrays
SMALL_PIECES = 1024
# `release_due` (a dispatch of `run`) writes the gathered appends of the queues that came of age (`hold_seconds`),
# those gathered first, at most the share of the holding queues that come of age in the time since the last batch,
# times RELEASE_CATCH_UP, and at least RELEASE_OLD_QUEUES; the others wait for the next batches. `run` over 10,000
# queues, each written every second, gathers the first append of nearly every queue in the same batch after a
# release: they all came of age together, and one batch (or the flusher, under the dispatch lock) wrote
# 5,000-10,000 files at once, an open, a pwritev and a close each outside the descriptor set: 50 ms to 5.9 s, the
# p99 append-to-dispatch latency of about 1 s. Spread over the batches they stay spread.
RELEASE_OLD_QUEUES = 64
RELEASE_CATCH_UP = 2.0
_COLUMNS = (("last_start", np.int64, -1), ("write_pos", np.int64, 0), ("max_phy", np.int64, -1),
            ("dirty", np.bool_, False), ("touched", np.bool_, False), ("held", np.int64, 0),
            ("held_phy", np.int64, NOT_HELD))
# the gathered pieces, one entry per queue and batch: the queue's slot, its units [lo, hi) of the batch's
# array, where they go in its last file, the batch (a key of `_arrays`) and when they were gathered
_ENTRIES = (("_slot", np.int64), ("_lo", np.int64), ("_hi", np.int64), ("_at", np.int64), ("_batch", np.int64),
            ("_time", np.float64))


def _grown(a: np.ndarray, size: int, fill) -> np.ndarray:
    new = np.full(max(size, 2 * len(a)), fill, dtype=a.dtype)
    new[: len(a)] = a
    return new


class QueueTable:
    """The rows of a store's queues (`add` gives each its slot) and the appends gathered for them."""

    __slots__ = ("_arrays", "_at", "_batch", "_bytes", "_hi", "_left", "_live", "_lo", "_n", "_next_batch",
                 "_slot", "_time", "dirty", "held", "held_phy", "last_start", "max_phy", "pinned", "queues", "touched",
                 "write_pos")

    def __init__(self, capacity: int = 1):
        for name, dtype, fill in _COLUMNS:
            setattr(self, name, np.full(max(1, capacity), fill, dtype=dtype))
        for name, dtype in _ENTRIES:
            setattr(self, name, np.zeros(16, dtype=dtype))
        self.queues: list[QueueWriter] = []  # by slot
        # gathered entries: the first `_n` rows of the entry columns, `_live` of them not released yet (a released
        # entry's `_slot` is -1 until the rows are compacted, once most of them are released: a release touches
        # the entries of the queues it writes, not every entry held)
        self._n = 0
        self._live = 0
        self._arrays: dict[int, np.ndarray] = {}  # the batches' arrays of units the entries take from
        self._bytes: dict[int, memoryview] = {}  # ... as bytes, made by the first `_write_joined` that takes from one
        self._left: dict[int, int] = {}  # per batch (a key of `_arrays`): its entries not released yet
        self._next_batch = 0
        self.pinned = 0  # bytes of those arrays: what the gathered appends keep alive

    def __len__(self) -> int:
        return len(self.queues)

    def add(self, queue: QueueWriter) -> int:
        """A row for `queue`, in its initial state: no file, nothing written."""
        slot = len(self.queues)
        if slot == len(self.last_start):
            for name, _, fill in _COLUMNS:
                setattr(self, name, _grown(getattr(self, name), slot + 1, fill))
        self.queues.append(queue)
        return slot

    def write_end(self, slots: np.ndarray) -> np.ndarray:
        """The logical offset each queue's next unit goes to (0 for a queue without a file)."""
        start = self.last_start[slots]
        return np.where(start >= 0, start + self.write_pos[slots], 0)

    # --- gathered appends -----------------------------------------------------------------------------

    @property
    def holding(self) -> bool:
        return self._live > 0

    def append(self, units: np.ndarray, ends: np.ndarray, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               at: np.ndarray, now: float = 0.0) -> int:
        """Put `units[lo[i]:hi[i]]` (each ending in the CommitLog at `ends`) at `at[i]` in the last file of queue
        `slots[i]`, where they continue it (`ConsumeQueueStore.dispatch`'s common case), and `gather` them; how many."""
        count = hi - lo
        self.write_pos[slots] = at + count * CQ_UNIT_SIZE
        self.max_phy[slots] = ends[hi - 1]
        self.dirty[slots] = True
        self.gather(units, slots, lo, hi, at, now)
        return int(count.sum())

    def gather(self, units: np.ndarray, slots: np.ndarray, lo: np.ndarray, hi: np.ndarray, at: np.ndarray,
               now: float = 0.0) -> None:
        """Hold `units[lo[i]:hi[i]]` for queue `slots[i]` (each slot once), to go at `at[i]` in its last file:
        right after what it holds already, or at its write position when it holds nothing. `now` (any clock)
        dates them for `release_older`."""
        k = len(slots)
        if not k:
            return
        n = self._n
        if n + k > len(self._slot):
            for name, _ in _ENTRIES:
                setattr(self, name, _grown(getattr(self, name), n + k, 0))
        batch = self._next_batch
        self._next_batch += 1
        self._arrays[batch] = units
        self._left[batch] = k
        self.pinned += units.nbytes
        for name, values in (("_slot", slots), ("_lo", lo), ("_hi", hi), ("_at", at)):
            getattr(self, name)[n : n + k] = values
        self._batch[n : n + k] = batch
        self._time[n : n + k] = now
        self._n = n + k
        self._live += k
        first = self.held[slots] == 0
        if first.any():
            self.held_phy[slots[first]] = units["commit_log_offset"][lo[first]]
        self.held[slots] += (hi - lo) * CQ_UNIT_SIZE

    def oldest_held(self) -> int | None:
        """The CommitLog offset of the first unit gathered and not written (None: none is): every unit of the
        records below it is written."""
        if not self._live:
            return None
        slots = self._slot[: self._n]
        return int(self.held_phy[slots[slots >= 0]].min())

    def release_older(self, before: float, most: int | None = None) -> None:
        """`release` the queues whose first gathered piece was gathered before `before` (on `gather`'s clock);
        with `most`, only the `most` of them whose first pieces are the oldest: the others wait for the next call."""
        old = int(np.searchsorted(self._time[: self._n], before, side="left"))
        if not old:
            return
        slots, first = np.unique(self._slot[:old], return_index=True)
        if len(slots) and slots[0] < 0:  # released already
            slots, first = slots[1:], first[1:]
        if most is not None and len(slots) > most:
            slots = slots[np.sort(np.argsort(first, kind="stable")[:most])]
        self.release(slots)

    def release_due(self, now: float, since: float, seconds: float) -> None:
        """`release_older(now - seconds)` spread over the batches: a batch dispatched `now` (the one before at
        `since`) releases a share of the queues that came of age (RELEASE_CATCH_UP, RELEASE_OLD_QUEUES)."""
        elapsed = now - since  # inf for the first batch
        finite = seconds > 0 and elapsed < float("inf")
        share = RELEASE_CATCH_UP * elapsed / seconds if finite else 1.0
        most = None if share >= 1 else max(RELEASE_OLD_QUEUES, int(share * np.count_nonzero(self.held[: len(self)])))
        self.release_older(now - seconds, most)

    def release(self, slots: np.ndarray | None = None) -> None:
        """Hand the gathered appends of `slots` (of every queue when None) to their descriptor sets' deferred
        writes (`ConsumeQueue.write_later`: a queue's pieces back to back, one vectored write), queue by queue
        in slot order."""
        n = self._n
        if not self._live:
            return
        if slots is None:
            live = self._slot[:n] >= 0 if self._live < n else slice(None)
            taken = {name: getattr(self, name)[:n][live] for name, _ in _ENTRIES}  # written before anything is gathered
            self._n = self._live = 0
        else:
            chosen = np.zeros(len(self.queues) + 1, dtype=np.bool_)  # the last: released entries' slot -1
            chosen[slots] = True
            at = np.flatnonzero(chosen[self._slot[:n]])
            if not len(at):
                return
            taken = {name: getattr(self, name)[at] for name, _ in _ENTRIES}
            self._slot[at] = -1
            self._live -= len(at)
            if not self._live:
                self._n = 0
            elif n > 2 * self._live:  # mostly released: compact, keeping the order gathered
                keep = self._slot[:n] >= 0
                for name, _ in _ENTRIES:
                    column = getattr(self, name)
                    kept = column[:n][keep]
                    column[: len(kept)] = kept
                self._n = self._live
        order = np.argsort(taken["_slot"], kind="stable")  # a queue's pieces stay in the order gathered
        slot, lo, hi, at, batch = (taken[name][order] for name in ("_slot", "_lo", "_hi", "_at", "_batch"))
        starts = np.flatnonzero(np.concatenate(([True], slot[1:] != slot[:-1])))
        released = slot[starts]
        self.held[released] = 0
        self.held_phy[released] = NOT_HELD
        keys, which, counts = np.unique(batch, return_inverse=True, return_counts=True)
        nbytes = int((hi - lo).sum()) * CQ_UNIT_SIZE
        if len(slot) > len(released) and nbytes < SMALL_PIECES * len(slot):
            self._write_joined(released, starts, slot, lo, hi, at, keys, which, nbytes)
        else:
            self._write_pieces(starts, slot, lo, hi, at, batch)
        # the batches no piece takes from any more are let go
        arrays, left = self._arrays, self._left
        for key, count in zip(keys.tolist(), counts.tolist(), strict=True):
            if left[key] > count:
                left[key] -= count
            else:
                del left[key]
                self.pinned -= arrays.pop(key).nbytes
                self._bytes.pop(key, None)

    def _write_pieces(self, starts: np.ndarray, slot: np.ndarray, lo: np.ndarray, hi: np.ndarray, at: np.ndarray,
                      batch: np.ndarray) -> None:
        """`release`'s writes: a queue's pieces as views of their batches' arrays, one vectored write per queue."""
        arrays, queues = self._arrays, self.queues
        slot_l, lo_l, hi_l, at_l, batch_l = slot.tolist(), lo.tolist(), hi.tolist(), at.tolist(), batch.tolist()
        bounds = [*starts.tolist(), len(slot_l)]
        for a, b in itertools.pairwise(bounds):
            if b - a == 1:
                data = arrays[batch_l[a]][lo_l[a] : hi_l[a]]
            else:
                data = [arrays[batch_l[i]][lo_l[i] : hi_l[i]] for i in range(a, b)]
            queues[slot_l[a]].write_later(data, at_l[a])

    def _write_joined(self, released: np.ndarray, starts: np.ndarray, slot: np.ndarray, lo: np.ndarray,
                      hi: np.ndarray, at: np.ndarray, keys: np.ndarray, which: np.ndarray, nbytes: int) -> None:
        """`release`'s writes when the pieces are many and small: every piece copied back to back into one buffer
        in C (`_kernels.gather_pieces`), each queue's write a slice of it. A view per piece cost about 1 us of
        Python here and as much again on the writer thread (its buffer), a piece being a unit or two over 10,000
        queues; the copy costs what memcpy does."""
        arrays, flat = self._arrays, self._bytes
        sources = [flat.get(k) or flat.setdefault(k, memoryview(np.ascontiguousarray(arrays[k]).view(np.uint8)))
                   for k in keys.tolist()]
        out = np.empty(nbytes, dtype=np.uint8)
        _kernels.gather_pieces(sources, which.astype(np.int64, copy=False), lo * CQ_UNIT_SIZE, hi * CQ_UNIT_SIZE, out)
        size = (hi - lo) * CQ_UNIT_SIZE
        ends = np.cumsum(size)
        first = np.concatenate(([0], ends[starts[1:] - 1])).tolist()
        last = ends[np.concatenate((starts[1:], [len(slot)])) - 1].tolist()
        data, queues = memoryview(out), self.queues
        for s, a, b, position in zip(released.tolist(), first, last, at[starts].tolist(), strict=True):
            queues[s].write_later(data[a:b], position)


class SlotIndex:
    """The table slots of a store's queues by topic and queue id, for a batch's queues at once (`lookup`): a row per
    topic, a column per queue id. Looked up by key one by one, the queues a batch puts units to cost some 0.3 us of
    Python each, and a batch over 10,000 queues meets hundreds of them. A queue id past what `max_cells` allows is
    not entered: its caller looks it up by key."""

    __slots__ = ("_rows", "_topics", "max_cells")

    def __init__(self, max_cells: int = 1 << 22) -> None:  # int64 cells: 100,000 topics of 8 queue ids take 800,000
        self.max_cells = max_cells
        self._topics: dict[str, int] = {}
        self._rows = np.full((64, 8), -1, dtype=np.int64)

    def lookup(self, topics, topic_index: np.ndarray, queue_id: np.ndarray) -> np.ndarray:
        """The slot of each queue (topics[topic_index[i]], queue_id[i]), -1 for one not entered."""
        found = np.fromiter(map(self._topics.get, topics, itertools.repeat(-1)), np.int64, len(topics))
        row, rows = found[topic_index], self._rows
        ok = (row >= 0) & (queue_id >= 0) & (queue_id < rows.shape[1])
        slots = np.full(len(row), -1, dtype=np.int64)
        slots[ok] = rows[row[ok], queue_id[ok]]
        return slots

    def add(self, topic: str, queue_id: int, slot: int) -> int:
        """Enter the queue's slot; returns it."""
        rows = self._rows
        row = self._topics.get(topic, len(self._topics))
        height, width = rows.shape
        if row >= height or queue_id >= width:
            width = max(width, queue_id + 1, 2 * width if queue_id >= width else 0)
            height = max(height, row + 1, min(2 * row, self.max_cells // width))
            if queue_id < 0 or height * width > self.max_cells:
                return slot
            grown = np.full((height, width), -1, dtype=np.int64)
            grown[: rows.shape[0], : rows.shape[1]] = rows
            self._rows = rows = grown
        self._topics[topic] = row
        rows[row, queue_id] = slot
        return slot


def _column(name: str, doc: str, *, writable: bool = True) -> property:
    """A queue's cell of the table's column `name`, read and set as an attribute of the queue."""

    def get(row: QueueRow) -> int:
        return getattr(row._table, name).item(row._slot)

    def put(row: QueueRow, value: int) -> None:
        getattr(row._table, name)[row._slot] = value

    return property(get, put if writable else None, doc=doc)


class QueueRow:
    """A queue's row of its `QueueTable` (`_table`, `_slot`), as the queue's own attributes."""

    __slots__ = ()
    _table: QueueTable
    _slot: int

    max_physic_offset = _column("max_phy", "The CommitLog end of the last real unit (-1 before one): "
                                           "`maxPhysicOffset`.")
    _write_pos = _column("write_pos", "Where in the last file the next unit goes.")
    _dirty = _column("dirty", "The last file was written since it was last synced.")
    held_bytes = _column("held", "Bytes of appends gathered and not written yet (`put_packed`'s `hold`).",
                         writable=False)


__all__ = ["NOT_HELD", "QueueRow", "QueueTable", "QueueWriter", "SlotIndex"]
