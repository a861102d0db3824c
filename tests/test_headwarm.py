"""The head warmer (daemon/engine/headwarm.py): the pages just past the writer's head are in the page cache
before the writer's page fault or the loop's read gets there, across a segment roll, and nothing else
changes: the file's bytes, and the descriptors open once it is closed."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import time
from pathlib import Path

from daemon.engine.headwarm import WARM_BYTES, HeadWarmer
from indexcore.reader import CommitLog
from indexcore.writer import CommitLogWriter, Message

PAGE = mmap.PAGESIZE


def resident(path: Path) -> bytes:
    """One byte per page of the file, bit 0 set when the page is in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    size = path.stat().st_size
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        vec = ctypes.create_string_buffer(-(-size // PAGE))
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return bytes(b & 1 for b in vec.raw)
    finally:
        libc.munmap(addr, size)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wait_resident(path: Path, first: int, last: int, timeout: float = 10.0) -> bytes:
    """Pages [first, last) of the file, once all are cached (or as they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        pages = resident(path)[first:last]
        if all(pages) or time.monotonic() > deadline:
            return pages
        time.sleep(0.01)


def test_the_pages_past_the_head_are_cached_and_nothing_else_changes(tmp_path):
    size = 64 << 20
    log_dir = tmp_path / "commitlog"
    fds = len(os.listdir("/proc/self/fd"))
    with CommitLogWriter(str(log_dir), size) as w:
        for _ in range(100):
            w.append(Message("T", 0, b"x" * 300, {"KEYS": "k"}))
        w._file._mm.flush()
        head = w.max_offset
        path = log_dir / f"{0:020d}"
        evict(path)
        before = digest(path)
        evict(path)
        warmer = HeadWarmer(CommitLog(str(log_dir), size, follow=True))
        try:
            warmer.note(head)
            first, last = head // PAGE, (head + WARM_BYTES) // PAGE
            assert all(wait_resident(path, first, last)), "the pages past the head were not brought in"
            far = resident(path)[last + 1024:]
            assert sum(far) == 0, f"{sum(far)} pages far past the warmed window were brought in"
            warmer.note(head + PAGE)  # the head moved a little: nothing more is asked for yet
        finally:
            warmer.close()
    assert digest(path) == before
    assert len(os.listdir("/proc/self/fd")) == fds


def test_the_warm_window_goes_on_into_the_next_segment_once_it_exists(tmp_path):
    size = 8 << 20
    log_dir = tmp_path / "commitlog"
    log_dir.mkdir()
    first_segment, second_segment = log_dir / f"{0:020d}", log_dir / f"{size:020d}"
    with open(first_segment, "wb") as f:
        f.truncate(size)
    log = CommitLog(str(log_dir), size, follow=True)
    warmer = HeadWarmer(log)
    try:
        head = size - (2 << 20)
        warmer.note(head)
        assert all(wait_resident(first_segment, head // PAGE, size // PAGE))
        with open(second_segment, "wb") as f:  # the writer rolls (or pre-creates its next file)
            f.truncate(size)
        evict(second_segment)
        log.refresh()
        warmer.note(head + PAGE)
        assert all(wait_resident(second_segment, 0, (head + WARM_BYTES - size) // PAGE))
    finally:
        warmer.close()
