"""The lifecycle shared by every pre-allocated, memory-mapped store file.

A RocketMQ mapped-file queue is a directory of files of one fixed size, each named by the logical byte
offset of its first byte as 20 zero-padded digits. Files are created at full size (sparse), because
the broker's loader rejects any other size, and their write position is not stored anywhere: it is
rediscovered by scanning. A crash leaves whatever the page cache had written; formats built on this
class define how to find their end again.

An IndexFile (and any file written through a mapping) is created complete or not at all (`create_file`):
built under a temporary name in its own directory, then renamed into place, so no reader and no recovery
ever sees one half made. A ConsumeQueue file is created in place (`create_in_place`), as the broker creates
its own: what a kill can leave of that creation (an empty file, a file of zeros, a part of its pre-blank
units) is what the queue's recovery takes for a creation cut short or a queue to complete, so a temporary
name and a rename would buy nothing for the two system calls and the directory entry they cost.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re

from indexcore import _failpoints, _kernels
from indexcore.errors import SizeMismatchError, StoreLayoutError

FILE_NAME_DIGITS = 20
_FILE_NAME = re.compile(rf"\d{{{FILE_NAME_DIGITS}}}")
# A file being created is `{name}.tmp` in the directory it will be renamed in: a kill can leave one,
# which holds nothing yet and is removed by the next writer that loads the directory.
TEMP_SUFFIX = ".tmp"


def offset_to_file_name(offset: int) -> str:
    """`UtilAll.offset2FileName`: a start offset as the 20-digit file name."""
    return f"{offset:0{FILE_NAME_DIGITS}d}"


def is_temporary(name: str) -> bool:
    """Whether a directory entry is a file still being created (`create_file`), not a store file."""
    return name.endswith(TEMP_SUFFIX)


def remove_temporaries(directory: str) -> list[str]:
    """Delete what creations cut short by a kill left in `directory`; returns the paths removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if is_temporary(name):
            path = os.path.join(directory, name)
            os.unlink(path)
            removed.append(path)
    return removed


def list_queue_files(directory: str, file_size: int | None = None, *,
                     temporaries: bool = False) -> list[tuple[int, str]]:
    """The (start offset, path) of every file of a mapped-file queue, in offset order.

    Anything that is not a 20-digit file name is a layout error, as it makes the broker fail to load;
    with `file_size`, so is a file of another size. With `temporaries`, files still being created
    (an output queue's) are passed over instead.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = os.path.join(directory, name)
        if temporaries and is_temporary(name):
            continue
        if not _FILE_NAME.fullmatch(name):
            raise StoreLayoutError(path, "not a mapped file: names must be 20-digit start offsets")
        out.append((int(name), path))
    out.sort()
    if file_size is not None:
        check_sizes(out, file_size)
    return out


def check_sizes(files: list[tuple[int, str]], file_size: int) -> None:
    """A layout error for the first file whose size is not `file_size`."""
    for _, path in files:
        actual = os.path.getsize(path)
        if actual != file_size:
            raise SizeMismatchError(path, f"file is {actual} bytes, the configured size is {file_size}")


def create_file(path: str, size: int, header: bytes = b"", *, label: str = "file", keep_open: bool = False,
                temp_dir: str | None = None) -> int | None:
    """Create `path`, `size` bytes with `header` at its start, so that it is complete or absent whatever
    instant a kill or a power loss strikes.

    Steps: open `path` + TEMP_SUFFIX, allocate it in full, write the header, fdatasync, rename. A kill
    before the rename leaves only the temporary file (removed at the next load, `remove_temporaries`);
    after it, the complete file. The data is synced before the rename, so a power loss cannot leave the
    name with a file whose header never reached the disk.

    The directory is not synced here: until it
    is, a power loss may only lose the new name, i.e. leave the file absent, the other allowed outcome;
    whoever checkpoints the file syncs its directory first (`daemon.engine.flusher.sync_new_entries`), which
    costs one directory sync per flush instead of one per file created. `label` names the steps for the
    crash matrix's fail points (`indexcore._failpoints`).

    The blocks are reserved now, which a file written through a mapping needs (no room later would be
    SIGBUS); a file written with `pwrite` gets ENOSPC from the write and may stay sparse, as the broker's
    ConsumeQueue files are (`create_in_place`). With `keep_open` the read-write descriptor is returned.

    `temp_dir` builds the file in another directory of the same file system (`.{dir}.{name}.tmp` there) and
    renames it in: for a directory someone else reads and takes every name in it for a store file (a
    CommitLog that a broker would refuse, and `reputd run` reports, with a `.tmp` in it). Across file
    systems (EXDEV) it falls back to the temporary name beside `path`.
    """
    if os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, "store file already exists", path)
    if temp_dir is not None:
        parent, name = os.path.split(path)
        tmp = os.path.join(temp_dir, f".{os.path.basename(parent)}.{name}{TEMP_SUFFIX}")
        try:
            return _create_via(tmp, path, size, header, label, keep_open)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
    return _create_via(path + TEMP_SUFFIX, path, size, header, label, keep_open)


def _create_via(tmp: str, path: str, size: int, header: bytes, label: str, keep_open: bool) -> int | None:
    """`create_file`'s steps, building the file as `tmp`."""
    _failpoints.reached(f"{label}.before_create")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _failpoints.reached(f"{label}.after_create")
        _preallocate(fd, path, size)
        _failpoints.reached(f"{label}.after_allocate")
        if header:
            written = os.pwrite(fd, header, 0)
            if written != len(header):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(header)} header bytes", tmp)
        _failpoints.reached(f"{label}.after_header")
        os.fdatasync(fd)
        _failpoints.reached(f"{label}.after_fsync")
        os.rename(tmp, path)
    except OSError:  # no room, say: nothing is left behind (anything else stands for a kill, in tests)
        os.close(fd)
        os.unlink(tmp)
        raise
    if not keep_open:
        os.close(fd)
        fd = None
    _failpoints.reached(f"{label}.after_rename")
    return fd


# `create_in_place_many`'s flags of a file: make the parent of its directory first (a new topic's directory),
# keep its descriptor open; and what it gives instead of a descriptor: the file existed, the file was made and
# closed
CREATE_MAKE_PARENT = _kernels.MAKE_PARENT
CREATE_KEEP_OPEN = _kernels.KEEP_OPEN
CREATE_EXISTED = _kernels.EXISTED
CREATE_CLOSED = _kernels.CLOSED


def create_in_place(path: str, size: int, header: bytes = b"", *, label: str = "file",
                    keep_open: bool = True) -> int:
    """Create `path` where it will stay: opened O_EXCL (FileExistsError when it exists), sized sparse to `size`,
    `header` written at its start; its read-write descriptor, or CREATE_CLOSED once closed without `keep_open`.

    For a file written with `pwrite` whose recovery takes any prefix of a creation for one cut short (a
    ConsumeQueue file: `indexcore.queuerecovery`): a kill after the open leaves an empty file, after the
    size a file of zeros, during the header a part of its pre-blank units, a power loss any of these or no
    name at all. Nothing is synced here: whoever checkpoints the file syncs it and its directory first
    (`daemon.engine.flusher`). A failure after the open removes the file again. `label` names the steps
    for the crash matrix's fail points (`indexcore._failpoints`).
    """
    _failpoints.reached(f"{label}.before_create")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _failpoints.reached(f"{label}.after_create")
        os.ftruncate(fd, size)
        _failpoints.reached(f"{label}.after_allocate")
        if header:
            pwrite_all(fd, header, 0, path)
        _failpoints.reached(f"{label}.after_header")
    except OSError:  # no room, say: nothing is left behind (anything else stands for a kill, in tests)
        os.close(fd)
        os.unlink(path)
        raise
    if keep_open:
        return fd
    os.close(fd)
    return CREATE_CLOSED


def create_in_place_many(files: list[tuple[str, str, bytes, int]], size: int, *, label: str = "file") -> list[int]:
    """`create_in_place(path, size, header)` for many (directory, path, header, flags), each directory made
    first (and its parent, with CREATE_MAKE_PARENT): for each, its read-write descriptor (CREATE_KEEP_OPEN),
    CREATE_CLOSED, or CREATE_EXISTED when the path exists already.

    The kernel (`_kernels.create_files`) takes the same steps in the same order for all of them with the
    GIL released, so a thread creating ten thousand queues does not queue for the GIL after each system
    call while another thread runs; with a fail point hook installed (the crash matrix stops the process
    at the steps), `create_in_place` does it file by file. On an error every descriptor made is closed and
    the error raised; the files made stay, complete."""
    if _failpoints.hook is None:
        return _kernels.create_files(files, size)
    made: list[int] = []
    try:
        for directory, path, header, flags in files:
            if flags & CREATE_MAKE_PARENT:
                with contextlib.suppress(FileExistsError, FileNotFoundError):
                    os.mkdir(os.path.dirname(directory))
            os.makedirs(directory, exist_ok=True)
            try:
                made.append(create_in_place(path, size, header, label=label, keep_open=bool(flags & CREATE_KEEP_OPEN)))
            except FileExistsError:
                made.append(CREATE_EXISTED)
    except BaseException:
        for fd in made:
            if fd >= 0:
                os.close(fd)
        raise
    return made


def _preallocate(fd: int, path: str, size: int) -> None:
    """Reserve the file's blocks up front, so a full disk is an OSError now rather than SIGBUS on a later
    write through the mapping; file systems without fallocate get a sparse file."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            # the path as `filename`, so a caller can name the file without parsing the message
            raise OSError(e.errno, f"cannot allocate {size} bytes ({e.strerror})", path) from None
        os.ftruncate(fd, size)


def pwrite_all(fd: int, data, position: int, path: str | None = None) -> None:
    """pwrite all of `data` (any contiguous buffer) at `position`: a write the kernel cuts short goes on from
    the byte it stopped at; a failure, or a write of nothing, is an OSError naming `path` (the bytes before it
    are written)."""
    view = memoryview(data).cast("B")
    try:
        while view:
            written = os.pwrite(fd, view, position)
            if written == 0:
                raise OSError(errno.EIO, "the kernel wrote nothing")
            view, position = view[written:], position + written
    except OSError as e:
        raise OSError(e.errno, f"cannot write {len(view)} bytes at {position} ({e.strerror})", path) from None


class MappedFile:
    """One fixed-size file mapped read-write; formats add their own entries on top."""

    __slots__ = ("_mm", "file_size", "path", "readonly")

    @classmethod
    def create(cls, path: str, file_size: int, header: bytes = b"", *, label: str = "file") -> MappedFile:
        """A new output file, created complete or not at all (`create_file`), then mapped read-write."""
        create_file(path, file_size, header, label=label)
        return cls(path, file_size)

    def __init__(self, path: str, file_size: int, *, create: bool = False, readonly: bool = False,
                 temp_dir: str | None = None):
        self.path = path
        self.file_size = file_size
        self.readonly = readonly
        fd = create_file(path, file_size, keep_open=True, temp_dir=temp_dir) if create else \
            os.open(path, os.O_RDONLY if readonly else os.O_RDWR)
        try:
            if not create:
                actual = os.fstat(fd).st_size
                if actual != file_size:
                    raise SizeMismatchError(path, f"file is {actual} bytes, the configured size is {file_size}")
            self._mm = mmap.mmap(fd, file_size, access=mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE)
        except BaseException:
            if create:
                os.unlink(path)
            raise
        finally:
            # the mapping keeps the file; no descriptor stays open, so thousands of queues need no fd each
            os.close(fd)

    @property
    def buffer(self) -> mmap.mmap:
        return self._mm

    def write(self, position: int, data: bytes | memoryview) -> None:
        self._mm[position : position + len(data)] = data

    def flush(self) -> None:
        """Force the mapping to disk (msync); data written before this call survives a crash."""
        if not self.readonly:
            self._mm.flush()

    def release(self, start: int = 0, length: int | None = None) -> None:
        """Drop this process's page-table entries for the mapping, or for the pages of [start, start + length)
        (MADV_DONTNEED). The data stays in the page cache, dirty or not, and is faulted back in on the next
        access; a long-running writer calls this after each flush so its RSS does not grow with the files it
        has written, and a reader of a large part of a file after each window it has read."""
        if self._mm.closed:
            return
        if start == 0 and length is None:
            self._mm.madvise(mmap.MADV_DONTNEED)
            return
        end = self.file_size if length is None else min(self.file_size, start + length)
        start -= start % mmap.PAGESIZE
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.close()

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# From this many files to make durable, syncing their file system once (syncfs) beats an fdatasync each: each of
# a new file cost ~130 us of CPU and waited ~6 ms for the disk here (16,000 queues one after the other: the
# backfill's tasks and commit); the 1,064 files and 2,128 directories of an LMQ rebuild 0.38 s instead of 0.68 s.
# It writes whatever else the file system holds too, so `run`'s periodic flushes beside a live broker keep to
# their own files.
SYNCFS_MIN_FILES = 256


def sync_file(path: str, *, data_only: bool = True) -> None:
    """fdatasync (fsync: `data_only=False`) through a descriptor of our own: safe while another thread closes
    or unmaps the file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if data_only:
            os.fdatasync(fd)
        else:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_file_system(path: str) -> None:
    """syncfs of the file system holding `path`: every file and directory on it durable at once."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _kernels.syncfs(fd)
    finally:
        os.close(fd)
