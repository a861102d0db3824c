"""One ConsumeQueue searched by store time: the broker's `searchOffset` (4.9.3's
`ConsumeQueue.getOffsetInQueueByTime`, step by step: `query offset`) and reputd's own bounds of a time window
(`query time`, daemon/commands/timequery.py).

A unit holds no time; its record's STORETIMESTAMP is read from the CommitLog, one record head per step
(`indexcore.recordhead`), so a search costs O(log n) CommitLog reads and never reads the queue through.
Like every binary search over store times (the broker's included) it rests on one premise: in a queue,
store times do not go down. The broker stamps them in CommitLog order under its put lock from its wall
clock, so they hold unless that clock is stepped back. Every time read is kept, and `out_of_order` says
when two of them contradict the premise; the window query then reads that queue through (`scan_times`).

The queue is looked at as the broker's recovery leaves it, without reading its files through: the write
position found by bisection in the newest file (`consumequeue.written_units`), the files retention expired
left out and the first retained unit found by bisection (`correctMinOffset`), each in a few reads.
"""

from __future__ import annotations

import bisect
import os
from typing import NamedTuple

from daemon.commands.query import _unit_damage, _unit_fault, check_queue, is_removed, open_commit_log
from daemon.config import Config
from indexcore.commitlog import is_record_start
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CQ_UNIT, CQ_UNIT_SIZE, ConsumeQueueUnit, written_units
from indexcore.errors import CorruptRecordError
from indexcore.mappedfile import check_sizes, list_queue_files
from indexcore.reader import CommitLog
from indexcore.recordhead import HEAD_READ_SIZE, RecordHead, decode_head, decode_tail
from indexcore.retention import expired_prefix


class LogHeads:
    """Reads record heads (and tails) from a CommitLog, plain or DLedger, one `pread` each, through
    descriptors kept open; `reads` counts the CommitLog reads made."""

    def __init__(self, log: CommitLog, max_message_size: int):
        self.log = log
        self.max_message_size = max_message_size
        self.reads = 0
        self._fds: dict[str, int] = {}

    def _pread(self, offset: int, size: int) -> bytes:
        path = self.log.find_segment(offset)
        if path is None:
            return b""
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        self.reads += 1
        return os.pread(fd, size, offset - self.log.segment_start(offset))

    def head_bytes(self, offset: int, size: int) -> bytes:
        """The first bytes of the `size`-byte record at `offset`: its head, and the whole record when it is
        no longer than a head's read."""
        return self._pread(offset, min(size, HEAD_READ_SIZE))

    def topic_and_properties(self, offset: int, head: RecordHead, data: bytes) -> tuple[bytes, bytes]:
        """(topic, properties) of the record whose head `head` was read with `data`: from `data` when it
        holds the record's tail, else with one more read of the tail alone (never the body)."""
        if len(data) >= head.total_size:
            return decode_tail(memoryview(data)[head.tail_at : head.total_size], head.magic)
        return decode_tail(self._pread(offset + head.tail_at, head.total_size - head.tail_at), head.magic)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class Probe(NamedTuple):
    """A unit read by a search: its queue offset, the unit, and its record's store time (None: no message
    to read, a blank unit or one retention removed)."""

    queue_offset: int
    unit: ConsumeQueueUnit
    store_timestamp: int | None


class QueueTimes:
    """One queue's units and their store times, read as a search needs them. Raises CorruptEntryError (the
    unit) or CorruptRecordError (the CommitLog) on damage, naming the file, entry and field."""

    def __init__(self, config: Config, directory: str, topic: str, queue_id: int, log: CommitLog, heads: LogHeads):
        self.config, self.directory, self.topic, self.queue_id = config, directory, topic, queue_id
        self.file_size = file_size = config.store.mapped_file_size_consume_queue
        self.log, self.heads = log, heads
        self.probes: dict[int, Probe] = {}
        self.reads = 0  # CommitLog reads for this queue
        files = list_queue_files(directory, temporaries=True)
        if files and os.path.getsize(files[-1][1]) == 0:  # a creation cut short: the broker's load drops it
            files.pop()
        check_sizes(files, file_size)
        self._fds: dict[int, int] = {}
        self.all_files = [start for start, _ in files]
        self._paths = dict(files)
        per_file = file_size // CQ_UNIT_SIZE
        if not files:
            self.min_offset = self.max_offset = 0
            self.files: list[int] = []
            self.removed = 0
            return
        newest = written_units(files[-1][1])
        self.max_offset = (files[-1][0] + newest * CQ_UNIT_SIZE) // CQ_UNIT_SIZE
        self._check_end(files[-1][0], newest)
        first = log.min_offset
        # the files the broker's clean-up deletes once the CommitLog starts at `first` (indexcore.retention)
        gone = expired_prefix(len(files), lambda i: self._last_unit_offset(files[i][0]), first) \
            if len(files) > 1 and first > 0 else 0
        self.files = self.all_files[gone:]
        lo = self.files[0] // CQ_UNIT_SIZE
        hi = min(lo + per_file, self.max_offset)
        if first > 0:  # `correctMinOffset`: the first unit pointing at or past the CommitLog's first offset
            self.min_offset = bisect.bisect_left(range(lo, hi), True,
                                                 key=lambda i: self.unit(i).commit_log_offset >= first) + lo
        else:
            self.min_offset = lo
        # units whose records retention deleted: before min_offset in its file, past its pre-blank units
        blanks = bisect.bisect_left(range(lo, self.min_offset), False, key=lambda i: self.is_blank(self.unit(i)))
        self.removed = self.min_offset - lo - blanks

    def _check_end(self, start: int, written: int) -> None:
        """The newest file's write position was found by bisection: when it stops at an invalid unit that
        written units follow (looked at 1, 2, 4, ... units on), the file is damaged there, as the broker's
        recovery would find it (`QueueRecovery._recover`); a unit a kill left torn is followed by zeros."""
        per_file = self.file_size // CQ_UNIT_SIZE
        step = 1
        while written + step < per_file:
            u = self.units_in(start, written + step)
            if u.commit_log_offset >= 0 and u.msg_size > 0:
                bad = self.units_in(start, written)
                field, value = (("commit_log_offset", bad.commit_log_offset) if bad.commit_log_offset < 0
                                else ("msg_size", bad.msg_size))
                raise _unit_damage(self, start // CQ_UNIT_SIZE + written, field,
                                   f"{value} makes it no valid unit, and written units follow it")
            step *= 2

    def units_in(self, start: int, index: int) -> ConsumeQueueUnit:
        """Unit `index` of the file starting at `start`, whatever the queue's bounds."""
        return ConsumeQueueUnit(*CQ_UNIT.unpack(os.pread(self._file_fd(start), CQ_UNIT_SIZE, index * CQ_UNIT_SIZE)))

    def _last_unit_offset(self, start: int) -> int | None:
        """The commit_log_offset of the last unit of a full file, None when it is not written (all zeros),
        as `indexcore.retention.last_unit_offset` reads it."""
        u = self.unit((start + self.file_size) // CQ_UNIT_SIZE - 1)
        return None if u == (0, 0, 0) else u.commit_log_offset

    @staticmethod
    def is_blank(u: ConsumeQueueUnit) -> bool:
        return u.commit_log_offset == 0 and u.msg_size == BLANK_UNIT_MSG_SIZE

    # --- units -------------------------------------------------------------------------------------

    def _file_fd(self, start: int) -> int:
        fd = self._fds.get(start)
        if fd is None:
            fd = self._fds[start] = os.open(self._paths[start], os.O_RDONLY)
        return fd

    def units(self, queue_offset: int, count: int) -> list[ConsumeQueueUnit]:
        """Up to `count` units from `queue_offset`, within the file holding it and below max_offset."""
        logical = queue_offset * CQ_UNIT_SIZE
        start = logical - logical % self.file_size
        count = min(count, self.max_offset - queue_offset, (start + self.file_size - logical) // CQ_UNIT_SIZE)
        if count <= 0 or start not in self._paths:
            return []
        data = os.pread(self._file_fd(start), count * CQ_UNIT_SIZE, logical - start)
        return [ConsumeQueueUnit(*u) for u in CQ_UNIT.iter_unpack(data[: len(data) - len(data) % CQ_UNIT_SIZE])]

    def unit(self, queue_offset: int) -> ConsumeQueueUnit:
        """The unit at `queue_offset` (one read; a search step's)."""
        logical = queue_offset * CQ_UNIT_SIZE
        start = logical - logical % self.file_size
        data = os.pread(self._file_fd(start), CQ_UNIT_SIZE, logical - start) if start in self._paths else b""
        if len(data) < CQ_UNIT_SIZE or queue_offset >= self.max_offset:
            raise _unit_damage(self, queue_offset, "commit_log_offset", "the unit is not there (the file ends)")
        return ConsumeQueueUnit._make(CQ_UNIT.unpack(data))

    # --- store times -------------------------------------------------------------------------------

    def head(self, queue_offset: int, u: ConsumeQueueUnit) -> tuple[RecordHead | None, bytes]:
        """The head of the unit's record (and the bytes read), None for a unit with no message to read: a
        blank unit, or one whose segment retention deleted. Damage is raised: of the unit when no record of
        its size starts where it points, of the CommitLog when the record there is damaged."""
        phy = u.commit_log_offset
        if self.is_blank(u) or is_removed(self.log, phy):
            return None, b""
        fault = _unit_fault(self.config, self.log, self, queue_offset, u)
        if fault is not None:
            raise fault
        before = self.heads.reads
        data = self.heads.head_bytes(phy, u.msg_size)
        self.reads += self.heads.reads - before
        if not is_record_start(data, phy):
            raise _unit_damage(self, queue_offset, "commit_log_offset", f"no record starts at CommitLog offset {phy}")
        try:
            head = decode_head(data, self.config.store.max_message_size)
        except CorruptRecordError as e:
            raise e.located(self.log.find_segment(phy) or "", phy) from None
        if head.total_size != u.msg_size:
            raise _unit_damage(self, queue_offset, "msg_size", f"{u.msg_size}, the record at CommitLog offset {phy} "
                                                               f"is {head.total_size} bytes")
        return head, data

    def probe(self, queue_offset: int) -> Probe:
        """The unit at `queue_offset` and its store time, read once and kept."""
        p = self.probes.get(queue_offset)
        if p is None:
            u = self.unit(queue_offset)
            head, _ = self.head(queue_offset, u)
            p = self.probes[queue_offset] = Probe(queue_offset, u, None if head is None else head.store_timestamp)
        return p

    def lower_bound(self, timestamp: int, from_offset: int = -1, lo: int | None = None, hi: int | None = None) -> int:
        """The first queue offset in [lo, hi) whose message is stored at or after `timestamp` (at
        `timestamp` itself, at or past CommitLog offset `from_offset`), hi when none is: a binary search. A
        unit without a message to read counts as before any time (such units only lead a queue)."""
        lo = self.min_offset if lo is None else lo
        hi = self.max_offset if hi is None else hi
        while lo < hi:
            mid = (lo + hi) // 2
            p = self.probe(mid)
            if p.store_timestamp is None or (p.store_timestamp, p.unit.commit_log_offset) < (timestamp, from_offset):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def gallop(self, start: int, step: int) -> None:
        """Probe units at growing distances from `start` (1, 2, 4, ... units, `step` giving the direction) to
        the end of the queue: O(log n) more reads, for `out_of_order` to see a step of the clock the
        bisection did not meet (a message stored in the window beyond one of its ends, say)."""
        distance = 1
        while self.min_offset <= (q := start + step * distance) < self.max_offset:
            self.probe(q)
            distance *= 2

    def out_of_order(self) -> tuple[Probe, Probe] | None:
        """Two probes whose store times go down from the lower queue offset to the higher, or None."""
        last = None
        for q in sorted(self.probes):
            p = self.probes[q]
            if p.store_timestamp is None:
                continue
            if last is not None and p.store_timestamp < last.store_timestamp:
                return last, p
            last = p
        return None

    def scan_times(self) -> list[Probe]:
        """Every unit from min_offset with its store time, read in order: the answer when store times go
        down in the queue (O(n) CommitLog reads, kept as probes)."""
        out = []
        q = self.min_offset
        while q < self.max_offset:
            chunk = self.units(q, 1024)
            if not chunk:
                break
            for u in chunk:
                p = self.probes.get(q)
                if p is None:
                    head, _ = self.head(q, u)
                    p = self.probes[q] = Probe(q, u, None if head is None else head.store_timestamp)
                out.append(p)
                q += 1
        return out

    # --- the broker's searchOffset ------------------------------------------------------------------

    def last_unit_time(self, start: int) -> int | None:
        end = min(start + self.file_size, self.max_offset * CQ_UNIT_SIZE)
        return self.probe(end // CQ_UNIT_SIZE - 1).store_timestamp if end > start else None

    def search_offset(self, timestamp: int) -> tuple[int, int]:
        """4.9.3's `getOffsetInQueueByTime(timestamp)`, and the file it searched (its start).

        The file: the first whose modification time is at or after `timestamp`, else the newest
        (`getMappedFileByTime`); reputd takes the store time of the file's last unit instead (what its
        modification time stands for: a file is last modified when its last unit is put, a few
        milliseconds after the message is stored), as a copy or a rebuild changes modification times. One
        read per file looked at (a queue of 16M units has 54 files of the default size).
        Then the broker's binary search over that file, step for step: an exact store time ends it at
        whichever unit it meets first; otherwise the nearer of the last units tried on each side (the
        earlier on a tie), the file's first when every unit is later and its last when every one is
        earlier. A unit below the CommitLog's first offset counts as earlier without being read (and is no
        side's value); so does a blank unit, where the broker would return 0."""
        if not self.files:
            return 0, 0
        # the files oldest first, as the broker walks them: one read of each file's last unit until one fits
        chosen = next((s for s in self.files[:-1] if _at_or_after(self.last_unit_time(s), timestamp)), self.files[-1])
        low = max(self.min_offset * CQ_UNIT_SIZE - chosen, 0)
        high = min(self.file_size, self.max_offset * CQ_UNIT_SIZE - chosen) - CQ_UNIT_SIZE
        target = left = right = -1
        left_value = right_value = -1
        while high >= low:
            mid = (low + high) // (2 * CQ_UNIT_SIZE) * CQ_UNIT_SIZE
            p = self.probe((chosen + mid) // CQ_UNIT_SIZE)
            if p.store_timestamp is None:
                low, left = mid + CQ_UNIT_SIZE, mid
                continue
            if p.store_timestamp == timestamp:
                target = mid
                break
            if p.store_timestamp > timestamp:
                high, right, right_value = mid - CQ_UNIT_SIZE, mid, p.store_timestamp
            else:
                low, left, left_value = mid + CQ_UNIT_SIZE, mid, p.store_timestamp
        if target != -1:
            offset = target
        elif left_value == -1:
            offset = right
        elif right_value == -1:
            offset = left
        else:
            offset = right if abs(timestamp - left_value) > abs(timestamp - right_value) else left
        return _java_div(chosen + offset, CQ_UNIT_SIZE), chosen

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class OffsetResult(NamedTuple):
    """`query offset`: the broker's answer (`queue_offset`, found in the file starting at `file_start`),
    the store time of the unit there (None past the queue's units), the first unit stored at or after the
    time (`first_at_or_after`), the queue's bounds, the CommitLog reads, and two units out of order when met."""

    queue_offset: int
    store_timestamp: int | None
    first_at_or_after: int
    min_offset: int
    max_offset: int
    file_start: int
    reads: int
    out_of_order: tuple[Probe, Probe] | None


def query_offset(config: Config, topic: str, queue_id: int, timestamp: int) -> OffsetResult:
    """The queue offset the broker's `searchOffset` (4.9.3 `getOffsetInQueueByTime`) gives for `timestamp`."""
    check_queue(config, topic, queue_id)
    log = open_commit_log(config)
    heads = LogHeads(log, config.store.max_message_size)
    qt = QueueTimes(config, os.path.join(config.output.dir, "consumequeue", topic, str(queue_id)), topic, queue_id,
                    log, heads)
    try:
        offset, file_start = qt.search_offset(timestamp)
        at = qt.probe(offset).store_timestamp if qt.min_offset <= offset < qt.max_offset else None
        first = qt.lower_bound(timestamp)
        return OffsetResult(offset, at, first, qt.min_offset, qt.max_offset, file_start, qt.reads, qt.out_of_order())
    finally:
        qt.close()
        heads.close()



def _at_or_after(store_timestamp: int | None, timestamp: int) -> bool:
    return store_timestamp is not None and store_timestamp >= timestamp


def _java_div(a: int, b: int) -> int:
    """Java's long division: truncated toward zero."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


__all__ = ["LogHeads", "OffsetResult", "Probe", "QueueTimes", "query_offset"]
