"""IndexFile: a fixed-size hash index from `topic#key` to CommitLog offsets.

File size = 40 + 4 * hash_slot_num + 20 * index_num (defaults 5,000,000 slots and 20,000,000 entries:
420,000,040 bytes). Neither number is stored in the file: reader and writer must be configured alike.

    header, 40 bytes (INDEX_HEADER ">qqqqii")
    0   8  begin_timestamp     store time of the first entry (pre-set to the predecessor's end on roll)
    8   8  end_timestamp       store time of the last entry
    16  8  begin_phy_offset
    24  8  end_phy_offset      CommitLog offset of the last entry
    32  4  hash_slot_count     number of chains started
    36  4  index_count         next entry number; starts at 1 (entry 0 is never written)

    slot table at 40: hash_slot_num int32, the entry number of the newest entry of the slot, 0 = empty

    entries at 40 + 4 * hash_slot_num, entry n at + 20 * n (INDEX_ENTRY ">iqii")
    0   4  key_hash            index_key_hash("topic#key"), never negative
    4   8  phy_offset
    12  4  time_diff           whole seconds since begin_timestamp, clamped to [0, 2**31-1]
    16  4  prev_index          the previous entry of the same slot, 0 ends the chain

A put writes its entry, then the slot, then the header fields, all through the mapping; the broker
never flushes a file that is not full, so after a crash the page cache's state is what there is. The
first put of a file created from a full predecessor measures its time_diff from the predecessor's
end_timestamp, then overwrites begin_timestamp: reproduced here, since it is what the broker writes.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from indexcore.mappedfile import MappedFile

INDEX_HEADER = struct.Struct(">qqqqii")
INDEX_HEADER_SIZE = INDEX_HEADER.size  # 40
HASH_SLOT = struct.Struct(">i")
HASH_SLOT_SIZE = HASH_SLOT.size  # 4
INDEX_ENTRY = struct.Struct(">iqii")
INDEX_ENTRY_SIZE = INDEX_ENTRY.size  # 20
INDEX_ENTRY_DTYPE = np.dtype([("key_hash", ">i4"), ("phy_offset", ">i8"), ("time_diff", ">i4"), ("prev_index", ">i4")])
INVALID_INDEX = 0
FIRST_INDEX = 1
DEFAULT_MAX_HASH_SLOT_NUM = 5_000_000
DEFAULT_MAX_INDEX_NUM = 20_000_000
MAX_TIME_DIFF = 2**31 - 1
MS_PER_SECOND = 1000

_HEADER_HASH_SLOT_COUNT = 32


def index_file_size(hash_slot_num: int, index_num: int) -> int:
    return INDEX_HEADER_SIZE + HASH_SLOT_SIZE * hash_slot_num + INDEX_ENTRY_SIZE * index_num


class IndexHeader(NamedTuple):
    begin_timestamp: int
    end_timestamp: int
    begin_phy_offset: int
    end_phy_offset: int
    hash_slot_count: int
    index_count: int

    def encode(self) -> bytes:
        return INDEX_HEADER.pack(*self)

    @classmethod
    def decode(cls, data: bytes | memoryview, pos: int = 0) -> IndexHeader:
        return cls(*INDEX_HEADER.unpack_from(data, pos))


class IndexEntry(NamedTuple):
    key_hash: int
    phy_offset: int
    time_diff: int
    prev_index: int

    def encode(self) -> bytes:
        return INDEX_ENTRY.pack(*self)

    @classmethod
    def decode(cls, data: bytes | memoryview, pos: int = 0) -> IndexEntry:
        return cls(*INDEX_ENTRY.unpack_from(data, pos))


def time_diffs(store_timestamps: np.ndarray, begin_timestamps: np.ndarray | int) -> np.ndarray:
    """Seconds since begin, truncated toward zero as Java's long division does, clamped to int32 >= 0;
    0 everywhere begin <= 0."""
    d = store_timestamps - begin_timestamps
    secs = np.where(d < 0, 0, d // MS_PER_SECOND)
    secs = np.minimum(secs, MAX_TIME_DIFF)
    return np.where(np.asarray(begin_timestamps) <= 0, 0, secs)


class IndexFile:
    """One IndexFile mapped read-write, with the header kept in memory as the broker keeps it."""

    def __init__(self, path: str, hash_slot_num: int, index_num: int, *, create: bool = False,
                 readonly: bool = False, end_phy_offset: int = 0, end_timestamp: int = 0):
        self.path = path
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self._file = MappedFile(path, index_file_size(hash_slot_num, index_num), create=create, readonly=readonly)
        self._entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * hash_slot_num
        if create:
            self.begin_timestamp = self.end_timestamp = 0
            self.begin_phy_offset = self.end_phy_offset = 0
            self.hash_slot_count = 0
            self.index_count = FIRST_INDEX
            if end_phy_offset > 0:
                self.begin_phy_offset = self.end_phy_offset = end_phy_offset
            if end_timestamp > 0:
                self.begin_timestamp = self.end_timestamp = end_timestamp
            h = self.header
            self._file.write(0, INDEX_HEADER.pack(h.begin_timestamp, h.end_timestamp, h.begin_phy_offset,
                                                  h.end_phy_offset, 0, 0))
        else:
            h = IndexHeader.decode(self._file.buffer)
            (self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset,
             self.hash_slot_count, count) = h
            self.index_count = count if count > 0 else FIRST_INDEX

    @property
    def header(self) -> IndexHeader:
        return IndexHeader(self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset,
                           self.hash_slot_count, self.index_count)

    def is_write_full(self) -> bool:
        return self.index_count >= self.index_num

    @property
    def room(self) -> int:
        return max(0, self.index_num - self.index_count)

    def is_time_matched(self, begin: int, end: int) -> bool:
        b, e = self.begin_timestamp, self.end_timestamp
        return (begin < b and end > e) or (b <= begin <= e) or (b <= end <= e)

    def _slots(self) -> np.ndarray:
        return np.ndarray((self.hash_slot_num,), dtype=">i4", buffer=self._file.buffer, offset=INDEX_HEADER_SIZE)

    def put_keys(self, key_hash: np.ndarray, phy_offset: np.ndarray, store_timestamp: np.ndarray) -> int:
        """`IndexFile.putKey` for each key in order until the file is full; returns how many were put.

        Chains are computed for the whole run at once: the previous entry of a key is the last earlier
        key of the run in the same slot, or the slot's current value for the first one.
        """
        k = min(len(key_hash), self.room)
        if k == 0:
            return 0
        kh = key_hash[:k].astype(np.int64)
        phy = phy_offset[:k].astype(np.int64)
        ts = store_timestamp[:k].astype(np.int64)
        numbers = self.index_count + np.arange(k, dtype=np.int64)
        slot = kh % self.hash_slot_num
        order = np.argsort(slot, kind="stable")
        s_sorted = slot[order]
        first_in_slot = np.ones(k, dtype=bool)
        first_in_slot[1:] = s_sorted[1:] != s_sorted[:-1]
        prev = np.empty(k, dtype=np.int64)
        prev_sorted = np.empty(k, dtype=np.int64)
        prev_sorted[1:] = numbers[order[:-1]]
        slots = self._slots()
        try:
            current = slots[s_sorted[first_in_slot]].astype(np.int64)
            firsts = order[first_in_slot]
            valid = (current > 0) & (current <= numbers[firsts])
            prev_sorted[first_in_slot] = np.where(valid, current, INVALID_INDEX)
            prev[order] = prev_sorted
            fresh_file = self.index_count <= FIRST_INDEX
            begins = np.full(k, ts[0] if fresh_file else self.begin_timestamp, dtype=np.int64)
            begins[0] = self.begin_timestamp
            entries = np.empty(k, dtype=INDEX_ENTRY_DTYPE)
            entries["key_hash"] = kh
            entries["phy_offset"] = phy
            entries["time_diff"] = time_diffs(ts, begins)
            entries["prev_index"] = prev
            at = self._entries_at + INDEX_ENTRY_SIZE * self.index_count
            self._file.write(at, entries.tobytes())
            last_in_slot = np.ones(k, dtype=bool)
            last_in_slot[:-1] = s_sorted[1:] != s_sorted[:-1]
            slots[s_sorted[last_in_slot]] = numbers[order[last_in_slot]]
        finally:
            del slots
        if fresh_file:
            self.begin_phy_offset = int(phy[0])
            self.begin_timestamp = int(ts[0])
        self.hash_slot_count += int(np.count_nonzero(prev == INVALID_INDEX))
        self.index_count += k
        self.end_phy_offset = int(phy[-1])
        self.end_timestamp = int(ts[-1])
        self._file.write(0, self.header.encode())
        return k

    def put_key(self, key_hash: int, phy_offset: int, store_timestamp: int) -> bool:
        """`IndexFile.putKey` for one key; False when the file is full."""
        return self.put_keys(np.array([key_hash]), np.array([phy_offset]), np.array([store_timestamp])) == 1

    def select_phy_offsets(self, out: list[int], key_hash: int, max_num: int, begin: int, end: int) -> None:
        """`selectPhyOffset`: walk the slot's chain newest first, appending offsets whose hash matches
        and whose reconstructed time lies in [begin, end]. Only the 32-bit hash is compared."""
        buf = self._file.buffer
        slot_value = HASH_SLOT.unpack_from(buf, INDEX_HEADER_SIZE + HASH_SLOT_SIZE * (key_hash % self.hash_slot_num))[0]
        if slot_value <= INVALID_INDEX or slot_value > self.index_count or self.index_count <= FIRST_INDEX:
            return
        n = slot_value
        while len(out) < max_num:
            kh, phy, time_diff, prev = INDEX_ENTRY.unpack_from(buf, self._entries_at + INDEX_ENTRY_SIZE * n)
            if time_diff < 0:
                break
            t = self.begin_timestamp + time_diff * MS_PER_SECOND
            if kh == key_hash and begin <= t <= end:
                out.append(phy)
            if prev <= INVALID_INDEX or prev > self.index_count or prev == n or t < begin:
                break
            n = prev

    def entry(self, n: int) -> IndexEntry:
        return IndexEntry.decode(self._file.buffer, self._entries_at + INDEX_ENTRY_SIZE * n)

    def slot(self, slot: int) -> int:
        return HASH_SLOT.unpack_from(self._file.buffer, INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slot)[0]

    def flush(self) -> None:
        """`IndexFile.flush`: write the whole header from memory, then force the mapping. Puts already wrote
        it; what changes is a new file's indexCount, 0 on disk until then and 1 in memory (§8.2, §16.6)."""
        if not self._file.readonly:
            self._file.write(0, self.header.encode())
        self._file.flush()

    def sync(self) -> None:
        """Force the mapping without rewriting the header: how a 4.9.3 broker's non-full file reaches disk
        (the OS writes back what the puts wrote), so a rolled file with no entry yet keeps indexCount 0."""
        self._file.flush()

    def close(self) -> None:
        self._file.close()
