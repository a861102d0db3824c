"""`reputd run`: the live reput loop, what RocketMQ's ReputMessageService does inside the broker.

A *session* (`daemon.session`) is one life of the pipeline: recover the output to a consistent point
(`daemon.recovery`), then read the CommitLog from there in batches and hand each batch to the
dispatchers, while the flusher thread (`daemon.flusher`) makes the output durable and checkpoints it. A
failing dispatcher ends the session without checkpointing past the data it did not take; the service
then starts a new session after a back-off, which recovers exactly as a restart after `kill -9` would:
one recovery path for every way of stopping. Records still being written at the head are held back
(`daemon.head`).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

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

from daemon import dledgerfence, dledgerfollow, failpoint
from daemon.cleaner import Cleaner
from daemon.config import ON_CORRUPTION_SKIP_SEGMENT, Config
from daemon.dledgermode import commit_log_path
from daemon.flusher import Flusher
from daemon.head import (
    HeadDescriptor,
    hold_torn_tail,
    oldest_undispatched_timestamp,
    segments_now,
    written_below,
    written_end,
)
from daemon.logs import RepeatedFailures, get_logger
from daemon.metrics import (
    DEGRADED,
    DOWN,
    HEALTHY,
    LAYOUT_REASON,
    ErrorKind,
    Health,
    Lag,
    MetricsServer,
    OutputStage,
    ReputMetrics,
    SkipReason,
)
from daemon.rebuild import widen_after_dispatch
from daemon.sdnotify import USEC_PER_SECOND, Notifier
from daemon.session import Session, open_session
from indexcore.dledgerlog import DLedgerLog
from indexcore.errors import CorruptRecordError, SizeMismatchError, StoreError, StoreLayoutError
from indexcore.reader import ReadResult, ReadStatus

EXIT_OK, EXIT_FAILURE = 0, 1
MS_PER_SECOND = 1000
# After reaching the head, look for the next record every PROBE_MIN_S, backing off to PROBE_MAX_S:
# a broker writes through its mapping, which raises no file event, and the probe is a 4-byte read. One
# interval while data flows: a backoff to 10 ms after a probe that found nothing (the writer a moment late)
# put 15 ms between two reads, the tail of the dispatch latency; shorter than 4 ms, the reads at 100,000
# msgs/s cost more CPU than they save latency (each read and dispatch has a fixed cost: bench/results/latency.md).
PROBE_MIN_S = 0.004
PROBE_MAX_S = 0.004
# A record caught being copied in is read again after IN_FLIGHT_RETRY_S, doubling while it stays incomplete:
# a copy takes microseconds, and the 8 ms the first retry waited were the p99 of the dispatch latency.
IN_FLIGHT_RETRY_S = 0.0005
# Once nothing has arrived for IDLE_AFTER_S, probe only every IDLE_PROBE_S: near-zero CPU when idle.
IDLE_AFTER_S = 2.0
IDLE_PROBE_S = 0.05
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0
STATUS_INTERVAL_S = 2.0
# While start-up recovery works, systemd's start timeout is pushed back every STARTUP_BEAT_S by
# STARTUP_EXTEND_S, as long as the process used at least STARTUP_PROGRESS_CPU_S of CPU or read or wrote
# data since the previous beat: a recovery that hangs (an NFS read that never returns) stops the beats,
# and TimeoutStartSec= ends it.
STARTUP_BEAT_S = 10.0
STARTUP_EXTEND_S = 30.0
STARTUP_PROGRESS_CPU_S = 0.05
# A record being copied in does not fill front to back (memcpy stores the tail of a small copy first),
# so a bad record near the head (in the newest segment with data, or the one before it, which a roll has
# just left) may be one still in flight: it is only declared corrupt once it has stayed bad this long.
IN_FLIGHT_GRACE_S = 1.0
# How far batches spread thin over many queues grow while the loop is behind (`rebuild.widen_thin_batches`):
# less than a rebuild's, since a stop waits for the batch in hand (catching up on 100,000 LMQ queues took
# 286.8 s in 4 MiB batches, 137.7 s up to 32 MiB, 97.7 s up to 64 MiB and 72.7 s up to 256 MiB)
RUN_MAX_BATCH_BYTES = 64 * 1024 * 1024
FLUSH_FAILED = "flush failed"
NO_SPACE = "output space exhausted"
# errnos that mean "no room for the output": a full file system, a quota, or RLIMIT_FSIZE (SIGXFSZ, which
# Python ignores, turns into EFBIG). IndexFiles are allocated in full when created and ConsumeQueue files
# are written with pwrite, so these surface as an OSError naming the file, never as SIGBUS on a write
# through a mapping.
NO_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG))
COMMITLOG_UNAVAILABLE = "CommitLog unavailable"
RESTARTING = "restarting from the last checkpoint"
_READ_ONLY_EVENTS = frozenset((EVENT_TYPE_OPENED, EVENT_TYPE_CLOSED_NO_WRITE))
# the events asked of inotify: not opening or reading a file, which reputd's own reads do hundreds of times
# a second (each event is handled by watchdog's threads, taking the interpreter from the loop)
_WAKING_EVENTS = [FileCreatedEvent, DirCreatedEvent, FileDeletedEvent, DirDeletedEvent, FileMovedEvent,
                  DirMovedEvent, FileModifiedEvent, DirModifiedEvent, FileClosedEvent]
CORRUPT_REASON = "corrupt"


class Outcome(enum.Enum):
    STOPPED = "stopped"  # SIGTERM/SIGINT
    CAUGHT_UP = "caught-up"  # --until-caught-up reached the end of the written data
    CORRUPT = "corrupt"  # --until-caught-up met corruption under onCorruption: stop
    FAILED = "failed"  # a dispatcher or the loop failed; nothing past the last checkpoint is trusted
    UNAVAILABLE = "unavailable"  # --until-caught-up lost the CommitLog directory


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


def _work_done() -> tuple[float, tuple[str, ...]]:
    """CPU seconds this process has used, and its I/O counters (bytes read and written, /proc/self/io),
    to tell a start-up that works from one that hangs."""
    times = os.times()
    io: tuple[str, ...] = ()
    with contextlib.suppress(OSError), open("/proc/self/io") as f:
        io = tuple(line for line in f if line.startswith(("read_bytes", "write_bytes")))
    return times.user + times.system, io


def _errno_name(error: BaseException) -> str | None:
    code = getattr(error, "errno", None)
    return errno.errorcode.get(code) if isinstance(code, int) else None


# --- the service ------------------------------------------------------------------------------------

class ReputService:
    """Runs sessions until stopped; owns what outlives a session (metrics, health, notifications)."""

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
        self.exit_error: str | None = None  # why `run --until-caught-up` stopped before the end, for its summary

    # --- control -------------------------------------------------------------------------------

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
        something only the outside can fix (health and STATUS= then say what); see systemd/README.md.
        Later calls send the status alone."""
        self._starting.clear()
        if not self._ready_sent:
            self._ready_sent = True
            self._notified(self.notifier.ready(status))
        else:
            self.notifier.status(status)
        self._last_status = time.monotonic()

    def _startup_beats(self) -> None:
        """While start-up recovery runs, push systemd's start timeout back every STARTUP_BEAT_S, as long as
        the process is working (CPU used, data read or written since the last beat)."""
        last = _work_done()
        while self._starting.is_set() and not self._stop.wait(STARTUP_BEAT_S):
            now = _work_done()
            if not self._starting.is_set():
                return
            if now[0] - last[0] >= STARTUP_PROGRESS_CPU_S or now[1] != last[1]:
                self._notified(self.notifier.extend_timeout(int(STARTUP_EXTEND_S * USEC_PER_SECOND)))
                self.notifier.status("starting: recovering the output")
            last = now

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
        if isinstance(s.commit_log, DLedgerLog):  # against the committed position (daemon/dledgerfollow.py)
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
                   s.checkpoint_written_at, behind_s, s.files("consumequeue"), s.files("index"))

    def progress(self) -> dict:
        s = self.session
        if s is None:
            return {}
        offset = s.dispatched_offset
        if isinstance(s.commit_log, DLedgerLog):  # the committed position (daemon/dledgerfollow.py)
            end = max(offset, dledgerfollow.committed_end(s.commit_log, self.config.store))
        else:
            end = written_end(s.commit_log, offset, segments_now(s.commit_log, offset))
        return {"reputFromOffset": offset, "checkpointOffset": s.checkpoint_offset, "commitLogMaxOffset": end}

    def _tick(self) -> None:
        """Keep systemd informed: WATCHDOG=1 at half its interval, STATUS= every few seconds."""
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

    # --- main -------------------------------------------------------------------------------------

    def run(self) -> int:
        metrics_cfg = self.config.metrics
        if metrics_cfg.enabled:
            self.server = MetricsServer(metrics_cfg.host, metrics_cfg.port, self.metrics, self.health, self.progress)
            self.server.start()
        self._log.info("reputd_started", store=commit_log_path(self.config.store), output=self.config.output.dir,
                       metrics=f"{metrics_cfg.host}:{metrics_cfg.port}" if metrics_cfg.enabled else None,
                       until_caught_up=self.until_caught_up)
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
        while not self._stop.is_set():
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
                    # no waiting fixes a setting: exit 1 lets systemd's Restart= and start limit end the
                    # retries (systemd/README.md)
                    self._log.error("commitlog_size_mismatch", path=e.path, error=mismatch, exit_code=EXIT_FAILURE)
                    self.notifier.status(f"failed: {mismatch}")
                    return EXIT_FAILURE
                if self.until_caught_up:
                    self.exit_error = str(e)
                    return EXIT_FAILURE
                self._notify_ready(f"down: {reason}; retrying in {backoff:g} s")
                self._sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            self._failure_reason = ""
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
            return code
        return EXIT_OK

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            self._tick()
            self._stop.wait(min(1.0, deadline - time.monotonic()))

    def _run_session(self, s: Session) -> Outcome:
        flusher = Flusher(s, self._flush_failed, self._flush_succeeded)
        cleaner = Cleaner(s)
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
        if not s.poisoned:
            try:
                Flusher(s, self._flush_failed).flush_once(thorough=True, whole_fs=True)
                self._log.info("final_flush", reput_from_offset=s.dispatched_offset,
                               checkpoint_offset=s.checkpoint_offset)
                if outcome is Outcome.CAUGHT_UP:  # a one-off run applies the retention rule once, unpaced
                    Cleaner(s).clean_reported(pause=False)
            except Exception as e:
                self._flush_failed(e)
                code = EXIT_FAILURE
        for d in s.dispatchers:
            try:
                d.close()
            except Exception as e:
                self._log.error("dispatcher_close_failed", dispatcher=d.name, error=str(e))
                code = EXIT_FAILURE
        s.reader.close()
        self._log.info("session_closed", outcome=outcome.value, reput_from_offset=s.dispatched_offset,
                       checkpoint_offset=s.checkpoint_offset)
        return code

    def _size_setting_mismatch(self, error: BaseException) -> str | None:
        """Why the CommitLog cannot be read with these settings, when its segments all have one size that is
        not mappedFileSizeCommitLog (SizeMismatchError from the CommitLog): the setting is not the broker's,
        which no waiting fixes. A single segment of another size, or a stray file, is damage an operator can
        repair: that is waited out."""
        if not isinstance(error, SizeMismatchError):
            return None
        dirs = [os.path.abspath(d) for d in (*self.config.store.commit_log_dirs, commit_log_path(self.config.store))]
        path = os.path.abspath(error.path)
        if not any(path.startswith(d + os.sep) for d in dirs):
            return None
        return f"{error}: set mappedFileSizeCommitLog to the broker's value"

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

    # --- the loop ---------------------------------------------------------------------------------

    def _follow(self, s: Session) -> Outcome:
        offset = s.dispatched_offset
        if self.first_offset is None:
            self.first_offset = offset
        cut_short = self._cut_short(s, None) if self.until_caught_up else None
        if cut_short is not None:  # refused as a whole before anything is dispatched, as `rebuild` refuses it
            self._commit_log_unavailable(cut_short)
            self.exit_error = str(cut_short)
            return Outcome.UNAVAILABLE
        head = HeadDescriptor()
        try:
            return self._follow_from(s, offset, head)
        finally:
            head.close()

    def _follow_from(self, s: Session, offset: int, head: HeadDescriptor) -> Outcome:
        poll = self.config.reput.poll_interval_ms / MS_PER_SECOND
        verified = 0.0
        while not self._stop.is_set():
            self._tick()
            now = time.monotonic()
            verify = self.until_caught_up or now - verified >= poll
            if verify:
                verified = now
            try:
                written = written_below(s.commit_log, offset, s.reader.batch_bytes + s.reader.max_message_size,
                                       head)
                result = s.reader.read(offset, verify_end=verify)
                self.metrics.reads.inc()
            except StoreLayoutError as e:  # the CommitLog directory vanished or holds a stray file
                self._commit_log_unavailable(e)
                if self.until_caught_up:
                    self.exit_error = str(e)
                    return Outcome.UNAVAILABLE
                continue
            result = hold_torn_tail(s, offset, result, written)
            # a new DLedger leader cut what was dispatched: at the head, or where the new entries make no sense
            if result.status is not ReadStatus.OK and dledgerfence.truncated(
                    s.dispatchers, now=result.status is not ReadStatus.END):
                return self._dledger_truncated(s, offset)
            if result.skipped_from is not None:
                skipped = result.next_offset - result.skipped_from
                self.metrics.skipped.labels(reason=SkipReason.RETENTION).inc(skipped)
                self._log.warning("offset_below_oldest_segment", requested=result.skipped_from,
                                  resumed_at=result.next_offset, skipped_bytes=skipped)
            if not self._dispatch(s, result):
                return Outcome.FAILED
            self.dispatched_messages += len(result.batch)
            if result.next_offset != offset:
                self._stalls = 0
                self._last_progress = time.monotonic()
            offset = result.next_offset
            if result.rolled:
                self._log.info("segment_rolled", next_segment=offset)
            # only a verified read tells a clean end from a bad record (a zero TOTALSIZE with data after it
            # reads as a plain end unverified): an unverified one must not restart the in-flight grace
            if result.status is ReadStatus.OK or (result.status is ReadStatus.END and result.pending is None
                                                  and verify):
                self._suspect = None
            if result.status is ReadStatus.OK:
                self._reported = None
                self._recovered_from_stall(offset)
                widen_after_dispatch(s.reader, s.dispatchers, RUN_MAX_BATCH_BYTES)  # behind the writer
                continue
            if result.status is ReadStatus.END:
                cut_short = self._cut_short(s, offset)
                if cut_short is not None:  # what `rebuild` refuses at once: the same rule, after a grace
                    self._commit_log_unavailable(cut_short)
                    if self.until_caught_up:
                        self.exit_error = str(cut_short)
                        return Outcome.UNAVAILABLE
                    continue
                s.reader.batch_bytes = self.config.reput.batch_bytes  # caught up: back to the configured size
                self._recovered_from_stall(offset)
                self._report_caught_up(offset)
                if self.until_caught_up:
                    if result.pending is not None:
                        self._log.warning("incomplete_record_at_end", error=str(result.pending))
                    return Outcome.CAUGHT_UP
                if result.pending is None:
                    self._stalls = 0
                    self._wait_for_data(s, offset, pending=False)
                else:
                    self._wait_in_flight(s, offset)
                continue
            if self._maybe_in_flight(s, offset):
                continue
            outcome = self._corrupt(s, result)
            if outcome is not None:
                return outcome
            offset = s.dispatched_offset
        return Outcome.STOPPED

    def _dledger_truncated(self, s: Session, offset: int) -> Outcome:
        """End the session with nothing checkpointed past the cut: the next start repairs the output
        (`daemon.dledgerfence.repair_truncation`)."""
        s.poisoned = True
        self._failure_reason = "DLedger entries already dispatched were cut from the log"
        self._log.warning("dledger_truncation_found", reput_from_offset=offset,
                          checkpoint_offset=s.checkpoint_offset, action=RESTARTING)
        return Outcome.FAILED

    def _cut_short(self, s: Session, offset: int | None) -> StoreLayoutError | None:
        """The newest segment (where reading stopped, or with `offset` None anywhere) when it is shorter than
        mappedFileSizeCommitLog and stays so for IN_FLIGHT_GRACE_S: a broker maps a new segment at its full
        size at once, so one that stays short was cut short (a copy, a disk that ran out), and the broker
        would refuse to load the directory, as `rebuild` does. `run --until-caught-up` waits the grace
        here; the live loop sees it again at each read."""
        log = s.commit_log
        deadline = time.monotonic() + IN_FLIGHT_GRACE_S
        while True:
            short = log.short_newest
            if short is None or (offset is not None and log.segment_start(offset) != int(os.path.basename(short[0]))):
                self._short_since = None
                return None
            now = time.monotonic()
            if self._short_since is None or self._short_since[0] != short[0]:
                self._short_since = (short[0], now)
            if now - self._short_since[1] >= IN_FLIGHT_GRACE_S:
                return StoreLayoutError(short[0], f"segment is {short[1]} bytes, mappedFileSizeCommitLog is "
                                                  f"{log.segment_size}")
            if not self.until_caught_up or now >= deadline or self._stop.wait(PROBE_MIN_S * 16):
                return None
            log.refresh()

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
                "caughtUp": self.caught_up_at is not None, "error": self.exit_error}

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

    def _dispatch(self, s: Session, result: ReadResult) -> bool:
        batch = result.batch
        n = len(batch)
        with s.lock:
            if n:
                for d, counter in zip(s.dispatchers, s.dispatched_counters, strict=True):
                    try:
                        d.dispatch(batch)
                    except Exception as e:
                        s.poisoned = True
                        self.metrics.errors.labels(kind=ErrorKind.DISPATCH).inc()
                        text = f"{type(e).__name__}: {e}"
                        extra = self._repeats.admit(("dispatch_failed", d.name, text))
                        if extra is not None:
                            self._log.error("dispatch_failed", dispatcher=d.name, error=text, errno=_errno_name(e),
                                            batch_start=batch.start_offset, batch_end=batch.end_offset,
                                            checkpoint_offset=s.checkpoint_offset, **extra)
                        no_space = self._report_no_space(OutputStage.DISPATCH, e, dispatcher=d.name,
                                                         checkpoint_offset=s.checkpoint_offset)
                        self._failure_reason = no_space or f"dispatcher {d.name} failed: {e}"
                        self._set_health(DEGRADED, self._failure_reason)
                        return False
                    counter.inc(n)
                self.metrics.batch_messages.observe(n)
            s.dispatched_offset = result.next_offset
        return True

    def _wait_for_data(self, s: Session, offset: int, *, pending: bool, limit: float | None = None) -> None:
        """Sleep until a file event, a probe that sees a new TOTALSIZE, or the poll interval."""
        now = time.monotonic()
        deadline = now + (limit or self.config.reput.poll_interval_ms / MS_PER_SECOND)
        longest = PROBE_MAX_S if now - self._last_progress < IDLE_AFTER_S else IDLE_PROBE_S
        delay = PROBE_MIN_S
        while not self._stop.is_set():
            if self._wake.wait(min(delay, max(0.0, deadline - time.monotonic()))):  # never past the limit
                self._wake.clear()
                return
            self._tick()
            if time.monotonic() >= deadline:
                return
            if not pending and s.reader.probe(offset):
                return
            delay = min(delay * 2, longest)

    def _maybe_in_flight(self, s: Session, offset: int) -> bool:
        """True while a bad record may still be being written: wait and re-read.

        Only data the writer has certainly left behind is judged. A broker fills segment after segment, so
        once a segment *two* on from the bad record's holds data, the writer has written the whole of the
        one between since, and the bad record is settled. Nearer the head (the record's segment is the
        newest with data, or the one before it) it is not: the record, the BLANK that ends its segment and
        the next segment's first records are written back to back, and what the reader saw of each came at
        different instants (issue 28 §3). There, the record must stay bad for IN_FLIGHT_GRACE_S."""
        log = s.commit_log
        if log.has_written_segment_after(log.segment_start(offset) + log.segment_size):
            return False
        now = time.monotonic()
        if self._suspect is None or self._suspect[0] != offset:
            self._suspect = (offset, now)
        if now - self._suspect[1] >= IN_FLIGHT_GRACE_S:
            return False
        self._wait_in_flight(s, offset)
        return True

    def _wait_in_flight(self, s: Session, offset: int) -> None:
        """Re-read an incomplete record soon, backing off to the poll interval if its writer is gone."""
        self._stalls += 1
        limit = min(IN_FLIGHT_RETRY_S * 2 ** min(self._stalls - 1, 16),
                    self.config.reput.poll_interval_ms / MS_PER_SECOND)
        self._wait_for_data(s, offset, pending=True, limit=limit)

    def _corrupt(self, s: Session, result: ReadResult) -> Outcome | None:
        """Apply onCorruption. `stop` stays at the offset (reported once, retried every poll interval in
        case the data is repaired); `skip-segment` logs and counts the range and goes to the next segment."""
        error = result.error
        offset = result.next_offset
        reason = error.field if isinstance(error, CorruptRecordError) else LAYOUT_REASON
        path = getattr(error, "path", None)
        policy = self.config.reput.on_corruption
        if self._reported != (offset, str(error)):
            self._reported = (offset, str(error))
            self.metrics.corrupt.labels(reason=reason).inc()
            self._log.error("corrupt_commitlog", file=path, offset=offset, reason=reason, error=str(error),
                            policy=policy)
        if policy == ON_CORRUPTION_SKIP_SEGMENT:
            nxt = s.commit_log.segment_start(offset) + s.commit_log.segment_size
            self.metrics.skipped.labels(reason=SkipReason.CORRUPTION).inc(nxt - offset)
            self._log.warning("segment_skipped", file=path, skipped_from=offset, skipped_to=nxt,
                              skipped_bytes=nxt - offset)
            with s.lock:
                s.dispatched_offset = nxt
            self._reported = None
            return None
        self._set_health(DEGRADED, f"{CORRUPT_REASON} CommitLog at offset {offset}: {error}")
        if self.until_caught_up:
            self.exit_error = str(error)
            return Outcome.CORRUPT
        deadline = time.monotonic() + self.config.reput.poll_interval_ms / MS_PER_SECOND
        while not self._stop.is_set() and time.monotonic() < deadline:
            self._tick()
            self._stop.wait(min(PROBE_MAX_S * 10, max(0.0, deadline - time.monotonic())))
        return None


def run_daemon(config: Config, *, until_caught_up: bool = False,
               on_exit: Callable[[dict], None] | None = None) -> int:
    """Run the service in this process, stopping cleanly on SIGTERM/SIGINT within the shutdown timeout;
    `on_exit` gets the service's `summary()` once it has stopped."""
    failpoint.install_from_env()
    service = ReputService(config, until_caught_up=until_caught_up)
    timeout = config.reput.shutdown_timeout_ms / MS_PER_SECOND
    finished = threading.Event()

    def give_up() -> None:
        """Written with one raw write: the main thread may be stuck holding the logger's lock."""
        event = {"event": "shutdown_timeout", "level": "error", "timeout_ms": config.reput.shutdown_timeout_ms,
                 "detail": "exiting without a final checkpoint; the next start recovers from the last one"}
        with contextlib.suppress(OSError):
            os.write(sys.stdout.fileno(), json.dumps(event).encode() + b"\n")
        os._exit(EXIT_FAILURE)

    def guard() -> None:
        """Started before any signal can arrive."""
        service.stopping.wait()
        if not finished.is_set():
            service.notify_stopping()
        if not finished.wait(timeout):
            give_up()

    def on_signal(signum, _frame) -> None:
        """Does nothing: a Python handler runs in the main thread between two bytecodes, possibly inside a
        lock the loop holds (setting the wake event while the loop cleared it deadlocked a SIGTERM until
        the shutdown timeout). The interpreter writes the signal's number to the wake-up descriptor, and
        `relay` stops the service from a thread of its own."""

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)

    def relay() -> None:
        try:
            while True:
                for signum in os.read(read_end, 64):
                    if signum == 0:  # run_daemon is done
                        return
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        service.request_stop(signal.Signals(signum).name)
        finally:
            os.close(read_end)

    threading.Thread(target=guard, name="reputd-shutdown-guard", daemon=True).start()
    threading.Thread(target=relay, name="reputd-signal-relay", daemon=True).start()
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)  # before a signal can arrive
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = service.run()
    finally:
        finished.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        os.write(write_end, b"\0")
        os.close(write_end)
    if on_exit is not None:
        on_exit(service.summary())
    return code
