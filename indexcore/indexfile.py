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

What a clean run leaves in the header on disk, which `truncate` reproduces: a file with no entry yet
has the values it was created with and indexCount 0 (written at creation; only a put or `flush`
writes the in-memory 1, and reputd flushes only full files); a file with entries, full or not, has the
in-memory header, since every put rewrites all of it.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from indexcore import _kernels
from indexcore.errors import CorruptEntryError, StoreLayoutError
from indexcore.mappedfile import MappedFile

INDEX_HEADER = struct.Struct(">qqqqii")
INDEX_HEADER_SIZE = INDEX_HEADER.size  # 40
HASH_SLOT = struct.Struct(">i")
HASH_SLOT_SIZE = HASH_SLOT.size  # 4
INDEX_ENTRY = struct.Struct(">iqii")
INDEX_ENTRY_SIZE = INDEX_ENTRY.size  # 20
# a numpy dtype spec, made into a dtype where it is used, so that importing the format needs no numpy
INDEX_ENTRY_DTYPE = [("key_hash", ">i4"), ("phy_offset", ">i8"), ("time_diff", ">i4"), ("prev_index", ">i4")]
HASH_SLOT_DTYPE = ">i4"
INVALID_INDEX = 0
FIRST_INDEX = 1
DEFAULT_MAX_HASH_SLOT_NUM = 5_000_000
DEFAULT_MAX_INDEX_NUM = 20_000_000
MAX_TIME_DIFF = 2**31 - 1
MS_PER_SECOND = 1000
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# entries read (and zeroed) at a time past the header's indexCount when truncating: a put cut short by
# a crash may have written entries, and slots, beyond the count its header never got to record
TAIL_SCAN_ENTRIES = 1024
# Bytes of slots or entries a whole-file check (`slot_fault`, `structure_fault`: what a start checks of the newest
# file) reads at a time, each window's pages released from the RSS once read: a start used to keep every page
# of the written part in its RSS (6,000,000 entries and 5,000,000 slots: 140 MB), for the whole first session.
CHECK_WINDOW_BYTES = 4 << 20
# A writer putting millions of keys (a rebuild catching up, a backfill task) drops the file's pages from its RSS
# every this many keys (about 20 MB of entries) with `release`, instead of only when the file is flushed.
RELEASE_AFTER_KEYS = 1 << 20

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


def header_problem(header: IndexHeader, hash_slot_num: int, index_num: int) -> str | None:
    """Why an on-disk header cannot have been written by a broker or by reputd, or None if it can.

    indexCount 0 is a created file before its first put and counts as 1. A broker killed inside a put
    may have written hashSlotCount but not yet indexCount, so the chains started can reach the
    (normalised) count itself, one more than the entries it records; never more than the slots.
    """
    fault = header_fault(header, hash_slot_num, index_num)
    return None if fault is None else fault[1]


def header_fault(header: IndexHeader, hash_slot_num: int, index_num: int) -> tuple[str, str] | None:
    """`header_problem` with the field at fault: (field, why), or None."""
    count = header.index_count
    if not 0 <= count <= index_num:
        return "index_count", f"header indexCount {count} is outside [0, maxIndexNum {index_num}]"
    most = min(hash_slot_num, max(count, FIRST_INDEX))
    if not 0 <= header.hash_slot_count <= most:
        return "hash_slot_count", (f"header hashSlotCount {header.hash_slot_count} is outside [0, {most}] "
                                   f"(maxHashSlotNum {hash_slot_num}, indexCount {count})")
    for field in ("begin_timestamp", "end_timestamp", "begin_phy_offset", "end_phy_offset"):
        if getattr(header, field) < 0:
            return field, f"header {field} {getattr(header, field)} is negative"
    if header.begin_phy_offset > header.end_phy_offset:
        return "begin_phy_offset", (f"header begin_phy_offset {header.begin_phy_offset} > end_phy_offset "
                                    f"{header.end_phy_offset}")
    return None


class IndexTruncation(NamedTuple):
    """What `IndexFile.truncate` did."""

    entries_removed: int
    slots_restored: int


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


class IndexFile:
    """One IndexFile mapped read-write, with the header kept in memory as the broker keeps it."""

    def __init__(self, path: str, hash_slot_num: int, index_num: int, *, create: bool = False,
                 readonly: bool = False, end_phy_offset: int = 0, end_timestamp: int = 0):
        self.path = path
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self._entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * hash_slot_num
        size = index_file_size(hash_slot_num, index_num)
        if create:
            self._seed(end_phy_offset, end_timestamp)
            self._file = MappedFile.create(path, size, self.written_header().encode(), label="index")
        else:
            self._file = MappedFile(path, size, readonly=readonly)
            h = IndexHeader.decode(self._file.buffer)
            problem = None if readonly else header_problem(h, hash_slot_num, index_num)
            if problem is not None:
                self._file.close()
                raise StoreLayoutError(path, problem)
            (self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset,
             self.hash_slot_count, count) = h
            self.index_count = count if count > 0 else FIRST_INDEX

    def _seed(self, end_phy_offset: int, end_timestamp: int) -> None:
        """The in-memory header of a new file: its predecessor's end values, when positive, as both begin
        and end values (`IndexFile` constructor), and indexCount 1."""
        self.begin_timestamp = self.end_timestamp = 0
        self.begin_phy_offset = self.end_phy_offset = 0
        self.hash_slot_count = 0
        self.index_count = FIRST_INDEX
        if end_phy_offset > 0:
            self.begin_phy_offset = self.end_phy_offset = end_phy_offset
        if end_timestamp > 0:
            self.begin_timestamp = self.end_timestamp = end_timestamp

    @property
    def header(self) -> IndexHeader:
        return IndexHeader(self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset,
                           self.hash_slot_count, self.index_count)

    def written_header(self) -> IndexHeader:
        """The header a clean run leaves on disk (module docstring): the in-memory one once a put wrote it;
        before the first put, the created values with hashSlotCount and indexCount 0."""
        if self.index_count > FIRST_INDEX:
            return self.header
        return self.header._replace(hash_slot_count=0, index_count=0)

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
        """`IndexFile.putKey` for each key in order until the file is full; returns how many were put."""
        k = min(len(key_hash), self.room)
        if k == 0:
            return 0
        buffer, entry_base = self._put_target(k)
        self.index_count, started, self.begin_timestamp, self.begin_phy_offset = _kernels.put_keys(
            buffer, self._entries_at, self.hash_slot_num, self.index_count, self.index_num,
            self.begin_timestamp, self.begin_phy_offset, np.ascontiguousarray(key_hash[:k], dtype=np.int64),
            np.ascontiguousarray(phy_offset[:k], dtype=np.int64),
            np.ascontiguousarray(store_timestamp[:k], dtype=np.int64), entry_base)
        self.hash_slot_count += started
        self.end_phy_offset = int(phy_offset[k - 1])
        self.end_timestamp = int(store_timestamp[k - 1])
        self._file.write(0, self.header.encode())
        return k

    def _put_target(self, keys: int) -> tuple[object, int]:
        """Where the next `keys` puts go: the buffer holding slots and entries, and the number of the first
        entry it holds (0: the whole file). The verifier's in-memory image holds a window of entries."""
        return self._file.buffer, 0

    def put_key(self, key_hash: int, phy_offset: int, store_timestamp: int) -> bool:
        """`IndexFile.putKey` for one key; False when the file is full."""
        return self.put_keys(np.array([key_hash]), np.array([phy_offset]), np.array([store_timestamp])) == 1

    def select_phy_offsets(self, out: list[int], key_hash: int, max_num: int, begin: int, end: int, *,
                           entries: list[int] | None = None, newest: bool = False) -> None:
        """`selectPhyOffset`: walk the slot's chain newest first, appending offsets whose hash matches
        and whose reconstructed time lies in [begin, end] (and, to `entries`, their entry numbers). Only
        the 32-bit hash is compared.

        Bounded on any bytes: a put links its entry to an older one, so every link must go back, and a
        walk visits at most indexCount entries. A slot or link that is negative, does not go back (a
        cycle, a self-loop) or points past the entries the file holds, and a negative time diff, are a
        CorruptEntryError naming the entry and field, raised after `out` got what the chain gave before
        it. The broker's walk stops silently at some of these and loops for ever on a longer cycle. In
        the `newest` file, a slot past indexCount is a put in progress (a live writer puts entries and
        slots before the header): its uncounted entries are passed over, as the broker does not count
        them, and the walk goes on from the first counted one.
        """
        buf = self._file.buffer
        slot = key_hash % self.hash_slot_num
        n = HASH_SLOT.unpack_from(buf, INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slot)[0]
        if n == INVALID_INDEX:
            return
        if n < INVALID_INDEX:
            raise self._damage(f"slot {slot}", "slot", f"{n} is negative")
        count = min(self.index_count, self.index_num)
        if n >= count and not (newest and n < self.index_num):
            raise self._damage(f"slot {slot}", "slot", f"points at entry {n}, past indexCount {count}")
        while len(out) < max_num:
            kh, phy, time_diff, prev = INDEX_ENTRY.unpack_from(buf, self._entries_at + INDEX_ENTRY_SIZE * n)
            if n < count:
                if time_diff < 0:
                    raise self._damage(f"entry {n}", "time_diff", f"{time_diff} is negative")
                t = self.begin_timestamp + time_diff * MS_PER_SECOND
                if kh == key_hash and begin <= t <= end:
                    out.append(phy)
                    if entries is not None:
                        entries.append(n)
                if t < begin:
                    break
            if prev == INVALID_INDEX:
                break
            if prev < INVALID_INDEX:
                raise self._damage(f"entry {n}", "prev_index", f"{prev} is negative")
            if prev >= n:
                raise self._damage(f"entry {n}", "prev_index", self._bad_link(n, prev, count))
            n = prev

    def entry_fault(self, n: int, e: IndexEntry) -> CorruptEntryError | None:
        """Why recorded entry `n` cannot have been put (the rules `select_phy_offsets` walks by), or None."""
        if e.time_diff < 0:
            return self._damage(f"entry {n}", "time_diff", f"{e.time_diff} is negative")
        if e.prev_index < INVALID_INDEX:
            return self._damage(f"entry {n}", "prev_index", f"{e.prev_index} is negative")
        if e.prev_index >= n:
            return self._damage(f"entry {n}", "prev_index", self._bad_link(n, e.prev_index, self.index_count))
        return None

    def slot_fault(self, *, newest: bool = False) -> CorruptEntryError | None:
        """The first slot that is negative or points past the recorded entries (in the `newest` file, past
        the entries the file can hold: a put in progress writes slots before the header), or None. Reads the
        slots a window at a time, releasing each (CHECK_WINDOW_BYTES)."""
        limit = self.index_num if newest else self.index_count
        step = CHECK_WINDOW_BYTES // HASH_SLOT_SIZE
        for lo in range(0, self.hash_slot_num, step):
            start, size = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * lo, HASH_SLOT_SIZE * min(step, self.hash_slot_num - lo)
            slots = np.frombuffer(self._file.buffer[start : start + size], dtype=HASH_SLOT_DTYPE)
            self._file.release(start, size)
            bad = np.flatnonzero((slots < INVALID_INDEX) | (slots >= limit))
            if len(bad):
                slot, value = lo + int(bad[0]), int(slots[bad[0]])
                break
        else:
            return None
        why = f"{value} is negative" if value < 0 else f"points at entry {value}, past indexCount {self.index_count}"
        return self._damage(f"slot {slot}", "slot", why)

    def structure_fault(self) -> CorruptEntryError | None:
        """The first slot or recorded entry no sequence of puts leaves (`slot_fault`, `entry_fault`), or None.
        Reads the slots and the recorded entries once, a window at a time, each window's pages released once
        read (CHECK_WINDOW_BYTES): what a writer checks of the file it will append to, so that it does not build
        on damage, without the written part of the file in its RSS."""
        bad = self.slot_fault()
        if bad is not None:
            return bad
        step = CHECK_WINDOW_BYTES // INDEX_ENTRY_SIZE
        for lo in range(FIRST_INDEX, min(self.index_count, self.index_num), step):
            hi = min(lo + step, self.index_count, self.index_num)
            start = self._entries_at + INDEX_ENTRY_SIZE * lo
            chunk = np.frombuffer(self._file.buffer[start : start + INDEX_ENTRY_SIZE * (hi - lo)],
                                  dtype=INDEX_ENTRY_DTYPE)
            self._file.release(start, INDEX_ENTRY_SIZE * (hi - lo))
            n = np.arange(lo, hi)
            wrong = np.flatnonzero((chunk["time_diff"] < 0) | (chunk["prev_index"] < INVALID_INDEX)
                                   | (chunk["prev_index"] >= n))
            if len(wrong):
                at = lo + int(wrong[0])
                return self.entry_fault(at, self.entry(at))
        return None

    def header_bytes(self) -> bytes:
        """The header as it is in the file (indexCount not normalised)."""
        return bytes(self._file.buffer[:INDEX_HEADER_SIZE])

    def _damage(self, entry: str, field: str, detail: str) -> CorruptEntryError:
        return CorruptEntryError(self.path, entry, field, detail)

    def _bad_link(self, n: int, prev: int, count: int) -> str:
        """What a prev_index that does not go back is: past the entries, a self-loop, or a cycle (found by
        following the links from `prev` for at most indexCount steps)."""
        if prev >= count:
            return f"{prev} is past indexCount {count}"
        if prev == n:
            return f"{prev} links the entry to itself (a cycle of 1)"
        at, steps = prev, 1
        while steps <= count and FIRST_INDEX <= at < min(count, self.index_num):
            at = INDEX_ENTRY.unpack_from(self._file.buffer, self._entries_at + INDEX_ENTRY_SIZE * at)[3]
            steps += 1
            if at == n:
                return f"{prev} links forward; the links from it come back to entry {n} (a cycle of {steps})"
        return f"{prev} links forward (a put links only to an older entry)"

    def count_last_entries(self, phy_offset: int) -> int:
        """How many of the newest recorded entries, counting back from the last, point at `phy_offset`:
        the keys this file holds of the last record indexed, when that record is at `phy_offset`."""
        count = 0
        n = self.index_count - 1  # the newest recorded entry; entry 0 is never written
        while n >= FIRST_INDEX:
            lo = max(FIRST_INDEX, n - TAIL_SCAN_ENTRIES + 1)
            start = self._entries_at + INDEX_ENTRY_SIZE * lo
            chunk = np.frombuffer(self._file.buffer[start : start + INDEX_ENTRY_SIZE * (n - lo + 1)],
                                  dtype=INDEX_ENTRY_DTYPE)["phy_offset"][::-1]
            other = np.flatnonzero(chunk != phy_offset)
            if len(other):
                return count + int(other[0])
            count += len(chunk)
            n = lo - 1
        return count

    def is_unwritten(self) -> bool:
        """Whether the header and the first entry are all zero: a file whose creation was cut short after
        its space was allocated (by an older reputd, or a broker), so nothing was ever put in it."""
        buf = self._file.buffer
        first = self._entries_at + INDEX_ENTRY_SIZE * FIRST_INDEX
        return not any(buf[:INDEX_HEADER_SIZE]) and not any(buf[first : first + INDEX_ENTRY_SIZE])

    def entry(self, n: int) -> IndexEntry:
        return IndexEntry.decode(self._file.buffer, self._entries_at + INDEX_ENTRY_SIZE * n)

    def slot(self, slot: int) -> int:
        return HASH_SLOT.unpack_from(self._file.buffer, INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slot)[0]

    def truncate(self, header: IndexHeader) -> IndexTruncation:
        """Put the file back as it was when its in-memory header was `header` (same index_count rules).

        Entries numbered >= header.index_count are zeroed (those the on-disk count records, and any a
        put cut short wrote past it), each slot they changed gets back the prev_index of its earliest
        removed entry, and the header is written as a clean run leaves it (module docstring). Everything
        is checked before anything is written: a file that cannot have reached its state from `header`
        by puts is a StoreLayoutError and stays untouched.
        """
        keep = header.index_count
        have = self.index_count
        if not FIRST_INDEX <= keep <= have:
            raise StoreLayoutError(self.path, f"holds {have - FIRST_INDEX} entries, the state to restore has "
                                              f"{keep - FIRST_INDEX}")
        buf = self._file.buffer
        if keep > FIRST_INDEX and self.entry(keep - 1).phy_offset != header.end_phy_offset:
            raise StoreLayoutError(self.path, f"entry {keep - 1} is at phy offset {self.entry(keep - 1).phy_offset}, "
                                              f"the state's end_phy_offset is {header.end_phy_offset}")
        end = self._written_end(have)
        entries = np.frombuffer(buf[self._entries_at + INDEX_ENTRY_SIZE * keep:
                                    self._entries_at + INDEX_ENTRY_SIZE * end], dtype=INDEX_ENTRY_DTYPE)
        recorded = entries[: have - keep]  # the puts whose header reached the page cache
        if have == keep:
            if self.header != header:
                raise StoreLayoutError(self.path, f"header {tuple(self.header)} differs from the state to restore "
                                                  f"{tuple(header)}")
        else:
            if keep > FIRST_INDEX and (self.begin_timestamp, self.begin_phy_offset) != (
                    header.begin_timestamp, header.begin_phy_offset):
                raise StoreLayoutError(self.path, "header begin values differ from the state to restore")
            started = int(np.count_nonzero(recorded["prev_index"] == INVALID_INDEX))
            if self.hash_slot_count - started != header.hash_slot_count:
                raise StoreLayoutError(self.path, f"hashSlotCount {self.hash_slot_count} less the {started} chains "
                                                  f"started after the state is not its {header.hash_slot_count}")
            if np.any(recorded["key_hash"] < 0) or np.any(recorded["phy_offset"] < header.end_phy_offset):
                raise StoreLayoutError(self.path, f"entries from {keep} on are not puts made after phy offset "
                                                  f"{header.end_phy_offset}")
        slot_ids, values = self._restored_slots(entries, keep, have, end)
        # Header first: if a kill interrupts what follows, the file reads as the state plus a put cut
        # short, and truncating again finishes the job (slots are recomputed from the entries still there).
        if have > keep:
            on_disk = 0 if keep == FIRST_INDEX and keep < self.index_num else keep
            self._file.write(0, header._replace(index_count=on_disk).encode())
        slots = self._slots()
        try:
            slots[slot_ids] = values
        finally:
            del slots
        for hi in range(end, keep, -TAIL_SCAN_ENTRIES):  # from the end, so a kill here leaves a prefix
            lo = max(keep, hi - TAIL_SCAN_ENTRIES)
            self._file.write(self._entries_at + INDEX_ENTRY_SIZE * lo, bytes(INDEX_ENTRY_SIZE * (hi - lo)))
        (self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset,
         self.hash_slot_count, self.index_count) = header
        return IndexTruncation(end - keep, len(slot_ids))

    def undo_cut_short_put(self) -> int:
        """Remove the entries a put cut short by a kill wrote past the header's count (and restore their
        slots), as `truncate` to the header's own state does; returns how many were removed."""
        if self._written_end(self.index_count) == self.index_count:
            return 0
        return self.truncate(self.header).entries_removed

    def _written_end(self, count: int) -> int:
        """One past the last entry written: the count, or further if a put was cut short before its header
        write. A written entry is all zero only if it is a hash-0 key at CommitLog offset 0 starting a chain
        with no time diff, and then leaving it is zeroing it."""
        end = at = count
        while at < self.index_num:
            n = min(TAIL_SCAN_ENTRIES, self.index_num - at)
            start = self._entries_at + INDEX_ENTRY_SIZE * at
            raw = np.frombuffer(self._file.buffer[start : start + INDEX_ENTRY_SIZE * n], dtype=np.uint8)
            used = np.flatnonzero(raw.reshape(n, INDEX_ENTRY_SIZE).any(axis=1))
            if len(used) == 0:
                break
            end = at + int(used[-1]) + 1
            at += n
        return end

    def _restored_slots(self, entries: np.ndarray, keep: int, have: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The slots the removed entries (numbers keep..end-1, of which keep..have-1 are recorded in the
        header) changed, and their values before: the prev_index of each slot's earliest removed entry.

        A slot of a recorded entry must point at its last recorded entry or at an unrecorded one; any other
        slot the removed entries map to must not point at a recorded one (a cut-short put may not have
        reached it). Anything else means the file is not the state plus puts, e.g. a truncation that was
        itself cut short, and is refused.
        """
        if len(entries) == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        slot = entries["key_hash"].astype(np.int64) % self.hash_slot_num
        slot_ids, first = np.unique(slot, return_index=True)
        slots = self._slots()
        try:
            current = slots[slot_ids].astype(np.int64)
        finally:
            del slots
        n_recorded = have - keep
        unrecorded = (current >= have) & (current < end)
        rec_ids, last_rev = np.unique(slot[:n_recorded][::-1], return_index=True)
        last = keep + n_recorded - 1 - last_rev
        at = np.searchsorted(slot_ids, rec_ids)
        ok = current >= INVALID_INDEX
        ok[at] = (current[at] == last) | unrecorded[at]
        other = np.ones(len(slot_ids), dtype=bool)
        other[at] = False
        ok[other] &= (current[other] < keep) | unrecorded[other]
        prev = entries["prev_index"][first].astype(np.int64)
        moved = current >= keep
        ok &= ~moved | ((prev >= INVALID_INDEX) & (prev < keep))
        if not np.all(ok):
            bad = int(slot_ids[np.flatnonzero(~ok)[0]])
            raise StoreLayoutError(self.path, f"slot {bad} holds {int(current[np.flatnonzero(~ok)[0]])}, which puts "
                                              f"after entry {keep - 1} cannot leave")
        return slot_ids[moved], prev[moved]

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

    def release(self) -> None:
        """Unmap this file's pages from this process (`MappedFile.release`)."""
        self._file.release()

    def release_entries(self) -> None:
        """`release` the entries recorded so far, and not the slot table: a writer's next keys touch slots all over
        the table (5,000,000 slots, 20 MB), and faulting their pages back in after a whole `release` cost the next
        batch of 1,200 keys 9 ms (median; up to 26) instead of 0.04; the entries are written in order, never
        touched again by the writer."""
        self._file.release(self._entries_at, INDEX_ENTRY_SIZE * self.index_count)

    def close(self) -> None:
        self._file.close()
