"""In-memory IndexFiles for verification (indexcore/verify.py says how): `IndexImage` holds the header and
the slot table of a file `IndexService.build_index` builds, and of its entries only those of the put in
progress, which are compared with the existing file at once; `_Predecessor` stands for the file before
the first one checked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from indexcore.indexfile import (
    FIRST_INDEX,
    HASH_SLOT_SIZE,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER_SIZE,
    IndexEntry,
    IndexFile,
    IndexHeader,
)


class _Image:
    """The buffer an IndexImage puts into: header, slot table, and a window of entries."""

    __slots__ = ("buffer", "entries_at", "readonly")

    def __init__(self, hash_slot_num: int):
        self.entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * hash_slot_num
        self.buffer = bytearray(self.entries_at + INDEX_ENTRY_SIZE * 1024)
        self.readonly = False

    def window(self, entries: int) -> bytearray:
        need = self.entries_at + INDEX_ENTRY_SIZE * entries
        if len(self.buffer) < need:
            grown = bytearray(max(need, self.entries_at + 2 * (len(self.buffer) - self.entries_at)))
            grown[: self.entries_at] = self.buffer[: self.entries_at]
            self.buffer = grown
        return self.buffer

    def slots(self) -> np.ndarray:
        return np.frombuffer(self.buffer, dtype=np.uint8, count=self.entries_at - INDEX_HEADER_SIZE,
                             offset=INDEX_HEADER_SIZE)

    def entries(self, n: int) -> np.ndarray:
        return np.frombuffer(self.buffer, dtype=np.uint8, count=INDEX_ENTRY_SIZE * n, offset=self.entries_at)

    def write(self, position: int, data: bytes) -> None:
        self.buffer[position : position + len(data)] = data

    def flush(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class IndexImage(IndexFile):
    """An IndexFile built in memory by the same puts as a real one: the header and slot table in full, of
    the entries only the window of the current put, which `on_put` compares before the next put.

    `first_checked` is the first entry number judged (entries below it are history when verifying from an
    offset); `seed_known` is False when the file was created from a predecessor that is not read, so its
    first entry's time_diff and its header before the first put cannot be derived.
    """

    def __init__(self, hash_slot_num: int, index_num: int, end_phy_offset: int, end_timestamp: int,
                 on_put: Callable[[IndexImage, int, int], None], on_close: Callable[[IndexImage], None]):
        self.path = None
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self._file = _Image(hash_slot_num)
        self._entries_at = self._file.entries_at
        self._seed(end_phy_offset, end_timestamp)
        self._on_put = on_put
        self._on_close = on_close
        self.first_checked = FIRST_INDEX
        self.seed_known = True
        self.actual: _ActualIndexFile | None = None
        self.matched = False
        self.ordinal = 0
        self.closed = False

    def _put_target(self, keys: int) -> tuple[object, int]:
        return self._file.window(keys), self.index_count

    def put_keys(self, key_hash: np.ndarray, phy_offset: np.ndarray, store_timestamp: np.ndarray) -> int:
        first = self.index_count
        put = super().put_keys(key_hash, phy_offset, store_timestamp)
        if put:
            self._on_put(self, first, put)
        return put

    def window_entries(self, n: int) -> np.ndarray:
        return self._file.entries(n)

    def slot_table(self) -> np.ndarray:
        return self._file.slots()

    def flush(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._on_close(self)


class _Predecessor:
    """Stands for a deleted IndexFile in `IndexService.build_index`: it takes keys, compared with nothing, until
    the key the first existing file starts with (the last `tail` keys of the record at `first_phy_offset`
    went there), then is full. Its end values, when it took a key, seed the next file as the real one did."""

    def __init__(self, first_phy_offset: int, tail: int):
        self.first_phy_offset = first_phy_offset
        self.tail = tail
        self.full = False
        self.put = 0
        self.end_phy_offset = 0
        self.end_timestamp = 0

    def is_write_full(self) -> bool:
        return self.full

    def put_keys(self, key_hash: np.ndarray, phy_offset: np.ndarray, store_timestamp: np.ndarray) -> int:
        at = np.flatnonzero(phy_offset == self.first_phy_offset)
        if len(at):
            cut = max(int(at[0]), int(at[-1]) + 1 - self.tail)
        else:
            cut = int(np.searchsorted(phy_offset, self.first_phy_offset))
        if cut:
            self.put += cut
            self.end_phy_offset, self.end_timestamp = int(phy_offset[cut - 1]), int(store_timestamp[cut - 1])
        self.full = cut < len(key_hash)
        return cut

    def flush(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _ActualIndexFile:
    name: str
    path: str
    size: int
    header: IndexHeader | None
    first_entry: IndexEntry | None

    def identities(self) -> set[int]:
        """The CommitLog offset the file starts at, as its header and its first entry say (either may be
        damaged): how an expected file finds its existing counterpart."""
        out = set()
        if self.header is not None:
            out.add(self.header.begin_phy_offset)
        if self.first_entry is not None and any(self.first_entry):
            out.add(self.first_entry.phy_offset)
        return out

    @property
    def identity(self) -> int | None:
        """The lowest of them."""
        ids = self.identities()
        return min(ids) if ids else None
