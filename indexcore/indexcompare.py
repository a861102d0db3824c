"""How `IndexCheck` (indexcore/indexcheck.py) judges what it built against the existing IndexFiles: a built
file matched to an existing one, entries compared (with the key a differing entry should hold), slot
chains and headers compared once a file is closed, entries past the last one, and files nothing
implies."""

from __future__ import annotations

import numpy as np

from indexcore.dispatch import index_keys_of
from indexcore.indexfile import (
    FIRST_INDEX,
    HASH_SLOT_SIZE,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER_SIZE,
    INVALID_INDEX,
    IndexEntry,
)
from indexcore.indeximage import IndexImage, _ActualIndexFile
from indexcore.indexservice import INDEX_DIR
from indexcore.javahash import index_key_hash
from indexcore.verify import (
    _HEADER_BEGIN,
    _HEADER_FIELD_AT,
    _HEADER_JSON,
    _PREV_AT,
    INDEX_CHAIN_BROKEN,
    INDEX_ENTRY_EXTRA,
    INDEX_ENTRY_MISSING,
    INDEX_ENTRY_WRONG,
    INDEX_FILE_EXTRA,
    INDEX_FILE_MISSING,
    INDEX_HEADER_WRONG,
    MAX_EXAMPLES,
    TAIL_SCAN_UNITS,
    _entry_json,
    _nonzero_rows,
    same_bytes,
)


class IndexComparison:
    """The comparing half of `IndexCheck`: each method reports what differs as findings."""

    # --- comparing ---------------------------------------------------------------------------------------

    def _match(self, image: IndexImage, identity: int) -> None:
        """The next existing file (in name order) that starts where the image starts; the ones passed over
        are extra. None found: the image's file is missing."""
        image.matched = True
        for j in range(self._next, len(self.actual)):
            a = self.actual[j]
            if identity in a.identities():
                for extra in self.actual[self._next : j]:
                    self._extra(extra)
                self._next = j + 1
                image.actual = a
                return

    def _extra(self, actual: _ActualIndexFile) -> None:
        self.findings.add(INDEX_FILE_EXTRA, self._rel(actual), None,
                          beginPhyOffset=None if actual.header is None else actual.header.begin_phy_offset,
                          indexCount=None if actual.header is None else actual.header.index_count)

    def _key_of(self, phy_offset: int, key_hash: int) -> str | None:
        """The `topic#key` of an expected entry, from the batch being dispatched (for examples only)."""
        b = self.batch
        if b is None or not len(b):
            return None
        i = int(np.searchsorted(b.phy_offset, phy_offset))
        if i >= len(b) or int(b.phy_offset[i]) != phy_offset:
            return None
        for key in index_keys_of(b.topic_of(i), b.uniq_key[i], b.keys[i]):
            if index_key_hash(key) == key_hash:
                return key
        return None

    def _entry_differs(self, actual: _ActualIndexFile, n: int, got: np.ndarray, want: np.ndarray | None) -> None:
        pos = self._entry_at(n)
        if want is None:
            kind = INDEX_ENTRY_EXTRA
        elif not got.any():
            kind = INDEX_ENTRY_MISSING
        elif np.array_equal(got[:_PREV_AT], want[:_PREV_AT]):
            kind, pos = INDEX_CHAIN_BROKEN, pos + _PREV_AT
        else:
            kind = INDEX_ENTRY_WRONG
        finding = self.findings.get(kind, self._rel(actual), pos, range_name="entries")
        example = None
        if len(finding.examples) < MAX_EXAMPLES:
            example = {"entry": n, "position": pos, "expected": None if want is None else _entry_json(want),
                       "actual": _entry_json(got) if got.any() else None}
            if want is not None:
                w = IndexEntry.decode(want.tobytes())
                example["key"] = self._key_of(w.phy_offset, w.key_hash)
            if got.any() and self.keys_at is not None:
                g = IndexEntry.decode(got.tobytes())
                example["actualKey"] = next((k for k in self.keys_at(g.phy_offset) if index_key_hash(k) == g.key_hash),
                                            None)
        finding.add(n, 1, example)

    def _closed(self, image: IndexImage) -> None:
        """The image is complete (rolled or at the end): its slots, header and what follows its entries."""
        if not image.matched:
            self._match(image, image.begin_phy_offset)
        actual = image.actual
        if actual is None:
            self.findings.add(INDEX_FILE_MISSING, f"{INDEX_DIR}/", None, key=f"{INDEX_DIR}/#{image.ordinal}",
                              ordinal=image.ordinal, indexEntries=image.index_count - image.first_checked,
                              beginPhyOffset=image.begin_phy_offset, endPhyOffset=image.end_phy_offset,
                              after=self._name_before(image))
            return
        frontier = self.live and self._finishing
        entry0 = self._view(actual, self._entry_at(INVALID_INDEX), INDEX_ENTRY_SIZE)
        if entry0.any():  # entry numbers start at 1: entry 0 is never written
            self._entry_differs(actual, INVALID_INDEX, entry0, None)
        self._compare_slots(image, actual, frontier)
        if not frontier:
            self._compare_header(image, actual)
            self._scan_extra_entries(image, actual)
        elif image.index_count > image.first_checked:
            # a put in progress writes hashSlotCount, then indexCount, then the end values: only the begin
            # values, fixed by the first put, can be held to the image while the broker writes
            self._compare_header(image, actual, begin_only=True)

    def _name_before(self, image: IndexImage) -> str | None:
        return self.actual[self._next - 1].name if self._next > 0 else None

    def _compare_slots(self, image: IndexImage, actual: _ActualIndexFile, frontier: bool) -> None:
        want = image.slot_table()
        got = self._view(actual, INDEX_HEADER_SIZE, len(want))
        if len(got) % HASH_SLOT_SIZE == 0 and same_bytes(got, want[: len(got)]):
            return
        w = np.frombuffer(want[: len(got) - len(got) % HASH_SLOT_SIZE], dtype=">i4")
        g = np.frombuffer(got[: len(w) * HASH_SLOT_SIZE], dtype=">i4")
        bad = g != w
        if frontier:  # a broker still writing: a slot may already lead to an entry past the frontier
            bad &= g < image.index_count
        for s in np.flatnonzero(bad).tolist():
            pos = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * s
            self.findings.get(INDEX_CHAIN_BROKEN, self._rel(actual), pos, range_name="slots").add(
                s, 1, {"slot": s, "position": pos, "expected": int(w[s]), "actual": int(g[s])})
        self.maps.done_with(actual.path, INDEX_HEADER_SIZE, INDEX_HEADER_SIZE + len(got))

    def _compare_header(self, image: IndexImage, actual: _ActualIndexFile, *, begin_only: bool = False) -> None:
        if actual.header is None:
            return
        got = actual.header
        if image.index_count > image.first_checked or image.first_checked > FIRST_INDEX:
            want = image.written_header()
        elif not image.seed_known:
            return
        else:
            want = image.written_header()
            if got.index_count == FIRST_INDEX:  # a created file flushed before its first put (5.x shutdown)
                want = want._replace(index_count=FIRST_INDEX)
        if begin_only:
            want, got = (tuple(v if i in _HEADER_BEGIN else None for i, v in enumerate(h)) for h in (want, got))
        if tuple(got) == tuple(want):
            return
        diff = {f: {"expected": e, "actual": a} for f, e, a in zip(_HEADER_JSON, want, got, strict=True) if e != a}
        first = _HEADER_JSON.index(next(iter(diff)))
        self.findings.add(INDEX_HEADER_WRONG, self._rel(actual), _HEADER_FIELD_AT[first], fields=diff)

    def _scan_extra_entries(self, image: IndexImage, actual: _ActualIndexFile) -> None:
        n = image.index_count
        while n < self.index_num:
            k = min(TAIL_SCAN_UNITS, self.index_num - n)
            at = self._entry_at(n)
            data = self._view(actual, at, INDEX_ENTRY_SIZE * k)
            rows = _nonzero_rows(data[: len(data) - len(data) % INDEX_ENTRY_SIZE], INDEX_ENTRY_SIZE)
            for r in rows.tolist():
                self._entry_differs(actual, n + r, data[r * INDEX_ENTRY_SIZE : (r + 1) * INDEX_ENTRY_SIZE], None)
            self.maps.done_with(actual.path, at, at + len(data))
            if len(rows) == 0:
                break
            n += k
