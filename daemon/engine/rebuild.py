"""Offline rebuild: read the CommitLog once, from its start or an offset, through the dispatchers.

The same path as the live reput loop (recovery -> reader -> batch -> dispatchers -> flush -> checkpoint),
run until the end of the written data. Rebuilding into an output that already holds files continues it
exactly where it ends, by the resume rules `reputd run` uses (`daemon.engine.recovery`): nothing already there
is written twice, and a rebuild stopped anywhere, then run again, ends as one rebuild would. It ends
with a checkpoint, so the next `rebuild` or `run` starts where it stopped. Point the output at an empty
directory for a from-scratch rebuild.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from daemon.config import Config
from daemon.engine import dledgermode
from daemon.engine.cleaner import clean_output
from daemon.engine.dispatchers import ConsumeQueueDispatcher, Dispatcher
from daemon.engine.flusher import final_checkpoint
from daemon.engine.readahead import ReadAhead
from daemon.engine.reading import make_reader, open_commit_log
from daemon.engine.recovery import recover_output
from daemon.ops import failpoint
from daemon.ops.logs import get_logger
from daemon.ops.outlock import BrokerLockWatch
from indexcore.errors import CorruptRecordError, StoreError, StoreLayoutError
from indexcore.indexfile import INDEX_HEADER_SIZE, IndexHeader
from indexcore.indexservice import IndexService
from indexcore.reader import CommitLog, CommitLogReader, ReadResult, ReadStatus

# A rebuild has no latency to keep, and every batch costs a fixed amount of Python per queue: it reads at
# least this much per batch (measured: 2,000,000 messages took 1.66 CPU-seconds in 4 MiB batches and
# 1.13 in 32 MiB ones).
REBUILD_BATCH_BYTES = 32 * 1024 * 1024
# A batch spread thin over many queues costs a Python put per queue it touches: in an LMQ store of 100,000
# queues a 32 MiB batch put two or three units into each of some 85,000. When a batch touches at least
# THIN_BATCH_QUEUES queues with fewer than THIN_BATCH_UNITS_PER_QUEUE units each on average, the next ones
# read twice as much, up to REBUILD_MAX_BATCH_BYTES, so that cost is shared by more units (measured on
# 100,000 LMQ queues: 47.9 CPU-seconds of user time in 32 MiB batches, 10.9 in 256 MiB ones). `rebuild`,
# `verify` and `run` while it is behind the writer do this.
THIN_BATCH_QUEUES = 4096
THIN_BATCH_UNITS_PER_QUEUE = 32
REBUILD_MAX_BATCH_BYTES = 256 * 1024 * 1024
# A rebuild writes each ConsumeQueue's appends once this much of them is gathered (`gather_appends`): a
# batch of an LMQ store puts some 4.6 KiB into each of a thousand queues, and the kernel took 0.20-0.28 s
# to write 160 MB to 1,064 files in pieces of that size against 0.07-0.09 s in 16-64 KiB ones (ext4 here).
REBUILD_GATHER_BYTES = 32 * 1024


@dataclass(slots=True)
class RebuildSummary:
    start_offset: int
    end_offset: int = 0
    messages: int = 0
    segments: int = 0
    seconds: float = 0.0
    files: dict[str, int] = field(default_factory=dict)
    pending: CorruptRecordError | None = None  # a torn record at the end of the written data
    skipped: list[tuple[int, int, str]] = field(default_factory=list)  # [from, to) left out by skip-segment
    interrupted: bool = False  # stopped on request at end_offset, a record boundary, everything before flushed
    # where the output's existing files ended (start_offset for an empty one): records from there on are
    # new; those read below it were already in the output and left as they were
    output_end: int = 0
    new_messages: int = 0
    # ConsumeQueue units written for records below output_end: queues whose files were gone or ended early
    restored_units: int = 0

    @property
    def bytes(self) -> int:
        return self.end_offset - self.start_offset

    @property
    def msgs_per_second(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "startOffset": self.start_offset, "endOffset": self.end_offset, "messages": self.messages,
            "bytes": self.bytes, "segments": self.segments, "seconds": round(self.seconds, 3),
            "msgsPerSecond": round(self.msgs_per_second), "files": self.files,
            "pendingTail": str(self.pending) if self.pending else None,
            "skipped": [{"from": a, "to": b, "error": e} for a, b, e in self.skipped],
            "interrupted": self.interrupted,
            "outputEnd": self.output_end, "newMessages": self.new_messages, "restoredUnits": self.restored_units,
        }


class RebuildFailed(StoreError):
    """The rebuild stopped at corrupt data; the summary covers what was dispatched before it."""

    def __init__(self, cause: StoreError, summary: RebuildSummary, hint: str | None = None):
        self.cause = cause
        self.summary = summary
        self.hint = hint
        super().__init__(f"{cause} ({hint})" if hint else str(cause))


class IndexSequenceGap(StoreLayoutError):
    """An IndexFile is missing from the middle of the sequence: the keys of the records between two files
    are in none. It cannot be put back in place (its successors hold the later keys, and the broker loads
    the files in name order), so the index is rebuilt into an empty directory instead."""

    def __init__(self, before: str, after: str, from_offset: int, to_offset: int):
        self.before, self.after, self.from_offset, self.to_offset = before, after, from_offset, to_offset
        super().__init__(after, f"an IndexFile is missing before it (after {os.path.basename(before)}): the keys "
                                f"of the records in CommitLog offsets ({from_offset}, {to_offset}) are in no "
                                "IndexFile, and one cannot be put back into the middle of the sequence")


# How much of the CommitLog `index_sequence_gap` reads after a full IndexFile's last record: the records up to
# the next one with keys, which begins the next file unless one is missing.
GAP_CHECK_BYTES = 64 * 1024


def index_sequence_gap(config: Config, commit_log: CommitLog) -> IndexSequenceGap | None:
    """Whether an IndexFile is missing from the middle of the output's sequence. A file follows a full one,
    and its first entry is the full one's last record (its keys straddle the roll) or the next record with
    keys: a record with keys between them means a file between them is gone. Files whose last record
    retention deleted are not judged. One small read per full file."""
    store = config.store
    if not store.message_index_enable:
        return None
    service = IndexService(config.output.dir, store.max_hash_slot_num, store.max_index_num)
    service.load(readonly=True)
    try:
        headers = []
        for name in service.names:
            with open(os.path.join(service.directory, name), "rb") as f:
                headers.append((os.path.join(service.directory, name), IndexHeader.decode(f.read(INDEX_HEADER_SIZE))))
    finally:
        service.close()
    pairs = [(a, ha, b, hb) for (a, ha), (b, hb) in itertools.pairwise(headers)
             if ha.index_count >= store.max_index_num and ha.end_phy_offset >= commit_log.min_offset
             and hb.begin_phy_offset > ha.end_phy_offset]
    if not pairs:
        return None
    reader = make_reader(config, commit_log, GAP_CHECK_BYTES)
    try:
        for a, ha, b, hb in pairs:
            batch = reader.read(ha.end_phy_offset, verify_end=False).batch
            keyed = batch.phy_offset[np.unique(batch.key_owner[batch.index_mask()[batch.key_owner]])]
            if ((keyed > ha.end_phy_offset) & (keyed < hb.begin_phy_offset)).any():
                return IndexSequenceGap(a, b, ha.end_phy_offset, hb.begin_phy_offset)
    finally:
        reader.close()
    return None


class FromOffsetError(ValueError):
    """`--from` names no offset of the CommitLog's written data: a usage error."""


def rebuild(config: Config, *, from_offset: int | None = None,
            progress: Callable[[int, int, int], None] | None = None,
            stop: threading.Event | None = None, broker: BrokerLockWatch | None = None) -> RebuildSummary:
    """Dispatch every record from where the output ends (an empty output: the CommitLog's first offset),
    or from `from_offset`, to the end.

    `progress(done, total, messages)` is called after each batch with bytes done and the bytes of written
    data from the start (the end of the written data as found at the start, or later if more came), and
    once more at the end with done == total. When `stop` is set, the rebuild ends after the batch in hand
    at a record boundary, flushes, checkpoints, and returns with `interrupted` set; so it does, without the
    retention pass, once `broker` (the output's broker lock, asked after every batch) is taken: a broker
    started on the output's store root writes its files itself."""
    failpoint.install_from_env()
    log = get_logger(command="rebuild")
    commit_log = open_commit_log(config)
    from_offset = dledgermode.reput_offset(commit_log, from_offset)
    out = config.output.dir
    os.makedirs(out, exist_ok=True)
    checked = progress is not None or from_offset is not None
    target = written_end_of(commit_log) if checked else commit_log.min_offset
    if from_offset is not None and not commit_log.min_offset <= from_offset <= target:
        raise FromOffsetError(f"--from {from_offset} is outside the CommitLog, which holds "
                              f"[{commit_log.min_offset}, {target}) in {dledgermode.commit_log_path(config.store)}")
    if from_offset is None:  # before anything is written
        gap = index_sequence_gap(config, commit_log)
        if gap is not None:
            raise gap
    recovered = recover_output(config, commit_log, log=get_logger(command="rebuild", component="recovery"),
                               quarantine_damaged=False, rescan=from_offset is None)
    dispatchers = recovered.dispatchers
    queues = [d for d in dispatchers if isinstance(d, ConsumeQueueDispatcher)]
    for d in queues:
        d.gather_appends(REBUILD_GATHER_BYTES)
    offset = recovered.start if from_offset is None else from_offset
    target = max(target, offset)
    summary = RebuildSummary(start_offset=offset, end_offset=offset, output_end=max(recovered.output_end, offset))
    reader = make_reader(config, commit_log, max(config.reput.batch_bytes, REBUILD_BATCH_BYTES))
    log.info("rebuild_started", store=dledgermode.commit_log_path(config.store), output=out, from_offset=offset,
             segments=len(commit_log.segments), dispatchers=[getattr(d, "name", type(d).__name__) for d in dispatchers])
    started = time.perf_counter()
    rolls = 0
    ahead = None
    failure: RebuildFailed | None = None
    alongside = ThreadPoolExecutor(1, thread_name_prefix="reputd-alongside")
    try:
        idle = [d.idle for d in dispatchers if hasattr(d, "idle")]
        ahead = ReadAhead(reader, offset, prepare=[d.prepare for d in dispatchers if hasattr(d, "prepare")],
                          idle=(lambda: any([f() for f in idle])) if idle else None)
        for result in ahead:
            written = sum(d.stats.written for d in queues)
            dispatch_batch(dispatchers, result, alongside)
            widen_after_dispatch(reader, dispatchers)
            summary.messages += len(result.batch)
            summary.new_messages += int(np.count_nonzero(result.batch.phy_offset >= summary.output_end))
            if queues and len(result.batch) and int(result.batch.phy_offset[0]) < summary.output_end:
                summary.restored_units += max(0, sum(d.stats.written for d in queues) - written
                                              - new_units(result.batch, summary.output_end))
            rolls += result.rolled
            offset = result.next_offset
            summary.end_offset = offset
            target = max(target, offset)
            if progress is not None:
                progress(offset - summary.start_offset, target - summary.start_offset, summary.messages)
            if result.skipped_from is not None:
                log.warning("offset_below_oldest_segment", requested=result.skipped_from, resumed_at=offset)
            if result.status is ReadStatus.END:
                summary.pending = result.pending
                if progress is not None:
                    progress(offset - summary.start_offset, offset - summary.start_offset, summary.messages)
                break
            if result.status is ReadStatus.CORRUPT:
                log.error("corrupt_commitlog", error=str(result.error), offset=offset)
                hint = None
                if from_offset is not None and offset == from_offset:
                    hint = f"--from {from_offset} may not be the start of a record"
                failure = RebuildFailed(result.error, summary, hint)
                break
            if (stop is not None and stop.is_set()) or (broker is not None and broker.taken(now=True) is not None):
                summary.interrupted = True
                break
        if from_offset is None or offset != from_offset:  # never a checkpoint at an unchecked --from alone
            # everything dispatched is flushed and checkpointed: the next rebuild or run goes on from here
            final_checkpoint(out, dispatchers, offset)
            # the broker's retention rule, as `run` applies it: files whose records the CommitLog no longer holds
            if broker is None or broker.holder is None:
                clean_output(dispatchers, commit_log.dirs, log)
        if failure is not None:
            raise failure
    finally:
        alongside.shutdown()
        if ahead is not None:
            ahead.close()
        reader.close()
        for d in dispatchers:
            d.close()
        summary.seconds = time.perf_counter() - started
        summary.segments = rolls + (summary.end_offset > commit_log.segment_start(summary.end_offset))
        summary.files = {getattr(d, "name", type(d).__name__): d.files() for d in dispatchers if hasattr(d, "files")}
    if summary.pending is not None:
        log.warning("incomplete_record_at_end", error=str(summary.pending))
    if summary.interrupted:
        log.warning("rebuild_interrupted", stopped_at=summary.end_offset, messages=summary.messages)
    log.info("rebuild_finished", **summary.as_dict())
    return summary


def new_units(batch, output_end: int) -> int:
    """The ConsumeQueue units the batch's records at or past `output_end` put (their own and their
    multi-dispatch targets'): units written for the others restored what the output lacked."""
    new = batch.consume_queue_mask() & (batch.phy_offset >= output_end)
    owner = batch.multi_owner
    return int(np.count_nonzero(new)) + (int(np.count_nonzero(new[owner])) if len(owner) else 0)


def written_end_of(commit_log: CommitLog) -> int:
    """Where the written data ends (the live daemon's rule, the one behind its lag gauge): what a rebuild
    reads up to, for the progress display and the check of --from."""
    from daemon.engine.head import written_end  # noqa: PLC0415 - the live daemon's module, loaded for this only

    return written_end(commit_log, commit_log.min_offset)


def dispatch_batch(dispatchers: list[Dispatcher], result: ReadResult, alongside: ThreadPoolExecutor) -> None:
    """Hand the batch to every dispatcher; those that say `dispatch_alongside` take it on the `alongside`
    thread while the others take it on this one (the rebuild of a store whose messages also go to 3 LMQ
    queues, ten alternating runs each: 1.100 s against 1.160 on tmpfs, 1.340 s against 1.375 on ext4).
    Returns once all are done, raising the error of a dispatcher on this thread if one failed, else the
    error of one alongside."""
    batch = result.batch
    if not len(batch):
        return
    aside = [alongside.submit(d.dispatch, batch) for d in dispatchers if getattr(d, "dispatch_alongside", False)]
    try:
        for d in dispatchers:
            if not getattr(d, "dispatch_alongside", False):
                d.dispatch(batch)
    finally:
        errors = [e for e in (f.exception() for f in aside) if e is not None]
    if errors:
        raise errors[0]


def widen_thin_batches(reader: CommitLogReader, spread: tuple[int, int], most: int | None = None) -> None:
    """Double the reader's batch size, up to `most` (REBUILD_MAX_BATCH_BYTES by default), after a batch that
    spread (queues, units) thin over many queues; a read-ahead thread takes the new size from its next read."""
    most = REBUILD_MAX_BATCH_BYTES if most is None else most
    queues, units = spread
    if queues >= THIN_BATCH_QUEUES and units < THIN_BATCH_UNITS_PER_QUEUE * queues:
        reader.batch_bytes = max(reader.batch_bytes, min(2 * reader.batch_bytes, most))


def widen_after_dispatch(reader: CommitLogReader, dispatchers: list[Dispatcher], most: int | None = None) -> None:
    """`widen_thin_batches` by the spread of the batch the ConsumeQueue dispatcher took last."""
    for d in dispatchers:
        if isinstance(d, ConsumeQueueDispatcher):
            widen_thin_batches(reader, d.spread, most)


class ProgressBar:
    """A one-line progress display on a terminal: percent of the written data, messages, rate.

    It is also a text stream: lines written to it (log events) appear above the bar, which is drawn again
    below them, so nothing is ever printed onto it. `finish` draws the final state and ends the line."""

    def __init__(self, stream=None, interval: float = 0.2, unit: str = "bytes"):
        self.stream = stream or sys.stderr
        self.unit = unit
        self.interval = interval
        self.started = time.perf_counter()
        self.last = 0.0
        self.line = ""
        self._state: tuple[int, int, int] | None = None
        self._partial = ""
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int, messages: int) -> None:
        self._state = (done, total, messages)
        now = time.perf_counter()
        if now - self.last >= self.interval or done >= total:
            self.last = now
            self._draw()

    def _text(self) -> str:
        if self._state is None:
            return ""
        done, total, messages = self._state
        pct = 100.0 * done / total if total > 0 else 100.0
        rate = messages / max(time.perf_counter() - self.started, 1e-9)
        count = f"  {messages:,} messages" if self.unit != "messages" else ""
        return f"  {min(pct, 100.0):5.1f}%  {done:,} of {total:,} {self.unit}{count}  {rate:,.0f} msgs/s"

    def _draw(self) -> None:
        with self._lock:
            text = self._text()
            self.stream.write("\r" + text + " " * max(0, len(self.line) - len(text)))
            self.line = text
            self.stream.flush()

    def write(self, text: str) -> int:
        """Print `text` above the bar, a whole line at a time (a writer may send a line in pieces)."""
        with self._lock:
            self._partial += text
            if "\n" in self._partial:
                lines, _, self._partial = self._partial.rpartition("\n")
                self.stream.write("\r" + " " * len(self.line) + "\r" + lines + "\n" + self.line)
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def finish(self) -> None:
        """Draw the final state (100% when the rebuild reached the end) and end the line."""
        if self._state is not None:
            self._draw()
        with self._lock:
            if self.line:
                self.stream.write("\n")
            self.line = ""
            if self._partial:
                self.stream.write(self._partial + "\n")
                self._partial = ""
            self.stream.flush()
