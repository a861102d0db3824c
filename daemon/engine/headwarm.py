"""Keep the pages just past the writer's head in the page cache, from a thread of reputd's own.

A broker (or any writer through a mapping, `warmMapedFileEnable` off, the default) meets each page of a new
segment first as a page fault, and the kernel answers a fault on an uncached page with a read around it of
the device's `read_ahead_kb`: on a disk set to 8 MiB, ~2,000 zero pages of the sparse segment filled while
the faulting thread, and any reader touching those pages, waits ~10-12 ms. At 100,000 msgs/s that happened
2-5 times a second, in the writer (records stamped, then late) or in the loop's frontier look and decode
(bench/results/latency.md): the loop's p99 rose from ~7 ms (128 KiB readahead) to 14-17 ms.

Here a thread asks the kernel for the next WARM_BYTES past the head (`POSIX_FADV_WILLNEED`, which reads them
in the calling thread, without the GIL): the zero pages are then cached before the writer or the loop gets
there, and a fault on a cached page reads nothing around it. It only reads: the file's bytes are unchanged,
and the pages are those the writer's own fault would have cached anyway.
"""

from __future__ import annotations

import contextlib
import os
import threading

from indexcore.reader import CommitLog

WARM_BYTES = 16 << 20  # how far past the head the pages are kept cached
DEFAULT_READ_AHEAD = 128 << 10  # the kernel's default read_ahead_kb
REWARM_BYTES = WARM_BYTES // 2  # the head may come this close to the warmed end before the next request


def read_ahead_bytes(fd: int) -> int:
    """The readahead of the block device holding the open file (`read_ahead_kb`): a `POSIX_FADV_WILLNEED`
    reads no more than that in one call. DEFAULT_READ_AHEAD when it cannot be told (no block device)."""
    dev = os.fstat(fd).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a whole disk, or a partition of one
        try:
            with open(f"{queue}/read_ahead_kb") as f:
                kib = int(f.read())
        except (OSError, ValueError):
            continue
        if kib > 0:
            return kib << 10
    return DEFAULT_READ_AHEAD


class HeadWarmer:
    """`note(head)` from the loop (a comparison, nothing more, unless the head nears the warmed end); the
    thread warms [head, head + WARM_BYTES) of the segments that exist."""

    def __init__(self, commit_log: CommitLog):
        self._commit_log = commit_log
        self._warmed = 0  # every page below this offset was asked for (or lies below the first head)
        self._want = 0
        self._wake = threading.Event()
        self._closed = False
        self._fd: tuple[str, int, int] | None = None
        self._thread = threading.Thread(target=self._run, name="reputd-headwarm", daemon=True)
        self._thread.start()

    def note(self, head: int) -> None:
        if head + REWARM_BYTES > self._warmed:
            self._want = head
            self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join()
        self._close_fd()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            head = self._want
            with contextlib.suppress(OSError):  # a segment deleted since it was listed: the next note asks again
                self._warm(max(head, self._warmed), head + WARM_BYTES)

    def _warm(self, start: int, end: int) -> None:
        """Ask for [start, end), segment by segment, as far as segments exist (the next one appears when the
        writer rolls, or earlier when it pre-creates it as a broker does)."""
        size = self._commit_log.segment_size
        while start < end:
            base = start - start % size
            path = self._commit_log.find_segment(start)
            if path is None:
                return
            upto = min(end, base + size)
            fd, step = self._segment_fd(path)
            for at in range(start - base, upto - base, step):  # the kernel reads at most its readahead a call
                os.posix_fadvise(fd, at, min(step, upto - base - at), os.POSIX_FADV_WILLNEED)
            self._warmed = start = upto

    def _segment_fd(self, path: str) -> tuple[int, int]:
        """The segment's descriptor, and the most one WILLNEED reads on its device."""
        if self._fd is None or self._fd[0] != path:
            self._close_fd()
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._fd = (path, fd, read_ahead_bytes(fd))
        return self._fd[1], self._fd[2]

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd[1])
            self._fd = None
