"""The two things `IndexService` (indexcore/indexservice.py) does with its IndexFiles' entries: put a dispatch
batch's keys (`build_index`, as the broker's `IndexService.buildIndex`, resuming past what the files
already hold) and answer a key query (`query_offset`, as `IndexService.queryOffset`). Files, their names,
loading and truncation stay with the service."""

from __future__ import annotations

import numpy as np

from indexcore import _failpoints
from indexcore.dispatch import INDEX_KEY_SEPARATOR, DispatchBatch
from indexcore.errors import CorruptEntryError
from indexcore.indexfile import (
    IndexFile,
)
from indexcore.indexresults import IndexQueryDamaged, IndexResume, IndexStats, QueryOffsetResult
from indexcore.javahash import index_key_hash


class IndexBuild:
    """Building and querying entries; the files come from `IndexService` (`last_file`, `_roll`, `_path`)."""

    def build_index(self, batch: DispatchBatch) -> IndexStats:
        """`buildIndex` for every record of the batch, in order.

        With `resume` set, records below its offset are left out altogether, as if dispatched before: they
        index nothing and do not create the file that follows a full one. In CommitLog order they are a
        prefix of the batch. The record at the offset puts only the keys the files do not hold yet.
        """
        stats = IndexStats()
        n = len(batch)
        if n == 0:
            return stats
        ts = batch.store_timestamp
        first = 0
        fresh = None
        at, drop = -1, 0
        if self.resume is not None:
            fresh, at, drop = self._fresh(batch, self.resume)
            if int(batch.phy_offset[-1]) > self.resume.phy_offset:
                self.resume = None  # the batches after this one are all past it
            if not fresh.any():
                return stats
            first = int(np.argmax(fresh))
        if self._last is None or self._last.is_write_full():
            self._roll(int(ts[first]), stats)
        eligible = batch.index_mask() & (batch.phy_offset >= self._last.end_phy_offset)
        if fresh is not None:
            eligible &= fresh
        hashes, owners = batch.index_keys(eligible)
        if drop:
            keep = np.ones(len(owners), dtype=bool)
            keep[np.flatnonzero(owners == at)[:drop]] = False
            hashes, owners = hashes[keep], owners[keep]
        if len(hashes):
            phys = batch.phy_offset[owners]
            key_ts = ts[owners]
            i = 0
            while i < len(hashes):
                f = self._last
                if f.is_write_full():
                    # it filled at key i-1: the next record to arrive creates the new file, be it key i's
                    # own record or, when the file filled at the end of a message, the one right after it
                    creator = int(owners[i]) if i == 0 else min(int(owners[i]), int(owners[i - 1]) + 1)
                    f = self._roll(int(ts[creator]), stats)
                    if i > 0 and creator == int(owners[i - 1]):  # the record's keys straddle the two files
                        i += f.put_keys(hashes[i : i + 1], phys[i : i + 1], key_ts[i : i + 1])
                        _failpoints.reached("index.after_straddling_key")
                        continue
                i += f.put_keys(hashes[i:], phys[i:], key_ts[i:])
            stats.keys_put += len(hashes)
            after = int(owners[-1]) + 1
        else:
            after = first
        if self._last.is_write_full() and after < n:
            self._roll(int(ts[after]), stats)
        return stats

    @staticmethod
    def _fresh(batch: DispatchBatch, resume: IndexResume) -> tuple[np.ndarray, int, int]:
        """The records of the batch still to index, the row of the record at the resume offset (-1: none
        here) and how many of its leading keys to drop."""
        phy = batch.phy_offset
        fresh = phy > resume.phy_offset
        row = int(np.searchsorted(phy, resume.phy_offset))
        if row == len(phy) or int(phy[row]) != resume.phy_offset:
            return fresh, -1, 0
        only = np.zeros(len(phy), dtype=bool)
        only[row] = True
        keys = len(batch.index_keys(only & batch.index_mask())[0])
        if resume.keys_put == 0 or resume.keys_put < keys:
            fresh[row] = True
            return fresh, row, resume.keys_put
        return fresh, -1, 0

    def query_offset(self, topic: str, key: str, max_num: int, begin: int, end: int) -> QueryOffsetResult:
        """`IndexService.queryOffset`: hash candidates for `topic#key`, newest file first. A damaged file
        is an IndexQueryDamaged carrying the candidates found before the damage."""
        max_num = min(max_num, self.max_msgs_num_batch)
        key_hash = index_key_hash(topic + INDEX_KEY_SEPARATOR + key)
        out: list[int] = []
        sources: list[tuple[str, int]] = []
        last_ts = last_phy = 0
        for i, name in enumerate(reversed(self.names)):
            if name in self.damaged:
                raise IndexQueryDamaged(self.damaged[name], QueryOffsetResult(out, last_ts, last_phy, sources))
            f = self._open_for_read(name)
            try:
                if i == 0:
                    last_ts, last_phy = f.end_timestamp, f.end_phy_offset
                if f.is_time_matched(begin, end):
                    entries: list[int] = []
                    try:
                        f.select_phy_offsets(out, key_hash, max_num, begin, end, entries=entries, newest=i == 0)
                    except CorruptEntryError as e:
                        sources.extend((f.path, n) for n in entries)
                        raise IndexQueryDamaged(e, QueryOffsetResult(out, last_ts, last_phy, sources)) from None
                    sources.extend((f.path, n) for n in entries)
                if f.begin_timestamp < begin or len(out) >= max_num:
                    break
            finally:
                if f is not self._last:
                    f.close()
        return QueryOffsetResult(out, last_ts, last_phy, sources)

    def _open_for_read(self, name: str) -> IndexFile:
        if self._last is not None and self._last.path == self._path(name):
            return self._last
        return IndexFile(self._path(name), self.hash_slot_num, self.index_num, readonly=True)
