"""The broker's `lock` in the backfill's output, watched for as long as the backfill writes there, as `run` and
`rebuild` watch it (daemon/engine/brokerlock.py): a broker started on the output directory (its store root,
`output.dir` unset) takes `lock` in DefaultMessageStore.start() and writes consumequeue/ and index/ itself; a
backfill that went on linking its files into place would be a second writer in those directories.

A start refused at once is `cmd_backfill`'s (daemon/ops/outlock.py, before Spark starts). From there on:

* while Spark starts and runs the jobs, a thread asks every BROKER_LOCK_CHECK_S (F_GETLK, about 5 us) and,
  once the lock is taken, cancels the job group (again every CANCEL_REPEAT_S until the driver leaves the jobs):
  the tasks write only under the output's staging directory (`.reputd-backfill/`, which the broker never
  reads and the job removes as it ends), never into consumequeue/ or index/;
* the driver asks again between the jobs, before the commit, and before it puts each queue's files and each
  IndexFile in place: once it is taken, nothing more is put there.

Then `broker_lock_taken` is logged (once), and the backfill ends with BrokerLockTaken, the one line `reputd
backfill` prints on stderr, exit 2 (what `run` and `rebuild` exit with for the same reason)."""

from __future__ import annotations

import contextlib
import threading

from daemon.backfill.interrupt import CANCEL_REPEAT_S
from daemon.backfill.plan import BackfillError
from daemon.engine.brokerlock import BROKER_LOCK_CHECK_S, EXIT_BROKER_RUNNING
from daemon.ops.outlock import BrokerLockWatch

NOTHING_PUT = "before putting any file in place: nothing of it is in the output"


class BrokerLockTaken(BackfillError):
    """A broker took `lock` in the output directory while the backfill ran; str() names the directory, the
    PID and how far the backfill got (nothing is put in place after the lock was seen). Exit 2."""

    def __init__(self, out: str, lock: str, pid: int, where: str):
        self.out, self.lock, self.pid, self.where = out, lock, pid, where
        who = f"PID {pid}" if pid else "another process"
        super().__init__(f"output directory {out} became the store root of a running broker ({who} took {lock}), "
                         f"which writes consumequeue/ and index/ there itself: the backfill stopped {where}; "
                         f"backfill elsewhere with --out DIR, or into {out} only while the broker is stopped")


class BrokerWatch:
    """The watch of one backfill (module docstring): `arm(sc, group)` once the jobs have a context and group,
    `check()` where the driver may stop, `put(...)` as the commit progresses, `close()` at the end."""

    def __init__(self, out: str, log):
        self.out = out
        self.watch = BrokerLockWatch(out, BROKER_LOCK_CHECK_S)
        self._log = log
        self._reported = threading.Lock()
        self._told = False
        self._sc = self._group = None
        self.where = NOTHING_PUT
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reputd-backfill-broker-lock", daemon=True)
        self._thread.start()

    @property
    def holder(self) -> int | None:
        return self.watch.holder

    def arm(self, sc, group: str) -> None:
        self._sc, self._group = sc, group

    def put(self, queues: int, of_queues: int, index_files: int, of_index_files: int) -> None:
        """How far the commit got, for the line and the event."""
        self.where = (f"after putting the files of {queues:,} of {of_queues:,} queues and {index_files:,} of "
                      f"{of_index_files:,} IndexFile{'s' * (of_index_files != 1)} in place, and put nothing more")

    def taken(self) -> bool:
        """Whether a broker holds the lock now (asked of the kernel at once); the first time, the event."""
        holder = self.watch.taken(now=True)
        if holder is None:
            return False
        with self._reported:
            if not self._told:
                self._told = True
                self._log.error("broker_lock_taken", lock=self.watch.path, pid=holder, stopped=self.where,
                                action=f"stop: put nothing more into the output, exit {EXIT_BROKER_RUNNING}")
        return True

    def check(self) -> None:
        """BrokerLockTaken once a broker holds the lock."""
        if self.taken():
            raise self.error()

    def error(self) -> BrokerLockTaken:
        return BrokerLockTaken(self.out, self.watch.path, self.holder or 0, self.where)

    def _run(self) -> None:
        while not self._done.wait(BROKER_LOCK_CHECK_S):
            if self.taken():
                break
        while not self._done.is_set():  # a job the driver submits after a cancel runs whole: cancel until it leaves
            if self._sc is not None:
                with contextlib.suppress(Exception):  # the context may be stopping already
                    self._sc.cancelJobGroup(self._group)
            self._done.wait(CANCEL_REPEAT_S)

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)


__all__ = ["BrokerLockTaken", "BrokerWatch"]
