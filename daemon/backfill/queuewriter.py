"""Phase 2 of the backfill, ConsumeQueue part: the tasks that build whole queues from the ranges' staged units.

A task is given a span of queue buckets (`QueueWork`, balanced by units over the tasks). Every range staged its
units queue after queue in bucket order (`stage.py`), so a span is one slice of each range's units.data. The
task cuts its span into pieces of at most WRITE_PIECE_UNITS units, reads a piece's slice of every range at once
(in CommitLog order) and regroups the units queue by queue (`stage.regroup`: one scatter). A queue whose units
all came in one piece is written straight where `place_units` puts them (the broker's rules: pre-blank,
repeats, out-of-order appends, offset-0 appends of multi-dispatch units), each file created, sized and written
in a few calls; a queue too large for a piece goes through a `ConsumeQueue` kept open over its reads. Nothing
is held or called per queue and range: 16,000 queues over 56 ranges cost what 64 do, but for each queue's
files. LMQ queues (`%LMQ%name`, queue 0) are queues like any other.

Queues are staged as STAGE/consumequeue/N/ (N: the queue's number in the task, so no directory per topic is
made by every task) and the driver renames each into place (`commit.commit_queue_dir`). Nothing is synced
until the task's end, then the files written: their file system once (syncfs) from SYNC_WHOLE_FS_FILES files,
each file otherwise. The task's result is the queues it staged as a few lists (`StagedQueues`), not an object
per queue.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from daemon.backfill.commit import SYNC_WHOLE_FS_FILES
from daemon.backfill.stage import StagedRange, StagedUnits, queue_numbers, regroup
from daemon.backfill.writers import Attempt, Fault, WriteStats
from indexcore.consumequeue import (
    BLANK_UNIT,
    CONSUME_QUEUE_DIR,
    CQ_UNIT_DTYPE,
    CQ_UNIT_SIZE,
    PutStats,
    QueueCursor,
    place_units,
)
from indexcore.mappedfile import offset_to_file_name, pwrite_all, sync_file
from indexcore.mappedfile import sync_file_system as _sync_file_system
from indexcore.openfiles import OpenFiles
from indexcore.queuefiles import ConsumeQueue
from indexcore.queuestore import open_queue_files_limit

# Units a task gathers from the ranges at a time (~110 bytes of arrays each while they are regrouped: ~30 MB), so
# that its memory does not grow with the CommitLog; a bucket holding more is read a few ranges at a time.
WRITE_PIECE_UNITS = 1 << 18


@dataclass(frozen=True, slots=True)
class QueueWork:
    ranges: tuple[str, ...]  # the dispatched ranges' staging directories, in CommitLog order
    buckets: tuple[int, int]  # [first, end) of the queue buckets (stage.queue_bucket) whose queues this task writes


class StagedQueue(NamedTuple):
    topic: str
    queue_id: int
    directory: str
    first_phy: int  # CommitLog offset of the queue's first unit in this backfill
    files: int
    span: tuple[int, int] | None  # [first, end) queue bytes its units were put in; None: not recorded (read all)


@dataclass(slots=True)
class StagedQueues:
    """The queues one task staged, as lists (what crosses to the driver is one of these per task, not an
    object per queue): queue i is (topics[topic[i]], queue_id[i]), staged in root/i/; its units were put in
    the queue's bytes [lo[i], hi[i]) (its files hold nothing else but pre-blanks: what a commit into an output
    that has the queue reads and compares), lo[i] -1 when not recorded."""

    root: str
    topics: list[str] = field(default_factory=list)
    topic: list[int] = field(default_factory=list)
    queue_id: list[int] = field(default_factory=list)
    first_phy: list[int] = field(default_factory=list)
    files: list[int] = field(default_factory=list)
    lo: list[int] = field(default_factory=list)
    hi: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.topic)

    def __iter__(self) -> Iterator[StagedQueue]:
        for n, (t, q, phy, files, lo, hi) in enumerate(zip(self.topic, self.queue_id, self.first_phy, self.files,
                                                           self.lo, self.hi, strict=True)):
            yield StagedQueue(self.topics[t], q, os.path.join(self.root, str(n)), phy, files,
                              None if lo < 0 else (lo, hi))


class Gathered(NamedTuple):
    """A piece's units from its ranges, queue after queue, each queue's in CommitLog order: queue i is
    (task topic topic[i], queue_id[i]) and holds units start[i]:start[i + 1]."""

    topic: np.ndarray
    queue_id: np.ndarray
    start: np.ndarray
    units: np.ndarray  # CQ_UNIT_DTYPE
    qo: np.ndarray
    ends: np.ndarray
    one_streak: np.ndarray  # per queue (`QueueUnits.one_streak`)


def pieces(tables: list[StagedUnits], buckets: tuple[int, int]) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
    """A span of buckets cut into pieces of at most WRITE_PIECE_UNITS units over all ranges (a bucket holding
    more is a piece of its own): (first bucket, end bucket, the [first, end) ranges of each read of it)."""
    b0, b1 = buckets
    edges = np.arange(b0, b1 + 1)
    before = np.array([m.start[np.searchsorted(m.bucket, edges)] for m in tables], dtype=np.int64).reshape(
        len(tables), len(edges))  # units of each range before each edge
    total = before.sum(axis=0)
    at = 0
    while at < len(edges) - 1:
        end = max(at + 1, int(np.searchsorted(total, total[at] + WRITE_PIECE_UNITS, side="right")) - 1)
        if total[end] > total[at]:
            reads, first, units = [], 0, 0
            for r, n in enumerate((before[:, end] - before[:, at]).tolist()):
                if units and units + n > WRITE_PIECE_UNITS:
                    reads.append((first, r))
                    first, units = r, 0
                units += n
            reads.append((first, len(tables)))
            yield int(edges[at]), int(edges[end]), reads
        at = end


def gather(ranges: list[StagedRange], tables: list[StagedUnits], b0: int, b1: int, topics: dict[str, int],
           to_task: list[np.ndarray]) -> Gathered:
    """The units of buckets [b0, b1) in `ranges`, regrouped queue by queue; topics are numbered by `topics`
    (the task's, added to), each range's topic numbers mapped to them by its `to_task` (-1: not mapped yet)."""
    units, qo, q_topic, q_id, counts = [], [], [], [], []
    for r, m, mapped in zip(ranges, tables, to_task, strict=True):
        qa, qb = (int(x) for x in np.searchsorted(m.bucket, (b0, b1)))
        if qa == qb:
            continue
        lo, hi = int(m.start[qa]), int(m.start[qb])
        units.append(r.units(lo, hi))
        qo.append(m.queue_offsets(lo, hi))
        piece_topics = mapped[m.topic[qa:qb]]
        if (piece_topics < 0).any():  # topics of this range met for the first time
            new = np.unique(m.topic[qa:qb][piece_topics < 0]).tolist()
            for t in new:
                mapped[t] = topics.setdefault(m.topics[t], len(topics))
            piece_topics = mapped[m.topic[qa:qb]]
        q_topic.append(piece_topics)
        q_id.append(m.queue_id[qa:qb])
        counts.append(np.diff(m.start[qa : qb + 1]))
    topic, queue_id, queue_of = queue_numbers(np.concatenate(q_topic), np.concatenate(q_id), len(topics))
    grouped, grouped_qo, start = regroup(np.concatenate(units), np.concatenate(qo), queue_of, np.concatenate(counts),
                                         len(topic))
    cq_units = grouped.view(CQ_UNIT_DTYPE)
    ends = cq_units["commit_log_offset"].astype(np.int64) + cq_units["msg_size"]
    # breaks[i]: streak breaks among units 1..i-1 (a unit whose offset does not follow, or whose end does not grow)
    breaks = np.zeros(len(ends) + 1, dtype=np.int64)
    breaks[2:] = (np.diff(grouped_qo) != 1) | (np.diff(ends) <= 0)
    np.cumsum(breaks, out=breaks)
    one_streak = breaks[start[1:]] == breaks[start[:-1] + 1]
    return Gathered(topic, queue_id, start, cq_units, grouped_qo, ends, one_streak)


class QueueWriter:
    """One task's queues, staged as STAGE/consumequeue/N/ (N the queue's number in the task: no directory per
    topic, which each task would make again): a queue read whole in one piece is written straight from
    `place_units`' placements, each file in one call; one read in several pieces goes through a ConsumeQueue
    kept open between them. Nothing is synced before `finish`."""

    def __init__(self, stage_dir: str, file_size: int):
        self.root = os.path.join(stage_dir, CONSUME_QUEUE_DIR)
        os.makedirs(self.root, exist_ok=True)
        self.file_size = file_size
        self.staged = StagedQueues(self.root)
        self.topics: dict[str, int] = {}  # the task's topic numbers (`gather`)
        self.stats = PutStats()
        self.unsynced: list[str] = []
        self._open: dict[tuple[int, int], tuple[ConsumeQueue, int]] = {}  # read in pieces: (queue, first unit)
        self._open_files: OpenFiles | None = None

    def put(self, g: Gathered, close: bool) -> None:
        """Put each queue's units of `g`; `close`: no later read has units of them, so each is written whole."""
        start = g.start.tolist()
        topic, queue_id, streak = g.topic.tolist(), g.queue_id.tolist(), g.one_streak.tolist()
        phy = g.units["commit_log_offset"][g.start[:-1]].tolist()
        names = list(self.topics)
        for i, (t, q) in enumerate(zip(topic, queue_id, strict=True)):
            lo, hi = start[i], start[i + 1]
            if close and (t, q) not in self._open:
                files, span = self._write_whole(self._directory(), g.qo[lo:hi], g.units[lo:hi], g.ends[lo:hi],
                                                streak[i])
                self._staged(t, q, phy[i], files, span)
                continue
            if (t, q) not in self._open:
                if self._open_files is None:
                    self._open_files = OpenFiles(open_queue_files_limit())
                cq = ConsumeQueue(self._directory(), names[t], q, self.file_size, open_files=self._open_files,
                                  new=True)
                self._open[(t, q)] = (cq, phy[i])
                self._staged(t, q, phy[i], 0, (-1, -1))  # its files counted when it is closed (`close_all`)
            cq = self._open[(t, q)][0]
            cq.put_packed(g.qo[lo:hi], g.units[lo:hi], g.ends[lo:hi], streak[i], stats=self.stats)

    def _directory(self) -> str:
        return os.path.join(self.root, str(len(self.staged)))

    def _staged(self, topic: int, queue_id: int, first_phy: int, files: int, span: tuple[int, int]) -> None:
        s = self.staged
        s.topic.append(topic)
        s.queue_id.append(queue_id)
        s.first_phy.append(first_phy)
        s.files.append(files)
        s.lo.append(span[0])
        s.hi.append(span[1])

    def _write_whole(self, directory: str, qo: np.ndarray, units: np.ndarray, ends: np.ndarray,
                     streak: bool) -> tuple[int, tuple[int, int]]:
        """Write a new queue's units in its directory, where `place_units` (the broker's put rules, from an empty
        queue) places them: each file created, sized and written in one call; the files made and the queue
        bytes [first, end) the units were put in."""
        os.mkdir(directory)
        files: list[tuple[str, list[tuple[int, object]]]] = []  # each file's pieces: (position, bytes)
        first, end = -1, -1
        for p in place_units(QueueCursor(), qo, ends, self.file_size, self.stats, streak):
            if p.created:
                files.append((os.path.join(directory, offset_to_file_name(p.file_start)), []))
            pieces = files[-1][1]
            at = p.logical - p.file_start
            if p.blanks:
                pieces.append((at - p.blanks * CQ_UNIT_SIZE, BLANK_UNIT * p.blanks))
            if p.last > p.first:
                pieces.append((at, units[p.first : p.last]))
                first = p.logical if first < 0 else min(first, p.logical)
                end = max(end, p.logical + (p.last - p.first) * CQ_UNIT_SIZE)
        for path, pieces in files:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.ftruncate(fd, self.file_size)
                _write_pieces(fd, pieces, path)
            finally:
                os.close(fd)
            self.unsynced.append(path)
        return len(files), (first, end) if first >= 0 else (0, 0)

    def close_all(self) -> None:
        """Close the queues read in pieces, their last files' syncs left to `finish`."""
        for cq, _ in self._open.values():
            if cq.dirty:
                self.unsynced.append(cq.writing_path)
                cq.mark_synced()
            cq.close()
            self.staged.files[int(os.path.basename(cq.directory))] = cq.file_count
        self._open.clear()

    def finish(self) -> StagedQueues:
        """Sync what was written: before the driver links it into the output."""
        self.close_all()
        if self._open_files is not None:
            self._open_files.close()
        self.staged.topics = list(self.topics)
        if len(self.unsynced) >= SYNC_WHOLE_FS_FILES:
            _sync_file_system(self.root)
        else:
            for path in self.unsynced:
                sync_file(path)
        return self.staged


def _write_pieces(fd: int, pieces: list[tuple[int, object]], path: str) -> None:
    """Write each run of adjacent pieces with one pwritev (the pre-blank header and the units, say)."""
    i = 0
    while i < len(pieces):
        position, run = pieces[i][0], [memoryview(pieces[i][1]).cast("B")]
        end = position + run[0].nbytes
        i += 1
        while i < len(pieces) and pieces[i][0] == end:
            run.append(memoryview(pieces[i][1]).cast("B"))
            end += run[-1].nbytes
            i += 1
        written = os.pwritev(fd, run, position)
        if written < end - position:  # cut short (no room): the rest as one write, which raises naming the file
            pwrite_all(fd, b"".join(run)[written:], position + written, path)


def write_queues(work: QueueWork, *, stage_dir: str, file_size: int, attempt: Attempt,
                 fault: Fault | None = None) -> tuple[WriteStats, StagedQueues]:
    """Build the queues of `work` in `stage_dir`, piece after piece of its buckets."""
    stats = WriteStats()
    started = time.perf_counter()
    writer = QueueWriter(stage_dir, file_size)
    ranges = [StagedRange(d) for d in work.ranges]
    try:
        tables = [r.unit_table() for r in ranges]
        to_task = [np.full(len(m.topics), -1, dtype=np.int64) for m in tables]
        for b0, b1, reads in pieces(tables, work.buckets):
            for r0, r1 in reads:
                writer.put(gather(ranges[r0:r1], tables[r0:r1], b0, b1, writer.topics, to_task[r0:r1]),
                           close=len(reads) == 1)
                for r in ranges[r0:r1]:
                    r.release()  # the units read leave the task's RSS (the page cache keeps them)
            writer.close_all()
        staged = writer.finish()
    finally:
        for r in ranges:
            r.close()
    stats.queues = len(staged)
    stats.units = writer.stats.written
    stats.already_built = writer.stats.already_built
    stats.gap_blanks = writer.stats.gap_blanks
    stats.seconds = time.perf_counter() - started
    if fault is not None:
        fault.check("consumequeue", "staged", attempt.attempt_number)
    return stats, staged
