"""Read-ahead for a sequential pass over the CommitLog: the next batch decodes while this one dispatches.

The batch decoder runs without the GIL, so one thread decoding window i+1 while the caller dispatches
window i keeps both cores busy during a rebuild. Results come back in CommitLog order; the thread stops
after the first read that is not OK (end of data or corruption), exactly where a plain loop would. The
`prepare` callables run on that thread too, on each batch before it is handed over: work a dispatcher can
do ahead (the ConsumeQueue grouping of a batch), off the dispatching thread. Only while the dispatching
thread is busy, though: when it is waiting for the batch, the batch goes to it as it is (its dispatch
prepares it) and this thread decodes the next, so whichever thread has time does that work. And `idle`, when
given, is what the dispatching thread does rather than wait for a batch (a rebuild creates its new queues'
files then).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from indexcore.dispatch import DispatchBatch
from indexcore.reader import CommitLogReader, ReadResult, ReadStatus

DEFAULT_DEPTH = 2


class ReadAhead:
    """Iterates the ReadResults of `reader` from `offset` on, read by a background thread."""

    def __init__(self, reader: CommitLogReader, offset: int, depth: int = DEFAULT_DEPTH,
                 prepare: Sequence[Callable[[DispatchBatch], None]] = (), idle: Callable[[], bool] | None = None):
        self._reader = reader
        self._offset = offset
        self._prepare = tuple(prepare)
        self._idle = idle
        self._results: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._consumer_waiting = False  # set while `__iter__` waits for the next result
        self._thread = threading.Thread(target=self._run, name="reputd-readahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = self._offset
        try:
            while not self._stop.is_set():
                result = self._reader.read(offset)
                if len(result.batch) and not self._consumer_waiting:
                    for prepare in self._prepare:
                        prepare(result.batch)
                self._put(result)
                if result.status is not ReadStatus.OK:
                    return
                offset = result.next_offset
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._results.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        """The results, once: iterating again after the last one (or after `close`) yields nothing."""
        while not self._done:
            item = self._next()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            yield item
            if item.status is not ReadStatus.OK:
                self._done = True

    def _next(self):
        """The next result; while none is ready, `idle` (a small piece of work, True while there is more) is
        called first, and only then does this thread wait."""
        if self._idle is not None:
            while True:
                try:
                    return self._results.get_nowait()
                except queue.Empty:
                    if not self._idle():
                        break
        self._consumer_waiting = True
        try:
            return self._results.get()
        finally:
            self._consumer_waiting = False

    def close(self) -> None:
        """Stop the thread and wait for it: the reader may be closed afterwards."""
        self._stop.set()
        self._done = True
        self._thread.join()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["ReadAhead", "ReadResult"]
