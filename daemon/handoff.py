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
3. set the broker's `checkpoint` to the times the files hold, as the broker's own clean shutdown leaves
   them: physicMsgTimestamp the store time of the CommitLog's last record, logicsMsgTimestamp that of the
   last record with a ConsumeQueue unit, indexMsgTimestamp the endTimestamp of the newest full IndexFile
   (no later than what the files hold, so a crash of the broker later recovers from them); remove
   `reputd.checkpoint` from the store root (the files are the broker's now: a later reputd resumes where
   they end); and remove `abort` last.

With an output directory other than the store root, step 3 is done only when asked (`--broker-files`),
and the directories to move are printed as commands.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from daemon.checkpoint import CHECKPOINT_FILE as REPUTD_CHECKPOINT_FILE
from daemon.checkpoint import CheckpointError, read_checkpoint
from daemon.config import Config
from daemon.logs import get_logger
from daemon.rebuild import RebuildFailed, make_reader, open_commit_log, rebuild, written_end_of
from daemon.render import human_time
from daemon.verify import (
    ABORT_FILE,
    LOCK_FILE,
    VerifyReport,
    _same_dir,
    dispatch_frontier,
    format_text,
    lock_held,
    verify,
)
from indexcore.checkpoint import CHECKPOINT_FILE, CHECKPOINT_FILE_SIZE, StoreCheckpoint
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CONSUME_QUEUE_DIR, CQ_UNIT, CQ_UNIT_SIZE
from indexcore.errors import StoreError
from indexcore.indexfile import INDEX_HEADER, INDEX_HEADER_SIZE, IndexHeader
from indexcore.indexservice import INDEX_DIR, index_file_name, index_file_time
from indexcore.reader import ReadStatus

# the three StoreCheckpoint fields a 4.9.3 broker reads, by their Java names
CHECKPOINT_FIELDS = (("physicMsgTimestamp", "physic_msg_timestamp"),
                     ("logicsMsgTimestamp", "logics_msg_timestamp"),
                     ("indexMsgTimestamp", "index_msg_timestamp"))
MOVED_ASIDE_SUFFIX = ".before-handoff"


class BrokerRunning(Exception):
    """The broker holds its `lock`: nothing was touched (exit 2)."""


class HandoffRefused(Exception):
    """The files cannot be handed over as they are; the broker's files were left as they were (exit 1)."""


@dataclass(slots=True)
class CheckpointTimes:
    """What the files hold, as the broker's own clean shutdown writes it into `checkpoint`."""

    physic_msg_timestamp: int
    logics_msg_timestamp: int
    index_msg_timestamp: int
    end_offset: int


@dataclass(slots=True)
class HandoffResult:
    end_offset: int = 0
    completed_messages: int = 0
    changes: list[str] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)
    dry_run: bool = False
    report: VerifyReport | None = None


def broker_lock_held(root: str) -> bool:
    return lock_held(os.path.join(root, LOCK_FILE))


def hold_broker_lock(root: str) -> int | None:
    """Take the broker's own `lock` (a POSIX lock on its first byte, what the broker's `start()` tries), so
    a broker started while the handoff works fails to start instead of loading half-prepared files. The
    lock goes with the process. None when the store has no `lock` file yet (no broker ever started)."""
    path = os.path.join(root, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise BrokerRunning(f"{path} is held: the broker is running; stop it first (handoff prepares the "
                                "files for the broker's next start)") from None
        raise
    return fd


def _last_unit_offset(path: str) -> int:
    """The CommitLog offset of the last unit of a ConsumeQueue file (the first invalid unit ends them, as
    the broker's recovery finds its write position), by bisection; -1 when it holds no real unit."""
    with open(path, "rb") as f:
        def unit(i: int) -> tuple[int, int, int]:
            return CQ_UNIT.unpack(os.pread(f.fileno(), CQ_UNIT_SIZE, i * CQ_UNIT_SIZE))

        lo, hi = 0, os.path.getsize(path) // CQ_UNIT_SIZE
        while lo < hi:
            mid = (lo + hi) // 2
            phy, msg_size, _ = unit(mid)
            if phy >= 0 and msg_size > 0:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return -1
        phy, msg_size, _ = unit(lo - 1)
        return -1 if msg_size == BLANK_UNIT_MSG_SIZE else phy


def newest_unit_offset(out: str) -> int:
    """The CommitLog offset of the newest unit over all ConsumeQueues, -1 when there is none."""
    newest = -1
    root = os.path.join(out, CONSUME_QUEUE_DIR)
    for topic in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        tdir = os.path.join(root, topic)
        for qid in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
            qdir = os.path.join(tdir, qid)
            names = sorted(n for n in os.listdir(qdir) if n.isdigit()) if os.path.isdir(qdir) else []
            if names:
                newest = max(newest, _last_unit_offset(os.path.join(qdir, names[-1])))
    return newest


def index_headers(out: str) -> list[tuple[str, IndexHeader]]:
    """Every IndexFile's name and header, in name order (the order the broker loads them in)."""
    index_dir = os.path.join(out, INDEX_DIR)
    names = sorted(n for n in os.listdir(index_dir) if n.isdigit()) if os.path.isdir(index_dir) else []
    headers = []
    for name in names:
        with open(os.path.join(index_dir, name), "rb") as f:
            head = f.read(INDEX_HEADER_SIZE)
        if len(head) == INDEX_HEADER_SIZE:
            headers.append((name, IndexHeader(*INDEX_HEADER.unpack(head))))
    return headers


def checkpoint_times(config: Config, end_offset: int) -> CheckpointTimes:
    """The StoreCheckpoint times the output proves, for an output complete to `end_offset`: the store time
    of the last record with a ConsumeQueue unit (read at the newest unit), of the CommitLog's last record
    (read on from there: only PREPARED and ROLLBACK records, which get no unit, can follow it), and the
    endTimestamp of the newest full IndexFile (4.9.3 records an IndexFile's end only once it is full)."""
    store = config.store
    commit_log = open_commit_log(config)
    newest = newest_unit_offset(config.output.dir)
    logics = 0
    start = commit_log.min_offset
    if newest >= 0:
        logics = commit_log.read_record(newest, check_crc=False, max_message_size=store.max_message_size)\
            .store_timestamp
        start = newest
    physic = logics
    reader = make_reader(config, commit_log)
    try:
        offset = start
        while offset < end_offset:
            result = reader.read(offset)
            if len(result.batch):
                physic = int(result.batch.store_timestamp[-1])
            if result.next_offset <= offset or result.status is not ReadStatus.OK:
                break
            offset = result.next_offset
    finally:
        reader.close()
    index = 0
    for _name, header in index_headers(config.output.dir):
        if header.index_count >= store.max_index_num:
            index = header.end_timestamp
    return CheckpointTimes(physic, logics, index, end_offset)


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
    if headers and index_file_time(headers[-1][0]) > now_ms:
        problems.append(f"{os.path.join(config.output.dir, INDEX_DIR, headers[-1][0])} is named later than now "
                        f"here ({index_file_name(now_ms)}, TZ={os.environ.get('TZ', 'unset')}): the broker "
                        "names its next IndexFile by its clock and would load it before this one; make the "
                        "index with reputd's TZ set to the broker's time zone")
    return problems


def read_broker_checkpoint(root: str) -> tuple[bytes | None, StoreCheckpoint | None, str | None]:
    """The page, the decoded checkpoint, and why it does not decode (None, None, None when absent)."""
    path = os.path.join(root, CHECKPOINT_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read(CHECKPOINT_FILE_SIZE + 1)
    except FileNotFoundError:
        return None, None, None
    try:
        return data, StoreCheckpoint.decode(data, path), None
    except StoreError as e:
        return data, None, str(e)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_broker_checkpoint(root: str, checkpoint: StoreCheckpoint) -> None:
    """Replace `checkpoint` atomically: a temporary file, synced, renamed over it, the directory synced."""
    path = os.path.join(root, CHECKPOINT_FILE)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(checkpoint.encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(root)


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _fsync_dir(os.path.dirname(path) or ".")


def _when(ms: int) -> str:
    return f"{ms} ({human_time(ms)})" if ms > 0 else "0"


_PAST = {"write": "wrote", "set": "set", "remove": "removed"}


@dataclass(frozen=True, slots=True)
class Change:
    """One change to the broker's files: `verb` and `what` print it ("would set ..." in a dry run, "set ..."
    once made), `apply` makes it."""

    verb: str
    what: str
    apply: Callable[[], None]

    def text(self, *, dry_run: bool) -> str:
        return f"would {self.verb} {self.what}" if dry_run else f"{_PAST[self.verb]} {self.what}"


def broker_file_changes(config: Config, times: CheckpointTimes, *, in_root: bool,
                        reputd_checkpoint_before: bool = True) -> list[Change]:
    """Each change to the broker's files, `abort` last. `reputd_checkpoint_before`: whether the store root
    held `reputd.checkpoint` before the handoff completed the output (which writes one): one the handoff
    wrote itself is removed without being listed as a change."""
    root = config.store.store_path_root_dir
    path = os.path.join(root, CHECKPOINT_FILE)
    page, current, problem = read_broker_checkpoint(root)
    target = (current or StoreCheckpoint())._replace(physic_msg_timestamp=times.physic_msg_timestamp,
                                                    logics_msg_timestamp=times.logics_msg_timestamp,
                                                    index_msg_timestamp=times.index_msg_timestamp)
    changes: list[Change] = []
    if current is None:
        why = "there was none" if page is None else problem
        detail = ", ".join(f"{java} {_when(getattr(target, name))}" for java, name in CHECKPOINT_FIELDS)
        changes.append(Change("write", f"{path} ({why}): {detail}", lambda: write_broker_checkpoint(root, target)))
    else:
        diffs = [f"{java} {_when(getattr(current, name))} -> {_when(getattr(target, name))}"
                 for java, name in CHECKPOINT_FIELDS if getattr(current, name) != getattr(target, name)]
        if diffs:
            changes.append(Change("set", f"{path}: " + "; ".join(diffs), lambda: write_broker_checkpoint(root, target)))
    reputd_checkpoint = os.path.join(config.output.dir, REPUTD_CHECKPOINT_FILE)
    if in_root and os.path.exists(reputd_checkpoint):
        if reputd_checkpoint_before:
            changes.append(Change("remove", f"{reputd_checkpoint} (the files are the broker's now: a later reputd "
                                            "resumes where they end)", lambda: remove_file(reputd_checkpoint)))
        else:
            remove_file(reputd_checkpoint)
    abort = os.path.join(root, ABORT_FILE)
    if os.path.exists(abort):
        changes.append(Change("remove", f"{abort} (the broker's mark of an unclean exit): its next start recovers "
                                        f"normally and reputs from CommitLog offset {times.end_offset}",
                              lambda: remove_file(abort)))
    return changes


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


def move_commands(config: Config, handoff_command: str | None) -> list[str]:
    """The shell commands that put the output's consumequeue/ and index/ in the store root, the broker's
    own set aside (never deleted), then the command that finishes the handoff there."""
    root, out = config.store.store_path_root_dir, config.output.dir
    lines = []
    for sub in (CONSUME_QUEUE_DIR, INDEX_DIR):
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
            handoff_command: str | None = None, say: Callable[[str], None] = print) -> HandoffResult:
    """Complete, check and hand over (module docstring). Raises HandoffRefused, leaving the broker's files
    as they were. `handoff_command` is the command to print for finishing in the store root after the
    moves (an output elsewhere, without `broker_files`)."""
    log = get_logger(command="handoff")
    root, out = config.store.store_path_root_dir, config.output.dir
    in_root = _same_dir(out, root) if os.path.isdir(out) else os.path.realpath(out) == os.path.realpath(root)
    result = HandoffResult(dry_run=dry_run)
    reputd_checkpoint_before = os.path.exists(os.path.join(out, REPUTD_CHECKPOINT_FILE))
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
            say(f"would complete the output {out}: dispatch CommitLog [{output_end}, {end}) ({end - output_end:,} "
                "bytes), flush and sync it")
            say("would then check it as `reputd verify` does")
    else:
        try:
            summary = rebuild(config)
        except RebuildFailed as e:
            raise HandoffRefused(f"completing the output stopped: {e}") from None
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
        report = verify(config, complete=True)
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
        problems = index_name_findings(config)
        if problems:
            for p in problems:
                say(f"indexFileName: {p}")
            log.error("handoff_refused", output=out, findings=len(problems), by_kind={"indexFileName": len(problems)})
            raise HandoffRefused(f"the broker would load {out}/{INDEX_DIR} out of order ({len(problems)} "
                                 "finding{}, listed above): nothing of the broker's was changed"
                                 .format("s" * (len(problems) != 1)))
    if (in_root or broker_files) and complete:
        times = checkpoint_times(config, end)
        changes = broker_file_changes(config, times, in_root=in_root,
                                      reputd_checkpoint_before=dry_run or reputd_checkpoint_before)
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
        result.moves = move_commands(config, None if broker_files else handoff_command)
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


__all__ = ["BrokerRunning", "HandoffRefused", "HandoffResult", "broker_lock_held", "checkpoint_times", "handoff",
           "hold_broker_lock", "index_name_findings", "move_commands"]
