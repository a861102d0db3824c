"""One writer per output directory.

Two writers on one output (two `reputd run`, or `run` with `rebuild` or `backfill`) interleave their puts
and corrupt the IndexFiles, so every writing command takes an exclusive lock on `reputd.lock` in the
output directory before it opens any output file, and holds it for the life of the process, as the broker
holds `lock` in its store root. The lock is an flock(2) on an open descriptor: the kernel releases it when
the process ends, however it ends (kill -9 included), so a lock file left behind never blocks anyone, and
the file is never deleted (a writer that deleted it would let the next two writers lock different
files: whoever locks it checks that the file it locked is still the one at the path). The holder writes
its PID and command into the file, for the message a second writer gets. Readers (`query`, `inspect`,
`verify`) never take the lock and never wait for it.

A command that fails before writing leaves no trace (`OutputLock.forget`): what it created, the directory
or only the lock file in an existing one, is removed while the lock is still held, and only when nothing
but the lock file, reputd's own checkpoint and empty directories came of it; anything that was there
before stays.

A broker's store root is not an output while the broker runs: the broker holds `lock` there (Java's
`FileChannel.tryLock(0, 1, false)`, a POSIX fcntl record lock on Linux, which flock does not see), writes
`consumequeue/` and `index/` itself, and a second writer corrupts them. Writers refuse such a directory
before creating anything (`BrokerRunning`); `verify` uses the same test to know a live broker. A broker
that starts there later is found by the same test, asked again for as long as the writer writes
(`BrokerLockWatch`: `reputd run` then stops writing and exits 2).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import time

LOCK_FILE = "reputd.lock"
BROKER_LOCK_FILE = "lock"  # DefaultMessageStore's `lock` in the store root
BROKER_ABORT_FILE = "abort"  # the store root's `abort`: left by a broker that did not exit cleanly
CHECKPOINT_FILE = "reputd.checkpoint"  # daemon.engine.checkpoint's; a failed command may have written only it
_HOLDER_MAX_BYTES = 256
_FLOCK = struct.Struct("@hhqqi")  # struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid
_FLOCK_SIZE = 32


class OutputLocked(Exception):
    """Another process holds the output directory's lock; str() names the directory and the holder."""

    def __init__(self, directory: str, holder: str):
        self.directory = directory
        self.holder = holder
        super().__init__(f"output directory {directory} is in use by another reputd writer ({holder}); stop it "
                         f"first: one writer per output (queries and inspect need no lock)")


class OutputNotWritable(Exception):
    """The output directory cannot be created or written; str() names it and the reason."""

    def __init__(self, directory: str, error: OSError):
        self.directory = directory
        self.error = error
        super().__init__(f"output directory {directory} cannot be created or written: {error.strerror or error}")


class BrokerRunning(Exception):
    """The directory is the store root of a running broker (its `lock` is held); str() names both."""

    def __init__(self, directory: str, pid: int):
        self.directory = directory
        self.pid = pid
        who = f"PID {pid}" if pid > 0 else "another process"
        super().__init__(f"output directory {directory} is the store root of a running broker ({who} holds "
                         f"{os.path.join(directory, BROKER_LOCK_FILE)}), which writes consumequeue/ and index/ "
                         f"there itself: stop the broker first, or write elsewhere with --out DIR; nothing was "
                         f"written")


def lock_holder(path: str) -> int | None:
    """The PID of a process holding a POSIX record lock on the file at `path` (0 when the kernel does not say:
    an open file description lock), None when none is held or there is no such file. Asked with F_GETLK,
    which takes no lock itself; a lock of this very process is not seen (POSIX locks are per process)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0).ljust(_FLOCK_SIZE, b"\0")
        l_type, _, _, _, l_pid = _FLOCK.unpack_from(fcntl.fcntl(fd, fcntl.F_GETLK, query))
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if l_type == fcntl.F_UNLCK else max(l_pid, 0)


def lock_held(path: str) -> bool:
    """Whether another process holds a POSIX lock on the file (the broker's `lock`)."""
    return lock_holder(path) is not None


class BrokerLockWatch:
    """The broker's `lock` in a directory a writer writes into, watched for as long as it writes (`reputd run`
    for months): a broker started there later takes it (DefaultMessageStore.start(), after its load()) and
    writes consumequeue/ and index/ itself. `taken()` asks the kernel (F_GETLK, 4 us) at most every
    `interval` seconds, or at once with `now`; once taken it stays taken (the writer stops for good)."""

    def __init__(self, directory: str, interval: float):
        self.path = os.path.join(directory, BROKER_LOCK_FILE)
        self.interval = interval
        self.holder: int | None = None  # the PID that took it (0: not said), once seen
        self._checked = float("-inf")

    def taken(self, *, now: bool = False) -> int | None:
        """The holder's PID once a broker holds the lock, else None."""
        if self.holder is None:
            t = time.monotonic()
            if now or t - self._checked >= self.interval:
                self._checked = t
                self.holder = lock_holder(self.path)
        return self.holder


class OutputLock:
    """The writer lock of one output directory, held by `fd` for the life of the process, and what taking
    it created: `created`, the outermost directory made for it (None when `directory` existed), and
    `before`, the names `directory` held before (None when it was created)."""

    def __init__(self, directory: str, fd: int, created: str | None, before: frozenset[str] | None):
        self.directory = directory
        self.fd = fd
        self.created = created
        self.before = before

    def forget(self) -> bool:
        """After a failure: remove what this command created when it wrote nothing (only the lock file,
        reputd's checkpoint and empty directories came of it), the lock file last but while still held.
        True when it removed it; otherwise, or on any error, everything stays as it is."""
        path = os.path.join(self.directory, LOCK_FILE)
        try:
            names = set(os.listdir(self.directory))
            new = names if self.before is None else names - self.before
            if LOCK_FILE not in new or not all(_nothing_written(os.path.join(self.directory, n)) for n in new):
                return False
            for name in sorted(new - {LOCK_FILE}):
                _remove_empty(os.path.join(self.directory, name))
            os.unlink(path)
            if self.created is not None:
                _remove_empty(self.directory)
                parent = os.path.dirname(os.path.abspath(self.directory))
                created = os.path.abspath(self.created)
                while len(parent) >= len(created) and parent.startswith(created):
                    os.rmdir(parent)
                    parent = os.path.dirname(parent)
        except OSError:
            return False
        return True


def _nothing_written(path: str) -> bool:
    """The lock file, reputd's checkpoint, or a directory holding nothing else (no data file)."""
    if os.path.islink(path):
        return False
    if os.path.isdir(path):
        return all(_nothing_written(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.basename(path) in (LOCK_FILE, CHECKPOINT_FILE) and os.path.isfile(path)


def _remove_empty(path: str) -> None:
    """Remove a tree `_nothing_written` accepted (the lock file excepted, which the caller removes)."""
    if os.path.isdir(path) and not os.path.islink(path):
        for name in os.listdir(path):
            _remove_empty(os.path.join(path, name))
        os.rmdir(path)
    elif os.path.basename(path) != LOCK_FILE:
        os.unlink(path)


def _outermost_missing(directory: str) -> str | None:
    """The outermost directory of `directory`'s path that does not exist (what makedirs will create)."""
    missing = None
    path = os.path.abspath(directory)
    while not os.path.lexists(path):
        missing = path
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def lock_output(directory: str, command: str) -> OutputLock:
    """Create `directory` if needed and lock it for this process; returns the lock (keep it: its descriptor
    holds the lock). BrokerRunning, before anything is created, when a broker holds `lock` there;
    OutputLocked at once when another reputd holds it; OutputNotWritable when the directory cannot be
    created or the lock file cannot be opened for writing."""
    holder = lock_holder(os.path.join(directory, BROKER_LOCK_FILE))
    if holder is not None:
        raise BrokerRunning(directory, holder)
    created = _outermost_missing(directory)
    path = os.path.join(directory, LOCK_FILE)
    while True:
        try:
            before = None if created is not None else frozenset(os.listdir(directory))
            os.makedirs(directory, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOENT):
                raise OutputNotWritable(directory, e) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder_text = _holder(fd)
            os.close(fd)
            raise OutputLocked(directory, holder_text) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            break
        os.close(fd)  # a failed writer removed the file between our open and our lock: lock the new one
    record = f"{os.getpid()} {command}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    return OutputLock(directory, fd, created, before)


def _same_file(fd: int, path: str) -> bool:
    with contextlib.suppress(OSError):
        a, b = os.fstat(fd), os.stat(path)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    return False


def writer_holding(directory: str) -> str | None:
    """Who holds the output directory's lock (`PID 1234, reputd run`), None when no process does. Asked of
    the kernel's lock table (/proc/locks), which takes no lock: a reader never gets in a writer's way. None
    too where that table cannot be read."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            table = f.read()
    except OSError:
        return None
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    if not any(line.split()[1:2] == ["FLOCK"] and ident in line.split() for line in table.splitlines()):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return "PID unknown"
    try:
        return _holder(fd)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """What the lock file says about its holder: `PID 1234 (reputd run)`."""
    try:
        text = os.pread(fd, _HOLDER_MAX_BYTES, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    pid, _, command = text.partition(" ")
    if not pid.isdigit():
        return "PID unknown: the holder has not written it yet"
    return f"PID {pid}" + (f", reputd {command}" if command else "")


__all__ = ["BROKER_LOCK_FILE", "LOCK_FILE", "BrokerLockWatch", "BrokerRunning", "OutputLock", "OutputLocked",
           "OutputNotWritable", "lock_held", "lock_holder", "lock_output", "writer_holding"]
