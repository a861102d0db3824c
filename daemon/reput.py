"""`reputd run`: the live reput loop, what RocketMQ's ReputMessageService does inside the broker.

A *session* is one life of the pipeline: recover the output to a consistent point, then read the
CommitLog from there in batches and hand each batch to the dispatchers, while the flusher thread
makes the output durable and checkpoints it. A failing dispatcher ends the session without
checkpointing past the data it did not take; the service then starts a new session after a back-off,
which recovers exactly as a restart after `kill -9` would: one recovery path for every way of stopping.

Recovery, in order of trust:
1. reputd's checkpoint: cut every dispatcher back to it (ConsumeQueue units and IndexFile entries at
   or past `reputFromOffset` are removed) and read on from there;
2. no checkpoint, or one that cannot be trusted: start where the broker would (the end of the last
   ConsumeQueue unit, the newest IndexFile's end offset, whichever is lower, floored at the CommitLog's
   first offset) and let the dispatchers' own dedupe skip what they already hold;
3. an output file of the wrong size or with a garbage header is moved to `quarantine/` in the output
   directory, and what it held is dispatched again from the CommitLog.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import json
import mmap
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from watchdog.events import EVENT_TYPE_CLOSED_NO_WRITE, EVENT_TYPE_OPENED, FileSystemEventHandler
from watchdog.observers import Observer

from daemon.checkpoint import Checkpoint, CheckpointError, read_checkpoint, write_checkpoint
from daemon.config import ON_CORRUPTION_SKIP_SEGMENT, Config
from daemon.dispatchers import Dispatcher, build_dispatchers
from daemon.flusher import Flusher
from daemon.logs import get_logger
from daemon.metrics import DEGRADED, DOWN, HEALTHY, Health, Lag, MetricsServer, ReputMetrics
from daemon.rebuild import make_reader
from daemon.sdnotify import Notifier
from indexcore.commitlog import RECORD_PREFIX, MessageRecord
from indexcore.consumequeue import CONSUME_QUEUE_DIR
from indexcore.dispatch import DispatchBatch
from indexcore.errors import CorruptRecordError, StoreError, StoreLayoutError
from indexcore.indexservice import INDEX_DIR
from indexcore.reader import CommitLog, CommitLogReader, ReadResult, ReadStatus

EXIT_OK, EXIT_FAILURE = 0, 1
MS_PER_SECOND = 1000
QUARANTINE_DIR = "quarantine"
# After reaching the head, look for the next record every PROBE_MIN_S, backing off to PROBE_MAX_S:
# a broker writes through its mapping, which raises no file event, and the probe is a 4-byte read.
PROBE_MIN_S = 0.005
PROBE_MAX_S = 0.01
# Once nothing has arrived for IDLE_AFTER_S, probe only every IDLE_PROBE_S: near-zero CPU when idle.
IDLE_AFTER_S = 2.0
IDLE_PROBE_S = 0.05
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0
STATUS_INTERVAL_S = 2.0
# A record being copied in does not fill front to back (memcpy stores the tail of a small copy first),
# so a bad record at the head of the newest segment may be one still in flight: it is only declared
# corrupt once it has stayed bad this long.
IN_FLIGHT_GRACE_S = 1.0
MAX_QUARANTINES = 64
FLUSH_FAILED = "flush failed"
NO_SPACE = "output space exhausted"
# errnos that mean "no room for the output": a full file system, a quota, or RLIMIT_FSIZE (SIGXFSZ, which
# Python ignores, turns into EFBIG). IndexFiles are allocated in full when created and ConsumeQueue files
# are written with pwrite, so these surface as an OSError naming the file, never as SIGBUS on a write
# through a mapping.
NO_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG))
COMMITLOG_UNAVAILABLE = "CommitLog unavailable"
_READ_ONLY_EVENTS = frozenset((EVENT_TYPE_OPENED, EVENT_TYPE_CLOSED_NO_WRITE))
CORRUPT_REASON = "corrupt"


class Outcome(enum.Enum):
    STOPPED = "stopped"  # SIGTERM/SIGINT
    CAUGHT_UP = "caught-up"  # --until-caught-up reached the end of the written data
    CORRUPT = "corrupt"  # --until-caught-up met corruption under onCorruption: stop
    FAILED = "failed"  # a dispatcher or the loop failed; nothing past the last checkpoint is trusted
    UNAVAILABLE = "unavailable"  # --until-caught-up lost the CommitLog directory


@dataclass(eq=False)
class Session:
    """The state the loop, the flusher and the metrics share; the lock is held for each dispatch."""

    config: Config
    output_dir: str
    commit_log: CommitLog
    reader: CommitLogReader
    dispatchers: list[Dispatcher]
    metrics: ReputMetrics
    dispatched_offset: int
    dispatched_store_timestamp: int = 0
    flushed_offset: int = 0
    checkpoint_offset: int = -1
    checkpoint_states: dict[str, Any] = field(default_factory=dict)
    checkpoint_written_at: float = 0.0
    poisoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    synced_paths: set[str] = field(default_factory=set)  # files and directories whose entries are durable
    dispatched_counters: list = field(default_factory=list)  # per dispatcher, labels resolved once

    def __post_init__(self) -> None:
        self.dispatched_counters = [self.metrics.dispatched.labels(dispatcher=d.name) for d in self.dispatchers]

    def files(self, name: str) -> int:
        for d in self.dispatchers:
            if d.name == name and hasattr(d, "files"):
                return d.files()
        return 0


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


# --- recovery -------------------------------------------------------------------------------------

def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(directory)]) == os.path.abspath(directory)


def quarantine(output_dir: str, bad_path: str) -> list[str]:
    """Move a damaged output file out of the way, with everything that depends on it: a ConsumeQueue's
    whole queue directory, or an IndexFile and every newer one. Returns the paths moved."""
    rel = os.path.relpath(bad_path, output_dir).split(os.sep)
    moved = []
    if rel[0] == CONSUME_QUEUE_DIR and len(rel) >= 3:
        targets = [os.path.join(output_dir, *rel[:3])]
    elif rel[0] == INDEX_DIR and len(rel) == 2:
        # newest first: a kill part-way leaves the older files, the damaged one still among them, so the
        # next start quarantines the rest and never sees a hole in the index
        index_dir = os.path.join(output_dir, INDEX_DIR)
        targets = [os.path.join(index_dir, n) for n in sorted(os.listdir(index_dir), reverse=True) if n >= rel[1]]
    else:
        targets = [bad_path]
    stamp = time.strftime("%Y%m%d%H%M%S")
    for target in targets:
        dest = os.path.join(output_dir, QUARANTINE_DIR, stamp, os.path.relpath(target, output_dir))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(target, dest)
        moved.append(target)
    return moved


def _write_replay_marker(output_dir: str, offset: int, reason: str, log) -> Checkpoint:
    """A checkpoint with no dispatcher state: "read again from `offset`; each dispatcher skips what its
    files already hold". Written, durably, before any step that a kill must not make recovery forget: a
    quarantine, or a start from offsets derived from the files (a batch is written queue by queue, so
    until the first real checkpoint the files may hold part of one)."""
    marker = Checkpoint(offset, {}, int(time.time() * MS_PER_SECOND))
    write_checkpoint(output_dir, marker)
    log.info("replay_marker_written", reput_from_offset=offset, reason=reason)
    return marker


def _build_with_quarantine(config: Config, output_dir: str, commit_log: CommitLog, log,
                           metrics: ReputMetrics | None = None) -> tuple[list[Dispatcher], list[str]]:
    moved: list[str] = []
    for _ in range(MAX_QUARANTINES):
        try:
            return build_dispatchers(config, output_dir), moved
        except StoreLayoutError as e:
            if not _inside(e.path, output_dir) or os.path.abspath(e.path) == os.path.abspath(output_dir):
                raise
            if not moved:
                _write_replay_marker(output_dir, commit_log.min_offset, "output files quarantined", log)
            paths = quarantine(output_dir, e.path)
            if metrics is not None:
                metrics.errors.labels(kind="recovery").inc()  # one damaged output file, counted as it is moved
            log.error("output_file_quarantined", path=e.path, error=str(e), moved=paths,
                      to=os.path.join(output_dir, QUARANTINE_DIR))
            moved.extend(paths)
    raise StoreLayoutError(output_dir, f"still damaged after quarantining {len(moved)} paths")


def open_session(config: Config, metrics: ReputMetrics) -> Session:
    """Recover the output and decide the offset to read from."""
    log = get_logger(component="recovery")
    commit_log = CommitLog(config.store.commit_log_dirs, config.store.mapped_file_size_commit_log, follow=True)
    out = config.output.dir
    os.makedirs(out, exist_ok=True)
    try:
        checkpoint = read_checkpoint(out)
    except CheckpointError as e:
        log.error("checkpoint_corrupt", path=e.path, error=e.detail, decision="rebuild from the CommitLog")
        metrics.errors.labels(kind="checkpoint").inc()
        checkpoint = None
    dispatchers, moved = _build_with_quarantine(config, out, commit_log, log, metrics)
    if moved:
        checkpoint = read_checkpoint(out)  # the replay marker written before the first move
    if checkpoint is not None and checkpoint.reput_from_offset > commit_log.max_offset:
        metrics.errors.labels(kind="checkpoint").inc()
        log.error("checkpoint_distrusted", reason="checkpoint is past the end of the CommitLog",
                  reput_from_offset=checkpoint.reput_from_offset, commit_log_max_offset=commit_log.max_offset)
        checkpoint = None
    start: int | None = None
    decision = "derived"
    if checkpoint is not None:
        try:
            start = _recover_to_checkpoint(dispatchers, checkpoint.reput_from_offset, checkpoint.dispatchers,
                                           commit_log.min_offset, log)
            decision = "checkpoint" if checkpoint.dispatchers else "replay"
        except (StoreError, ValueError) as e:
            log.error("checkpoint_distrusted", reason=str(e))
            metrics.errors.labels(kind="recovery").inc()
    if start is None:
        offsets = [d.resume_offset() for d in dispatchers if hasattr(d, "resume_offset")]
        start = min((commit_log.min_offset if o is None else o for o in offsets), default=commit_log.min_offset)
    if start < commit_log.min_offset:
        skipped = commit_log.min_offset - start
        log.warning("offset_below_oldest_segment", requested=start, resumed_at=commit_log.min_offset,
                    skipped_bytes=skipped, detail="CommitLog segments were deleted before they were dispatched")
        metrics.skipped.labels(reason="retention").inc(skipped)
        start = commit_log.min_offset
    if decision == "derived":
        checkpoint = _write_replay_marker(out, start, "no checkpoint to trust", log)
    metrics.recoveries.labels(decision=decision).inc()
    log.info("recovered", decision=decision, reput_from_offset=start, checkpoint=checkpoint.reput_from_offset,
             commit_log_min_offset=commit_log.min_offset, segments=len(commit_log.segments))
    session = Session(config, out, commit_log, make_reader(config, commit_log), dispatchers, metrics,
                      dispatched_offset=start, flushed_offset=start)
    session.checkpoint_offset = checkpoint.reput_from_offset
    session.checkpoint_states = checkpoint.dispatchers
    session.checkpoint_written_at = time.time()
    return session


def _recover_to_checkpoint(dispatchers: list[Dispatcher], offset: int, states: dict[str, Any], first_offset: int,
                           log) -> int:
    """Cut the dispatchers that the checkpoint covers back to it; a dispatcher it does not cover (one
    added to the config since) needs records from its own resume offset, which may be lower."""
    start = offset
    for d in dispatchers:
        if d.name in states and hasattr(d, "recover"):
            d.recover(offset, states[d.name])
            log.info("dispatcher_recovered", dispatcher=d.name, reput_from_offset=offset)
        elif hasattr(d, "resume_offset"):
            resume = d.resume_offset()
            start = min(start, first_offset if resume is None else resume)
            log.info("dispatcher_not_in_checkpoint", dispatcher=d.name, resume_offset=resume)
    return start


# --- the CommitLog's head --------------------------------------------------------------------------

def _data_frontier(path: str, start: int, size: int, offset: int, horizon: int | None = None) -> int:
    """In the segment file `path` (CommitLog offsets [start, start + size)): the end of the last non-zero
    byte before the first all-zero page past `offset`'s page, found by galloping then bisecting pages (a
    zero page inside a record only makes it lower); with `horizon`, simply a written page that many bytes
    on when there is one. `offset` itself on any error."""
    page = mmap.PAGESIZE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return offset

    def zero(n: int) -> bool:
        data = os.pread(fd, page, n * page)
        return data.count(0) == len(data)

    try:
        first, pages = (offset - start) // page, -(-size // page)
        if horizon is not None:
            far = (offset - start + horizon) // page
            if far < pages and not zero(far):  # catching up: the writer is far ahead
                return start + far * page
        lo, step = first, 1  # page lo holds data (or is offset's own page); find a zero page above it
        hi = min(lo + step, pages)
        while hi < pages and not zero(hi):
            lo, step = hi, step * 2
            hi = min(lo + step, pages)
        while hi - lo > 1:  # page lo: data or offset's page; page hi: zero (or the end)
            mid = (lo + hi) // 2
            if zero(mid):
                hi = mid
            else:
                lo = mid
        tail = os.pread(fd, page, lo * page).rstrip(b"\0")
        return start + lo * page + len(tail)
    except OSError:
        return offset
    finally:
        os.close(fd)


def written_below(commit_log: CommitLog, offset: int, horizon: int) -> int:
    """A point of the segment holding `offset` below which every byte a front-to-back writer meant to write
    is in (`_data_frontier`, or a written page `horizon` bytes on: no read ends past it). A record copied
    in another order (TOTALSIZE last) does not decode before it is complete: only front-to-back copies
    need it."""
    path = commit_log.find_segment(offset)
    if path is None:
        return offset
    return _data_frontier(path, commit_log.segment_start(offset), commit_log.segment_size, offset, horizon)


def hold_torn_tail(s: Session, offset: int, result: ReadResult, written: int) -> ReadResult:
    """Dispatch only records that were complete when they were decoded.

    A record copied front to back decodes as soon as its header, body (CRC-checked), topic and properties
    length are in, while its properties still end in unwritten zeros: dispatched then, its KEYS, UNIQ_KEY
    or TAGS would be cut short. `written` was taken before the read (`written_below`): records ending
    below it were complete. The others were written while the read ran: the last one must be complete
    now (its final byte written, or data after it, or no NUL in its properties: a record without
    properties ends in its zero length), then all of them are decoded again and must match what the read
    saw. The batch is cut before the first that fails; the rest is read again. (tests/test_torn_writes.py)
    """
    batch = result.batch
    n = len(batch)
    if not n or result.rolled or result.status is ReadStatus.CORRUPT:
        return result
    late = batch.phy_offset.astype(np.int64) + batch.msg_size > written
    if not late.any():
        return result
    first = int(np.argmax(late))  # records lie in offset order: the late ones are a suffix
    cut, pending = n, None
    at, size = int(batch.phy_offset[n - 1]), int(batch.msg_size[n - 1])
    path = s.commit_log.find_segment(at)
    try:
        with open(path, "rb") as f:  # before reading it again: what is complete now reads complete then
            data = os.pread(f.fileno(), size + RECORD_PREFIX.size, at - s.commit_log.segment_start(at))
        if len(data) >= size and not data[size - 1] and not any(data[size:]):
            properties = MessageRecord.decode(data[:size], check_crc=False, max_message_size=size).properties
            if b"\0" in properties:
                cut = n - 1
                pending = CorruptRecordError("properties", "last byte not written yet (properties end in zeros)",
                                             path=path, offset=at)
    except (OSError, TypeError, StoreError):
        cut = n - 1  # the next read decides
    start = int(batch.phy_offset[first])
    again = _read_records(s, start, result.next_offset - start)
    for i in range(first, cut):
        j = i - first
        if j >= len(again.batch) or not _same_dispatch(again.batch, j, batch, i):
            cut = i
            break
    if cut == n:
        return result
    head = _read_records(s, offset, int(batch.phy_offset[cut]) - offset) if cut else None
    if head is None or head.next_offset != int(batch.phy_offset[cut]):
        head = ReadResult(DispatchBatch.empty(offset), offset, ReadStatus.OK)
    return dataclasses.replace(result, batch=head.batch, next_offset=head.next_offset, error=None, pending=pending,
                               status=ReadStatus.OK if pending is None else ReadStatus.END)


def _read_records(s: Session, offset: int, max_bytes: int) -> ReadResult:
    """The records that start in [offset, offset + max_bytes), decoded now."""
    limit = s.reader.batch_bytes
    s.reader.batch_bytes = max(max_bytes, 1)
    try:
        return s.reader.read(offset, verify_end=False)
    finally:
        s.reader.batch_bytes = limit


def _same_dispatch(a, i: int, b, j: int) -> bool:
    """Whether row `i` of batch `a` dispatches as row `j` of batch `b`."""
    return (a.topic_of(i) == b.topic_of(j) and a.keys[i] == b.keys[j] and a.uniq_key[i] == b.uniq_key[j]
            and all(int(getattr(a, c)[i]) == int(getattr(b, c)[j]) for c in _DISPATCH_COLUMNS))


_DISPATCH_COLUMNS = ("phy_offset", "msg_size", "queue_id", "queue_offset", "sys_flag", "store_timestamp",
                     "tags_code", "prepared_transaction_offset")


def written_end(commit_log: CommitLog, offset: int) -> int:
    """End of the written data of the newest segment (the broker pre-allocates zeros): exact unless a
    message ends in zero bytes; good enough for a lag gauge, and it costs a few page reads per scrape."""
    segments = commit_log.segments
    if not segments:
        return offset
    start, path = segments[-1]
    size = commit_log.segment_size
    if offset >= start + size:
        return offset
    return max(offset, _data_frontier(path, start, size, max(offset, start)))


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
        self._ready_sent = False
        self._notify_failed = False
        self._last_watchdog = 0.0
        self._last_status = 0.0
        self._reported: tuple[int, str] | None = None
        self._suspect: tuple[int, float] | None = None  # (offset, first seen) of a bad record at the head
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

    # --- control -------------------------------------------------------------------------------

    @property
    def stopping(self) -> threading.Event:
        """Set once a stop is requested."""
        return self._stop

    def request_stop(self, reason: str = "signal") -> None:
        """Safe in a signal handler: only sets flags (logging there could deadlock on the log's lock);
        the loop reports the request when it sees it."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop.set()
        self._wake.set()

    def _report_stop(self) -> None:
        if self._stop_reason is not None and not self._stop_reported:
            self._stop_reported = True
            self._log.info("shutdown_requested", reason=self._stop_reason)

    def _set_health(self, state: str, reason: str = "") -> None:
        if self.health.set(state, reason):
            self.metrics.set_health(state)
            if state != HEALTHY:
                self._log.warning("health_changed", state=state, reason=reason)
            else:
                self._log.info("health_changed", state=state)

    def _lag(self) -> Lag | None:
        s = self.session
        if s is None:
            return None
        offset = s.dispatched_offset
        behind_s = 0.0
        if s.dispatched_store_timestamp:
            behind_s = max(0.0, time.time() - s.dispatched_store_timestamp / MS_PER_SECOND)
        return Lag(offset, written_end(s.commit_log, offset), s.flushed_offset, max(s.checkpoint_offset, 0),
                   s.checkpoint_written_at, behind_s, s.files("consumequeue"), s.files("index"))

    def progress(self) -> dict:
        s = self.session
        if s is None:
            return {}
        return {"reputFromOffset": s.dispatched_offset, "checkpointOffset": s.checkpoint_offset,
                "commitLogMaxOffset": written_end(s.commit_log, s.dispatched_offset)}

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
        self._log.info("reputd_started", store=self.config.store.store_path_commit_log, output=self.config.output.dir,
                       metrics=f"{metrics_cfg.host}:{metrics_cfg.port}" if metrics_cfg.enabled else None,
                       until_caught_up=self.until_caught_up)
        try:
            return self._run_sessions()
        finally:
            self._report_stop()
            self.notifier.stopping()
            if self.server is not None:
                self.server.stop()
            self._log.info("reputd_stopped")

    def _run_sessions(self) -> int:
        backoff = RETRY_MIN_S
        while not self._stop.is_set():
            try:
                self.session = open_session(self.config, self.metrics)
            except (StoreError, OSError) as e:
                self.metrics.errors.labels(kind="recovery").inc()
                self._log.error("recovery_failed", error=str(e), errno=_errno_name(e),
                                retry_in_s=None if self.until_caught_up else backoff)
                reason = self._report_no_space("recovery", e) or str(e)
                self._set_health(DOWN, reason)
                if self.until_caught_up:
                    return EXIT_FAILURE
                self._sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            self._failure_reason = ""
            outcome = self._run_session(self.session)
            code = self._close_session(self.session, outcome)
            if outcome is Outcome.FAILED:
                if self.session.dispatched_offset > self._failed_at:
                    backoff = RETRY_MIN_S  # the failure is a new one, not the last one again
                self._failed_at = self.session.dispatched_offset
            if outcome is Outcome.FAILED and not self.until_caught_up and not self._stop.is_set():
                reason = self._failure_reason or "dispatch failed"
                self._set_health(DEGRADED, f"{reason}; restarting from the last checkpoint in {backoff:g} s")
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
        observer = self._watch(s.commit_log.dirs)
        flusher.start()
        if not self._ready_sent:
            self._notified(self.notifier.ready(f"recovered; reading from offset {s.dispatched_offset}"))
            self._ready_sent = True
        self._set_health(HEALTHY)
        try:
            return self._follow(s)
        except Exception as e:  # anything unexpected ends the session like a failed dispatch
            s.poisoned = True
            self.metrics.errors.labels(kind="loop").inc()
            self._log.exception("reput_loop_failed", error=f"{type(e).__name__}: {e}", offset=s.dispatched_offset)
            return Outcome.FAILED
        finally:
            flusher.stop()
            if observer is not None:
                observer.stop()
                observer.join()

    def _close_session(self, s: Session, outcome: Outcome) -> int:
        self._report_stop()
        code = EXIT_OK if outcome in (Outcome.STOPPED, Outcome.CAUGHT_UP) else EXIT_FAILURE
        if not s.poisoned:
            try:
                Flusher(s, self._flush_failed).flush_once(thorough=True)
                self._log.info("final_flush", reput_from_offset=s.dispatched_offset,
                               checkpoint_offset=s.checkpoint_offset)
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

    def _flush_succeeded(self) -> None:
        if self.health.state == DEGRADED and self.health.reason.startswith(FLUSH_FAILED):
            self._set_health(HEALTHY)

    def _flush_failed(self, error: Exception) -> None:
        self.metrics.errors.labels(kind="flush").inc()
        self._log.error("flush_failed", error=f"{type(error).__name__}: {error}", errno=_errno_name(error))
        self._report_no_space("flush", error)
        self._set_health(DEGRADED, f"{FLUSH_FAILED}: {error}")

    def _report_no_space(self, stage: str, error: BaseException, **fields) -> str | None:
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
        self._log.error("output_space_exhausted", stage=stage, file=path, errno=_errno_name(cause),
                        error=cause.strerror or str(cause), output_dir=self.config.output.dir, free_bytes=free,
                        **fields, action="nothing past the checkpoint is trusted; retrying after a back-off"
                        if stage != "flush" else "the checkpoint waits until a flush succeeds")
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
                observer.schedule(Wake(), d, recursive=False)
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
        poll = self.config.reput.poll_interval_ms / MS_PER_SECOND
        verified = 0.0
        while not self._stop.is_set():
            self._tick()
            now = time.monotonic()
            verify = self.until_caught_up or now - verified >= poll
            if verify:
                verified = now
            try:
                written = written_below(s.commit_log, offset, s.reader.batch_bytes + s.reader.max_message_size)
                result = s.reader.read(offset, verify_end=verify)
                self.metrics.reads.inc()
            except StoreLayoutError as e:  # the CommitLog directory vanished or holds a stray file
                self._commit_log_unavailable(e)
                if self.until_caught_up:
                    return Outcome.UNAVAILABLE
                continue
            result = hold_torn_tail(s, offset, result, written)
            if result.skipped_from is not None:
                skipped = result.next_offset - result.skipped_from
                self.metrics.skipped.labels(reason="retention").inc(skipped)
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
                self._recovered_from_stall()
                continue
            if result.status is ReadStatus.END:
                self._recovered_from_stall()
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
                "caughtUp": self.caught_up_at is not None}

    def _recovered_from_stall(self) -> None:
        if self.health.state != HEALTHY and self.health.reason.startswith((CORRUPT_REASON, COMMITLOG_UNAVAILABLE)):
            self._set_health(HEALTHY)

    def _commit_log_unavailable(self, error: StoreLayoutError) -> None:
        """Report once, stay up (metrics keep being served) and look again every poll interval."""
        if self._reported != (-1, str(error)):
            self._reported = (-1, str(error))
            self.metrics.errors.labels(kind="commitlog").inc()
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
                        self.metrics.errors.labels(kind="dispatch").inc()
                        self._log.error("dispatch_failed", dispatcher=d.name, error=f"{type(e).__name__}: {e}",
                                        errno=_errno_name(e), batch_start=batch.start_offset,
                                        batch_end=batch.end_offset, checkpoint_offset=s.checkpoint_offset)
                        no_space = self._report_no_space("dispatch", e, dispatcher=d.name,
                                                         checkpoint_offset=s.checkpoint_offset)
                        self._failure_reason = no_space or f"dispatcher {d.name} failed: {e}"
                        self._set_health(DEGRADED, self._failure_reason)
                        return False
                    counter.inc(n)
                s.dispatched_store_timestamp = int(batch.store_timestamp[-1])
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
            if self._wake.wait(delay):
                self._wake.clear()
                return
            self._tick()
            if time.monotonic() >= deadline:
                return
            if not pending and s.reader.probe(offset):
                return
            delay = min(delay * 2, longest)

    def _maybe_in_flight(self, s: Session, offset: int) -> bool:
        """True while a bad record in the newest segment may still be being written: wait and re-read."""
        if s.commit_log.has_written_segment_after(offset):
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
        limit = min(PROBE_MIN_S * 2 ** min(self._stalls, 16), self.config.reput.poll_interval_ms / MS_PER_SECOND)
        self._wait_for_data(s, offset, pending=True, limit=limit)

    def _corrupt(self, s: Session, result: ReadResult) -> Outcome | None:
        """Apply onCorruption. `stop` stays at the offset (reported once, retried every poll interval in
        case the data is repaired); `skip-segment` logs and counts the range and goes to the next segment."""
        error = result.error
        offset = result.next_offset
        reason = error.field if isinstance(error, CorruptRecordError) else "layout"
        path = getattr(error, "path", None)
        policy = self.config.reput.on_corruption
        if self._reported != (offset, str(error)):
            self._reported = (offset, str(error))
            self.metrics.corrupt.labels(reason=reason).inc()
            self._log.error("corrupt_commitlog", file=path, offset=offset, reason=reason, error=str(error),
                            policy=policy)
        if policy == ON_CORRUPTION_SKIP_SEGMENT:
            nxt = s.commit_log.segment_start(offset) + s.commit_log.segment_size
            self.metrics.skipped.labels(reason="corruption").inc(nxt - offset)
            self._log.warning("segment_skipped", file=path, skipped_from=offset, skipped_to=nxt,
                              skipped_bytes=nxt - offset)
            with s.lock:
                s.dispatched_offset = nxt
            self._reported = None
            return None
        self._set_health(DEGRADED, f"{CORRUPT_REASON} CommitLog at offset {offset}: {error}")
        if self.until_caught_up:
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
        """Started before any signal can arrive, so the handler itself only sets flags."""
        service.stopping.wait()
        if not finished.wait(timeout):
            give_up()

    def on_signal(signum, _frame) -> None:
        service.request_stop(signal.Signals(signum).name)

    threading.Thread(target=guard, name="reputd-shutdown-guard", daemon=True).start()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = service.run()
    finally:
        finished.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if on_exit is not None:
        on_exit(service.summary())
    return code
