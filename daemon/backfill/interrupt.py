"""SIGINT and SIGTERM during a backfill: one line, exit 130, nothing left running (the Spark launcher,
gateway JVM and Python workers this process started are ended)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from daemon.backfill.jvm import end_gateway

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GATEWAY_EXIT_TIMEOUT_S = 10.0
CANCEL_REPEAT_S = 0.2  # how often the jobs are cancelled again while the driver still runs them


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (from /proc), children first."""
    parent: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        found.extend(frontier)
    return found


def kill_spark_processes() -> None:
    """Kill the processes this backfill started (the Spark launcher and gateway JVM, and under it the Python
    workers) at once: a JVM whose driver went away prints a Java stack trace, then lingers for minutes."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        from pyspark import SparkContext  # noqa: PLC0415

        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None:
            proc.wait(GATEWAY_EXIT_TIMEOUT_S)


def end_driver_jvm() -> None:
    """After the context has stopped: end the gateway JVM this process launched, killing it if it does not
    exit; the Python process may go on (a test, a caller)."""
    end_gateway(GATEWAY_EXIT_TIMEOUT_S)


class Interrupt:
    """SIGINT or SIGTERM at any moment of a backfill that owns its Spark context ends it as an interruption (the
    caller's KeyboardInterrupt: one line, exit 130), with nothing left running:

    * before Spark starts: at once;
    * while Spark starts (`launching`): the launcher and JVM are killed, so the start fails and is reported
      as the interruption (PySpark's own SIGINT handler, which SparkContext installs, is kept out: it raised
      from inside a call to the JVM and left the JVM running);
    * during the jobs (`arm`): they are cancelled from another thread, and again every CANCEL_REPEAT_S until
      the driver stops running them, and the job that fails of it ends the backfill (PySpark's handler called
      into the JVM from the thread the signal interrupts, which is inside a call to the JVM: py4j then printed
      three tracebacks); a second signal kills Spark's processes at once;
    * once the commit begins (`committing`, which first raises a signal that came during the write job, in
      case the job ended before a cancel reached it): the commit stops before its next queue or IndexFile
      (`Phases` asks `signal`), no file half put, and ends with CommitInterrupted, which says what the output
      holds (the commit of a rerun over 16,000 queues took many minutes and could not be stopped);
    * while the context stops (`stopping`): the stop goes on.

    For a caller's context, and off the main thread (where no handler can be set), it does nothing."""

    def __init__(self, own: bool):
        self.signal: int | None = None
        self._sc = self._group = None
        self._state = "before"
        self._kept = {}
        if own and threading.current_thread() is threading.main_thread():
            self._kept = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
            for sig in self._kept:
                signal.signal(sig, self._on_signal)

    @contextlib.contextmanager
    def launching(self):
        """Around the context's creation: a signal kills what is starting; PySpark's SIGINT handler is kept
        out; the start that fails of the kill, or succeeds before it, ends as the interruption."""
        try:
            import pyspark.core.context as pyspark_context  # noqa: PLC0415 - Spark 4
        except ImportError:
            import pyspark.context as pyspark_context  # noqa: PLC0415 - Spark 3.5

        real = pyspark_context.signal
        pyspark_context.signal = _SignalsKept(real, set(self._kept))
        self._state = "launching"
        try:
            yield
        except Exception:
            if self.signal is not None:
                raise KeyboardInterrupt from None
            raise
        finally:
            pyspark_context.signal = real
            self._state = "before"
        if self.signal is not None:
            kill_spark_processes()
            raise KeyboardInterrupt

    def arm(self, sc, group: str) -> None:
        self._sc, self._group = sc, group
        self._state = "running"

    def committing(self) -> None:
        """The last moment a signal stops the backfill: from here on the commit and the stop go on."""
        self.check()
        self._state = "committing"

    def commit_began(self) -> bool:
        return self._state == "committing"

    def stopping(self) -> None:
        self._state = "stopping"

    def disarm(self) -> None:
        for sig, handler in self._kept.items():
            signal.signal(sig, handler)
        self._kept = {}

    def _on_signal(self, signum: int, _frame) -> None:
        first = self.signal is None
        if first:
            self.signal = signum
        if self._state == "before":
            raise KeyboardInterrupt
        if self._state == "launching":
            kill_spark_processes()
        elif self._state == "running":
            if not first:
                kill_spark_processes()
                raise KeyboardInterrupt
            threading.Thread(target=self._cancel, name="reputd-backfill-cancel", daemon=True).start()

    def _cancel(self) -> None:
        """Spark cancels only the group's jobs that are running: a job the driver submits just after (the
        write job as the decode ends) ran whole, seconds to minutes after the Ctrl-C. So the cancel is
        repeated until the driver leaves the jobs (the job fails, or a check between them raises)."""
        while self._state == "running":
            with contextlib.suppress(Exception):  # the context may be stopping already
                self._sc.cancelJobGroup(self._group)
            time.sleep(CANCEL_REPEAT_S)

    def check(self) -> None:
        """Raise the interruption if a signal came while the driver was not waiting for a job."""
        if self.signal is not None:
            raise KeyboardInterrupt


def commit_where(queues: int, of_queues: int, index_files: int, of_index_files: int) -> str:
    return (f"after putting the files of {queues:,} of {of_queues:,} queues and {index_files:,} of "
            f"{of_index_files:,} IndexFile{'s' * (of_index_files != 1)} in place")


class CommitInterrupted(KeyboardInterrupt):
    """A signal during the commit stopped it between two files (no queue or IndexFile half put); str() says
    what the output holds. The command's exit is 130, as for any interruption."""

    def __init__(self, out: str, counts: tuple[int, int, int, int], catalog: bool = False):
        self.out = out
        self.counts = counts
        rest = ", and the catalog was not extended" if catalog else ""
        super().__init__(f"the backfill's commit stopped {commit_where(*counts)} (each whole) and put nothing "
                         f"more in {out}{rest}; the same backfill run again puts the rest (what is in place is "
                         f"checked and kept)")

    def __str__(self) -> str:
        return self.args[0]


class _SignalsKept:
    """The `signal` module as PySpark's context sees it while it starts: handlers for the signals the backfill
    handles itself are not replaced."""

    def __init__(self, real, kept: set):
        self._real = real
        self._kept = kept

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def signal(self, signum, handler):
        if signum in self._kept:
            return self._real.getsignal(signum)
        return self._real.signal(signum, handler)
