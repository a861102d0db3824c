"""`reputd run`: the live reput loop, what RocketMQ's ReputMessageService does inside the broker.

A *session* (`daemon.engine.session`) is one life of the pipeline: recover the output to a consistent point
(`daemon.engine.recovery`), then read the CommitLog from there in batches and hand each batch to the
dispatchers, while the flusher thread (`daemon.engine.flusher`) makes the output durable and checkpoints it. A
failing dispatcher ends the session without checkpointing past the data it did not take; the service
then starts a new session after a back-off, which recovers exactly as a restart after `kill -9` would:
one recovery path for every way of stopping. Records still being written at the head are held back
(`daemon.engine.head`).

This module is the loop itself (`ReputService`, with the start-up beats to systemd while recovery runs)
and `run_daemon`, the process around it (signals, the shutdown timeout); the sessions it runs in are
daemon/engine/runner.py, what the service shows the outside (health, systemd, metrics, failure reports)
daemon/engine/service.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from daemon.config import ON_CORRUPTION_SKIP_SEGMENT, Config
from daemon.engine import dledgerfence
from daemon.engine.head import (
    HeadDescriptor,
    hold_torn_tail,
    written_below,
)
from daemon.engine.headwarm import HeadWarmer
from daemon.engine.rebuild import widen_after_dispatch
from daemon.engine.runner import (
    Outcome,
    SessionRunner,
)
from daemon.engine.service import (
    CORRUPT_REASON,
    EXIT_FAILURE,
    MS_PER_SECOND,
    RESTARTING,
    _errno_name,
)
from daemon.engine.session import Session
from daemon.ops import failpoint
from daemon.ops.metrics import (
    DEGRADED,
    LAYOUT_REASON,
    ErrorKind,
    OutputStage,
    SkipReason,
)
from daemon.ops.sdnotify import USEC_PER_SECOND
from indexcore.errors import CorruptRecordError, StoreLayoutError
from indexcore.reader import ReadResult, ReadStatus

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
# A record being copied in does not fill front to back (memcpy stores the tail of a small copy first),
# so a bad record near the head (in the newest segment with data, or the one before it, which a roll has
# just left) may be one still in flight: it is only declared corrupt once it has stayed bad this long.
IN_FLIGHT_GRACE_S = 1.0
# How far batches spread thin over many queues grow while the loop is behind (`rebuild.widen_thin_batches`):
# less than a rebuild's, since a stop waits for the batch in hand (catching up on 100,000 LMQ queues took
# 286.8 s in 4 MiB batches, 137.7 s up to 32 MiB, 97.7 s up to 64 MiB and 72.7 s up to 256 MiB)
RUN_MAX_BATCH_BYTES = 64 * 1024 * 1024
# While start-up recovery works, systemd's start timeout is pushed back every STARTUP_BEAT_S by
# STARTUP_EXTEND_S, as long as the process used at least STARTUP_PROGRESS_CPU_S of CPU or read or wrote
# data since the previous beat: a recovery that hangs (an NFS read that never returns) stops the beats,
# and TimeoutStartSec= ends it.
STARTUP_BEAT_S = 10.0
STARTUP_EXTEND_S = 30.0
STARTUP_PROGRESS_CPU_S = 0.05


def _work_done() -> tuple[float, tuple[str, ...]]:
    """CPU seconds this process has used, and its I/O counters (bytes read and written, /proc/self/io),
    to tell a start-up that works from one that hangs."""
    times = os.times()
    io: tuple[str, ...] = ()
    with contextlib.suppress(OSError), open("/proc/self/io") as f:
        io = tuple(line for line in f if line.startswith(("read_bytes", "write_bytes")))
    return times.user + times.system, io



class ReputService(SessionRunner):
    """The live reput loop: follow the CommitLog from the session's offset, dispatch each batch, wait at the
    head for data, hold back records still being written, and decide what a bad record ends."""

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
        self._warmer = HeadWarmer(s.commit_log)
        try:
            return self._follow_from(s, offset, head)
        finally:
            self._warmer.close()
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
                self._warmer.note(written)
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
            if len(result.batch) and self.broker_lock.taken(now=True):  # a broker writes its root now: not one unit
                return Outcome.BROKER_RUNNING
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

    def _dledger_truncated(self, s: Session, offset: int) -> Outcome:
        """End the session with nothing checkpointed past the cut: the next start repairs the output
        (`daemon.engine.dledgerfence.repair_truncation`)."""
        s.poisoned = True
        self._failure_reason = "DLedger entries already dispatched were cut from the log"
        self._log.warning("dledger_truncation_found", reput_from_offset=offset,
                          checkpoint_offset=s.checkpoint_offset, action=RESTARTING)
        return Outcome.FAILED

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
               on_exit: Callable[[dict], None] | None = None, on_started: Callable[[], None] | None = None) -> int:
    """Run the service in this process, stopping cleanly on SIGTERM/SIGINT within the shutdown timeout;
    `on_started` is called once the first session has opened the output, `on_exit` gets the service's
    `summary()` once it has stopped."""
    failpoint.install_from_env()
    service = ReputService(config, until_caught_up=until_caught_up)
    service.on_started = on_started
    timeout = config.reput.shutdown_timeout_ms / MS_PER_SECOND
    finished = threading.Event()

    def give_up() -> None:
        """Written with one raw write: the main thread may be stuck holding the logger's lock."""
        event = {"event": "shutdown_timeout", "level": "error", "timeout_ms": config.reput.shutdown_timeout_ms,
                 "detail": "exiting without a final checkpoint; the next start recovers from the last one"}
        with contextlib.suppress(OSError):
            os.write(sys.stdout.fileno(), json.dumps(event).encode() + b"\n")
        with contextlib.suppress(OSError):  # and the one line on stderr every failing command gives
            os.write(sys.stderr.fileno(), f"reputd: error: the stop took longer than reput.shutdownTimeoutMs "
                                          f"({config.reput.shutdown_timeout_ms} ms): {event['detail']}\n".encode())
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
