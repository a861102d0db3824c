"""The broker's `lock`, watched for as long as `reputd run` writes: a broker started on the output directory
(the operator rebuilt into its store root while it was down, then started it) takes `lock` in
DefaultMessageStore.start() and reputs into its own consumequeue/ and index/ at once. Two writers on one
ConsumeQueue, two processes creating IndexFiles in one directory: `run` refuses such a root at its start
(daemon/ops/outlock.py) and stops writing the moment one is taken afterwards.

It looks before each batch it dispatches and, while the loop waits, every BROKER_LOCK_CHECK_S (F_GETLK,
about 4 us). Once taken: health `down` with the reason, the event `broker_lock_taken`, the counter
`reputd_broker_lock_taken_total`, STATUS= for systemd, and a stop: the batch in hand is not dispatched, what
was is flushed and checkpointed by the session's close, and the process exits EXIT_BROKER_RUNNING (2, what
a start refused for the same reason exits with, which systemd's RestartPreventExitStatus=2 does not restart
into the same conflict). The broker's load() reads the files before start() takes the lock; what reputd
dispatched in between are the units and keys the broker's own reput writes again, byte for byte."""

from __future__ import annotations

import threading
from collections.abc import Callable

from daemon.ops.metrics import DOWN
from daemon.ops.outlock import BrokerLockWatch

EXIT_BROKER_RUNNING = 2
BROKER_RUNNING = "broker running"
BROKER_LOCK_CHECK_S = 0.05  # between two looks at the broker's lock while the loop waits


class BrokerLockGuard:
    """`taken()` says whether a broker took its lock in `directory`, and the first time it does, reports it
    and stops the service (`stop(reason)`); `offset()` gives where dispatching stood, for the event."""

    def __init__(self, directory: str, metrics, log, set_health: Callable[[str, str], None], notifier,
                 stop: Callable[[str], None], offset: Callable[[], int | None]):
        self.watch = BrokerLockWatch(directory, BROKER_LOCK_CHECK_S)
        self._metrics, self._log, self._set_health, self._notifier = metrics, log, set_health, notifier
        self._stop, self._offset = stop, offset
        self._reported = False
        self._report_lock = threading.Lock()  # the loop and the clean-up both ask: one report

    @property
    def holder(self) -> int | None:
        """The PID that took the lock (0: the kernel did not say), None while no broker did."""
        return self.watch.holder

    def taken(self, *, now: bool = False) -> bool:
        """Whether a broker holds the lock (`now`: asked at once, else at most every BROKER_LOCK_CHECK_S)."""
        holder = self.watch.taken(now=now)
        if holder is None:
            return False
        with self._report_lock:
            first, self._reported = not self._reported, True
        if first:
            self._metrics.broker_lock_taken.inc()
            self._log.error("broker_lock_taken", lock=self.watch.path, pid=holder, reput_from_offset=self._offset(),
                            action=f"stop writing, flush, checkpoint, exit {EXIT_BROKER_RUNNING}")
            reason = f"{BROKER_RUNNING}: PID {holder} took {self.watch.path}; reputd stopped writing there"
            self._set_health(DOWN, reason)
            self._notifier.status(f"stopping: {reason}")
            self._stop("broker_lock_taken")
        return True

    def error(self, directory: str, checkpoint_offset: int | None) -> str:
        """The one line `run` exits with once a broker took the lock (after its last checkpoint)."""
        who = f"PID {self.holder}" if self.holder else "another process"
        where = (f"checkpoint at CommitLog offset {checkpoint_offset}" if checkpoint_offset is not None and
                 checkpoint_offset >= 0 else "before its recovery wrote anything")
        return (f"output directory {directory} became the store root of a running broker ({who} took "
                f"{self.watch.path}), which writes consumequeue/ and index/ there itself: reputd stopped writing, "
                f"{where}; write elsewhere with --out DIR, or run reputd there only while the broker is stopped")


__all__ = ["BROKER_LOCK_CHECK_S", "BROKER_RUNNING", "EXIT_BROKER_RUNNING", "BrokerLockGuard"]
