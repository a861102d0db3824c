"""Retention: which ConsumeQueue files and IndexFiles a 4.9.3 broker deletes once its CommitLog shrinks.

The broker's `CleanConsumeQueueService` (every `cleanResourceInterval` ms) runs when the CommitLog's first
offset, `minPhyOffset` (the base offset of its oldest retained segment), has moved past the last value it
cleaned for, and then, with that offset:

* each ConsumeQueue (`ConsumeQueue.deleteExpiredFile` -> `MappedFileQueue.deleteExpiredFileByOffset`):
  files are taken oldest first, never the newest; a file goes when the commit_log_offset of its LAST unit
  (bytes `mappedFileSize - 20` to the end) is below `minPhyOffset`; the first file that does not go stops
  the walk, so what goes is always a prefix. A file whose last unit is not written (the broker's
  `selectMappedBuffer` finds nothing there) stops it too. Then `correctMinOffset`: the queue's min offset
  is the first unit of its (new) first file that points at or past `minPhyOffset`, unchanged if none does;
* the IndexFiles (`IndexService.deleteExpiredFile`): nothing unless the oldest file's endPhyOffset is
  below `minPhyOffset`; then, oldest first and never the newest, each file whose endPhyOffset is below
  it, up to the first that is not.

The functions here are that rule on plain values (no I/O, no clock), and the small reads that feed it.
The daemon's clean-up (`daemon.engine.cleaner`) applies the same rule but looks every interval, not only
once the offset has moved (a queue's file that rolls after its records expired, and a pass stopped part-way,
are deleted without waiting for the broker's next deletion), and orders and paces the deletions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable

from indexcore import _failpoints
from indexcore.consumequeue import CQ_UNIT, CQ_UNIT_SIZE
from indexcore.indexservice import IndexService
from indexcore.queuefiles import ConsumeQueue

UNWRITTEN = None  # a file's last unit that no put wrote (all zeros): the walk stops there


def expired_prefix(files: int, last_unit: Callable[[int], int | None], min_phy_offset: int) -> int:
    """`MappedFileQueue.deleteExpiredFileByOffset` over a queue of `files` files: how many of the oldest go.
    `last_unit(i)` is the commit_log_offset of file i's last unit (None: not written), oldest file 0; it is
    asked for only as far as the walk goes, never for the newest file."""
    n = 0
    while n < files - 1:  # the newest file is never deleted
        last = last_unit(n)
        if last is UNWRITTEN or last >= min_phy_offset:
            break
        n += 1
    return n


def expired_index_prefix(files: int, end_phy_offset: Callable[[int], int], min_phy_offset: int) -> int:
    """`IndexService.deleteExpiredFile` over `files` IndexFiles: how many of the oldest go. `end_phy_offset(i)`
    is file i's endPhyOffset, oldest file 0; asked for only as far as the walk goes."""
    if files == 0 or end_phy_offset(0) >= min_phy_offset:
        return 0
    n = 0
    while n < files - 1 and end_phy_offset(n) < min_phy_offset:
        n += 1
    return n


def last_unit_offset(path: str, file_size: int) -> int | None:
    """The commit_log_offset of the last unit of a ConsumeQueue file, None when that unit is not written."""
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), CQ_UNIT_SIZE, file_size - CQ_UNIT_SIZE)
    if len(data) < CQ_UNIT_SIZE or not any(data):
        return UNWRITTEN
    return CQ_UNIT.unpack(data)[0]


def expired_queue_files(cq: ConsumeQueue, min_phy_offset: int) -> int:
    """How many of the queue's oldest files `ConsumeQueue.deleteExpiredFile(min_phy_offset)` deletes."""
    return len(expired_queue_prefix(cq.file_starts, lambda start: last_unit_offset(cq.file_path(start), cq.file_size),
                                    min_phy_offset))


def expired_queue_prefix(starts: list[int], last_unit: Callable[[int], int | None], min_phy_offset: int
                         ) -> list[tuple[int, int]]:
    """The files `ConsumeQueue.deleteExpiredFile(min_phy_offset)` deletes from a queue whose files start at
    `starts` (oldest first), as (start, age): `last_unit(start)` is a file's last unit's commit_log_offset
    (None: not written), asked for only as far as the walk goes. A file's age is the highest last unit of it
    and the files before it: the queue's files in the order they go, so that files of many queues sorted by
    age go oldest first and each queue still loses a prefix (a file ending in blank units, offset 0, sorts
    after the real units before it)."""
    seen: list[int | None] = []

    def last(i: int) -> int | None:
        seen.append(last_unit(starts[i]))  # the walk asks for each file once, in order
        return seen[-1]

    out: list[tuple[int, int]] = []
    age = -1
    for start, offset in zip(starts[: expired_prefix(len(starts), last, min_phy_offset)], seen, strict=False):
        age = max(age, offset)
        out.append((start, age))
    return out


def expired_index_files(service: IndexService, min_phy_offset: int) -> int:
    """How many of the oldest IndexFiles `IndexService.deleteExpiredFile(min_phy_offset)` deletes."""
    names = list(service.names)
    return expired_index_prefix(len(names), lambda i: service.end_phy_offset_of(names[i]), min_phy_offset)


def delete_expired(cq_store: Iterable[ConsumeQueue], service: IndexService | None, min_phy_offset: int
                   ) -> list[str]:
    """One clean-up pass without pacing or locking (a store nothing else writes): every expired ConsumeQueue
    file, `correctMinOffset`, then every expired IndexFile. The paths deleted, oldest first per queue."""
    deleted: list[str] = []
    for cq in cq_store:
        paths = cq.forget_oldest(expired_queue_files(cq, min_phy_offset))
        remove_files(paths)
        cq.correct_min_offset(min_phy_offset)
        deleted += paths
    if service is not None:
        paths = service.forget_oldest(expired_index_files(service, min_phy_offset))
        remove_files(paths)
        deleted += paths
    return deleted


def remove_files(paths: list[str]) -> None:
    """Delete `paths` in order, oldest first: a kill part-way leaves a queue's newer files, never a hole.
    A file already gone (a broker cleaning the same store) is not an error."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _failpoints.reached("retention.after_delete")


def disk_bytes(path: str) -> int:
    """Bytes a file holds on disk (its allocated blocks: ConsumeQueue files are sparse)."""
    return os.stat(path).st_blocks * 512


__all__ = ["UNWRITTEN", "delete_expired", "disk_bytes", "expired_index_files", "expired_index_prefix", "expired_prefix",
           "expired_queue_files", "expired_queue_prefix", "last_unit_offset", "remove_files"]
