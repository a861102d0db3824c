"""Putting a task attempt's files into the output: staged first, then linked into place, never clobbered.

Each task attempt writes its files under `{out}/.reputd-backfill/{job}/{attempt}/`, outside
`consumequeue/` and `index/` (whose loaders refuse foreign names), and only when the attempt has
written all of them does it link each into place. A failed, retried or speculative attempt therefore
leaves nothing partial in the output: its staging directory is removed, and the job removes the whole
staging tree when it ends.

A queue the output does not hold yet is put in place whole, its directory renamed (`rename(2)` of a
directory fails when one with entries is there). Any other file is put in place with `link(2)`, which fails
instead of replacing a file that exists; the file that exists is never replaced, since someone may have it
mapped (a live daemon writing the same ConsumeQueue). Then:
* a ConsumeQueue file is *merged*: every real unit of the staged file must land on a pre-blank unit
  (0, 0x7FFFFFFF, 0) or on the same unit, and is written in place. This is how a backfill fills the
  blank head of the first file of a daemon that started later in the same queue; a zero (unwritten)
  unit or a different one is refused, naming the file and queue offset;
* an IndexFile must be byte-identical (the same file committed by an earlier attempt or run).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable

import numpy as np

from daemon.backfill.plan import BackfillError
from indexcore.consumequeue import BLANK_UNIT, CQ_UNIT_SIZE
from indexcore.indexfile import (
    FIRST_INDEX,
    HASH_SLOT_SIZE,
    INDEX_ENTRY_DTYPE,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER_SIZE,
    IndexHeader,
)
from indexcore.mappedfile import SYNCFS_MIN_FILES, list_queue_files, pwrite_all, sync_file, sync_file_system

STAGING_DIR = ".reputd-backfill"
_COMPARE_BYTES = 1 << 22
# From this many files written (the queue writer's tasks, the commit's merges), their file system is synced once
SYNC_WHOLE_FS_FILES = SYNCFS_MIN_FILES

LINKED, MERGED, PRESENT = "linked", "merged", "present"


def file_counts() -> dict[str, int]:
    """Files committed, by outcome, all zero."""
    return {LINKED: 0, MERGED: 0, PRESENT: 0}


def staging_root(output_dir: str, job_id: str) -> str:
    return os.path.join(output_dir, STAGING_DIR, job_id)


def attempt_dir(output_dir: str, job_id: str, phase: str, partition: int, attempt_id: int) -> str:
    """A directory of its own for one task attempt."""
    return os.path.join(staging_root(output_dir, job_id), f"{phase}-p{partition}-a{attempt_id}")


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    parent = os.path.dirname(path)
    if os.path.basename(parent) == STAGING_DIR:
        with contextlib.suppress(OSError):
            os.rmdir(parent)  # only when no other job stages there


def _link(staged: str, final: str) -> bool:
    """Put `staged` at `final` unless a file is there; True when it was put."""
    os.makedirs(os.path.dirname(final), exist_ok=True)
    try:
        os.link(staged, final)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        # a file system without hard links: check, then rename (no longer atomic against a racing creator)
        if os.path.exists(final):
            return False
        os.rename(staged, final)
        return True
    os.unlink(staged)
    return True


def _rename_dir(staged: str, final: str) -> bool:
    """Put the directory `staged` at `final` unless a directory with entries (or anything else) is there."""
    for attempt in (0, 1):
        try:
            os.rename(staged, final)
            return True
        except FileNotFoundError:
            if attempt or not os.path.isdir(staged):
                raise
            os.makedirs(os.path.dirname(final), exist_ok=True)  # the topic's first queue in the output
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.EXDEV, errno.EPERM,
                           errno.EACCES, errno.EBUSY, errno.EINVAL):
                return False
            raise
    return False


def _units(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, CQ_UNIT_SIZE)


def _real_offsets(units: np.ndarray) -> np.ndarray:
    """The CommitLog offsets of the real units (not blank, not unwritten) of a unit array."""
    blank = _units(BLANK_UNIT)[0]
    real = units[~(units == blank).all(axis=1) & units.any(axis=1)]
    return real[:, :8].copy().view(">i8").ravel()


def _read(path: str, start: int, end: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, end - start, start)
    finally:
        os.close(fd)


def file_span(path: str, span: tuple[int, int] | None, size: int | None = None) -> tuple[int, int]:
    """The bytes [start, end) of a staged ConsumeQueue file that can hold real units: those of the queue's `span`
    (the queue bytes its units were put in, `StagedQueue.span`) that fall in this file; None: all of it.
    Outside them it holds pre-blank units or nothing, which a commit neither checks nor writes. `size`: the
    file's, when the caller has it."""
    if size is None:
        size = os.stat(path).st_size
    if span is None:
        return 0, size
    file_start = int(os.path.basename(path))
    start, end = max(0, span[0] - file_start), min(size, span[1] - file_start)
    return (start, end) if start < end else (0, 0)


def commit_queue_file(staged: str, final: str, new_offsets: list | None = None,
                      span: tuple[int, int] | None = None, unsynced: list | None = None) -> str:
    """Link a staged ConsumeQueue file into place, or merge its units into the file already there. With
    `new_offsets`, the CommitLog offsets of the units it put there are appended to it (an array). `span`: the
    staged queue's (`file_span`): only those bytes are read, of both files (a rerun over 16,000 queues read
    every 6 MB file whole, twice). `unsynced`: a merged file's path is appended to it for the caller to sync
    (`sync_files`), instead of syncing it here."""
    size = os.stat(staged).st_size
    start, end = file_span(staged, span, size)
    ours = _units(_read(staged, start, end)) if new_offsets is not None else None
    if _link(staged, final):
        if new_offsets is not None:
            new_offsets.append(_real_offsets(ours))
        return LINKED
    if ours is None:
        ours = _units(_read(staged, start, end))
    fd = os.open(final, os.O_RDWR | os.O_CLOEXEC)
    try:
        theirs_size = os.fstat(fd).st_size
        if theirs_size != size:
            raise BackfillError(f"{final}: is {theirs_size} bytes, the backfilled file is {size}")
        theirs = _units(os.pread(fd, end - start, start))
        blank = _units(BLANK_UNIT)[0]
        ours_blank = (ours == blank).all(axis=1)
        ours_real = ~ours_blank & ours.any(axis=1)
        same = (theirs == ours).all(axis=1)
        theirs_blank = (theirs == blank).all(axis=1)
        bad = np.flatnonzero(ours_real & ~same & ~theirs_blank)
        if len(bad):
            queue_offset = (int(os.path.basename(final)) + start) // CQ_UNIT_SIZE + int(bad[0])
            what = "no unit yet" if not theirs[bad[0]].any() else "another unit"
            raise BackfillError(f"{final}: queue offset {queue_offset} holds {what}; backfill writes only into an "
                                f"empty output or the blank head of a queue that a daemon started after --to")
        write = np.flatnonzero(ours_real & ~same)
        if len(write) == 0:
            return PRESENT
        if new_offsets is not None:
            new_offsets.append(_real_offsets(ours[write]))
        runs = np.split(write, np.flatnonzero(np.diff(write) != 1) + 1)
        for run in runs:
            lo, hi = int(run[0]), int(run[-1]) + 1
            pwrite_all(fd, ours[lo:hi].tobytes(), start + lo * CQ_UNIT_SIZE, final)
        if unsynced is None:
            os.fsync(fd)
        else:
            unsynced.append(final)
    finally:
        os.close(fd)
    return MERGED


def commit_queue_dir(staged_dir: str, final_dir: str, files: int | None = None,
                     new_offsets: list | None = None, span: tuple[int, int] | None = None,
                     unsynced: list | None = None) -> dict[str, int]:
    """Commit one staged queue (`files`: how many files it has, when known); counts by outcome. A queue the
    output does not hold yet is renamed into place whole: rename(2) of a directory fails when a directory
    with entries is there (and replaces only an empty one), so no file is replaced, and one call does what a
    directory made, a link and an unlink per file did (16,000 queues: 18,000 mkdir at ~100 us each here).
    A queue the output holds has each file linked or merged (`commit_queue_file`). `new_offsets`, `span` and
    `unsynced`: as commit_queue_file's (a queue renamed into place puts every unit of its files)."""
    counts = file_counts()
    if _rename_dir(staged_dir, final_dir):
        if new_offsets is not None:
            for _, path in list_queue_files(final_dir):
                new_offsets.append(_real_offsets(_units(_read(path, *file_span(path, span)))))
        counts[LINKED] += len(list_queue_files(final_dir)) if files is None else files
        return counts
    for _, path in list_queue_files(staged_dir):
        counts[commit_queue_file(path, os.path.join(final_dir, os.path.basename(path)), new_offsets, span,
                                 unsynced)] += 1
    return counts


def distinct_count(arrays: list[np.ndarray]) -> int:
    """How many distinct values the arrays hold: CommitLog offsets of the units and keys a commit put, each
    queue's and each IndexFile's in CommitLog order, so a stable sort (a merge of those runs) does it; np.unique
    took 29.7 CPU-s for 48,000,000 such offsets here, this 1.2."""
    if not arrays:
        return 0
    values = np.sort(np.concatenate(arrays), kind="stable")
    return int(np.count_nonzero(values[1:] != values[:-1])) + (len(values) > 0)


def commit_queues(queues, root: str, new_offsets: list | None, between: Callable[[int], None]) -> dict[str, int]:
    """Commit every staged queue (`StagedQueue`s) under `root` (the output's consumequeue/); counts by outcome.
    `between(n)` is called before the n-th queue (it raises to stop the commit there: a queue is put whole or
    not at all); the files merged are synced once, whether it ends or stops."""
    counts = file_counts()
    unsynced: list[str] = []
    try:
        for n, q in enumerate(queues):
            between(n)
            for k, v in commit_queue_dir(q.directory, os.path.join(root, q.topic, str(q.queue_id)), q.files,
                                         new_offsets, q.span, unsynced).items():
                counts[k] += v
    finally:
        sync_files(unsynced)
    return counts


def sync_files(paths: list[str]) -> None:
    """Sync the files merged into place: their file system once (syncfs) from SYNC_WHOLE_FS_FILES of them, as
    the queue writer syncs what it staged, each one otherwise."""
    if len(paths) >= SYNC_WHOLE_FS_FILES:
        sync_file_system(paths[0])
        return
    for path in paths:
        sync_file(path, data_only=False)


def _same_contents(a: str, b: str) -> bool:
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(_COMPARE_BYTES), fb.read(_COMPARE_BYTES)
            if x != y:
                return False
            if not x:
                return True


def index_entry_offsets(path: str, hash_slot_num: int) -> np.ndarray:
    """The CommitLog offsets of an IndexFile's entries (indexCount - 1 of them, from its header)."""
    with open(path, "rb") as f:
        header = IndexHeader.decode(f.read(INDEX_HEADER_SIZE))
        count = max(0, header.index_count - FIRST_INDEX)
        start = INDEX_HEADER_SIZE + hash_slot_num * HASH_SLOT_SIZE + FIRST_INDEX * INDEX_ENTRY_SIZE
        data = os.pread(f.fileno(), count * INDEX_ENTRY_SIZE, start)
    return np.frombuffer(data, dtype=INDEX_ENTRY_DTYPE)["phy_offset"].astype(np.int64)


def commit_index_file(staged: str, final: str, new_offsets: list | None = None, hash_slot_num: int = 0) -> str:
    """Link a staged IndexFile into place; a file already there must be the same bytes. With `new_offsets`,
    the CommitLog offsets of the entries of a file it put there are appended to it."""
    if _link(staged, final):
        if new_offsets is not None:
            new_offsets.append(index_entry_offsets(final, hash_slot_num))
        return LINKED
    if not _same_contents(staged, final):
        raise BackfillError(f"{final}: an IndexFile of this name already exists with other contents")
    return PRESENT
