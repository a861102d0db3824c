"""The live service's sessions: start (metrics server, start-up beats to systemd), open a session (recover,
open the CommitLog), run it with its flusher, cleaner and file watch, close it (final flush, checkpoint),
and after a failure back off and open the next one, which recovers as a restart would. The loop that
follows the CommitLog inside a session is daemon/engine/reput.py."""

from __future__ import annotations

import enum
import gc
import threading
import time

from watchdog.events import (
    EVENT_TYPE_CLOSED_NO_WRITE,
    EVENT_TYPE_OPENED,
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from daemon.engine.brokerlock import EXIT_BROKER_RUNNING
from daemon.engine.cleaner import Cleaner
from daemon.engine.dledgermode import commit_log_path, store_mode_problem
from daemon.engine.flusher import Flusher
from daemon.engine.service import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    RESTARTING,
    ServiceState,
    _errno_name,
)
from daemon.engine.session import Session, open_session
from daemon.ops.metrics import (
    DEGRADED,
    DOWN,
    HEALTHY,
    ErrorKind,
    MetricsServer,
    OutputStage,
)
from indexcore.errors import StoreError

RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0
_READ_ONLY_EVENTS = frozenset((EVENT_TYPE_OPENED, EVENT_TYPE_CLOSED_NO_WRITE))
# the events asked of inotify: not opening or reading a file, which reputd's own reads do hundreds of times
# a second (each event is handled by watchdog's threads, taking the interpreter from the loop)
_WAKING_EVENTS = [FileCreatedEvent, DirCreatedEvent, FileDeletedEvent, DirDeletedEvent, FileMovedEvent,
                  DirMovedEvent, FileModifiedEvent, DirModifiedEvent, FileClosedEvent]


class Outcome(enum.Enum):
    STOPPED = "stopped"  # SIGTERM/SIGINT
    CAUGHT_UP = "caught-up"  # --until-caught-up reached the end of the written data
    CORRUPT = "corrupt"  # --until-caught-up met corruption under onCorruption: stop
    FAILED = "failed"  # a dispatcher or the loop failed; nothing past the last checkpoint is trusted
    UNAVAILABLE = "unavailable"  # --until-caught-up lost the CommitLog directory
    BROKER_RUNNING = "broker-running"  # a broker took its lock in the output directory: stop writing (exit 2)


class SessionRunner(ServiceState):
    """Runs sessions until stopped; each follows the CommitLog with the loop a subclass defines (`_follow`)."""


    def run(self) -> int:
        metrics_cfg = self.config.metrics
        if metrics_cfg.enabled:
            self.server = MetricsServer(metrics_cfg.host, metrics_cfg.port, self.metrics, self.health, self.progress)
            self.server.start()
        self._log.info("reputd_started", store=commit_log_path(self.config.store), output=self.config.output.dir,
                       metrics=f"{metrics_cfg.host}:{metrics_cfg.port}" if metrics_cfg.enabled else None,
                       until_caught_up=self.until_caught_up)
        mismatch = store_mode_problem(self.config.store)
        if mismatch:  # a CommitLog of the other kind (DLedger or plain) than the config reads: no wait fixes it
            self.metrics.errors.labels(kind=ErrorKind.RECOVERY).inc()
            self._set_health(DOWN, mismatch)
            return self._config_mismatch(mismatch, self.config.store.store_path_root_dir)
        if self.notifier.enabled:
            self._starting.set()
            threading.Thread(target=self._startup_beats, name="reputd-startup-beats", daemon=True).start()
        try:
            return self._run_sessions()
        finally:
            self._starting.clear()
            self._report_stop()
            if self._ready_sent or self._stop.is_set():  # a start that failed is not a stop: STATUS= says why
                self.notify_stopping()
            if self.server is not None:
                self.server.stop()
            self._log.info("reputd_stopped")

    def _run_sessions(self) -> int:
        backoff = RETRY_MIN_S
        while not self._stop.is_set() and not self.broker_lock.taken(now=True):  # recovery writes the output
            try:
                self.session = open_session(self.config, self.metrics)
            except (StoreError, OSError) as e:
                self.metrics.errors.labels(kind=ErrorKind.RECOVERY).inc()
                mismatch = self._size_setting_mismatch(e)
                retry = None if self.until_caught_up or mismatch else backoff
                extra = self._repeats.admit(("recovery_failed", str(e)))
                if extra is not None:
                    self._log.error("recovery_failed", error=str(e), errno=_errno_name(e), retry_in_s=retry, **extra)
                reason = self._report_no_space(OutputStage.RECOVERY, e) or str(e)
                self._set_health(DOWN, reason)
                if mismatch:
                    return self._config_mismatch(mismatch, e.path)
                if self.until_caught_up:
                    self.exit_error = str(e)
                    return EXIT_FAILURE
                self._notify_ready(f"down: {reason}; retrying in {backoff:g} s")
                self._sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            self._failure_reason = ""
            if self.on_started is not None:
                self.on_started()
                self.on_started = None
            if not gc.get_freeze_count():
                # what start-up and recovery left alive stays so: out of the collector's way, so that a full
                # collection in the loop scans only what the loop allocates (one took 22 ms at 100,000 msgs/s)
                gc.collect()
                gc.freeze()
            outcome = self._run_session(self.session)
            code = self._close_session(self.session, outcome)
            if outcome is Outcome.FAILED:
                if self.session.dispatched_offset > self._failed_at:
                    backoff = RETRY_MIN_S  # the failure is a new one, not the last one again
                self._failed_at = self.session.dispatched_offset
            if outcome is Outcome.FAILED and not self.until_caught_up and not self._stop.is_set():
                reason = self._failure_reason or "dispatch failed"
                self._set_health(DEGRADED, f"{reason}; {RESTARTING} in {backoff:g} s")
                self._sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            if code != EXIT_OK and self.exit_error is None:  # why, for the line on stderr (daemon/cli/run.py)
                self.exit_error = self._failure_reason or "closing the session failed: see the log's error events"
            return code
        if self.broker_lock.holder is not None:  # taken before a session opened (its recovery writes)
            self.exit_error = self.exit_error or self.broker_lock.error(self.config.output.dir, None)
            return EXIT_BROKER_RUNNING
        return EXIT_OK

    def _config_mismatch(self, error: str, path: str) -> int:
        """Settings that do not read these files: no waiting fixes a setting. Exit 2, the configuration
        error every command gives for it, which systemd's unit does not restart (RestartPreventExitStatus=2,
        docs/systemd.md); STATUS= and the log say why."""
        self._log.error("config_mismatch", path=path, error=error, exit_code=EXIT_USAGE)
        self.notifier.status(f"failed: {error}")
        self.exit_error = error
        return EXIT_USAGE

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            self._tick()
            self._stop.wait(min(1.0, deadline - time.monotonic()))

    def _run_session(self, s: Session) -> Outcome:
        flusher = Flusher(s, self._flush_failed, self._flush_succeeded)
        cleaner = Cleaner(s, broker_lock=self.broker_lock)  # deleting is writing: it stops once a broker took it
        observer = self._watch(s.commit_log.dirs)
        flusher.start()
        cleaner.start()
        self._notify_ready(f"recovered; reading from offset {s.dispatched_offset}")
        if not self._retrying():  # a session retried after a failure is healthy once it gets past it
            self._set_health(HEALTHY)
        try:
            return self._follow(s)
        except Exception as e:  # anything unexpected ends the session like a failed dispatch
            s.poisoned = True
            self.metrics.errors.labels(kind=ErrorKind.LOOP).inc()
            self._log.exception("reput_loop_failed", error=f"{type(e).__name__}: {e}", offset=s.dispatched_offset)
            self._failure_reason = f"the reput loop failed at offset {s.dispatched_offset}: {type(e).__name__}: {e}"
            return Outcome.FAILED
        finally:
            cleaner.stop()
            flusher.stop()
            if observer is not None:
                observer.stop()
                observer.join()

    def _close_session(self, s: Session, outcome: Outcome) -> int:
        self._report_stop()
        if outcome is not Outcome.FAILED:
            self.notify_stopping()
        code = EXIT_OK if outcome in (Outcome.STOPPED, Outcome.CAUGHT_UP) else EXIT_FAILURE
        if self.broker_lock.holder is not None:  # whatever ended the session, the output is the broker's now
            code = EXIT_BROKER_RUNNING
        if not s.poisoned:
            try:
                Flusher(s, self._flush_failed).flush_once(thorough=True, whole_fs=True)
                self._log.info("final_flush", reput_from_offset=s.dispatched_offset,
                               checkpoint_offset=s.checkpoint_offset)
                if outcome is Outcome.CAUGHT_UP:  # a one-off run applies the retention rule once, unpaced
                    Cleaner(s, broker_lock=self.broker_lock).clean_reported(paced=False)
            except Exception as e:
                self._flush_failed(e)
                self._failure_reason = self._failure_reason or f"the final flush failed: {type(e).__name__}: {e}"
                code = EXIT_FAILURE
        for d in s.dispatchers:
            try:
                d.close()
            except Exception as e:
                self._log.error("dispatcher_close_failed", dispatcher=d.name, error=str(e))
                self._failure_reason = self._failure_reason or f"closing dispatcher {d.name} failed: {e}"
                code = EXIT_FAILURE
        s.reader.close()
        self._log.info("session_closed", outcome=outcome.value, reput_from_offset=s.dispatched_offset,
                       checkpoint_offset=s.checkpoint_offset)
        if self.broker_lock.holder is not None:
            self.exit_error = self.broker_lock.error(self.config.output.dir, s.checkpoint_offset)
        return code

    def _watch(self, dirs):
        """Wake the loop on file events in the CommitLog directories: a new segment, a deletion, or data
        from a writer that uses write(2). Without inotify the probe and the poll still find new data."""
        wake = self._wake

        class Wake(FileSystemEventHandler):
            def on_any_event(self, event):
                # opening or reading a segment (reputd itself does, every loop) must not wake the loop
                if event.event_type not in _READ_ONLY_EVENTS:
                    wake.set()

        observer = Observer()
        try:
            for d in dirs:
                observer.schedule(Wake(), d, recursive=False, event_filter=_WAKING_EVENTS)
            observer.start()
        except OSError as e:
            self._log.warning("file_events_unavailable", error=str(e), fallback="polling")
            return None
        return observer
