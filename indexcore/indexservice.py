"""IndexService: the directory of IndexFiles, rolled when full, queried newest first.

Files live in `{root}/index/`, named `yyyyMMddHHmmssSSS` in local time. The broker names a file by the
wall clock at its creation, which no rebuild can reproduce; reputd names it by the store timestamp of
the record being dispatched when it is created (the next free millisecond on a clash, and always after
the newest existing name), so two rebuilds of one CommitLog give the same names and name order stays
creation order. Contents are what the broker writes, byte for byte.

As in `IndexService.buildIndex`, every dispatched record first makes sure a non-full last file exists
(so a new file appears as soon as anything follows a full one), records below the last file's
end_phy_offset are skipped as already indexed, ROLLBACK records are not indexed, and a key that does
not fit is retried in a new file created from the full one's end values.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from indexcore.dispatch import INDEX_KEY_SEPARATOR, DispatchBatch
from indexcore.errors import StoreLayoutError
from indexcore.indexfile import DEFAULT_MAX_HASH_SLOT_NUM, DEFAULT_MAX_INDEX_NUM, IndexFile, index_file_size
from indexcore.javahash import index_key_hash, index_key_hash_many

INDEX_DIR = "index"
INDEX_FILE_NAME_DIGITS = 17
DEFAULT_MAX_MSGS_NUM_BATCH = 64
_INDEX_FILE_NAME = re.compile(rf"\d{{{INDEX_FILE_NAME_DIGITS}}}")


def index_file_name(timestamp_ms: int) -> str:
    """`UtilAll.timeMillisToHumanString` in local time: yyyyMMddHHmmssSSS."""
    return time.strftime("%Y%m%d%H%M%S", time.localtime(timestamp_ms // 1000)) + f"{timestamp_ms % 1000:03d}"


def index_file_time(name: str) -> int:
    """The local-time millisecond a file name stands for (inverse of `index_file_name`)."""
    return int(time.mktime(time.strptime(name[:14], "%Y%m%d%H%M%S"))) * 1000 + int(name[14:])


@dataclass(frozen=True, slots=True)
class QueryOffsetResult:
    """`QueryOffsetResult`: candidate offsets (hash matches only), newest first, file by file."""

    phy_offsets: list[int]
    index_last_update_timestamp: int
    index_last_update_phy_offset: int


@dataclass(slots=True)
class IndexStats:
    keys_put: int = 0
    files_created: int = 0


class IndexService:
    """Writes and queries the IndexFiles of one store; only the newest file stays mapped for writing."""

    def __init__(self, root: str, hash_slot_num: int = DEFAULT_MAX_HASH_SLOT_NUM,
                 index_num: int = DEFAULT_MAX_INDEX_NUM, max_msgs_num_batch: int = DEFAULT_MAX_MSGS_NUM_BATCH):
        self.directory = os.path.join(root, INDEX_DIR)
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self.max_msgs_num_batch = max_msgs_num_batch
        self.file_size = index_file_size(hash_slot_num, index_num)
        self.names: list[str] = []
        self._last: IndexFile | None = None

    def load(self, *, readonly: bool = False) -> None:
        """Open the existing files in name order; a foreign name or a wrong size is a layout error."""
        self.close()
        names = []
        if os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                path = os.path.join(self.directory, name)
                if not _INDEX_FILE_NAME.fullmatch(name):
                    raise StoreLayoutError(path, "not an IndexFile: names are 17-digit yyyyMMddHHmmssSSS")
                size = os.path.getsize(path)
                if size != self.file_size:
                    raise StoreLayoutError(path, f"IndexFile is {size} bytes; maxHashSlotNum {self.hash_slot_num} "
                                                 f"and maxIndexNum {self.index_num} give {self.file_size}")
                names.append(name)
        self.names = sorted(names)
        if self.names:
            self._last = IndexFile(self._path(self.names[-1]), self.hash_slot_num, self.index_num, readonly=readonly)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    @property
    def last_file(self) -> IndexFile | None:
        return self._last

    @property
    def end_phy_offset(self) -> int:
        """end_phy_offset of the newest file: records below it are already indexed."""
        return self._last.end_phy_offset if self._last is not None else 0

    def _new_name(self, store_timestamp: int) -> str:
        ms = store_timestamp
        if self.names:
            ms = max(ms, index_file_time(self.names[-1]) + 1)
        name = index_file_name(ms)
        while os.path.exists(self._path(name)) or (self.names and name <= self.names[-1]):
            ms += 1
            name = index_file_name(ms)
        return name

    def _roll(self, store_timestamp: int, stats: IndexStats) -> IndexFile:
        """`getAndCreateLastIndexFile`: a new file seeded with the previous one's end values."""
        prev = self._last
        end_phy, end_ts = (prev.end_phy_offset, prev.end_timestamp) if prev is not None else (0, 0)
        os.makedirs(self.directory, exist_ok=True)
        name = self._new_name(store_timestamp)
        created = IndexFile(self._path(name), self.hash_slot_num, self.index_num, create=True,
                            end_phy_offset=end_phy, end_timestamp=end_ts)
        if prev is not None:
            prev.flush()
            prev.close()
        self.names.append(name)
        self._last = created
        stats.files_created += 1
        return created

    def build_index(self, batch: DispatchBatch) -> IndexStats:
        """`buildIndex` for every record of the batch, in order."""
        stats = IndexStats()
        n = len(batch)
        if n == 0:
            return stats
        ts = batch.store_timestamp
        if self._last is None or self._last.is_write_full():
            self._roll(int(ts[0]), stats)
        eligible = batch.index_mask() & (batch.phy_offset >= self._last.end_phy_offset)
        keys, owners = batch.index_keys(eligible)
        if keys:
            hashes = index_key_hash_many(keys)
            phys = batch.phy_offset[owners]
            key_ts = ts[owners]
            i = 0
            while i < len(keys):
                f = self._last
                if f.is_write_full():
                    # it filled at key i-1: the next record to arrive creates the new file, be it key i's
                    # own record or, when the file filled at the end of a message, the one right after it
                    creator = int(owners[i]) if i == 0 else min(int(owners[i]), int(owners[i - 1]) + 1)
                    f = self._roll(int(ts[creator]), stats)
                i += f.put_keys(hashes[i:], phys[i:], key_ts[i:])
            stats.keys_put += len(keys)
            after = int(owners[-1]) + 1
        else:
            after = 0
        if self._last.is_write_full() and after < n:
            self._roll(int(ts[after]), stats)
        return stats

    def query_offset(self, topic: str, key: str, max_num: int, begin: int, end: int) -> QueryOffsetResult:
        """`IndexService.queryOffset`: hash candidates for `topic#key`, newest file first."""
        max_num = min(max_num, self.max_msgs_num_batch)
        key_hash = index_key_hash(topic + INDEX_KEY_SEPARATOR + key)
        out: list[int] = []
        last_ts = last_phy = 0
        for i, name in enumerate(reversed(self.names)):
            f = self._open_for_read(name)
            try:
                if i == 0:
                    last_ts, last_phy = f.end_timestamp, f.end_phy_offset
                if f.is_time_matched(begin, end):
                    f.select_phy_offsets(out, key_hash, max_num, begin, end)
                if f.begin_timestamp < begin or len(out) >= max_num:
                    break
            finally:
                if f is not self._last:
                    f.close()
        return QueryOffsetResult(out, last_ts, last_phy)

    def _open_for_read(self, name: str) -> IndexFile:
        if self._last is not None and self._last.path == self._path(name):
            return self._last
        return IndexFile(self._path(name), self.hash_slot_num, self.index_num, readonly=True)

    def _sync_last(self) -> None:
        """Make the newest file durable as the broker leaves it: a full file is flushed when it is
        replaced (`FlushIndexFileThread`), a non-full one only ever reaches disk through the OS."""
        if self._last is not None:
            if self._last.is_write_full():
                self._last.flush()
            else:
                self._last.sync()

    def flush(self) -> None:
        self._sync_last()

    def close(self) -> None:
        if self._last is not None:
            self._sync_last()
            self._last.close()
            self._last = None


__all__ = ["INDEX_DIR", "IndexService", "QueryOffsetResult", "index_file_name", "index_file_time"]

