"""What a clean-up pass (`daemon.engine.cleaner`) deletes, in which order, and how fast.

* **The plan.** Every expired ConsumeQueue file of every queue (`indexcore.retention.expired_queue_prefix`,
  the broker's rule), sorted by age: the highest commit_log_offset of its last unit and those of the files
  before it in its queue. Files of all queues go oldest first and each queue still loses a prefix, so a
  pass stopped part-way (a restart, a `kill -9`) leaves the youngest expired files, and the next life's
  first pass, which plans from the files again, deletes from where the stopped one was: no state is kept
  between lives, and none is needed.
* **What stays for a recovery.** A queue keeps the file a recovery to the checkpoint would leave as its
  newest (the last one starting below the checkpoint's offset) and the ones after it: while the checkpoint
  trails the CommitLog's first offset (a restart across a retention gap, until the new life's first
  checkpoint, which the cleaner asks for), a queue whose units past the checkpoint all point at deleted
  records would otherwise lose its place (docs/recovery.md, "Retention and recovery").
* **What it reads.** A file older than a queue's newest is written no more, so its last unit and its size
  are read once a session (`FileFacts`); a pass walks only each queue's expired prefix and the next file,
  from the cache, and reads from disk only files it has not met. File lists are taken under the dispatch
  lock, when every deferred write of the last batch is in its file.
* **The pace.** Deleting costs the disk per file (the unlink: inode, directory, journal) and per byte
  (freeing the blocks, a discard with `-o discard`); `Pace` books each deletion against two budgets,
  `retention.deleteFilesPerSecond` and `retention.deleteBytesPerSecond`, and says how long to wait before
  the next one. Measured here (ext4 with discard, virtio disk): unlinking a 6 KB ConsumeQueue file takes
  0.2-0.3 ms, a 6 MB written one 2-8 ms.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from indexcore.consumequeue import CQ_UNIT, CQ_UNIT_SIZE
from indexcore.queuefiles import ConsumeQueue
from indexcore.retention import UNWRITTEN, expired_queue_prefix

BLOCK_BYTES = 512  # st_blocks' unit
# a pace's allowance for a burst: deletions are spread over time, never more than this much of a second's
# budget at once (a group of them shares one hold of the locks)
PACE_BURST_SECONDS = 0.05
GROUP_MAX_FILES = 64
GONE = -1  # the last unit a file deleted by someone else is taken to have: below any CommitLog offset


class QueueFiles(NamedTuple):
    """A queue as a pass sees it: its file starts, taken under the dispatch lock."""

    key: tuple[str, int]
    queue: ConsumeQueue
    starts: list[int]


@dataclass(frozen=True, slots=True)
class Expired:
    """An expired ConsumeQueue file, as a pass deletes it."""

    age: int  # the highest last unit of it and the files before it in its queue: the order of deletion
    key: tuple[str, int]  # the queue (topic, queue id)
    start: int  # the file's start offset
    path: str
    size: int  # allocated bytes


class FileFacts:
    """The last unit and allocated size of files older than their queue's newest, which are written no more:
    read once, then from memory. A last unit not written is never remembered (a file that looked so while a
    batch was being written is read again the next time)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, int]] = {}
        self._first: dict[str, int] = {}  # the commit_log_offset of a file's first unit, when asked for
        self.reads = 0  # files read from disk (a test counts them)

    def facts(self, path: str, file_size: int) -> tuple[int | None, int]:
        known = self._known.get(path)
        if known is not None:
            return known
        self.reads += 1
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), CQ_UNIT_SIZE, file_size - CQ_UNIT_SIZE)
                size = os.fstat(f.fileno()).st_blocks * BLOCK_BYTES
        except FileNotFoundError:  # gone already (a broker cleaning the same store): the queue forgets it
            return GONE, 0
        if len(data) < CQ_UNIT_SIZE or not any(data):
            return UNWRITTEN, size
        self._known[path] = found = (CQ_UNIT.unpack(data)[0], size)
        return found

    def first_unit_below(self, path: str, offset: int) -> bool:
        """Whether the file's first unit is a unit (real or blank) pointing below `offset`: one that a recovery
        to a checkpoint at `offset` keeps, and with it the file (`ConsumeQueue.truncate_to`)."""
        first = self._first.get(path)
        if first is None:
            try:
                with open(path, "rb") as f:
                    data = os.pread(f.fileno(), CQ_UNIT_SIZE, 0)
            except FileNotFoundError:
                return False
            if len(data) < CQ_UNIT_SIZE:
                return False
            phy, size, _ = CQ_UNIT.unpack(data)
            if phy < 0 or size <= 0:  # not written yet: nothing is known of it
                return False
            self._first[path] = first = phy
        return first < offset

    def forget(self, path: str) -> None:
        self._known.pop(path, None)
        self._first.pop(path, None)


def expired_queue_plan(queues: Iterable[QueueFiles], min_phy_offset: int, facts: FileFacts,
                       recover_to: int | None = None) -> tuple[list[Expired], list[Expired]]:
    """Every expired file of `queues` a pass deletes, oldest first over all of them; and those it keeps for
    a recovery.

    With `recover_to`, the offset a recovery after a kill would cut the output back to (the checkpoint's):
    a queue keeps the file that recovery would leave as its newest, the last one starting below that
    offset, and the ones after it (a queue loses only a prefix), so a kill never costs a queue its place.
    The queue's other expired files hold no unit a recovery needs: their units point below the CommitLog's
    first offset, and their records are not dispatched again."""
    plan: list[Expired] = []
    held: list[Expired] = []
    for q in queues:
        if len(q.starts) < 2:
            continue
        cq, starts, size = q.queue, q.starts, q.queue.file_size

        def last_unit(start: int, cq=cq, size=size) -> int | None:
            return facts.facts(cq.file_path(start), size)[0]

        prefix = expired_queue_prefix(starts, last_unit, min_phy_offset)
        n = len(prefix)
        if recover_to is not None:
            n = 0
            while n < len(prefix) and facts.first_unit_below(cq.file_path(starts[n + 1]), recover_to):
                n += 1
        for i, (start, age) in enumerate(prefix):
            path = cq.file_path(start)
            (plan if i < n else held).append(Expired(age, q.key, start, path, facts.facts(path, size)[1]))
    plan.sort(key=lambda e: (e.age, e.key, e.start))
    return plan, held


class Pace:
    """Books deletions against a files-per-second and a bytes-per-second budget (0: no limit) and says how
    long to wait before the ones booked may go: a generic cell rate, one clock per budget, a burst of at
    most PACE_BURST_SECONDS of each."""

    def __init__(self, files_per_second: float, bytes_per_second: float, clock: Callable[[], float]):
        self.rates = (files_per_second, bytes_per_second)
        self._clock = clock
        self._due = [clock(), clock()]  # when each budget has paid for everything booked so far

    def book(self, files: int, nbytes: int) -> float:
        """Book `files` deletions of `nbytes`; the seconds to wait before doing them."""
        now = self._clock()
        wait = 0.0
        for i, (amount, rate) in enumerate(zip((files, nbytes), self.rates, strict=True)):
            if rate <= 0 or amount <= 0:
                continue
            self._due[i] = max(self._due[i], now) + amount / rate
            wait = max(wait, self._due[i] - now - PACE_BURST_SECONDS)
        return wait

    def group(self, plan: list[Expired], at: int) -> int:
        """How many of the plan's files from `at` to take at once: a burst's worth, at least one."""
        files_rate, bytes_rate = self.rates
        most = GROUP_MAX_FILES
        if files_rate > 0:
            most = max(1, min(most, int(files_rate * PACE_BURST_SECONDS)))
        n, nbytes = 0, 0
        for e in plan[at : at + most]:
            if n and bytes_rate > 0 and nbytes + e.size > bytes_rate * PACE_BURST_SECONDS:
                break
            n += 1
            nbytes += e.size
        return n


__all__ = ["Expired", "FileFacts", "Pace", "QueueFiles", "expired_queue_plan"]
