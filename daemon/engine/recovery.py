"""Recovery: where `reputd run` and `reputd rebuild` start reading, and how the output is put back to a
point from which dispatching again ends in the files of an uninterrupted run.

Every start goes through `recover_output`, with one set of rules per output file kind:

| output file  | checkpoint with dispatcher state (X, S)    | no such checkpoint                                |
|--------------|--------------------------------------------|---------------------------------------------------|
| ConsumeQueue | units at or past X zeroed, a file left     | `run`: the end of the last unit over all queues   |
|              | empty deleted; fewer queues than S counts: | (the broker's rule); `rebuild` (`rescan`): the    |
|              | from the CommitLog's first offset          | CommitLog's first offset; each queue skips units  |
|              |                                            | it holds                                          |
| IndexFile    | files newer than S's deleted, entries past | the last record indexed is at the newest file's   |
|              | S removed and their slots restored;        | end_phy_offset E, and the files hold its first j  |
|              | records below X left out                   | keys (counted back from the newest entry, across  |
|              |                                            | a roll): from E, putting only its other keys;     |
|              |                                            | records below E left out                          |
| plug-in      | `recover(X, state)`                        | `resume_offset()`                                 |

One rule places every unit, whatever the start: at its own record's queue offset. A queue skips the units
it holds (their records end at or below its last unit's, or their offsets lie below its write position),
goes on at its write position, and meets a unit past it only when the records between were never read:
retention deleted them (a start below the CommitLog's first offset reads from there) or a queue's files
were deleted. The unit goes to its offset with blank units between (`consumequeue.place_units`), where a
4.9.3 broker appends it off its offset for good. That is why the start may be as low as any file needs
and no lower than the CommitLog allows: a deleted queue is rebuilt exactly by `rebuild`, which reads from
the first offset when no checkpoint says where the output ends (the end of the last unit over all queues
tells nothing of a queue that is gone or ends early), and a restart across a retention gap leaves
retained records' units where a broker running all along has them, the units the output never held
durably blank, and counts as retention-skipped only the bytes no output file holds.

"No such checkpoint": none, a replay marker (a checkpoint without dispatcher state), or one that cannot be
trusted. The start is X when the checkpoint covers every dispatcher; otherwise the lowest offset any
dispatcher needs (a kind with nothing written needs the CommitLog's first offset), and never above a
replay marker's offset. A start derived from the files is first written as a replay marker, durably: a
batch is written queue by queue, so until the first real checkpoint the files may hold part of one, and
a kill must make the next start read that batch again rather than derive a higher offset.

A kill can stop a ConsumeQueue write between two pages, the unit across the boundary half written
(`consumequeue.WRITE_PAGE_SIZE`): under a replay marker, each queue's last unit across a page boundary at
or past the marker is removed first, since its cut-off tags_code would make it look whole and the replay
would pass it over (`ConsumeQueueDispatcher.drop_torn_tails`); a load zeroes an invalid unit so cut.

Before any of it, each kind's load removes what a kill during a file's creation left: the temporary
file of a creation cut short and, from an older reputd or a broker, a 0-byte newest file, a queue's
only file allocated without its pre-blank units, a newest IndexFile allocated without its header. They
hold nothing, so the checkpoint stays good. Files of a kind all of one size the config does not give
are the config's mistake, refused and left as they are (daemon/engine/sizes.py: exit 2); one output file
of the wrong size among right ones, or one with a garbage header, is damage: `run` moves it to
`quarantine/` in the output directory with what depends on it (a ConsumeQueue's whole queue directory, an
IndexFile and every newer one), after a replay marker at the CommitLog's first
offset, and what it held is dispatched again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from daemon.config import Config
from daemon.engine.checkpoint import Checkpoint, CheckpointError, read_checkpoint, write_checkpoint
from daemon.engine.dispatchers import Dispatcher, build_dispatchers
from daemon.engine.dledgermode import reput_offset
from daemon.engine.dledgeroutput import cut_after_quarantine, plugins_not_cut, repair_at_start
from daemon.engine.sizes import settings_or_damage
from daemon.ops.logs import get_logger
from daemon.ops.metriclabels import ErrorKind, RecoveryDecision, SkipReason
from indexcore.consumequeue import CONSUME_QUEUE_DIR
from indexcore.errors import SizeMismatchError, StoreError, StoreLayoutError
from indexcore.indexservice import INDEX_DIR
from indexcore.reader import CommitLog

if TYPE_CHECKING:
    from daemon.ops.metrics import ReputMetrics

MS_PER_SECOND = 1000
QUARANTINE_DIR = "quarantine"
MAX_QUARANTINES = 64


@dataclass(slots=True)
class Recovered:
    """The output put back to a consistent point, and where to read from."""

    dispatchers: list[Dispatcher]
    start: int  # the CommitLog offset to dispatch from
    decision: str
    checkpoint: Checkpoint  # the checkpoint now on disk (a replay marker for a derived start)
    output_end: int  # records at or past it are new to some output file; those below, every dispatcher had


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


def write_replay_marker(output_dir: str, offset: int, reason: str, log) -> Checkpoint:
    """A checkpoint with no dispatcher state: "read again from `offset`; each dispatcher skips what its
    files already hold". Written, durably, before any step that a kill must not make recovery forget: a
    quarantine, or a start from offsets derived from the files."""
    marker = Checkpoint(offset, {}, int(time.time() * MS_PER_SECOND))
    write_checkpoint(output_dir, marker)
    log.info("replay_marker_written", reput_from_offset=offset, reason=reason)
    return marker


def _count(metrics: ReputMetrics | None, name: str, amount: float = 1, **labels) -> None:
    if metrics is not None:
        getattr(metrics, name).labels(**labels).inc(amount)


def _build_with_quarantine(config: Config, output_dir: str, commit_log: CommitLog, log,
                           metrics: ReputMetrics | None, enabled: bool) -> tuple[list[Dispatcher], list[str]]:
    moved: list[str] = []
    for _ in range(MAX_QUARANTINES):
        try:
            return build_dispatchers(config, output_dir), moved
        except StoreLayoutError as e:
            if isinstance(e, SizeMismatchError) and _inside(e.path, output_dir):
                # every file of its kind that size: the config is not the broker's (raised, exit 2); else damage
                settings_or_damage(e, output_dir, config.store)
                if not enabled:
                    raise StoreLayoutError(e.path, e.detail) from None
            if not enabled or not _inside(e.path, output_dir) or \
                    os.path.abspath(e.path) == os.path.abspath(output_dir):
                raise
            if not moved:
                write_replay_marker(output_dir, commit_log.min_offset, "output files quarantined", log)
            paths = quarantine(output_dir, e.path)
            _count(metrics, "errors", kind=ErrorKind.RECOVERY)  # one damaged output file, counted as it is moved
            log.error("output_file_quarantined", path=e.path, error=str(e), moved=paths,
                      to=os.path.join(output_dir, QUARANTINE_DIR))
            moved.extend(paths)
    raise StoreLayoutError(output_dir, f"still damaged after quarantining {len(moved)} paths")


def _recover_to_checkpoint(dispatchers: list[Dispatcher], offset: int, states: dict[str, Any], commit_log: CommitLog,
                           log) -> int:
    """Cut the dispatchers that the checkpoint covers back to it; a dispatcher it does not cover (one
    added to the config since, or every one under a replay marker) needs records from its own resume
    offset, which may be lower, and one that lost files the checkpoint counted (a deleted queue) needs the
    CommitLog from its first offset."""
    first_offset = commit_log.min_offset
    start = offset
    for d in dispatchers:
        if d.name in states and hasattr(d, "recover"):
            d.recover(offset, states[d.name])
            log.info("dispatcher_recovered", dispatcher=d.name, reput_from_offset=offset)
            missing = getattr(d, "missing_queues", 0)
            if missing:
                start = first_offset
                log.warning("queues_missing", dispatcher=d.name, queues=missing, reput_from_offset=first_offset,
                            detail="queues the checkpoint counted are gone: read again from the CommitLog's "
                                   "first offset, each queue skipping the units it holds")
        elif hasattr(d, "resume_offset"):
            torn = d.drop_torn_tails(offset) if hasattr(d, "drop_torn_tails") else []
            if torn:
                log.warning("torn_units_removed", dispatcher=d.name, paths=torn, reput_from_offset=offset,
                            detail="last units a kill may have left half written; the replay writes them again")
            resume = d.resume_offset()
            start = min(start, first_offset if resume is None else reput_offset(commit_log, resume))
            log.info("dispatcher_not_in_checkpoint", dispatcher=d.name, resume_offset=resume)
    return start


def recover_output(config: Config, commit_log: CommitLog, *, metrics: ReputMetrics | None = None,
                   log=None, quarantine_damaged: bool = True, rescan: bool = False) -> Recovered:
    """Open the dispatchers on the output, put their files back to a consistent point by the rules above,
    and decide the offset to dispatch from. Raises StoreError or OSError when the output cannot be used;
    without `quarantine_damaged` (`reputd rebuild`, an operator's command), also for a damaged file, which
    the operator then sees named instead of moved. With `rescan` (`reputd rebuild`), a start without a
    checkpoint is the CommitLog's first offset, so that a queue whose files are gone or end early is
    completed exactly (each queue skips the units it holds, the index the records it indexed)."""
    log = log or get_logger(component="recovery")
    out = config.output.dir
    os.makedirs(out, exist_ok=True)
    # DLedger: entries dispatched that a new leader cut
    repair = repair_at_start(config, metrics=metrics, log=log, first_offset=commit_log.min_offset)
    try:
        checkpoint = read_checkpoint(out)
    except CheckpointError as e:
        log.error("checkpoint_corrupt", path=e.path, error=e.detail, decision="rebuild from the CommitLog")
        _count(metrics, "errors", kind=ErrorKind.CHECKPOINT)
        checkpoint = None
    dispatchers, moved = _build_with_quarantine(config, out, commit_log, log, metrics, quarantine_damaged)
    if moved and repair is not None:  # the quarantine's replay marker replaced the repair's checkpoint
        for d in dispatchers:
            d.close()
        cut_after_quarantine(config, commit_log.min_offset, log)
        dispatchers = build_dispatchers(config, out)
    for d in dispatchers:
        removed = getattr(d, "removed", None)
        if removed:
            log.warning("unfinished_files_removed", dispatcher=d.name, paths=removed,
                        detail="files whose creation a kill cut short; they held nothing")
        torn = getattr(d, "torn", None)
        if torn:
            log.warning("torn_units_zeroed", dispatcher=d.name, paths=torn,
                        detail="the first bytes of units whose write a kill stopped; they are written again")
    if moved:
        checkpoint = read_checkpoint(out)  # the replay marker written before the first move
    plugins_not_cut(repair, dispatchers, checkpoint, log)
    if checkpoint is not None and checkpoint.reput_from_offset > commit_log.max_offset:
        _count(metrics, "errors", kind=ErrorKind.CHECKPOINT)
        log.error("checkpoint_distrusted", reason="checkpoint is past the end of the CommitLog",
                  reput_from_offset=checkpoint.reput_from_offset, commit_log_max_offset=commit_log.max_offset)
        checkpoint = None
    start: int | None = None
    decision = RecoveryDecision.DERIVED
    if checkpoint is not None:
        try:
            start = _recover_to_checkpoint(dispatchers, checkpoint.reput_from_offset, checkpoint.dispatchers,
                                           commit_log, log)
            decision = RecoveryDecision.CHECKPOINT if checkpoint.dispatchers else RecoveryDecision.REPLAY
        except (StoreError, ValueError) as e:
            log.error("checkpoint_distrusted", reason=str(e))
            _count(metrics, "errors", kind=ErrorKind.RECOVERY)
    if start is None:
        # a record's store offset as the reader takes it (in a DLedger log, its entry's position: pos + 48 - 48)
        offsets = [reput_offset(commit_log, d.resume_offset()) for d in dispatchers if hasattr(d, "resume_offset")]
        start = min((commit_log.min_offset if o is None else o for o in offsets), default=commit_log.min_offset)
        if rescan:
            start = commit_log.min_offset
    if decision == RecoveryDecision.CHECKPOINT:
        output_end = held = checkpoint.reput_from_offset
    else:
        ends = [d.output_end() for d in dispatchers if hasattr(d, "output_end")]
        output_end = max(start, min(ends, default=start))  # from here on, new to at least one dispatcher
        held = max([start, *ends])  # below it, some output file holds the records
    if start < commit_log.min_offset:
        # only what no output file holds was lost to retention; the units of the records it never got are
        # blank at their queue offsets (`consumequeue.place_units`), every later unit at its own
        skipped = max(0, commit_log.min_offset - held)
        log.warning("offset_below_oldest_segment", requested=start, resumed_at=commit_log.min_offset,
                    skipped_bytes=skipped, output_end=held,
                    detail="CommitLog segments were deleted before their records were dispatched")
        _count(metrics, "skipped", skipped, reason=SkipReason.RETENTION)
        start = commit_log.min_offset
    if decision == RecoveryDecision.DERIVED:
        checkpoint = write_replay_marker(out, start, "no checkpoint to trust", log)
    _count(metrics, "recoveries", decision=decision)
    log.info("recovered", decision=decision, reput_from_offset=start, checkpoint=checkpoint.reput_from_offset,
             commit_log_min_offset=commit_log.min_offset, segments=len(commit_log.segments))
    return Recovered(dispatchers, start, decision, checkpoint, output_end)
