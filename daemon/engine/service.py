"""What the live service shows the outside and keeps across sessions: stop requests, systemd notifications
(READY, STATUS, WATCHDOG, STOPPING), health and the reason for it, lag and progress for /metrics and
/healthz, and how a failure is reported (events, counters, a full output named as such). The sessions
(daemon/engine/runner.py) and the loop (daemon/engine/reput.py) build on it."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

from daemon.config import Config
from daemon.engine import dledgerfollow
from daemon.engine.brokerlock import BrokerLockGuard
from daemon.engine.head import (
    oldest_undispatched_timestamp,
    segments_now,
    written_end,
)
from daemon.engine.session import Session
from daemon.engine.sizes import size_advice
from daemon.ops.logs import RepeatedFailures, get_logger
from daemon.ops.metrics import (
    DEGRADED,
    DOWN,
    HEALTHY,
    ErrorKind,
    Health,
    Lag,
    MetricsServer,
    OutputStage,
    ReputMetrics,
)
from daemon.ops.sdnotify import Notifier
from indexcore.dledgerlog import DLedgerLog
from indexcore.errors import SizeMismatchError, StoreLayoutError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
MS_PER_SECOND = 1000
STATUS_INTERVAL_S = 2.0
FLUSH_FAILED = "flush failed"
NO_SPACE = "output space exhausted"
# errnos that mean "no room for the output": a full file system, a quota, or RLIMIT_FSIZE (SIGXFSZ, which
# Python ignores, turns into EFBIG). IndexFiles are allocated in full when created and ConsumeQueue files
# are written with pwrite, so these surface as an OSError naming the file, never as SIGBUS on a write
# through a mapping.
NO_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG))
COMMITLOG_UNAVAILABLE = "CommitLog unavailable"
RESTARTING = "restarting from the last checkpoint"
CORRUPT_REASON = "corrupt"


def no_space_error(error: BaseException) -> OSError | None:
    """The OSError saying the output has no room, if that is what `error` is or was caused by."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None


def _errno_name(error: BaseException) -> str | None:
    code = getattr(error, "errno", None)
    return errno.errorcode.get(code) if isinstance(code, int) else None


class ServiceState:
    """Owns what outlives a session (metrics, health, notifications) and what the outside sees of the service."""

    def __init__(self, config: Config, *, until_caught_up: bool = False):
        self.config = config
        self.until_caught_up = until_caught_up
        self.session: Session | None = None
        self.health = Health()
        self.metrics = ReputMetrics(self._lag)
        self.notifier = Notifier.from_env()
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._stop_reported = False
        self._wake = threading.Event()
        self._log = get_logger(component="reput")
        self._repeats = RepeatedFailures()  # an identical failure is logged once a minute, with a count
        self._ready_sent = False
        self._stopping_sent = False
        self._notify_lock = threading.Lock()
        self._starting = threading.Event()  # set while start-up recovery runs before READY=1
        self._notify_failed = False
        self._last_watchdog = 0.0
        self._last_status = 0.0
        self._reported: tuple[int, str] | None = None
        self._suspect: tuple[int, float] | None = None  # (offset, first seen) of a bad record at the head
        self._short_since: tuple[str, float] | None = None  # (path, first seen) of a newest segment cut short
        self._stalls = 0  # consecutive re-reads of an incomplete record
        self._failed_at = -1  # dispatched offset when the last session failed: back off while stuck there
        self._failure_reason = ""  # why the last session failed, kept in /healthz while waiting to retry
        self._last_progress = 0.0
        self.server: MetricsServer | None = None
        # what this process dispatched, for the `caught_up` event and `run --until-caught-up`'s summary
        self.first_offset: int | None = None
        self.dispatched_messages = 0
        self.started_at = time.monotonic()
        self.caught_up_at: float | None = None
        self.exit_error: str | None = None  # why `run` ended with a failure, for its line on stderr
        self.on_started = None  # called once, when the first session has opened the output
        self.broker_lock = BrokerLockGuard(config.output.dir, self.metrics, self._log, self._set_health, self.notifier,
                                           self.request_stop, lambda: getattr(self.session, "dispatched_offset", None))


    @property
    def stopping(self) -> threading.Event:
        """Set once a stop is requested."""
        return self._stop

    def request_stop(self, reason: str = "signal") -> None:
        """Sets the stop and wake events (it takes their locks: never call it from a signal handler, see
        `run_daemon`); the loop reports the request when it sees it."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop.set()
        self._wake.set()

    def _report_stop(self) -> None:
        if self._stop_reason is not None and not self._stop_reported:
            self._stop_reported = True
            self._log.info("shutdown_requested", reason=self._stop_reason)

    def notify_stopping(self) -> None:
        """STOPPING=1, once, as soon as stopping starts (before the final flush): systemd then shows the
        unit as deactivating and times the stop with TimeoutStopSec=. Safe from any thread but a signal
        handler (`run_daemon`'s guard thread sends it when a signal arrives)."""
        with self._notify_lock:
            if self._stopping_sent:
                return
            self._stopping_sent = True
        self._notified(self.notifier.stopping("stopping: finishing the batch, flushing, writing the checkpoint"))

    def _notify_ready(self, status: str) -> None:
        """READY=1 with `status`, once: start-up is over, either following the CommitLog or waiting for
        something only the outside can fix (health and STATUS= then say what); see docs/systemd.md.
        Later calls send the status alone."""
        self._starting.clear()
        if not self._ready_sent:
            self._ready_sent = True
            self._notified(self.notifier.ready(status))
        else:
            self.notifier.status(status)
        self._last_status = time.monotonic()

    def _set_health(self, state: str, reason: str = "") -> None:
        if self.health.set(state, reason):
            self.metrics.set_health(state)
            if state != HEALTHY:
                self._log.warning("health_changed", state=state, reason=reason)
            else:
                self._log.info("health_changed", state=state)
                self._repeats_ended()

    def _repeats_ended(self, match=lambda key: True) -> None:
        """One line per failure that stopped after repeats were held back: how many, over how long."""
        for key, repeated, seconds in self._repeats.ended(match):
            self._log.info("failure_repeats_ended", failure=key[0], repeated=repeated, repeated_over_s=seconds)

    def _lag(self) -> Lag | None:
        """At scrape time, from the directories as they are now (`segments_now`, not the loop's last scan) and
        from the oldest record not dispatched yet: true while far behind, right after a start, after idle."""
        s = self.session
        if s is None:
            return None
        offset = s.dispatched_offset
        if isinstance(s.commit_log, DLedgerLog):  # against the committed position (engine/dledgerfollow.py)
            end, behind_s = dledgerfollow.lag_end_and_age(s.commit_log, self.config.store, offset)
        else:
            segments = segments_now(s.commit_log, offset)
            end = written_end(s.commit_log, offset, segments)
            behind_s = 0.0
            if end > offset:
                stored = oldest_undispatched_timestamp(s.commit_log, offset, segments)
                if stored is not None:
                    behind_s = max(0.0, time.time() - stored / MS_PER_SECOND)
        return Lag(offset, end, s.flushed_offset, max(s.checkpoint_offset, 0),
                   s.checkpoint_written_at, behind_s, s.files("consumequeue"), s.files("index"), s.retention_behind)

    def progress(self) -> dict:
        s = self.session
        if s is None:
            return {}
        offset = s.dispatched_offset
        if isinstance(s.commit_log, DLedgerLog):  # the committed position (engine/dledgerfollow.py)
            end = max(offset, dledgerfollow.committed_end(s.commit_log, self.config.store))
        else:
            end = written_end(s.commit_log, offset, segments_now(s.commit_log, offset))
        return {"reputFromOffset": offset, "checkpointOffset": s.checkpoint_offset, "commitLogMaxOffset": end}

    def _tick(self) -> None:
        """Keep systemd informed: WATCHDOG=1 at half its interval, STATUS= every few seconds; look at the
        broker's lock now and again (daemon/engine/brokerlock.py)."""
        self.broker_lock.taken()
        now = time.monotonic()
        interval = self.notifier.watchdog_interval
        if interval and now - self._last_watchdog >= interval:
            self._notified(self.notifier.watchdog())
            self._last_watchdog = now
        if self.notifier.enabled and now - self._last_status >= STATUS_INTERVAL_S and self.session is not None:
            self._last_status = now
            p = self.progress()
            behind = p["commitLogMaxOffset"] - p["reputFromOffset"]
            self.notifier.status(f"{self.health.state}: reput offset {p['reputFromOffset']}, "
                                 f"{max(behind, 0)} bytes behind")

    def _notified(self, sent: bool) -> None:
        """systemd times a start out, or kills on a missed watchdog, without saying why: say it here."""
        if not sent and not self._notify_failed:
            self._notify_failed = True
            self._log.warning("sd_notify_failed", socket=self.notifier.address, error=str(self.notifier.last_error))

    def _size_setting_mismatch(self, error: BaseException) -> str | None:
        """Why the files cannot be read with these settings: every CommitLog segment (the reader's rule), or
        every ConsumeQueue file or IndexFile of the output (recovery's, daemon/engine/sizes.py), has one size
        the config does not give (SizeMismatchError): the setting is not the broker's, which no waiting
        fixes. A single file of another size is damage an operator can repair (a segment: waited out) or
        recovery quarantines (an output file)."""
        if not isinstance(error, SizeMismatchError):
            return None
        return size_advice(error)

    def _flush_succeeded(self) -> None:
        if self.health.state == DEGRADED and self.health.reason.startswith(FLUSH_FAILED):
            self._set_health(HEALTHY)
        self._repeats_ended(lambda key: key[0] == "flush_failed" or key[1:2] == (OutputStage.FLUSH,))

    def _flush_failed(self, error: Exception) -> None:
        self.metrics.errors.labels(kind=ErrorKind.FLUSH).inc()
        text = f"{type(error).__name__}: {error}"
        extra = self._repeats.admit(("flush_failed", text))
        if extra is not None:
            self._log.error("flush_failed", error=text, errno=_errno_name(error), **extra)
        self._report_no_space(OutputStage.FLUSH, error)
        self._set_health(DEGRADED, f"{FLUSH_FAILED}: {error}")

    def _report_no_space(self, stage: OutputStage, error: BaseException, **fields) -> str | None:
        """Name a full output explicitly (event, counter); returns the health reason, None if not that."""
        cause = no_space_error(error)
        if cause is None:
            return None
        self.metrics.no_space.labels(stage=stage).inc()
        path = cause.filename or self.config.output.dir
        free = None
        with contextlib.suppress(OSError):
            st = os.statvfs(self.config.output.dir)
            free = st.f_bavail * st.f_frsize
        extra = self._repeats.admit(("output_space_exhausted", stage, path, _errno_name(cause)))
        if extra is not None:
            self._log.error("output_space_exhausted", stage=stage, file=path, errno=_errno_name(cause),
                            error=cause.strerror or str(cause), output_dir=self.config.output.dir, free_bytes=free,
                            **fields, **extra, action="nothing past the checkpoint is trusted; retrying after a "
                            "back-off" if stage != "flush" else "the checkpoint waits until a flush succeeds")
        return f"{NO_SPACE} ({_errno_name(cause)}) writing {path}"

    def _report_caught_up(self, offset: int) -> None:
        """Log `caught_up` the first time the loop reaches the end of the written data."""
        if self.caught_up_at is None:
            self.caught_up_at = time.monotonic()
            self._log.info("caught_up", reput_from_offset=offset, dispatched=self.dispatched_messages,
                           dispatched_bytes=offset - (self.first_offset or 0),
                           seconds=round(self.caught_up_at - self.started_at, 3))

    def summary(self) -> dict:
        """What this process dispatched: offsets, messages, seconds (for `run --until-caught-up`)."""
        first = self.first_offset if self.first_offset is not None else 0
        end = self.session.dispatched_offset if self.session is not None else first
        return {"startOffset": first, "endOffset": end, "messages": self.dispatched_messages,
                "bytes": end - first, "seconds": round(time.monotonic() - self.started_at, 3),
                "checkpointOffset": self.session.checkpoint_offset if self.session is not None else None,
                "caughtUp": self.caught_up_at is not None, "error": self.exit_error,
                "brokerLockTaken": self.broker_lock.holder is not None}

    def _retrying(self) -> bool:
        return self.health.state == DEGRADED and RESTARTING in self.health.reason

    def _recovered_from_stall(self, offset: int) -> None:
        """Healthy again once reading goes on: past a bad record or a missing directory, or past the batch
        the last session failed on."""
        if self.health.state != HEALTHY and (self.health.reason.startswith((CORRUPT_REASON, COMMITLOG_UNAVAILABLE))
                                             or (self._retrying() and offset > self._failed_at)):
            self._set_health(HEALTHY)

    def _commit_log_unavailable(self, error: StoreLayoutError) -> None:
        """Report once, stay up (metrics keep being served) and look again every poll interval."""
        if self._reported != (-1, str(error)):
            self._reported = (-1, str(error))
            self.metrics.errors.labels(kind=ErrorKind.COMMITLOG).inc()
            self._log.error("commitlog_unavailable", path=error.path, error=str(error))
        self._set_health(DOWN, f"{COMMITLOG_UNAVAILABLE}: {error}")
        self._stop.wait(self.config.reput.poll_interval_ms / MS_PER_SECOND)
