"""The IndexFile half of verification (indexcore/verify.py says how): `IndexCheck` is an `IndexService`
that builds into `IndexImage`s and compares each put with the existing files: entries, slot chains,
headers, files the CommitLog implies and files it does not."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from indexcore.dispatch import DispatchBatch
from indexcore.indexcompare import IndexComparison
from indexcore.indexfile import (
    FIRST_INDEX,
    HASH_SLOT_SIZE,
    INDEX_ENTRY_DTYPE,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER_SIZE,
    INVALID_INDEX,
    IndexEntry,
    IndexHeader,
)
from indexcore.indeximage import IndexImage, _ActualIndexFile, _Predecessor
from indexcore.indexservice import INDEX_DIR, IndexService
from indexcore.verify import (
    _INDEX_FILE_NAME,
    _TIME_DIFF,
    INDEX_FILE_SIZE,
    TAIL_SCAN_UNITS,
    Findings,
    MappedFiles,
    list_store_files,
    same_bytes,
)


class IndexCheck(IndexComparison, IndexService):
    """`IndexService.build_index` into IndexImages, each compared with the existing file it stands for.

    Existing files are taken in name order and matched to the images by the CommitLog offset they start at,
    so a missing or an extra file is one finding, not a shift of everything after it.
    """

    def __init__(self, root: str, hash_slot_num: int, index_num: int, findings: Findings, *,
                 live: bool = False, frontier: int | None = None,
                 keys_at: Callable[[int], list[str]] | None = None):
        super().__init__(root, hash_slot_num, index_num)
        self.findings = findings
        self.keys_at = keys_at  # the `topic#key`s of the record at an offset: names what an existing entry holds
        self.live = live
        self.frontier = frontier
        self.maps = MappedFiles()
        self.batch: DispatchBatch | None = None
        self.actual: list[_ActualIndexFile] = []
        self._next = 0  # the next existing file not matched yet
        self._images = 0
        self.entries = 0
        self._scan_actual()

    # --- the existing files ---------------------------------------------------------------------------

    def _scan_actual(self) -> None:
        if not os.path.isdir(self.directory):
            return
        for name, path, size in list_store_files(self.directory, _INDEX_FILE_NAME, self.file_size, self.live,
                                                 self.findings, INDEX_DIR):
            if size != self.file_size:
                self.findings.add(INDEX_FILE_SIZE, f"{INDEX_DIR}/{name}", size, expectedSize=self.file_size,
                                  actualSize=size)
            header = entry = None
            with open(path, "rb") as f:
                head = f.read(INDEX_HEADER_SIZE)
                if len(head) == INDEX_HEADER_SIZE:
                    header = IndexHeader.decode(head)
                raw = os.pread(f.fileno(), INDEX_ENTRY_SIZE, self._entry_at(FIRST_INDEX))
                if len(raw) == INDEX_ENTRY_SIZE:
                    entry = IndexEntry.decode(raw)
            self.actual.append(_ActualIndexFile(name, path, size, header, entry))

    def _entry_at(self, n: int) -> int:
        return INDEX_HEADER_SIZE + HASH_SLOT_SIZE * self.hash_slot_num + INDEX_ENTRY_SIZE * n

    def _rel(self, actual: _ActualIndexFile) -> str:
        return f"{INDEX_DIR}/{actual.name}"

    def _view(self, actual: _ActualIndexFile, position: int, length: int) -> np.ndarray:
        """The bytes [position, position + length) of an existing file, cut at its end."""
        length = max(0, min(length, actual.size - position))
        if length == 0:
            return np.zeros(0, dtype=np.uint8)
        return self.maps.view(actual.path, position, length)

    # --- starting in the middle of the history ----------------------------------------------------------

    def start_at(self, from_offset: int, store_timestamp_at: Callable[[int], int | None]) -> None:
        """Take up the index as it stood just before `from_offset`: the newest existing file that starts below
        it, cut back to its entries below it (slots restored along their chains), as the image to continue.
        Files before that one are history. With none, the first file's deleted predecessor stands before it."""
        usable = [i for i, a in enumerate(self.actual) if a.size == self.file_size and a.identity is not None
                  and a.header is not None]
        before = [i for i in usable if self.actual[i].identity < from_offset]
        if not before:
            if usable:
                self._last = self._predecessor_of(self.actual[usable[0]])
                self.names.append("deleted-predecessor")
            return
        i = before[-1]
        actual = self.actual[i]
        count = max(actual.header.index_count, FIRST_INDEX)
        n0 = self._first_entry_at_or_after(actual, from_offset, count)
        image = self._create_file("", 0, 0)
        h = actual.header
        image.begin_timestamp, image.begin_phy_offset = h.begin_timestamp, h.begin_phy_offset
        image.index_count = n0
        last = self._entry(actual, n0 - 1) if n0 > FIRST_INDEX else None
        image.end_phy_offset = last.phy_offset if last is not None else h.end_phy_offset
        ts = None if last is None or n0 == count else store_timestamp_at(last.phy_offset)
        image.end_timestamp = h.end_timestamp if ts is None else ts
        slots = np.frombuffer(self._view(actual, INDEX_HEADER_SIZE, HASH_SLOT_SIZE * self.hash_slot_num),
                              dtype=">i4").copy()
        started = 0
        for hi in range(count, n0, -TAIL_SCAN_UNITS):  # newest first: the oldest entry of a slot wins
            lo = max(n0, hi - TAIL_SCAN_UNITS)
            entries = np.frombuffer(self._view(actual, self._entry_at(lo), INDEX_ENTRY_SIZE * (hi - lo)),
                                    dtype=INDEX_ENTRY_DTYPE)
            slot = entries["key_hash"].astype(np.int64) % self.hash_slot_num
            ids, first = np.unique(slot, return_index=True)
            slots[ids] = entries["prev_index"][first]
            started += int(np.count_nonzero(entries["prev_index"] == INVALID_INDEX))
        image.slot_table()[:] = slots.view(np.uint8)
        image.hash_slot_count = max(0, h.hash_slot_count - started)
        image.first_checked = n0
        image.actual, image.matched = actual, True
        self.names.append(f"history-{actual.name}")
        self._last = image
        self._next = i + 1

    def _predecessor_of(self, first: _ActualIndexFile) -> _Predecessor:
        """The full file the first existing one was rolled from, deleted since (the broker deletes IndexFiles
        that end below its oldest segment). It takes the keys that precede the first existing file's first
        entry, among them the leading keys of a record whose keys the roll split between the two."""
        e1 = self._entry(first, FIRST_INDEX)
        p1 = e1.phy_offset if any(e1) else first.header.begin_phy_offset
        tail = 0
        while FIRST_INDEX + tail < max(first.header.index_count, FIRST_INDEX) and \
                self._entry(first, FIRST_INDEX + tail).phy_offset == p1:
            tail += 1
        return _Predecessor(p1, tail)

    def _entry(self, actual: _ActualIndexFile, n: int) -> IndexEntry:
        return IndexEntry.decode(self._view(actual, self._entry_at(n), INDEX_ENTRY_SIZE).tobytes())

    def _first_entry_at_or_after(self, actual: _ActualIndexFile, offset: int, count: int) -> int:
        lo, hi = FIRST_INDEX, count
        while lo < hi:
            mid = (lo + hi) // 2
            if self._entry(actual, mid).phy_offset < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    # --- IndexService hooks --------------------------------------------------------------------------

    _finishing = False

    def _new_name(self, store_timestamp: int) -> str:
        return f"expected-{len(self.names)}"

    def _create_file(self, name: str, end_phy_offset: int, end_timestamp: int) -> IndexImage:
        image = IndexImage(self.hash_slot_num, self.index_num, end_phy_offset, end_timestamp, self._put, self._closed)
        image.ordinal = self._images
        self._images += 1
        if isinstance(self._last, _Predecessor):
            image.seed_known = self._last.put > 0
        return image

    def check(self, batch: DispatchBatch) -> None:
        self.batch = batch
        self.build_index(batch)

    def _put(self, image: IndexImage, first: int, n: int) -> None:
        self.entries += n
        if not image.matched:
            self._match(image, image.begin_phy_offset)
        actual = image.actual
        if actual is None:
            return
        want = image.window_entries(n)
        if not image.seed_known and first == FIRST_INDEX:
            want = want.copy()  # the first entry's time_diff counts from the unread predecessor's end
            got = self._view(actual, self._entry_at(FIRST_INDEX) + _TIME_DIFF.start, 4)
            if len(got) == 4:
                want[_TIME_DIFF] = got
        at = self._entry_at(first)
        got = self._view(actual, at, INDEX_ENTRY_SIZE * n)
        fit = len(got) // INDEX_ENTRY_SIZE
        got = got[: fit * INDEX_ENTRY_SIZE]
        if not same_bytes(got, want[: fit * INDEX_ENTRY_SIZE]):
            g, w = got.reshape(-1, INDEX_ENTRY_SIZE), want[: fit * INDEX_ENTRY_SIZE].reshape(-1, INDEX_ENTRY_SIZE)
            for r in np.flatnonzero((g != w).any(axis=1)).tolist():
                self._entry_differs(actual, first + r, g[r], w[r])
        if fit < n:
            self.findings.get(INDEX_FILE_SIZE, self._rel(actual), actual.size).add(first + fit, n - fit)
        self.maps.done_with(actual.path, at, at + INDEX_ENTRY_SIZE * fit)

    def finish(self) -> None:
        """Close the last image; existing files left unmatched are extra (past the frontier of a live
        broker, its newest work)."""
        self._finishing = True
        self.close()
        if not self.live:  # files after the last one expected: a broker still writing may have made them since
            for a in self.actual[self._next :]:
                self._extra(a)
        self._next = len(self.actual)
        self.maps.close()

    def files_checked(self) -> int:
        return len(self.actual)
