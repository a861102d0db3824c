"""One writer per output directory.

Two writers on one output (two `reputd run`, or `run` with `rebuild` or `backfill`) interleave their puts
and corrupt the IndexFiles, so every writing command takes an exclusive lock on `reputd.lock` in the
output directory before it opens any output file, and holds it for the life of the process, as the broker
holds `lock` in its store root. The lock is an flock(2) on an open descriptor: the kernel releases it when
the process ends, however it ends (kill -9 included), so a lock file left behind never blocks anyone, and
the file is never deleted (a writer that deleted it would let the next two writers lock different
files). The holder writes its PID and command into the file, for the message a second writer gets.
Readers (`query`, `inspect`, `verify`) never take the lock and never wait for it.
"""

from __future__ import annotations

import errno
import fcntl
import os

LOCK_FILE = "reputd.lock"
_HOLDER_MAX_BYTES = 256


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


def lock_output(directory: str, command: str) -> int:
    """Create `directory` if needed and lock it for this process; returns the descriptor holding the lock
    (keep it open). OutputLocked at once when another process holds it, OutputNotWritable when the
    directory cannot be created or the lock file cannot be opened for writing."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOENT):
            raise OutputNotWritable(directory, e) from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise OutputLocked(directory, holder) from None
    except BaseException:
        os.close(fd)
        raise
    record = f"{os.getpid()} {command}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    return fd


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


__all__ = ["LOCK_FILE", "OutputLocked", "OutputNotWritable", "lock_output", "writer_holding"]
