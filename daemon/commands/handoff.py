"""`reputd handoff`: make a store root ready for the broker, started next, to take reputd's consumequeue/ and
index/ as its own and serve every message.

Why it is needed. At `load()` a 4.9.3 broker reads its `checkpoint` (StoreCheckpoint) and whether `abort`
exists (its last exit was not clean). With `abort`, `IndexService.load(false)` destroys every IndexFile
whose endTimestamp is later than indexMsgTimestamp (all of them when `checkpoint` is gone), and
`recoverAbnormally` re-dispatches from the newest CommitLog segment whose first store time is at most
min(physicMsgTimestamp, logicsMsgTimestamp) - 3 s, appending units at each queue's current end whatever
their queue offset, before the delay levels are loaded (a delayed message gets its tags hash, not its
delivery time). Without `abort` it recovers normally: files taken as they are, and its reput starts where
the ConsumeQueues end. So, with the broker stopped:

1. complete the output to the end of the CommitLog's written data (`rebuild` continuing it, so a stopped
   `reputd run` output is finished first), flushed and synced;
2. check it as `verify` does, holding the whole CommitLog to it, and refuse on any finding; and check that
   the IndexFile names sort after nothing the broker will name later (they are local times);
3. set the broker's `checkpoint` to the times the files hold, the latest the broker's own flushes would
   record for them: physicMsgTimestamp the store time of the CommitLog's last record, logicsMsgTimestamp that of the
   last record with a ConsumeQueue unit, indexMsgTimestamp the endTimestamp of the newest full IndexFile
   (no later than what the files hold, so a crash of the broker later recovers from them); remove
   `reputd.checkpoint` from the store root (the files are the broker's now: a later reputd resumes where
   they end); and remove `abort` last.

With an output directory other than the store root, step 3 is done only when asked (`--broker-files`),
and the directories to move are printed as commands.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from daemon.commands.brokerfiles import broker_file_changes, checkpoint_times, foreign_owned, index_headers
from daemon.commands.frontier import _same_dir, dispatch_frontier
from daemon.commands.verify import ABORT_FILE, VerifyReport, verify
from daemon.commands.verify_text import format_text
from daemon.config import Config
from daemon.engine.checkpoint import CHECKPOINT_FILE as REPUTD_CHECKPOINT_FILE
from daemon.engine.checkpoint import CheckpointError, read_checkpoint
from daemon.engine.reading import make_reader, open_commit_log
from daemon.engine.rebuild import RebuildFailed, rebuild, written_end_of
from daemon.engine.sizes import check_store_root_sizes
from daemon.ops.logs import get_logger
from indexcore.checkpoint import CHECKPOINT_FILE
from indexcore.consumequeue import CONSUME_QUEUE_DIR
from indexcore.indexservice import INDEX_DIR, index_file_name, index_file_time
from indexcore.reader import ReadStatus

MOVED_ASIDE_SUFFIX = ".before-handoff"


class HandoffRefused(Exception):
    """The files cannot be handed over as they are; the broker's files were left as they were (exit 1)."""


class HandoffInterrupted(Exception):
    """A stop was asked for (`stop` set) before the broker's files were changed; str() says where it stopped.
    What was completed of the output is flushed and checkpointed; nothing of the broker's was changed."""


def _stop_asked(stop: threading.Event | None, where: str) -> None:
    if stop is not None and stop.is_set():
        raise HandoffInterrupted(where)


@dataclass(slots=True)
class HandoffResult:
    end_offset: int = 0
    completed_messages: int = 0
    changes: list[str] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)
    dry_run: bool = False
    report: VerifyReport | None = None


def first_dispatched_record(config: Config, commit_log, start: int, end: int) -> int | None:
    """The offset of the first record in [start, end) that gets a ConsumeQueue unit or an index key, None
    when none does: what a dry run reads to tell an output that is complete (only PREPARED or ROLLBACK
    records without keys past the files' frontier) from one that is not."""
    reader = make_reader(config, commit_log)
    try:
        offset = start
        while offset < end:
            result = reader.read(offset)
            batch = result.batch
            if len(batch):
                keyed = np.zeros(len(batch), dtype=bool)
                keyed[batch.key_owner] = True
                needed = batch.consume_queue_mask() | (keyed & batch.index_mask())
                if needed.any():
                    return int(batch.phy_offset[int(needed.argmax())])
            if result.status is not ReadStatus.OK or result.next_offset <= offset:
                break
            offset = result.next_offset
    finally:
        reader.close()
    return None


def dispatched_kinds(config: Config, commit_log, start: int, end: int) -> set[str]:
    """The output's subdirectories (consumequeue/, index/) that dispatching [start, end) with the configured
    dispatchers would write into: what a dry run's plan names as moved, as the real run's does once it has
    completed the output. Reads until each configured kind has a record (a batch, mostly)."""
    names = {d.name for d in config.dispatchers}
    wanted = {CONSUME_QUEUE_DIR} if "consumequeue" in names else set()
    if "index" in names and config.store.message_index_enable:
        wanted.add(INDEX_DIR)
    found: set[str] = set()
    reader = make_reader(config, commit_log)
    try:
        offset = start
        while offset < end and found != wanted:
            result = reader.read(offset)
            batch = result.batch
            if len(batch):
                keyed = np.zeros(len(batch), dtype=bool)
                keyed[batch.key_owner] = True
                if batch.consume_queue_mask().any():
                    found.add(CONSUME_QUEUE_DIR)
                if (keyed & batch.index_mask()).any():
                    found.add(INDEX_DIR)
            if result.status is not ReadStatus.OK or result.next_offset <= offset:
                break
            offset = result.next_offset
    finally:
        reader.close()
    return found & wanted


def index_name_findings(config: Config, now_ms: int | None = None) -> list[str]:
    """Why the broker would load the IndexFiles in another order than they were written: it loads them in
    name order and names a new one by its wall clock, and the names are local times of the zone of the
    process that made them."""
    headers = index_headers(config.output.dir)
    problems = []
    for (a, ha), (b, hb) in itertools.pairwise(headers):
        if hb.begin_phy_offset < ha.begin_phy_offset:
            problems.append(f"{os.path.join(config.output.dir, INDEX_DIR, b)} sorts after {a} but holds earlier "
                            f"records (beginPhyOffset {hb.begin_phy_offset} < {ha.begin_phy_offset}): IndexFiles "
                            "named in two time zones")
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if headers:
        newest = os.path.join(config.output.dir, INDEX_DIR, headers[-1][0])
        try:
            ahead = index_file_time(headers[-1][0]) > now_ms
        except (ValueError, OverflowError):
            problems.append(f"{newest} is not named by a time (yyyyMMddHHmmssSSS)")
            ahead = False
        if ahead:
            problems.append(f"{newest} is named later than now here ({index_file_name(now_ms)}, time zone "
                            f"{time.strftime('%Z')}): the broker names its next IndexFile by its clock and would "
                            "load it before this one; make the index with reputd's TZ set to the broker's time "
                            "zone")
    return problems


@contextlib.contextmanager
def _signals_held(hold: bool):
    """SIGINT and SIGTERM held back (delivered on leaving) on the main thread, so that the checkpoint,
    reputd.checkpoint and abort change together, abort last."""
    if not hold or threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def move_commands(config: Config, handoff_command: str | None, to_come: set[str] | frozenset[str] = frozenset()
                  ) -> list[str]:
    """The shell commands that put the output's consumequeue/ and index/ in the store root, the broker's
    own set aside (never deleted), then the command that finishes the handoff there. `to_come`: the
    subdirectories the completion of the output would write (a dry run's), moved as if they were there."""
    root, out = config.store.store_path_root_dir, config.output.dir
    lines = []
    for sub in (CONSUME_QUEUE_DIR, INDEX_DIR):
        if not os.path.isdir(os.path.join(out, sub)) and sub not in to_come:
            continue  # nothing of that kind to hand over (an index switched off): the broker's stays
        target = os.path.join(root, sub)
        if os.path.lexists(target):
            aside = target + MOVED_ASIDE_SUFFIX
            n = 1
            while os.path.lexists(aside):
                n += 1
                aside = f"{target}{MOVED_ASIDE_SUFFIX}.{n}"
            lines.append(f"mv {shlex.quote(target)} {shlex.quote(aside)}")
        lines.append(f"mv {shlex.quote(os.path.join(out, sub))} {shlex.quote(target)}")
    if handoff_command:
        lines.append(handoff_command)
    return lines


def handoff(config: Config, *, dry_run: bool = False, broker_files: bool = False,
            handoff_command: str | None = None, say: Callable[[str], None] = print,
            progress: Callable[[], contextlib.AbstractContextManager] | None = None,
            stop: threading.Event | None = None, reputd_lock_before: bool = True) -> HandoffResult:
    """Complete, check and hand over (module docstring). Raises HandoffRefused, leaving the broker's files
    as they were. `handoff_command` is the command to print for finishing in the store root after the
    moves (an output elsewhere, without `broker_files`). `progress()`, when given, makes a context manager
    yielding the `progress(done, total, messages)` callback of each pass over the CommitLog (a terminal's
    progress bar). `stop`, once set, ends the completion at a batch boundary and the check at once, raising
    HandoffInterrupted; from the first change to the broker's files on, the handoff goes to its end.
    `reputd_lock_before`: whether the output held `reputd.lock` before this handoff locked it (one it made
    itself goes without being listed)."""
    passes = progress or (lambda: contextlib.nullcontext(None))
    log = get_logger(command="handoff")
    root, out = config.store.store_path_root_dir, config.output.dir
    in_root = _same_dir(out, root) if os.path.isdir(out) else os.path.realpath(out) == os.path.realpath(root)
    result = HandoffResult(dry_run=dry_run)
    to_come: set[str] = set()  # what completing the output would write (a dry run's plan moves it too)
    reputd_checkpoint_before = os.path.exists(os.path.join(out, REPUTD_CHECKPOINT_FILE))
    check_store_root_sizes(config)  # the output's files are to replace the store root's: the same sizes
    commit_log = open_commit_log(config)
    end = written_end_of(commit_log)
    if dry_run:
        frontier = None
        if os.path.isdir(out):
            try:
                reputd_checkpoint = read_checkpoint(out)
            except CheckpointError:
                reputd_checkpoint = None
            frontier = dispatch_frontier(out, commit_log, None, reputd_checkpoint.reput_from_offset
                                         if reputd_checkpoint is not None else None)
        output_end = frontier.offset if frontier is not None else commit_log.min_offset
        complete = output_end >= end or first_dispatched_record(config, commit_log, output_end, end) is None
        if not complete:
            if not os.path.lexists(out):  # the real run creates it (`reputd: note: created the output directory`)
                say(f"would create the output directory {out} (it does not exist)")
            say(f"would complete the output {out}: dispatch CommitLog [{output_end}, {end}) ({end - output_end:,} "
                "bytes), flush and sync it")
            say("would then check it as `reputd verify` does")
            to_come = dispatched_kinds(config, commit_log, output_end, end)
    else:
        try:
            with passes() as bar:
                summary = rebuild(config, progress=bar, stop=stop)
        except RebuildFailed as e:
            raise HandoffRefused(f"completing the output stopped: {e}") from None
        if summary.interrupted:
            raise HandoffInterrupted(f"stopped completing the output {out} at CommitLog offset {summary.end_offset} "
                                     "(everything before it written, flushed and checkpointed)")
        result.completed_messages = summary.new_messages
        if summary.new_messages:
            say(f"completed the output {out}: dispatched {summary.new_messages:,} messages up to CommitLog offset "
                f"{summary.end_offset} in {summary.seconds:.2f} s, flushed and synced")
        else:
            say(f"the output {out} already ends at the end of the CommitLog's written data ({summary.end_offset})")
        if summary.pending is not None:
            say(f"note: the CommitLog ends with an incomplete record, which the broker's recovery cuts off: "
                f"{summary.pending}")
        end = summary.end_offset
        complete = True
    result.end_offset = end
    if complete:
        _stop_asked(stop, f"stopped before checking the output {out}")

        def checking(bar):
            """The check's progress callback: the bar's, and where a stop ends the check."""
            def step(done: int, total: int, messages: int) -> None:
                _stop_asked(stop, f"stopped checking the output {out}")
                if bar is not None:
                    bar(done, total, messages)
            return step if stop is not None else bar

        with passes() as bar:
            report = verify(config, complete=True, progress=checking(bar))
        result.report = report
        if not report.consistent:
            for line in format_text(report):
                say(line)
            log.error("handoff_refused", output=out, findings=len(report.findings), by_kind=report.by_kind())
            raise HandoffRefused(f"{out} differs from what the CommitLog implies ({len(report.findings)} "
                                 f"finding{'s' * (len(report.findings) != 1)}, listed above): nothing of the "
                                 "broker's was changed")
        for note in report.notes:
            say(f"note: {note}")
        say(f"checked: {report.messages:,} messages [{report.from_offset}, {report.end_offset}), "
            f"{report.units:,} units in {report.queue_files:,} ConsumeQueue files, {report.entries:,} index "
            f"entries in {report.index_files:,} IndexFiles: consistent")
        problems = [f"indexFileName: {p}" for p in index_name_findings(config)]
        uid, gid, others = foreign_owned(config)
        if others:
            problems.append(f"fileOwner: {len(others):,} files and directories under {out} (first {others[0]}) are "
                            f"not owned by uid {uid}, who owns the CommitLog (the broker's user), which could not "
                            f"write them; give them to it: chown -R {uid}:{gid} "
                            + " ".join(shlex.quote(os.path.join(out, sub)) for sub in (CONSUME_QUEUE_DIR, INDEX_DIR)
                                       if os.path.isdir(os.path.join(out, sub))))
        if problems:
            for p in problems:
                say(p)
            log.error("handoff_refused", output=out, findings=len(problems),
                      by_kind={k: sum(p.startswith(k + ":") for p in problems) for k in ("indexFileName", "fileOwner")})
            raise HandoffRefused(f"the broker could not take {out} as it is ({len(problems)} finding"
                                 f"{'s' * (len(problems) != 1)}, listed above): nothing of the broker's was changed")
    if (in_root or broker_files) and complete:
        times = checkpoint_times(config, end)
        _stop_asked(stop, f"stopped after checking the output {out}")
        changes = broker_file_changes(config, times, in_root=in_root,
                                      reputd_checkpoint_before=dry_run or reputd_checkpoint_before,
                                      reputd_lock_before=dry_run or reputd_lock_before)
        with _signals_held(not dry_run):  # the changes are made together: a Ctrl-C lands after them
            for change in changes:
                if not dry_run:
                    change.apply()
                text = change.text(dry_run=dry_run)
                say(text)
                result.changes.append(text)
        if not changes:
            say(f"the broker's files in {root} already agree with the output: nothing to change")
    elif in_root or broker_files:
        say(f"would then set {os.path.join(root, CHECKPOINT_FILE)} to the times the completed files hold"
            + (f" and remove {os.path.join(root, ABORT_FILE)}" if os.path.exists(os.path.join(root, ABORT_FILE))
               else ""))
    if not in_root:
        result.moves = move_commands(config, None if broker_files else handoff_command, to_come)
        say(f"to hand {out} to the broker, with the broker stopped, run:" if not broker_files else
            f"before the broker starts, move {out}'s files into {root}:")
        for line in result.moves:
            say(f"  {line}")
    if dry_run:
        say("dry run: nothing was changed")
    elif in_root or broker_files:
        say(f"handed off: the broker started next on {root} takes its {CONSUME_QUEUE_DIR}/ and {INDEX_DIR}/ "
            f"as its own and reputs from CommitLog offset {end}"
            + ("" if in_root else " (once they are moved there)"))
    log.info("handoff_finished", output=out, store=root, end_offset=end, dry_run=dry_run,
             completed_messages=result.completed_messages, changes=result.changes, moves=result.moves)
    return result


__all__ = ["HandoffInterrupted", "HandoffRefused", "HandoffResult", "dispatched_kinds", "first_dispatched_record",
           "handoff", "index_name_findings", "move_commands"]
