"""`OpenFiles`: the bounded set of read-write descriptors that ConsumeQueue files are written through (`pwrite`,
deferred writes made in one call without the GIL, or by `run`'s write-behind thread), and that creates the files
a rebuild makes with their first write (`create_later`)."""

from __future__ import annotations

import errno
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from indexcore import _kernels
from indexcore.mappedfile import (
    CREATE_EXISTED,
    CREATE_KEEP_OPEN,
    CREATE_MAKE_PARENT,
    create_in_place,
    create_in_place_many,
    pwrite_all,
)


def pwrite_many(pending: list[tuple], paths: list[str], under: tuple[int, bytes] | None = None) -> None:
    """`_kernels.pwrite_many`; a failure is an OSError naming the file (here and on `run`'s writer thread). With
    `under` (a directory's descriptor and path), the files under it that a write opens are opened relative to it."""
    failed = _kernels.pwrite_many(pending, *under) if under is not None else _kernels.pwrite_many(pending)
    if failed is not None:
        at, left, position, err = failed
        raise OSError(err, f"cannot write {left} bytes at {position} ({os.strerror(err)})", paths[at])


MAKE_OPEN_AT_ONCE = 128  # files `OpenFiles.flush_writes` creates (`create_later`) and writes, at most, at once


class WriteBehind(Protocol):
    """What makes an `OpenFiles`' deferred writes elsewhere (`daemon.engine.writebehind`): in the order handed over."""

    def submit(self, writes: list[tuple], paths: list[str]) -> None: ...

    def drain(self) -> None: ...

    def barrier(self) -> Callable[[], None]: ...


class OpenFiles:
    """Read-write descriptors of at most `limit` files, the least recently used closed first.

    Writers that append through `pwrite` take their descriptor here, so a store of 100,000 queue files
    stays within the process's descriptor limit (and, unlike a mapping per file, within vm.max_map_count).
    A descriptor with deferred writes (`write_later`) is closed only after they are made. With a write-behind
    (`write_behind`: `run`'s writer thread), `submit_writes` hands the deferred writes over instead of making
    them, and everything else done here first waits for what was handed over (`WriteBehind.drain`).
    """

    __slots__ = ("_behind", "_fds", "_inflight_fds", "_pending", "_pending_fds", "_pending_paths", "_unmade",
                 "limit")

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"OpenFiles needs room for at least one descriptor, not {limit}")
        self.limit = limit
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._pending: list[tuple] = []  # write_later's (fd, data, position) or (-1, data, position, path), in order
        self._pending_paths: list[str] = []
        self._pending_fds: set[int] = set()
        self._unmade: dict[str, tuple[str, bytes, int, int, str]] = {}  # create_later's: path -> how to create it
        self._behind: WriteBehind | None = None
        self._inflight_fds: set[int] = set()  # descriptors of writes handed to the write-behind, until a drain

    def create_later(self, files: list[tuple[str, str, bytes, int]], size: int, *, label: str = "file") -> None:
        """`create_in_place_many(files, size)`, each file made when first written, opened, synced or discarded
        here, or at `close`, its creation and first write sharing one open (a rebuild writes a queue once, at its
        end). A file existing by then is a FileExistsError naming it (another writer: the output lock's job)."""
        for directory, path, header, flags in files:
            self._unmade[path] = (directory, header, flags & CREATE_MAKE_PARENT, size, label)

    def _make(self, paths: list[str], keep_open: bool) -> list[int]:
        """Create these files of `create_later` now, in one call; their descriptors (`keep_open`) or CREATE_CLOSED."""
        unmade = self._unmade
        items = [unmade.pop(path) for path in paths]
        made = create_in_place_many(
            [(d, path, header, flags | (CREATE_KEEP_OPEN if keep_open else 0))
             for path, (d, header, flags, _, _) in zip(paths, items, strict=True)], items[0][3], label=items[0][4])
        existed = [path for path, fd in zip(paths, made, strict=True) if fd == CREATE_EXISTED]
        if existed:
            for fd in made:
                if fd >= 0:
                    os.close(fd)
            raise FileExistsError(errno.EEXIST, "store file made by someone else", existed[0])
        return made

    def __len__(self) -> int:
        return len(self._fds)

    def fd(self, path: str, *, create_size: int | None = None, header: bytes = b"", label: str = "file") -> int:
        """A read-write descriptor of `path`; with `create_size`, the file is created sparse with `header`
        (`create_in_place`: it is written with `pwrite`)."""
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        if create_size is not None:
            fd = create_in_place(path, create_size, header, label=label)
        elif path in self._unmade:
            fd = self._make([path], True)[0]
        else:
            fd = os.open(path, os.O_RDWR)
        self._make_room()
        self._fds[path] = fd
        return fd

    def _make_room(self) -> None:
        fds = self._fds
        while len(fds) >= self.limit:
            oldest = next(iter(fds.values()))
            if oldest in self._pending_fds or oldest in self._inflight_fds:
                self.flush_writes()
            os.close(fds.popitem(last=False)[1])

    def write_later(self, path: str, data, position: int) -> None:
        """`write`, deferred until `flush_writes` or until anything else is done here, whichever comes first
        (so writes keep their order): the appends a batch makes to a thousand LMQ queues then go to the
        kernel in one call, without the GIL. `data` (any contiguous buffer, or a list of them written back to
        back) must not change until then. A file not held open is opened while the set has room; once it is
        full, the write opens the file for itself and closes it (`_kernels.pwrite_many`), evicting nothing:
        the gathered appends of 100,000 queues, written once each, would otherwise close and open a
        descriptor of the set for every one of them. A file of `create_later` is made by `flush_writes`,
        MAKE_OPEN_AT_ONCE in one call: taking its descriptor here filled the set with descriptors that had
        writes pending, and every later file was made and written alone (100,000 calls of each)."""
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
        elif len(self._fds) < self.limit and path not in self._unmade:  # those are made a piece at a time
            fd = self.fd(path)
        if fd is None:
            self._pending.append((-1, data, position, path))
        else:
            self._pending.append((fd, data, position))
            self._pending_fds.add(fd)
        self._pending_paths.append(path)

    def write_behind(self, writer: WriteBehind | None) -> None:
        """Hand deferred writes to `writer` at `submit_writes` from now on (None: make them here again)."""
        self.flush_writes()
        self._behind = writer

    def submit_writes(self) -> None:
        """`flush_writes`, or, with a write-behind, hand the deferred writes over to it and return: they are made
        in order after those handed over before, and before anything else is done here."""
        if self._behind is None or self._unmade:  # files of create_later are made here, with their first writes
            self.flush_writes()
            return
        if not self._pending:
            return
        pending, paths = self._pending, self._pending_paths
        self._pending, self._pending_paths = [], []
        self._inflight_fds |= self._pending_fds
        self._pending_fds.clear()
        self._behind.submit(pending, paths)

    def barrier(self) -> Callable[[], None] | None:
        """With a write-behind: hand the deferred writes over and return a wait for every write handed over until
        now, which raises if any write failed (`WriteBehind.barrier`); without, make them now and return None."""
        self.submit_writes()
        return self._behind.barrier() if self._behind is not None else None

    def flush_writes(self) -> None:
        """Make the deferred writes, in order; no room (or any other failure) is an OSError naming the file,
        and the writes after it are dropped, as if the failure had stopped the writer there."""
        if self._behind is not None:
            try:
                self._behind.drain()
            except OSError:
                self._pending, self._pending_paths = [], []  # after the failure: dropped
                self._pending_fds.clear()
                raise
            finally:
                self._inflight_fds.clear()
        if not self._pending:
            return
        pending, paths = self._pending, self._pending_paths
        self._pending, self._pending_paths = [], []
        self._pending_fds.clear()
        if not self._unmade:
            return pwrite_many(pending, paths)
        # files of create_later written first now are made a piece at a time, their descriptors kept for the writes
        unmade, at = self._unmade, 0
        piece = self._room_for(MAKE_OPEN_AT_ONCE, {w[0] for w in pending if w[0] >= 0})
        while at < len(pending):
            end, make = at, {}
            while end < len(pending) and len(make) < piece:
                if pending[end][0] == -1 and pending[end][3] in unmade:
                    make.setdefault(pending[end][3], len(make))
                end += 1
            fds = self._make(list(make), True) if make else []
            try:
                pwrite_many([(fds[make[w[3]]], w[1], w[2]) if w[0] == -1 and w[3] in make else w
                              for w in pending[at:end]], paths[at:end])
            finally:
                for fd in fds:
                    os.close(fd)
            at = end

    def _room_for(self, wanted: int, busy: set[int]) -> int:
        """Close the least recently used descriptors, but those in `busy`, until `wanted` more fit in `limit`
        (or none is left to close); how many fit, at least one."""
        fds = self._fds
        if len(fds) + wanted > self.limit:
            for path in [p for p, fd in fds.items() if fd not in busy][: len(fds) + wanted - self.limit]:
                os.close(fds.pop(path))
        return max(1, min(wanted, self.limit - len(fds)))

    def write(self, path: str, data: bytes, position: int) -> None:
        """pwrite all of `data`; no room (or any other failure) is an OSError naming `path`."""
        self.flush_writes()
        pwrite_all(self.fd(path), data, position, path)

    def adopt(self, path: str, fd: int) -> None:
        """Take in a descriptor opened elsewhere (read-write), as `fd` would have opened it."""
        self.discard(path)
        self._make_room()
        self._fds[path] = fd

    def sync(self, path: str) -> None:
        """fdatasync `path`: what was written to it survives a crash."""
        self.flush_writes()
        os.fdatasync(self.fd(path))

    def discard(self, path: str) -> None:
        self.flush_writes()
        if path in self._unmade:
            self._make([path], False)
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def make_ahead(self, most: int) -> int:
        """Create up to `most` files of `create_later` now, closed (their first writes open them again): work for
        a thread that would otherwise wait, as a rebuild's dispatching thread does for its read-ahead. How many."""
        paths = list(itertools.islice(self._unmade, most))
        if paths:
            self._make(paths, False)
        return len(paths)

    def make_all(self) -> None:
        """Every deferred write made and every file of `create_later` created (in one call)."""
        self.flush_writes()
        if self._unmade:
            self._make(list(self._unmade), False)

    def close(self) -> None:
        try:
            self.make_all()
        finally:
            while self._fds:
                os.close(self._fds.popitem()[1])
