"""The ConsumeQueue writer thread of `run`: the deferred writes of a batch (`OpenFiles.submit_writes`) are made
here, off the dispatching thread, in the order they were handed over.

Over 10,000 queues at 100,000 msgs/s the gathered appends of about 10,000 queues a second come of age (each
queue's once a flush interval), a pwritev each, with an open and a close for a queue outside the descriptor
set: made by the batch that released them they put 15-20 ms into one dispatch in 64 (a release of the 64
queues' second of appends) and more over 10,000. Here they run in C without the GIL while the next batch is
read and dispatched. The order holds because every write goes through one FIFO and one thread, and whatever
else touches a queue's files (a sync, a read, a truncation, a descriptor closed) first waits for the writes
handed over before it (`drain`, through `OpenFiles.flush_writes`). A checkpoint covers only written data: the
flusher syncs a plan's files only after the writes handed over up to its plan are made (`barrier`), and once a
write failed no later barrier passes, so nothing after the failure is ever checkpointed in this session.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading

from indexcore import _failpoints
from indexcore.openfiles import pwrite_many

# Batches of writes handed over and not made yet before `submit` waits for the writer: memory stays bounded
# (each holds its batch's arrays of units) when the disk is slower than the dispatch.
MAX_BEHIND = 8


class WriteBehind:
    """One writer thread making handed-over batches of writes (`_kernels.pwrite_many` lists) in order."""

    def __init__(self, name: str = "reputd-cq-writer", max_behind: int = MAX_BEHIND, under: str | None = None):
        """`under`: the directory the files written lie under (the store's `consumequeue/`): a file a write opens
        is opened relative to a descriptor of it (`pwrite_many`), once it exists."""
        self._under = under
        self._dir: tuple[int, bytes] | None = None  # (descriptor, path) of `under`, opened by the first write
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._submitted = 0  # batches handed over
        self._done = 0  # batches made (or dropped after a failure)
        self._max_behind = max_behind
        self._error: OSError | None = None  # the first write that failed: every later write is dropped
        self._reported = False  # `drain` raised it once
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, writes: list[tuple], paths: list[str]) -> None:
        """Make `writes` (each naming the file `paths[i]`) after every batch handed over before, on the writer
        thread; waits while MAX_BEHIND batches are not made yet. After a write failed, raises its error."""
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise RuntimeError("the ConsumeQueue writer is closed")
            while self._submitted - self._done >= self._max_behind and self._error is None:
                self._cond.wait()
            self._queue.append((writes, paths))
            self._submitted += 1
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every batch handed over is made. A write that failed is raised here once (the writes after
        it were dropped, as if the failure had stopped the writer there); `submit` and `barrier` keep raising it."""
        with self._cond:
            self._cond.wait_for(lambda: self._done == self._submitted)
            if self._error is not None and not self._reported:
                self._reported = True
                raise self._error

    def barrier(self):
        """A wait for the batches handed over until now: the flusher calls it before it syncs the files of a plan
        made now. It raises when any write of this writer failed (then no checkpoint may follow)."""
        with self._cond:
            ticket = self._submitted

        def wait() -> None:
            with self._cond:
                self._cond.wait_for(lambda: self._done >= ticket)
                if self._error is not None:
                    raise OSError(self._error.errno, f"a ConsumeQueue write failed: {self._error.strerror}",
                                  self._error.filename)

        return wait

    def close(self) -> None:
        """Make what was handed over, then end the thread (a failure is left to `drain`)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        if self._dir is not None:
            os.close(self._dir[0])
            self._dir = None

    @property
    def behind(self) -> int:
        """Batches handed over and not made yet."""
        return self._submitted - self._done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                writes, paths = self._queue[0]
                dropped = self._error is not None
            if not dropped:
                _failpoints.reached("consumequeue.write_behind")  # the crash matrix: a kill with writes in flight
            if not dropped and self._dir is None and self._under is not None:
                self._open_under()
            error = None if dropped else self._write(writes, paths, self._dir)
            with self._cond:
                self._queue.popleft()
                if error is not None and self._error is None:
                    self._error = error
                self._done += 1
                self._cond.notify_all()

    def _open_under(self) -> None:
        with contextlib.suppress(OSError):  # not made yet: the writes open their files by their whole paths
            self._dir = (os.open(self._under, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), os.fsencode(self._under))

    @staticmethod
    def _write(writes: list[tuple], paths: list[str], under: tuple[int, bytes] | None = None) -> OSError | None:
        try:
            pwrite_many(writes, paths, under)
        except OSError as e:
            return e
        except Exception as e:  # any failure stops the writes, to be raised on the dispatching side
            return OSError(0, f"cannot write: {e}", paths[0] if paths else None)
        return None
