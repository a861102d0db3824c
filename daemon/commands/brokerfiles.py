"""The broker's own files in its store root that decide how a 4.9.3 broker starts on it: `lock` (held while
it runs), `abort` (its last exit was not clean: it then recovers abnormally from the times in `checkpoint`)
and `checkpoint` (StoreCheckpoint, indexcore/checkpoint.py), and the times an output's files hold, which
`reputd handoff` writes there (daemon/commands/handoff.py says why)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass

from daemon.commands.render import human_time
from daemon.commands.verify import ABORT_FILE, LOCK_FILE, lock_held
from daemon.config import Config
from daemon.engine.checkpoint import CHECKPOINT_FILE as REPUTD_CHECKPOINT_FILE
from daemon.engine.dledgermode import commit_log_path
from daemon.engine.reading import make_reader, open_commit_log
from daemon.ops.outlock import LOCK_FILE as REPUTD_LOCK_FILE
from indexcore.checkpoint import CHECKPOINT_FILE, CHECKPOINT_FILE_SIZE, StoreCheckpoint
from indexcore.consumequeue import CONSUME_QUEUE_DIR, last_written_unit
from indexcore.errors import StoreError
from indexcore.indexfile import INDEX_HEADER, INDEX_HEADER_SIZE, IndexHeader
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import sync_file
from indexcore.reader import ReadStatus

# the three StoreCheckpoint fields a 4.9.3 broker reads, by their Java names
CHECKPOINT_FIELDS = (("physicMsgTimestamp", "physic_msg_timestamp"),
                     ("logicsMsgTimestamp", "logics_msg_timestamp"),
                     ("indexMsgTimestamp", "index_msg_timestamp"))


class BrokerRunning(Exception):
    """The broker holds its `lock`: nothing was touched (exit 2)."""


@dataclass(slots=True)
class CheckpointTimes:
    """The StoreCheckpoint times the files hold: the latest the broker's own flushes would record for them
    (its clean shutdown leaves these, or an earlier physicMsgTimestamp: its last CommitLog flush)."""

    physic_msg_timestamp: int
    logics_msg_timestamp: int
    index_msg_timestamp: int
    end_offset: int


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
    """The CommitLog offset of the last unit of a ConsumeQueue file; -1 when it holds no real unit."""
    last = last_written_unit(path)
    return -1 if last is None else last[0]


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
    if store.enable_d_leger_commit_log:
        # DLedger mode: no CommitLog flush service runs, and every ConsumeQueue write sets physicMsgTimestamp
        # too (ConsumeQueue.putMessagePositionInfoWrapper), so it is the last unit's store time (NOTES §9)
        physic = logics
    index = 0
    for _name, header in index_headers(config.output.dir):
        if header.index_count >= store.max_index_num:
            index = header.end_timestamp
    return CheckpointTimes(physic, logics, index, end_offset)


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


def write_broker_checkpoint(root: str, checkpoint: StoreCheckpoint) -> None:
    """Write `checkpoint` and sync it. An existing one is written in place, one page as the broker writes it,
    so it keeps its owner and mode (a new file made by a reputd running as root would be one the broker's
    user cannot open); a missing one is made under a temporary name, given the owner of the store root,
    synced and renamed into place."""
    path = os.path.join(root, CHECKPOINT_FILE)
    page = checkpoint.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, page)
            owner = os.stat(root)
            if (owner.st_uid, owner.st_gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):
                    os.fchown(fd, owner.st_uid, owner.st_gid)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        sync_file(root, data_only=False)
        return
    try:
        os.pwrite(fd, page, 0)
        os.ftruncate(fd, len(page))
        os.fsync(fd)
    finally:
        os.close(fd)


def foreign_owned(config: Config) -> tuple[int, int, list[str]]:
    """The broker's user (the owner of the CommitLog directory) and the files and directories under the
    output's consumequeue/ and index/ owned by someone else: files the broker could not write to."""
    owner = os.stat(commit_log_path(config.store).split(",")[0])
    others = []
    for sub in (CONSUME_QUEUE_DIR, INDEX_DIR):
        top = os.path.join(config.output.dir, sub)
        for dirpath, dirnames, filenames in os.walk(top):
            for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                with contextlib.suppress(FileNotFoundError):
                    if os.lstat(name).st_uid != owner.st_uid:
                        others.append(name)
    return owner.st_uid, owner.st_gid, sorted(set(others))


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sync_file(os.path.dirname(path) or ".", data_only=False)


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
                        reputd_checkpoint_before: bool = True, reputd_lock_before: bool = True) -> list[Change]:
    """Each change to the broker's files, `abort` last. In the store root reputd's own files go (the files
    are the broker's now): `reputd.checkpoint` and `reputd.lock`. `reputd_checkpoint_before`: whether the
    store root held `reputd.checkpoint` before the handoff completed the output (which writes one), and
    `reputd_lock_before` `reputd.lock` before the handoff locked it: one the handoff made itself is removed
    without being listed as a change (the lock is still held through the descriptor; a writer that opens
    the path afterwards locks a new file, which daemon/ops/outlock.py allows for)."""
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
    reputd_lock = os.path.join(config.output.dir, REPUTD_LOCK_FILE)
    if in_root and os.path.exists(reputd_lock):
        if reputd_lock_before:
            changes.append(Change("remove", f"{reputd_lock} (reputd's writer lock: nothing of reputd's stays in the "
                                            "broker's store root)", lambda: remove_file(reputd_lock)))
        else:
            remove_file(reputd_lock)
    abort = os.path.join(root, ABORT_FILE)
    if os.path.exists(abort):
        changes.append(Change("remove", f"{abort} (the broker's mark of an unclean exit): its next start recovers "
                                        f"normally and reputs from CommitLog offset {times.end_offset}",
                              lambda: remove_file(abort)))
    return changes


__all__ = ["BrokerRunning", "Change", "CheckpointTimes", "broker_file_changes", "broker_lock_held", "checkpoint_times",
           "foreign_owned", "hold_broker_lock", "index_headers", "read_broker_checkpoint", "write_broker_checkpoint"]
