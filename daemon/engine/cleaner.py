"""The clean-up thread: RocketMQ's CleanConsumeQueueService, so the output shrinks as the CommitLog does, and
keeps up whatever the number of queues and restarts.

At the start of a session and then every `cleanResourceInterval` ms it reads the CommitLog's first offset
(the base offset of its oldest segment, which the broker's retention moves) and deletes what the 4.9.3
broker deletes for that offset (`indexcore.retention`):

1. the expired IndexFiles, first and all at once (there are few, and each is the largest file reputd
   writes): never the newest, and never the one the checkpoint names or a newer one, which a recovery
   after a kill cuts back into;
2. the expired ConsumeQueue files of every queue, oldest first over all queues and never a queue's
   newest, paced by what deleting costs (`retention.deleteFilesPerSecond`, `deleteBytesPerSecond`), a
   group at a time (`daemon.engine.cleanplan`). A pass stopped part-way leaves the youngest expired
   files, and the next pass, in this life or the next, deletes from there.

It deletes for the CommitLog's first offset as it is now, not for the checkpoint's, and keeps what a
recovery to the checkpoint after a kill needs: the IndexFile the checkpoint names, and in each queue the
file the recovery would leave as its newest (docs/recovery.md, "Retention and recovery", says why the rest
is safe to delete). When it keeps expired files for that reason (the checkpoint trails: after a restart, or
while reputd is behind, or a retention shorter than flushConsumeQueueThoroughInterval) it asks for a
checkpoint (`Session.checkpoint_wanted`): the flusher's next cycle is thorough, and the next pass deletes them.

How it stays out of the way of the rest of the session:
* the loop: file lists are read and changed under the dispatch lock, for a moment; files are read and
  unlinked after it is released. Only files older than the newest are ever touched, and those are written
  no more (a file is flushed when its successor is created);
* the flusher: files are unlinked under `Session.files_lock`, which the flusher holds from taking its plan
  to the end of its syncs, so no file it plans to sync disappears under it (both take `files_lock` before
  the dispatch lock);
* a kill at any point leaves no hole: a queue loses a prefix of its files, oldest first, so a kill between
  two deletions leaves its newer files, which the next start loads and the next pass deletes;
* a broker started on the output directory: deleting is writing, so the broker's lock is asked before
  the IndexFiles and before each group of ConsumeQueue files (`broker_lock`, daemon/engine/brokerlock.py),
  and once it is taken the pass deletes nothing more (the broker's own retention cleans there now).

What it publishes: the expired output still on disk, as of its last look (`reputd_retention_behind_*`,
`Session.retention_behind`), and a `retention_behind` event when some of it has waited too long.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.engine.cleanplan import GROUP_MAX_FILES, Expired, FileFacts, Pace, QueueFiles, expired_queue_plan
from daemon.engine.dispatchers import ConsumeQueueDispatcher, IndexDispatcher
from daemon.ops.logs import get_logger
from daemon.ops.metriclabels import ErrorKind, FileKind, RetentionBehind
from daemon.ops.periodic import Periodic
from indexcore.errors import StoreLayoutError
from indexcore.mappedfile import list_queue_files
from indexcore.retention import disk_bytes, expired_index_files, remove_files

if TYPE_CHECKING:
    from daemon.engine.brokerlock import BrokerLockGuard
    from daemon.engine.dispatchers import Dispatcher
    from daemon.engine.session import Session
    from daemon.ops.metrics import ReputMetrics

MS_PER_SECOND = 1000
# expired output waiting longer than this (or three intervals, when longer) is logged as `retention_behind`,
# again every BEHIND_REPEAT_S while it lasts
BEHIND_WARN_S = 120.0
BEHIND_REPEAT_S = 600.0


def commit_log_min_offset(dirs: tuple[str, ...]) -> int | None:
    """`CommitLog.getMinOffset`: the start of the oldest segment over every CommitLog directory, None when
    there is none, or when a directory holds a stray file (the loop reports that, `commitlog_unavailable`,
    and waits for it to be repaired; so does the clean-up). Listed afresh (the reader's segment list
    belongs to the loop's thread)."""
    try:
        starts = [start for d in dirs for start, _ in list_queue_files(d, temporaries=True)]
    except StoreLayoutError:
        return None
    return min(starts) if starts else None


@dataclass(slots=True)
class CleanPass:
    """What one pass deleted."""

    commit_log_min_offset: int
    cleaned_below: int  # the offset cleaned for: the CommitLog's first offset
    files: dict[str, int] = field(default_factory=lambda: {FileKind.CONSUME_QUEUE: 0, FileKind.INDEX: 0})
    bytes: dict[str, int] = field(default_factory=lambda: {FileKind.CONSUME_QUEUE: 0, FileKind.INDEX: 0})
    queues: int = 0
    seconds: float = 0.0
    interrupted: bool = False  # a stop cut the pass short: the next pass goes on from there
    index_files_kept: int = 0  # expired IndexFiles kept because the checkpoint names them (or an older one)
    behind: RetentionBehind = field(default_factory=RetentionBehind)  # what was left expired when it ended

    def add(self, kind: FileKind, paths: list[str], sizes: int) -> None:
        self.files[kind] += len(paths)
        self.bytes[kind] += sizes

    @property
    def deleted(self) -> int:
        return sum(self.files.values())


def _sizes(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            total += disk_bytes(path)
    return total


def _named(dispatchers: list[Dispatcher], kind: type):
    """The built-in dispatcher of that class (a plug-in's files are its own business)."""
    return next((d for d in dispatchers if isinstance(d, kind)), None)


def _by_queue(group: list[Expired]) -> dict[tuple[str, int], list[Expired]]:
    """A slice of a plan by queue: each queue's files there are consecutive ones of its prefix, oldest first."""
    out: dict[tuple[str, int], list[Expired]] = {}
    for e in group:
        out.setdefault(e.key, []).append(e)
    return out


class Cleaner(Periodic):
    """Deletes expired output files of a session, paced; `clean_once` is one pass."""

    def __init__(self, session: Session, metrics: ReputMetrics | None = None, *, interval_ms: int | None = None,
                 clock=time.monotonic, broker_lock: BrokerLockGuard | None = None):
        store = session.config.store
        interval = (store.clean_resource_interval if interval_ms is None else interval_ms) / MS_PER_SECOND
        super().__init__("reputd-cleaner", interval)
        self.session = session
        self.metrics = metrics if metrics is not None else session.metrics
        retention = session.config.retention
        self._clock = clock
        self.pace = Pace(retention.delete_files_per_second, retention.delete_bytes_per_second, clock)
        self.facts = FileFacts()
        self.last_cleaned = 0  # the offset of the last pass that ran to its end
        self.warn_after = max(BEHIND_WARN_S, 3 * interval)
        self._since: dict[str, float] = {}  # expired file -> when a look first found it expired (clock)
        self._warned_at: float | None = None
        self._log = get_logger(component="cleaner")
        self._failed: str | None = None
        self._broker_lock = broker_lock

    def _run(self) -> None:
        self.tick()  # a start meets what expired while reputd was stopped: at once, not an interval later
        super()._run()

    def tick(self) -> None:
        self.clean_reported()

    def clean_reported(self, *, paced: bool = True) -> CleanPass | None:
        """`clean_once`, an error reported (once per distinct error: the next interval tries again)."""
        try:
            result = self.clean_once(paced=paced)
            self._failed = None
            return result
        except Exception as e:
            if self._failed != str(e):
                self._failed = str(e)
                self.metrics.errors.labels(kind=ErrorKind.RETENTION).inc()
                code = getattr(e, "errno", None)
                self._log.error("expired_files_delete_failed", error=f"{type(e).__name__}: {e}",
                                errno=errno.errorcode.get(code) if isinstance(code, int) else None)
            return None

    def clean_once(self, *, paced: bool = True) -> CleanPass | None:
        """One pass for the CommitLog's first offset as it is now: None when there is no CommitLog to read.
        Logs `expired_files_deleted` when it deleted anything or was cut short."""
        first = commit_log_min_offset(self.session.commit_log.dirs)
        if first is None:
            return None
        started = self._clock()
        result = CleanPass(first, first)
        index_kept = self._clean_index(first, result, paced)
        plan, held, queues = self._plan(first)
        self._delete(plan, queues, first, held, index_kept, result, paced)
        result.interrupted = self._halted()
        if not result.interrupted:
            self.last_cleaned = first
        result.seconds = self._clock() - started
        if result.deleted or result.interrupted:
            report(result, None, self._log)
        return result

    # --- IndexFiles: at once -----------------------------------------------------------------------------

    def _clean_index(self, first: int, result: CleanPass, paced: bool) -> list[str]:
        """Delete the expired IndexFiles but those the checkpoint needs; the paths of those kept."""
        s = self.session
        index = _named(s.dispatchers, IndexDispatcher)
        if index is None:
            return []
        service = index.service
        names = list(service.names)
        n = expired_index_files(service, first)  # headers read unlocked: only files older than the newest
        keep_from = self._checkpoint_index_name()
        allowed = n if keep_from is None else sum(1 for name in names[:n] if name < keep_from)
        kept = [os.path.join(service.directory, name) for name in names[allowed:n]]
        result.index_files_kept = len(kept)
        if allowed and not self._halted():
            with s.files_lock:
                with s.lock:
                    paths = service.forget_oldest(allowed)
                size = _sizes(paths)
                remove_files(paths)
            result.add(FileKind.INDEX, paths, size)
            self._count(FileKind.INDEX, len(paths), size)
            if paced:  # the ConsumeQueue deletions that follow pay for their bytes
                self.pace.book(0, size)
        return kept

    def _checkpoint_index_name(self) -> str | None:
        """The IndexFile the checkpoint names: a recovery cuts back into it, so it and newer ones stay."""
        states = self.session.checkpoint_states
        index_state = states.get("index") if states else None
        return index_state.get("name") if isinstance(index_state, dict) else None

    # --- ConsumeQueue files: oldest first, paced ----------------------------------------------------------

    def _plan(self, first: int) -> tuple[list[Expired], list[Expired], dict]:
        """The expired files to delete, oldest first; those kept for a recovery; the queues by key."""
        s = self.session
        cq = _named(s.dispatchers, ConsumeQueueDispatcher)
        if cq is None:
            return [], [], {}
        # a queue with one file has nothing to lose: passed over unlocked (an LMQ store has 100,000 of them)
        queues = {key: q for key, q in list(cq.queues.queues.items()) if q.file_count >= 2}
        with s.lock:  # every deferred write of the last batch is in its file
            files = [QueueFiles(key, q, q.file_starts) for key, q in queues.items()]
            recover_to = s.checkpoint_offset  # where a recovery after a kill now would cut back to
        plan, held = expired_queue_plan(files, first, self.facts, recover_to if recover_to >= 0 else None)
        return plan, held, queues

    def _delete(self, plan: list[Expired], queues: dict, first: int, held: list[Expired], index_kept: list[str],
                result: CleanPass, paced: bool) -> None:
        now = self._clock()
        index_sizes = _sizes(index_kept)
        kept = [e.path for e in held] + index_kept  # expired, and left on disk for a recovery's sake
        self._since = {path: self._since.get(path, now) for path in [e.path for e in plan] + kept}
        # the earliest time a file from each position on was found expired: what is left waited since then
        oldest = [min((self._since[p] for p in kept), default=None)] * (len(plan) + 1)
        for i in range(len(plan) - 1, -1, -1):
            since = self._since[plan[i].path]
            oldest[i] = since if oldest[i + 1] is None else min(since, oldest[i + 1])
        if kept:  # a newer checkpoint frees them: the flusher writes one at its next cycle, the next pass deletes
            self.session.checkpoint_wanted.set()
        left = [len(plan) + len(held), sum(e.size for e in plan) + sum(e.size for e in held)]
        total = Counter(e.key for e in plan)
        planned = total.copy()
        self._publish(left, len(index_kept), index_sizes, oldest[0])
        at = 0
        while at < len(plan) and not self._halted():
            group = plan[at : at + (self.pace.group(plan, at) if paced else GROUP_MAX_FILES)]
            size = sum(e.size for e in group)
            if paced:
                wait = self.pace.book(len(group), size)
                if wait > 0 and (self._stop.wait(wait) or self._halted()):
                    break
            deleted = self._delete_group(group, queues)
            result.add(FileKind.CONSUME_QUEUE, [e.path for e in deleted], sum(e.size for e in deleted))
            self._count(FileKind.CONSUME_QUEUE, len(deleted), sum(e.size for e in deleted))
            for key, done in Counter(e.key for e in group).items():
                planned[key] -= done
                if planned[key] == 0:  # the queue lost all it had to: its min offset, as the broker corrects it
                    queues[key].correct_min_offset(first)
                    result.queues += 1
            at += len(group)
            left[0] -= len(group)
            left[1] -= size
            self._publish(left, len(index_kept), index_sizes, oldest[at])
        for key, n in planned.items():  # cut short: the queues that lost some of theirs
            if 0 < n < total[key]:
                queues[key].correct_min_offset(first)
                result.queues += 1
        result.behind = self.session.retention_behind or RetentionBehind()

    def _delete_group(self, group: list[Expired], queues: dict) -> list[Expired]:
        """Forget and unlink a group of planned files; a queue whose oldest file is no longer the one planned
        (nothing else deletes them, but a file list is the truth) keeps its files for the next pass."""
        s = self.session
        forgotten: set[str] = set()
        with s.files_lock:
            with s.lock:
                for key, files in _by_queue(group).items():
                    q = queues[key]
                    starts = q.file_starts
                    take = 0
                    while take < len(files) and take < len(starts) - 1 and starts[take] == files[take].start:
                        take += 1
                    forgotten.update(q.forget_oldest(take))
            deleted = [e for e in group if e.path in forgotten]
            paths = [e.path for e in deleted]
            remove_files(paths)  # in the plan's order
        for path in paths:
            self.facts.forget(path)
            self._since.pop(path, None)
        return deleted

    def _halted(self) -> bool:
        """A stop, or a broker that took the lock of the output directory: no more deletions."""
        return self._stop.is_set() or (self._broker_lock is not None and self._broker_lock.taken(now=True))

    # --- what it tells -------------------------------------------------------------------------------------

    def _count(self, kind: FileKind, files: int, size: int) -> None:
        if self.metrics is not None and files:
            self.metrics.deleted_files.labels(kind=kind).inc(files)
            self.metrics.deleted_bytes.labels(kind=kind).inc(size)

    def _publish(self, left: list[int], index_files: int, index_bytes: int, oldest: float | None) -> None:
        behind = RetentionBehind(left[0], left[1], index_files, index_bytes, oldest if left[0] or index_files else None)
        self.session.retention_behind = behind
        now = self._clock()
        waited = 0.0 if behind.oldest_since is None else now - behind.oldest_since
        if waited >= self.warn_after and (self._warned_at is None or now - self._warned_at >= BEHIND_REPEAT_S):
            self._warned_at = now
            self._log.warning("retention_behind", behind_s=round(waited), consumequeue_files=left[0],
                              consumequeue_bytes=left[1], index_files=index_files, index_bytes=index_bytes,
                              detail="expired output files are still on disk: see the ReputdRetentionBehind "
                                     "runbook in docs/operations.md")
        elif behind.oldest_since is None and self._warned_at is not None:
            self._warned_at = None
            self._log.info("retention_caught_up", detail="no expired output file is left on disk")


def report(result: CleanPass, metrics: ReputMetrics | None, log) -> None:
    """Log a pass's one event; with `metrics` (a pass not counted as it went), count its deletions too."""
    if metrics is not None:
        for kind in (FileKind.CONSUME_QUEUE, FileKind.INDEX):
            metrics.deleted_files.labels(kind=kind).inc(result.files[kind])
            metrics.deleted_bytes.labels(kind=kind).inc(result.bytes[kind])
    log.info("expired_files_deleted", commit_log_min_offset=result.commit_log_min_offset,
             cleaned_below=result.cleaned_below, consumequeue_files=result.files[FileKind.CONSUME_QUEUE],
             index_files=result.files[FileKind.INDEX], deleted_bytes=sum(result.bytes.values()),
             queues=result.queues, seconds=round(result.seconds, 3), interrupted=result.interrupted,
             index_files_kept=result.index_files_kept, behind_files=result.behind.files,
             behind_bytes=result.behind.bytes)


def clean_output(dispatchers: list[Dispatcher], commit_log_dirs: tuple[str, ...], log=None) -> CleanPass | None:
    """One unpaced pass over an output nothing else writes (`reputd rebuild` after its final checkpoint,
    which names the newest IndexFile): the same rule and order, for the CommitLog's first offset."""
    first = commit_log_min_offset(commit_log_dirs)
    if first is None:
        return None
    started = time.monotonic()
    result = CleanPass(first, first)
    index = _named(dispatchers, IndexDispatcher)
    if index is not None:
        paths = index.service.forget_oldest(expired_index_files(index.service, first))
        size = _sizes(paths)
        remove_files(paths)
        result.add(FileKind.INDEX, paths, size)
    cq = _named(dispatchers, ConsumeQueueDispatcher)
    if cq is not None:
        queues = cq.queues.queues
        plan, _ = expired_queue_plan([QueueFiles(key, q, q.file_starts) for key, q in queues.items()], first,
                                     FileFacts())
        for e in plan:  # oldest first over all queues, as the live pass
            paths = queues[e.key].forget_oldest(1)
            remove_files(paths)
            result.add(FileKind.CONSUME_QUEUE, paths, e.size if paths else 0)
        for key in {e.key for e in plan}:
            queues[key].correct_min_offset(first)
            result.queues += 1
    result.seconds = time.monotonic() - started
    if result.deleted:
        report(result, None, log or get_logger(component="cleaner"))
    return result


__all__ = ["CleanPass", "Cleaner", "clean_output", "commit_log_min_offset", "report"]
