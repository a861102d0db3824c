"""The clean-up thread: RocketMQ's CleanConsumeQueueService, so the output shrinks as the CommitLog does.

Every `cleanResourceInterval` ms it looks at the CommitLog's first offset (the base offset of its oldest
segment, which the broker's retention moves); once that has moved past the offset of its last pass, it
deletes what the 4.9.3 broker deletes (`indexcore.retention`): each queue's ConsumeQueue files, oldest
first and never the newest, while the last unit of a file points below the offset, then the IndexFiles,
never the newest, while a file's endPhyOffset lies below it. After each queue that lost files it pauses
`deleteConsumeQueueFilesInterval` ms, as the broker does, so a large clean-up leaves the disk to dispatch.

How it stays out of the way of the rest of the session:
* the loop: a queue's or the index's file list is changed under the dispatch lock, for a moment; the
  files are unlinked after the lock is released. Only files older than the newest are ever touched, and
  those are written no more (a file is flushed when its successor is created);
* the flusher: a file is unlinked under `Session.files_lock`, which the flusher holds from taking its plan
  to the end of its syncs, so no file it plans to sync disappears under it (both take `files_lock` before
  the dispatch lock);
* recovery: it cleans for the lower of the CommitLog's first offset and the checkpoint's offset, and
  never deletes the IndexFile the checkpoint names or a newer one. A kill at any point leaves what a
  checkpoint recovery needs, and no hole: a queue loses a prefix of its files, oldest first, so a kill
  between two deletions leaves its newer files, which the next start loads and the next pass deletes.
"""

from __future__ import annotations

import contextlib
import errno
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.engine.dispatchers import ConsumeQueueDispatcher, IndexDispatcher
from daemon.ops.logs import get_logger
from daemon.ops.metrics import ErrorKind, FileKind
from daemon.ops.periodic import Periodic
from indexcore.errors import StoreLayoutError
from indexcore.mappedfile import list_queue_files
from indexcore.retention import (
    disk_bytes,
    expired_index_files,
    expired_queue_files,
    remove_files,
    should_clean,
)

if TYPE_CHECKING:
    from daemon.engine.dispatchers import Dispatcher
    from daemon.engine.session import Session
    from daemon.ops.metrics import ReputMetrics

MS_PER_SECOND = 1000


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
    cleaned_below: int  # the offset cleaned for: min(commit_log_min_offset, checkpoint)
    files: dict[str, int] = field(default_factory=lambda: {FileKind.CONSUME_QUEUE: 0, FileKind.INDEX: 0})
    bytes: dict[str, int] = field(default_factory=lambda: {FileKind.CONSUME_QUEUE: 0, FileKind.INDEX: 0})
    queues: int = 0
    seconds: float = 0.0
    interrupted: bool = False  # a stop cut the pass short: the next start does it again

    def add(self, kind: FileKind, paths: list[str], sizes: int) -> None:
        self.files[kind] += len(paths)
        self.bytes[kind] += sizes


def _sizes(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            total += disk_bytes(path)
    return total


def _named(dispatchers: list[Dispatcher], kind: type):
    """The built-in dispatcher of that class (a plug-in's files are its own business)."""
    return next((d for d in dispatchers if isinstance(d, kind)), None)


class Cleaner(Periodic):
    """Deletes expired output files of a session, paced; `clean_once` is one pass of the broker's service."""

    def __init__(self, session: Session, metrics: ReputMetrics | None = None, *,
                 interval_ms: int | None = None, pause_ms: int | None = None):
        store = session.config.store
        super().__init__("reputd-cleaner",
                         (store.clean_resource_interval if interval_ms is None else interval_ms) / MS_PER_SECOND)
        self.session = session
        self.metrics = metrics if metrics is not None else session.metrics
        self.pause = (store.delete_consume_queue_files_interval if pause_ms is None else pause_ms) / MS_PER_SECOND
        self.last_cleaned = 0  # lastPhysicalMinOffset
        self._log = get_logger(component="cleaner")
        self._failed: str | None = None

    def tick(self) -> None:
        self.clean_reported()

    def clean_reported(self, *, pause: bool = True) -> CleanPass | None:
        """`clean_once`, an error reported (once per distinct error: the next interval tries again)."""
        try:
            result = self.clean_once(pause=pause)
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

    def _threshold(self) -> tuple[int, int, str | None] | None:
        s = self.session
        first = commit_log_min_offset(s.commit_log.dirs)
        if first is None:
            return None
        index_state = s.checkpoint_states.get("index") if s.checkpoint_states else None
        keep_index_from = index_state.get("name") if isinstance(index_state, dict) else None
        return first, min(first, max(s.checkpoint_offset, 0)), keep_index_from

    def clean_once(self, *, pause: bool = True) -> CleanPass | None:
        """One pass: None when the offset to clean for has not moved since the last one."""
        found = self._threshold()
        if found is None:
            return None
        first, below, keep_index_from = found
        if not should_clean(below, self.last_cleaned):
            return None
        started = time.monotonic()
        s = self.session
        result = CleanPass(first, below)
        cq = _named(s.dispatchers, ConsumeQueueDispatcher)
        if cq is not None:
            with s.lock:
                queues = list(cq.queues.queues.values())
            for q in queues:
                if self._stop.is_set():
                    break
                if q.file_count < 2:
                    continue
                n = expired_queue_files(q, below)  # files older than the newest: written no more, read unlocked
                if n == 0:
                    continue
                with s.files_lock:
                    with s.lock:
                        paths = q.forget_oldest(n)
                    size = _sizes(paths)
                    remove_files(paths)
                q.correct_min_offset(below)
                result.add(FileKind.CONSUME_QUEUE, paths, size)
                result.queues += 1
                if pause and self.pause > 0:
                    self._stop.wait(self.pause)
        index = _named(s.dispatchers, IndexDispatcher)
        if index is not None and not self._stop.is_set():
            service = index.service
            # headers read unlocked: only files older than the newest are read, and those are written no more
            n = expired_index_files(service, below)
            if keep_index_from is not None:  # the checkpoint's IndexFile and newer ones stay
                n = min(n, sum(1 for name in list(service.names) if name < keep_index_from))
            with s.files_lock:
                with s.lock:
                    paths = service.forget_oldest(n)
                size = _sizes(paths)
                remove_files(paths)
            result.add(FileKind.INDEX, paths, size)
        result.interrupted = self._stop.is_set()
        if not result.interrupted:  # a pass cut short by a stop, or failed, is done again
            self.last_cleaned = below
        result.seconds = time.monotonic() - started
        report(result, self.metrics, self._log)
        return result


def report(result: CleanPass, metrics: ReputMetrics | None, log) -> None:
    """Count a pass (`reputd_deleted_files_total`, `reputd_deleted_bytes_total`) and log its one event."""
    if metrics is not None:
        for kind in (FileKind.CONSUME_QUEUE, FileKind.INDEX):
            metrics.deleted_files.labels(kind=kind).inc(result.files[kind])
            metrics.deleted_bytes.labels(kind=kind).inc(result.bytes[kind])
    log.info("expired_files_deleted", commit_log_min_offset=result.commit_log_min_offset,
             cleaned_below=result.cleaned_below, consumequeue_files=result.files[FileKind.CONSUME_QUEUE],
             index_files=result.files[FileKind.INDEX], deleted_bytes=sum(result.bytes.values()),
             queues=result.queues, seconds=round(result.seconds, 3), interrupted=result.interrupted)


def clean_output(dispatchers: list[Dispatcher], commit_log_dirs: tuple[str, ...], checkpoint_offset: int,
                 log=None) -> CleanPass | None:
    """One unpaced pass over an output nothing else writes (`reputd rebuild` after its final checkpoint,
    which names the newest IndexFile): the same rule, for min(CommitLog first offset, checkpoint)."""
    first = commit_log_min_offset(commit_log_dirs)
    if first is None:
        return None
    below = min(first, checkpoint_offset)
    if not should_clean(below, 0):
        return None
    started = time.monotonic()
    result = CleanPass(first, below)
    cq = _named(dispatchers, ConsumeQueueDispatcher)
    if cq is not None:
        for q in list(cq.queues.queues.values()):
            paths = q.forget_oldest(expired_queue_files(q, below))
            if paths:
                size = _sizes(paths)
                remove_files(paths)
                q.correct_min_offset(below)
                result.add(FileKind.CONSUME_QUEUE, paths, size)
                result.queues += 1
    index = _named(dispatchers, IndexDispatcher)
    if index is not None:
        paths = index.service.forget_oldest(expired_index_files(index.service, below))
        size = _sizes(paths)
        remove_files(paths)
        result.add(FileKind.INDEX, paths, size)
    result.seconds = time.monotonic() - started
    report(result, None, log or get_logger(component="cleaner"))
    return result


__all__ = ["CleanPass", "Cleaner", "clean_output", "commit_log_min_offset", "report"]
