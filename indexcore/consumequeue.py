"""ConsumeQueue: the per-topic, per-queue index of CommitLog positions.

Directory `{root}/consumequeue/{topic}/{queueId}/`, a mapped-file queue of `mappedFileSizeConsumeQueue`
bytes per file (default 300,000 units = 6,000,000 bytes), named by the start byte offset of the queue's
logical stream. Unit n (queue offset n) lives at logical byte n * 20. A unit is 20 bytes, big-endian:

    offset  size  field
    0       8     commit_log_offset   PHYSICALOFFSET of the record
    8       4     msg_size            TOTALSIZE of the record
    12      8     tags_code           Java hash of TAGS (sign-extended), or a delay deliver time

    CQ_UNIT_SIZE = 8 + 4 + 8 = 20

A queue whose first unit is not queue offset 0 starts with blank units (0, 0x7FFFFFFF, 0) up to that
unit inside its first file. The write position is not stored: it is the first unit with
commit_log_offset < 0 or msg_size <= 0 (blank units count as valid). A crash can leave units the
checkpoint does not cover; `truncate_to` removes them, and zeroes what it removes, so that a queue
recovered after a crash is byte-identical to one built in a single run.

Units are appended with `pwrite` through a bounded set of descriptors (`mappedfile.OpenFiles`), not a
mapping per queue: an LMQ broker has tens of thousands of queues, more than a process may map
(vm.max_map_count) or keep open, and a write into a fresh mapped page costs a page fault that a
`pwrite` does not. Files are created sparse, as the broker's are (100,000 queues of 6,000,000-byte
files take a few hundred megabytes, not 600 GB); no room is then an OSError from the write, naming
the file, never a SIGBUS.

A file is created complete (its pre-blank units written) or not at all (`mappedfile.create_file`), a
queue's first file with its pre-blank units as the header.
Loading removes what a creation cut short by an older reputd left: a 0-byte newest file, or a queue's
only file allocated but left without its pre-blank units (all zeros: a first file always gets its
first unit or its blanks). Truncating removes a first file left with nothing but pre-blank units, as
a run that stopped there would not have made it yet.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from indexcore import _kernels
from indexcore.dispatch import DispatchBatch
from indexcore.errors import CorruptEntryError, StoreLayoutError
from indexcore.mappedfile import OpenFiles, check_sizes, list_queue_files, offset_to_file_name, remove_temporaries

CQ_UNIT = struct.Struct(">qiq")
CQ_UNIT_SIZE = CQ_UNIT.size
# a numpy dtype spec, made into a dtype where it is used, so that importing the format needs no numpy
CQ_UNIT_DTYPE = [("commit_log_offset", ">i8"), ("msg_size", ">i4"), ("tags_code", ">i8")]
BLANK_UNIT_MSG_SIZE = 0x7FFFFFFF
BLANK_UNIT = CQ_UNIT.pack(0, BLANK_UNIT_MSG_SIZE, 0)
DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE = 300_000 * CQ_UNIT_SIZE
RECOVER_FROM_LAST_FILES = 3  # ConsumeQueue.recover starts at the third-newest file
CONSUME_QUEUE_DIR = "consumequeue"
_RADIX_KEYS = 1 << 16
MAX_QUEUE_KEYS = 1 << 22  # queue keys (topics x span of queue ids) of a batch counted in C
PRIVATE_OPEN_FILES = 2  # a queue on its own: its writing file, and the one before it while rolling
MAX_OPEN_QUEUE_FILES = 65536
CREATE_LABEL = "consumequeue"  # names the steps of a file's creation (`mappedfile.create_file`'s fail points)
# The kernel copies a write into the page cache page by page, and a SIGKILL can stop it between two pages:
# a unit that straddles a page boundary is the one a kill can leave torn, its first bytes written and the
# rest not (`torn_unit_at`, `ConsumeQueue.drop_torn_tail`).
WRITE_PAGE_SIZE = mmap.PAGESIZE
# Appends a store gathers (`ConsumeQueueStore.hold_bytes`) are all written once they come to this many bytes,
# or were gathered over this many batches: each gathered piece keeps its batch's array of units alive.
HELD_BYTES_BUDGET = 64 * 1024 * 1024
HELD_BATCHES = 8


class ConsumeQueueUnit(NamedTuple):
    commit_log_offset: int
    msg_size: int
    tags_code: int

    def encode(self) -> bytes:
        return CQ_UNIT.pack(*self)

    @classmethod
    def decode(cls, data: bytes | memoryview, pos: int = 0) -> ConsumeQueueUnit:
        return cls(*CQ_UNIT.unpack_from(data, pos))

    @property
    def is_valid(self) -> bool:
        return self.commit_log_offset >= 0 and self.msg_size > 0


@dataclass(slots=True)
class QueueCursor:
    """What the put rules need to know of a queue: the start of its newest file (None before the first),
    the logical byte offset of its write position, and the end of the last unit put (maxPhysicOffset)."""

    file_start: int | None = None
    write_offset: int = 0
    max_physic_offset: int = -1


class Placement(NamedTuple):
    """Where `place_units` puts units[first:last]: at logical byte offset `logical`, in the file starting
    at `file_start` (`created`: made for this put), after `blanks` blank units written just before them (a
    first file's pre-blank units, or a gap in the queue's offsets; in a file `created` for this put they
    start at its position 0, its header). first == last when the put only creates a file or fills it."""

    file_start: int
    created: bool
    blanks: int
    logical: int
    first: int
    last: int


class QueueUnits(NamedTuple):
    """The units one queue gets from a batch, in the order the broker puts them, with each unit's CommitLog
    end. `one_streak`: their queue offsets are consecutive and their ends grow from first to last, so
    `place_units` places them without an array operation when they continue the queue."""

    topic: str
    queue_id: int
    queue_offset: np.ndarray
    units: np.ndarray  # CQ_UNIT_DTYPE
    ends: np.ndarray
    one_streak: bool = False


class NewQueue(NamedTuple):
    """A queue a batch creates: its key, its directory, the start of its first file and the pre-blank units
    that file is created with (its first unit's place in it)."""

    key: tuple[str, int]
    directory: str
    first_file: int
    blanks: int

    @property
    def path(self) -> str:
        return os.path.join(self.directory, offset_to_file_name(self.first_file))

    @property
    def header(self) -> bytes:
        return BLANK_UNIT * self.blanks


@dataclass(slots=True)
class PutStats:
    """What a put did: units written, units already present, blank units written into gaps of a queue's
    offsets (units whose records the output never got: `place_units`)."""

    written: int = 0
    already_built: int = 0
    gap_blanks: int = 0

    def add(self, other: PutStats) -> None:
        self.written += other.written
        self.already_built += other.already_built
        self.gap_blanks += other.gap_blanks


def _last_real_unit_end(units: np.ndarray) -> int:
    """offset + size of the last unit that is not a pre-blank unit, or -1: a blank (size 0x7FFFFFFF) says
    nothing about the CommitLog, and taken as a real unit it would mark 2 GiB of it as already built."""
    real = np.flatnonzero((units["commit_log_offset"] != 0) | (units["msg_size"] != BLANK_UNIT_MSG_SIZE)
                          | (units["tags_code"] != 0))
    if len(real) == 0:
        return -1
    last = units[real[-1]]
    return int(last["commit_log_offset"]) + int(last["msg_size"])


def last_written_unit(path: str) -> tuple[int, int] | None:
    """(commit_log_offset, msg_size) of a ConsumeQueue file's last unit, found as the broker's recovery finds
    its write position (the first invalid unit ends them), by bisection over a few reads; None when it holds
    no unit or ends in a pre-blank unit, which says nothing about the CommitLog."""
    with open(path, "rb") as f:
        def unit(i: int) -> tuple[int, int, int]:
            return CQ_UNIT.unpack(os.pread(f.fileno(), CQ_UNIT_SIZE, i * CQ_UNIT_SIZE))

        lo, hi = 0, os.fstat(f.fileno()).st_size // CQ_UNIT_SIZE
        while lo < hi:
            mid = (lo + hi) // 2
            phy, msg_size, _ = unit(mid)
            if phy >= 0 and msg_size > 0:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return None
        phy, msg_size, _ = unit(lo - 1)
    return None if msg_size == BLANK_UNIT_MSG_SIZE else (phy, msg_size)


def _data_regions(fd: int, size: int) -> list[tuple[int, int]]:
    """The [start, end) byte ranges of a file that hold data (SEEK_DATA/SEEK_HOLE); the rest reads as zeros.
    A file system without them reports the whole file."""
    regions: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:
                break
            if e.errno == errno.EINVAL and not regions:
                return [(0, size)]
            raise
        end = min(size, os.lseek(fd, start, os.SEEK_HOLE))
        regions.append((start, end))
        pos = end
    return regions


def _read_units(path: str) -> np.ndarray:
    """The units of a file up to the end of its written data; every unit past them is zero (a hole).

    A file is created sparse and written from its start, so only that part is read: a store of 100,000
    LMQ queues of 6,000,000-byte files loads without reading 600 GB of holes."""
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        regions = _data_regions(fd, size)
        count = min(size // CQ_UNIT_SIZE, -(-regions[-1][1] // CQ_UNIT_SIZE)) if regions else 0
        buf = np.zeros(count * CQ_UNIT_SIZE, dtype=np.uint8)
        view = memoryview(buf)
        for start, end in regions:
            at, stop = start, min(end, len(buf))
            while at < stop:
                got = os.preadv(fd, [view[at:stop]], at)
                if got == 0:
                    break
                at += got
    return buf.view(CQ_UNIT_DTYPE)


def _valid_prefix(units: np.ndarray, below_phy: int | None = None) -> int:
    """How many leading units are valid (offset >= 0 and size > 0, so blank units count), and, with
    `below_phy`, also point below that CommitLog offset."""
    stop = (units["commit_log_offset"] < 0) | (units["msg_size"] <= 0)
    if below_phy is not None:
        stop |= units["commit_log_offset"] >= below_phy
    first = np.flatnonzero(stop)
    return int(first[0]) if len(first) else len(units)


def straddles_page(position: int) -> bool:
    """Whether the unit at byte `position` of a file lies across a page boundary."""
    return position // WRITE_PAGE_SIZE != (position + CQ_UNIT_SIZE - 1) // WRITE_PAGE_SIZE


def torn_unit_at(units: np.ndarray, n: int) -> bool:
    """Whether the invalid unit n, and the written bytes after it, are what a write stopped by a kill leaves:
    unit n straddles a page boundary, and every written byte from it on lies before that boundary."""
    position = n * CQ_UNIT_SIZE
    if not straddles_page(position):
        return False
    boundary = position - position % WRITE_PAGE_SIZE + WRITE_PAGE_SIZE
    return not units.view(np.uint8)[boundary:].any()


def pack_units(commit_log_offset: np.ndarray, msg_size: np.ndarray, tags_code: np.ndarray) -> np.ndarray:
    """Units as they lie in the file, big-endian, one per element."""
    units = np.empty(len(commit_log_offset), dtype=CQ_UNIT_DTYPE)
    units["commit_log_offset"] = commit_log_offset
    units["msg_size"] = msg_size
    units["tags_code"] = tags_code
    return units


def _queue_order(topic_id: np.ndarray, queue_id: np.ndarray, topics: int) -> tuple[np.ndarray, np.ndarray]:
    """The permutation that groups units queue by queue, keeping their order inside a queue, and where
    each queue's run starts in it.

    A stable sort; when the queues of a batch number at most 2**16, their keys fit 16 bits and numpy's
    stable sort of them is a radix sort, linear in the batch.
    """
    qmin = int(queue_id.min())
    span = int(queue_id.max()) - qmin + 1
    if topics * span <= _RADIX_KEYS:
        key = (topic_id.astype(np.int64) * span + (queue_id - qmin)).astype(np.uint16)
    else:
        key = (topic_id.astype(np.int64) << 32) | (queue_id.astype(np.int64) & 0xFFFFFFFF)
    order = np.argsort(key, kind="stable")
    key = key[order]
    return order, np.flatnonzero(key[1:] != key[:-1]) + 1


def consume_queue_units(batch: DispatchBatch) -> Iterator[QueueUnits]:
    """`CommitLogDispatcherBuildConsumeQueue` for a batch: which units go to which queue, queue by queue, in
    put order, packed as they lie in the file. What rebuild, run and backfill write and verify expects.

    Every NOT_TYPE and COMMIT_TYPE record puts a unit into its own queue at its QUEUEOFFSET and then,
    when the batch carries multi-dispatch targets, one into each target queue at the target's offset
    (`putMessagePositionInfoWrapper`). Each queue receives its units in CommitLog order and a record's own
    unit before its targets, as the broker's sequential dispatch gives them. What the queue does with each
    (written, skipped as a repeat, appended out of order) is `place_units`'s business. `batch` is a
    DispatchBatch or anything with its columns (the backfill's RowChunk).
    """
    mask = batch.consume_queue_mask()
    if len(mask) == 0:
        return
    qids, multi_qids = batch.queue_id, batch.multi_queue_id
    qmin = min(int(qids.min()), int(multi_qids.min()) if len(multi_qids) else 0)
    span = max(int(qids.max()), int(multi_qids.max()) if len(multi_qids) else 0) - qmin + 1
    if len(batch.topics) * span > MAX_QUEUE_KEYS:
        yield from _group_units_sorting(batch, mask)
        return
    # queue keys topic * span + queue: a counting sort in C (_kernels.group_units) groups them, linear in
    # the units and the keys
    keys = len(batch.topics) * span
    owner = np.ascontiguousarray(batch.multi_owner, dtype=np.int64)
    total = int(np.count_nonzero(mask)) + (int(np.count_nonzero(mask[owner])) if len(owner) else 0)
    if total == 0:
        return
    units = np.empty(total, dtype=CQ_UNIT_DTYPE)
    qo, ends = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
    counts, state, cursor = np.empty(keys, np.int64), np.empty(keys, np.uint8), np.empty(keys, np.int64)
    _kernels.group_units(
        np.ascontiguousarray(mask, dtype=np.bool_), batch.topic_id.astype(np.int64) * span + (qids - qmin),
        *(np.ascontiguousarray(c, dtype=np.int64) for c in (batch.queue_offset, batch.phy_offset, batch.msg_size,
                                                            batch.tags_code)),
        owner, batch.multi_topic_id.astype(np.int64) * span + (multi_qids - qmin),
        np.ascontiguousarray(batch.multi_queue_offset, dtype=np.int64), units.view(np.uint8), qo, ends, counts, state,
        cursor)
    used = np.flatnonzero(counts)
    bounds = [0, *np.cumsum(counts[used]).tolist()]
    topics = batch.topics
    for key, lo, hi, streak in zip(used.tolist(), bounds[:-1], bounds[1:], (state[used] == 1).tolist(), strict=True):
        yield QueueUnits(topics[key // span], key % span + qmin, qo[lo:hi], units[lo:hi], ends[lo:hi], streak)


def _group_units_sorting(batch: DispatchBatch, mask: np.ndarray) -> Iterator[QueueUnits]:
    """`consume_queue_units` for a batch whose queue keys are too many to count (topics x queue id span
    over MAX_QUEUE_KEYS): a stable sort instead."""
    rows = np.flatnonzero(mask)
    topic_id, queue_id, queue_offset = batch.topic_id[rows], batch.queue_id[rows], batch.queue_offset[rows]
    owner = batch.multi_owner
    taken = mask[owner] if len(owner) else None  # targets of records that get no unit get none either
    multi = [c[taken] for c in (owner, batch.multi_topic_id, batch.multi_queue_id, batch.multi_queue_offset)] \
        if taken is not None else None
    if multi is not None and len(multi[0]):
        owner = multi[0]
        # merge the record's own units and the targets by record, own unit first: record r's units start
        # after those of the records before it (the kernel lists targets in record order)
        own = mask.astype(np.int64)
        targets = np.bincount(owner, minlength=len(mask))
        start = np.cumsum(own + targets) - (own + targets)
        at_own = start[rows]
        at_multi = start[owner] + own[owner] + np.arange(len(owner)) - (np.cumsum(targets) - targets)[owner]
        n = len(rows) + len(owner)
        rows, topic_id, queue_id, queue_offset = (
            _merge(at_own, a, at_multi, b, n)
            for a, b in zip((rows, topic_id, queue_id, queue_offset), multi, strict=True))
    if len(rows) == 0:
        return
    order, starts = _queue_order(topic_id, queue_id, len(batch.topics))
    rows, queue_offset = rows[order], queue_offset[order].astype(np.int64, copy=False)
    first = order[np.concatenate(([0], starts))]
    phy = batch.phy_offset[rows]
    size = batch.msg_size[rows]
    ends = phy + size
    units = pack_units(phy, size, batch.tags_code[rows])
    bounds = np.concatenate(([0], starts, [len(rows)])).tolist()
    topics = batch.topics
    for t, q, lo, hi, streak in zip(topic_id[first].tolist(), queue_id[first].tolist(), bounds[:-1], bounds[1:],
                                    _one_streak(queue_offset, ends, bounds).tolist(), strict=True):
        yield QueueUnits(topics[t], q, queue_offset[lo:hi], units[lo:hi], ends[lo:hi], streak)


def _streak_breaks(queue_offset: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Where a streak ends: the queue offsets stop being consecutive, or the ends stop growing (a name
    repeated in one record: its second unit is not past maxPhysicOffset)."""
    return np.flatnonzero((np.diff(queue_offset) != 1) | (np.diff(ends) <= 0)) + 1


def _one_streak(queue_offset: np.ndarray, ends: np.ndarray, bounds: list[int]) -> np.ndarray:
    """Per run: no streak break inside it (what `place_units` would find, for the whole batch at once)."""
    breaks = _streak_breaks(queue_offset, ends)
    inside = np.searchsorted(breaks, bounds[1:], side="left") - np.searchsorted(breaks, bounds[:-1], side="right")
    return inside == 0


def _merge(at_a: np.ndarray, a: np.ndarray, at_b: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.result_type(a, b))
    out[at_a], out[at_b] = a, b
    return out


def open_queue_files_limit() -> int:
    """How many queue files a store keeps open: half the descriptor limit, at most MAX_OPEN_QUEUE_FILES
    (a queue outside the set costs an open(2) when it is next written)."""
    import resource  # noqa: PLC0415 - POSIX only, and only a store that writes needs it

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(PRIVATE_OPEN_FILES, min(MAX_OPEN_QUEUE_FILES, (soft if soft > 0 else 1024) // 2))


def place_units(cursor: QueueCursor, qo: np.ndarray, ends: np.ndarray, file_size: int, stats: PutStats,
                one_streak: bool = False) -> Iterator[Placement]:
    """`putMessagePositionInfo` for units in put order, without touching a file: where each streak goes,
    advancing `cursor`. The writer (`ConsumeQueue.put_packed`) and the verifier (`reputd verify`) both
    follow these placements.

    Unit by unit this is the broker's put; runs of units it treats alike are placed at once: a streak of
    consecutive queue offsets and growing ends goes to one place, and units it skips (ending at or below
    maxPhysicOffset; or behind the queue's end: "build consume queue repeatedly") are skipped together. A
    unit at offset 0 goes wherever the queue ends (no order check for it).

    One rule differs from 4.9.3 on purpose: a unit whose queue offset lies past the queue's write position
    goes to its own queue offset, the units between made blank units (0, 0x7FFFFFFF, 0), the bytes of the
    broker's pre-blank (`fillPreBlank`), to the end of each file they cross. The broker appends such a unit
    at the write position ("[BUG]logic queue order maybe wrong") and every later unit of the queue then
    sits off its offset for ever; it only meets the case when records were never dispatched, which a
    broker running all along never does, while reputd does whenever retention deleted CommitLog segments
    it had not read. Blank units keep the queue contiguous for both recoveries (they count as valid units)
    and for `getMessage` (a unit below the CommitLog's first offset reads as removed). `one_streak`
    (`QueueUnits.one_streak`) spares the search for streak ends."""
    n = len(qo)
    if n == 0:
        return
    breaks = None if one_streak else _streak_breaks(qo, ends)
    i = 0
    while i < n:
        if ends[i] <= cursor.max_physic_offset:
            past = ends[i:] > cursor.max_physic_offset
            skip = int(np.argmax(past)) if past.any() else n - i
            stats.already_built += skip
            i += skip
            continue
        q = int(qo[i])
        expect = q * CQ_UNIT_SIZE
        created, blanks = False, 0
        if cursor.file_start is None:  # `getLastMappedFile` creates the first file, pre-blanked (§7.5 step 6)
            cursor.file_start = cursor.write_offset = expect - expect % file_size
            created = True
            if q != 0:
                blanks = (expect - cursor.file_start) // CQ_UNIT_SIZE
                cursor.write_offset = expect
        elif cursor.write_offset - cursor.file_start >= file_size:
            cursor.file_start += file_size
            created = True
        current = cursor.write_offset
        if breaks is None:
            streak_end = n
        else:
            k = np.searchsorted(breaks, i, side="right")
            streak_end = int(breaks[k]) if k < len(breaks) else n
        if q != 0 and expect < current:  # the streak, as far as it lies behind the queue's end
            skip = min(streak_end - i, (current - expect) // CQ_UNIT_SIZE)
            stats.already_built += skip
            if created:
                yield Placement(cursor.file_start, True, blanks, current, i, i)
            i += skip
            continue
        if q != 0 and expect > current:  # a gap: blank units up to the unit's own offset
            end_of_file = cursor.file_start + file_size
            gap = (min(expect, end_of_file) - current) // CQ_UNIT_SIZE
            stats.gap_blanks += gap
            cursor.write_offset = current = current + gap * CQ_UNIT_SIZE
            blanks += gap
            if current == end_of_file:  # the gap runs on into the next file
                yield Placement(cursor.file_start, created, blanks, current, i, i)
                continue
        # queue offset 0 skips the order check (§7.5); the units after it are each checked again
        j = min(i + 1 if q == 0 else streak_end, i + (file_size - (current - cursor.file_start)) // CQ_UNIT_SIZE)
        yield Placement(cursor.file_start, created, blanks, current, i, j)
        cursor.write_offset += (j - i) * CQ_UNIT_SIZE
        cursor.max_physic_offset = int(ends[j - 1])
        stats.written += j - i
        i = j


class ConsumeQueue:
    """One topic/queue: loads and recovers its files, appends units, reads units, truncates."""

    def __init__(self, directory: str, topic: str, queue_id: int,
                 file_size: int = DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE, *, readonly: bool = False,
                 open_files: OpenFiles | None = None, new: bool = False, made: int | None = None):
        if file_size <= 0 or file_size % CQ_UNIT_SIZE:
            raise ValueError(f"ConsumeQueue file size {file_size} is not a positive multiple of {CQ_UNIT_SIZE}")
        self.directory = directory
        self.topic = topic
        self.queue_id = queue_id
        self.file_size = file_size
        self.readonly = readonly
        self.max_physic_offset = -1
        self.min_logic_offset = 0
        self._files: list[int] = []  # start offsets, ascending
        self._open = open_files if open_files is not None else OpenFiles(PRIVATE_OPEN_FILES)
        self._write_pos = 0  # in the last file
        self._dirty = False  # the last file was written since it was last synced
        self._writing: str | None = None  # the last file's path
        self._made = made  # the start of a first file the caller created (empty) for the first unit
        self._held: list[np.ndarray] | None = None  # appends gathered for one write, up to the write position
        self._held_at = 0  # where in the last file they go
        self.held_bytes = 0
        self.removed: list[str] = []  # what loading removed: leftovers of creations cut short
        self.torn: list[str] = []  # files where loading zeroed a unit a kill left half written
        if not new:  # `new`: the caller knows the directory holds no file (it just made it)
            self._recover()

    # --- load and recovery ----------------------------------------------------------------------

    def _path(self, start: int) -> str:
        return os.path.join(self.directory, offset_to_file_name(start))

    def _recover(self) -> None:
        """`ConsumeQueue.recover`: scan from the third-newest file to the first invalid unit, after
        removing (or, read-only, passing over) what a creation cut short left."""
        self.removed = [] if self.readonly else remove_temporaries(self.directory)
        files = list_queue_files(self.directory, temporaries=True)
        if files and os.path.getsize(files[-1][1]) == 0:
            self._drop_newest(files)
        check_sizes(files, self.file_size)
        newest = _read_units(files[-1][1]) if files else None
        if len(files) == 1 and not newest.view(np.uint8).any():
            # a first file is never left without a unit or its pre-blanks: this one's creation was cut short
            self._drop_newest(files)
            newest = None
        self._files = [start for start, _ in files]
        if not files:
            return
        end = self._files[0]
        for start, path in files[max(0, len(files) - RECOVER_FROM_LAST_FILES):]:
            units = newest if newest is not None and start == self._files[-1] else _read_units(path)
            n = _valid_prefix(units)
            if n < len(units) and units[n:].view(np.uint8).any():
                if start != files[-1][0] or not torn_unit_at(units, n):
                    # units are appended in order and truncation zeroes what it removes: written bytes after
                    # the first invalid unit are damage, and taking the queue as ending there would lose them
                    # (only the newest file is written to, so only it can hold a write a kill stopped)
                    bad = units[n]
                    field, value = (("commit_log_offset", int(bad["commit_log_offset"]))
                                    if bad["commit_log_offset"] < 0 else ("msg_size", int(bad["msg_size"])))
                    raise CorruptEntryError(path, f"unit at queue offset {start // CQ_UNIT_SIZE + n}", field,
                                            f"{value} makes it no valid unit, and written units follow it")
                if not self.readonly:  # the first bytes of a unit whose write a kill stopped: not a unit
                    self._open.write(path, bytes(CQ_UNIT_SIZE), n * CQ_UNIT_SIZE)
                    self.torn.append(path)
            max_phy = _last_real_unit_end(units[:n])
            if max_phy >= 0:
                self.max_physic_offset = max_phy
            end = start + n * CQ_UNIT_SIZE
            if n * CQ_UNIT_SIZE < self.file_size:
                break
        self._truncate_files_after(end)
        self.min_logic_offset = self._files[0] if self._files else 0
        if self.max_physic_offset < 0 and len(self._files) > RECOVER_FROM_LAST_FILES:
            self.max_physic_offset = self._real_end_before(len(self._files) - RECOVER_FROM_LAST_FILES)

    def _real_end_before(self, index: int) -> int:
        """The end of the last real unit in the files before the `index`th, or -1: the newest files may hold
        nothing but blank units (a gap in the queue's offsets, `place_units`), which say nothing of the
        CommitLog. Read newest first, so only the blank files and the one before them are read."""
        for start in reversed(self._files[:index]):
            end = _last_real_unit_end(_read_units(self._path(start)))
            if end >= 0:
                return end
        return -1

    def _drop_newest(self, files: list[tuple[int, str]]) -> None:
        """Forget the newest file, which holds no real unit; writable, delete it."""
        _, path = files.pop()
        if not self.readonly:
            os.unlink(path)
            self.removed.append(path)

    def _truncate_files_after(self, end: int) -> None:
        """`truncateDirtyFiles`: drop files that start past `end`; append to the one holding it.

        A read-only queue only forgets them, so a query never changes the files it reads.
        """
        while self._files and self._files[-1] > end:
            start = self._files.pop()
            if not self.readonly:
                os.unlink(self._path(start))
        if self._files:
            self._write_pos = end - self._files[-1]
        self._writing = self._path(self._files[-1]) if self._files else None

    def _new_file(self, start: int, blanks: int) -> None:
        """Create the next file, with its `blanks` pre-blank units, and make it the one units go to. The one
        before is synced first: a file is flushed when the next one is opened, so only the last can hold
        unflushed units."""
        self.flush()
        if self._writing is not None:
            self._open.discard(self._writing)
        path = self._path(start)
        if start == self._made and not self._files:
            self._made = None  # created with its blanks and open already: `ConsumeQueueStore.made_queues`
        else:
            self._open.fd(path, create_size=self.file_size, header=BLANK_UNIT * blanks, label=CREATE_LABEL)
        self._files.append(start)
        self._writing = path
        self._write_pos = blanks * CQ_UNIT_SIZE

    def _write(self, position: int, data: bytes) -> None:
        """Write into the last file at `position`."""
        self.release_held()
        self._dirty = True
        self._open.write(self._writing, data, position)

    def _gather(self, units: np.ndarray, hold: int) -> None:
        """Add `units`, which go at the write position, to the gathered appends (the arrays themselves, not
        copies: copying costs a fresh page per 4 KiB), and let them go once they are `hold` bytes."""
        if self._held is None:
            self._held, self._held_at, self.held_bytes = [units], self._write_pos, units.nbytes
        else:
            self._held.append(units)
            self.held_bytes += units.nbytes
        if self.held_bytes >= hold:
            self.release_held()

    def release_held(self) -> None:
        """Hand the gathered appends to the store's deferred writes (`OpenFiles.write_later`, one vectored
        write): whatever writes, syncs, reads or closes the last file does this first, so the file is written
        in order."""
        if self._held is not None:
            held, self._held, self.held_bytes = self._held, None, 0
            self._open.write_later(self._writing, held, self._held_at)

    def _write_held(self) -> None:
        """Write the gathered appends, and any other deferred write, now: before the file is read or cut."""
        self.release_held()
        self._open.flush_writes()

    # --- appending --------------------------------------------------------------------------------

    @property
    def _last_start(self) -> int:
        return self._files[-1]

    def _create_file(self, start: int, blanks: int = 0) -> None:
        """`getLastMappedFile` creating a file (the queue's directory too, for its first), created complete
        with its `blanks` pre-blank units (only ever a queue's first file has them)."""
        if not self._files and self._made is None:
            try:
                os.mkdir(self.directory)
            except FileExistsError:
                pass
            except FileNotFoundError:
                os.makedirs(self.directory, exist_ok=True)
        self._new_file(start, blanks)

    def put_units(self, queue_offset: np.ndarray, commit_log_offset: np.ndarray, msg_size: np.ndarray,
                  tags_code: np.ndarray) -> PutStats:
        """`putMessagePositionInfo` for units in CommitLog order, writing each run of consecutive
        queue offsets with one copy. Repeats are skipped, as the broker skips them."""
        ends = commit_log_offset.astype(np.int64) + msg_size
        return self.put_packed(queue_offset.astype(np.int64, copy=False), pack_units(commit_log_offset, msg_size,
                                                                                     tags_code), ends)

    def put_packed(self, qo: np.ndarray, units: np.ndarray, ends: np.ndarray, one_streak: bool = False, *,
                   later: bool = False, stats: PutStats | None = None, hold: int = 0) -> PutStats:
        """`put_units` with the units already laid out (CQ_UNIT_DTYPE) and each one's CommitLog end.

        Unit by unit this is the broker's put; runs of units it would treat alike are handled at once: a
        streak of consecutive queue offsets and growing ends is written with one copy, and units the
        broker would skip (ending at or below maxPhysicOffset, or behind the queue's end) are skipped
        together. `one_streak` says the units are one streak (`QueueUnits.streaks`), so the common case,
        a streak that continues the queue inside its last file, costs no array operation. With `later`, that
        streak is written at the store's next `OpenFiles.flush_writes` (`units` must not change until then);
        with `hold` as well, a streak smaller than `hold` bytes is gathered with the next ones until they come
        to `hold` bytes (`release_held`), so that each write is large; `units` must not change until then.
        The counts are added to `stats` when given (a batch's thousand puts share one), and returned."""
        if stats is None:
            stats = PutStats()
        n = len(qo)
        if one_streak and self._files and ends.item(0) > self.max_physic_offset and \
                qo.item(0) * CQ_UNIT_SIZE == self._last_start + self._write_pos and \
                n <= (self.file_size - self._write_pos) // CQ_UNIT_SIZE:
            # the one placement place_units gives a streak that continues the queue inside its last file
            if later:
                self._dirty = True
                if hold and (self._held is not None or n * CQ_UNIT_SIZE < hold):
                    self._gather(units, hold)
                else:
                    self._open.write_later(self._writing, units, self._write_pos)
            else:
                self._write(self._write_pos, units.tobytes())
            self._write_pos += n * CQ_UNIT_SIZE
            self.max_physic_offset = ends.item(-1)
            stats.written += n
            return stats
        cursor = QueueCursor(self._last_start if self._files else None, self.write_offset, self.max_physic_offset)
        for p in place_units(cursor, qo, ends, self.file_size, stats, one_streak):
            if p.created:
                if not self._files:
                    self.min_logic_offset = p.logical
                self._create_file(p.file_start, p.blanks)
            elif p.blanks:  # a gap in the queue's offsets, inside the file it has
                self._write(p.logical - p.file_start - p.blanks * CQ_UNIT_SIZE, BLANK_UNIT * p.blanks)
            if p.last > p.first:
                self._write(p.logical - p.file_start, units[p.first : p.last].tobytes())
                self.max_physic_offset = int(ends[p.last - 1])
            self._write_pos = p.logical - p.file_start + (p.last - p.first) * CQ_UNIT_SIZE
        return stats

    # --- reading ----------------------------------------------------------------------------------

    @property
    def max_offset(self) -> int:
        """Queue offset after the last unit (`getMaxOffsetInQueue`)."""
        return (self._last_start + self._write_pos) // CQ_UNIT_SIZE if self._files else 0

    @property
    def min_offset(self) -> int:
        return self.min_logic_offset // CQ_UNIT_SIZE

    def correct_min_offset(self, commit_log_min_offset: int, first_file: int = 0) -> None:
        """`correctMinOffset`: the first unit of the first file that points at or past the CommitLog's
        oldest offset; blank units (offset 0) before a queue's first real unit are passed over once the
        CommitLog no longer starts at 0. `first_file`: look in that file (by position) instead, as if the
        ones before it were deleted already (a query over files retention has not cleaned yet)."""
        if not self._files:
            return
        start = self._files[min(first_file, len(self._files) - 1)]
        units = _read_units(self._path(start))
        at = np.flatnonzero(units["commit_log_offset"] >= commit_log_min_offset)
        if len(at):
            self.min_logic_offset = start + int(at[0]) * CQ_UNIT_SIZE

    def read_units(self, queue_offset: int, max_count: int | None = None) -> list[ConsumeQueueUnit]:
        """Units from `queue_offset` to the end of the written data of the file holding it."""
        if not self.min_offset <= queue_offset < self.max_offset:
            return []
        self._write_held()
        logical = queue_offset * CQ_UNIT_SIZE
        start = logical - logical % self.file_size
        written_end = self._last_start + self._write_pos if start == self._last_start else start + self.file_size
        length = written_end - logical
        if max_count is not None:
            length = min(length, max_count * CQ_UNIT_SIZE)
        with open(self._path(start), "rb") as f:
            data = os.pread(f.fileno(), length, logical - start)
        return [ConsumeQueueUnit(*u) for u in CQ_UNIT.iter_unpack(data[: len(data) - len(data) % CQ_UNIT_SIZE])]

    # --- truncation, flush, close ----------------------------------------------------------------

    def drop_torn_tail(self, from_phy: int) -> int | None:
        """Remove the last unit when a kill may have torn it (`WRITE_PAGE_SIZE`): it straddles a page
        boundary, is no pre-blank unit, and points at or past `from_phy`, where the interrupted run began
        (its first bytes can look like a whole unit with a zero tags_code, which the replay would pass
        over as already built). The replay from `from_phy` or before writes it again. Returns its
        commit_log_offset when removed."""
        if not self._files or self._write_pos < CQ_UNIT_SIZE or not straddles_page(self._write_pos - CQ_UNIT_SIZE):
            return None
        self._write_held()
        with open(self._writing, "rb") as f:
            phy, size, _ = CQ_UNIT.unpack(os.pread(f.fileno(), CQ_UNIT_SIZE, self._write_pos - CQ_UNIT_SIZE))
        if size == BLANK_UNIT_MSG_SIZE or phy < from_phy:
            return None
        self.truncate_to(phy)
        return phy

    def truncate_to(self, phy_offset: int) -> None:
        """Remove every unit whose commit_log_offset >= phy_offset (`truncateDirtyLogicFiles`).

        Unlike the broker, removed units are zeroed and a file left empty is deleted, so the queue
        reads, byte for byte, as if they had never been written.
        """
        self._write_held()
        while self._files:
            start = self._last_start
            path = self._path(start)
            units = _read_units(path)
            keep = _valid_prefix(units, below_phy=phy_offset)
            if keep == 0:
                self._open.discard(path)
                os.unlink(path)
                self._files.pop()
                self._writing = self._path(self._files[-1]) if self._files else None
                self._dirty = False  # a file before the last was synced when the next was created
                self.max_physic_offset = -1
                continue
            written = np.flatnonzero(units[keep:].view(np.uint8).reshape(-1, CQ_UNIT_SIZE).any(axis=1))
            self._write_pos = keep * CQ_UNIT_SIZE
            if len(written):
                self._write(self._write_pos, bytes((int(written[-1]) + 1) * CQ_UNIT_SIZE))
            self.max_physic_offset = _last_real_unit_end(units[:keep])
            break
        if not self._files:
            self.min_logic_offset = 0
        elif self.max_physic_offset < 0:
            self.max_physic_offset = self._real_end_before(len(self._files) - 1)

    @property
    def file_count(self) -> int:
        return len(self._files)

    @property
    def file_starts(self) -> list[int]:
        """The start offsets of the queue's files, oldest first (a copy)."""
        return list(self._files)

    def file_path(self, start: int) -> str:
        return self._path(start)

    def forget_oldest(self, n: int) -> list[str]:
        """Stop using the `n` oldest files (never the newest, which units go to) and return their paths, for
        the caller to delete (retention: `indexcore.retention`); the min offset moves to the new first file
        until `correct_min_offset` refines it."""
        n = min(n, len(self._files) - 1)
        if n <= 0:
            return []
        paths = [self._path(start) for start in self._files[:n]]
        for path in paths:
            self._open.discard(path)
        del self._files[:n]
        self.min_logic_offset = max(self.min_logic_offset, self._files[0])
        return paths

    @property
    def write_offset(self) -> int:
        return self._last_start + self._write_pos if self._files else 0

    @property
    def writing_path(self) -> str | None:
        """The file new units go to: the only one that can hold unflushed units, since a file is
        flushed when the next one is opened."""
        return self._writing

    @property
    def dirty(self) -> bool:
        """Whether the last file holds writes not synced yet (the files before it never do)."""
        return self._dirty

    def mark_synced(self) -> None:
        """The caller synced `writing_path` itself (after the last write)."""
        self._dirty = False

    def flush(self) -> None:
        """Sync the last file if it was written since its last sync."""
        self.release_held()
        if self._dirty:
            self._open.sync(self._writing)
            self._dirty = False

    def close(self) -> None:
        self.flush()
        if self._writing is not None:
            self._open.discard(self._writing)


class ConsumeQueueStore:
    """Every ConsumeQueue under `{root}/consumequeue/`, created on first use."""

    def __init__(self, root: str, file_size: int = DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE, *,
                 readonly: bool = False, open_files_limit: int | None = None):
        self.root = os.path.join(root, CONSUME_QUEUE_DIR)
        self.file_size = file_size
        self.readonly = readonly
        self.open_files = OpenFiles(open_files_limit or open_queue_files_limit())
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self.touched: set[tuple[str, int]] = set()  # queues `dispatch` put units to, for the flusher to take
        # Appends to a queue smaller than this are gathered in memory until they reach it (0: none are), within
        # HELD_BYTES_BUDGET and HELD_BATCHES for the store: a rebuild of an LMQ store puts a few kilobytes per
        # batch into each of a thousand queues, and the kernel writes 160 MB to 1,064 files in 4.6 KiB pieces
        # in 0.20-0.28 s, in 16-64 KiB ones in 0.07-0.09 s (ext4 here). What is gathered is written before
        # any sync, read, or close.
        self.hold_bytes = 0
        self._holding: set[ConsumeQueue] = set()
        self._held_total = 0
        self._held_batches = 0
        self._by_id: dict[tuple[int, str], ConsumeQueue] = {}

    def load(self) -> None:
        """Open and recover every queue directory that exists (`DefaultMessageStore.loadConsumeQueue`)."""
        if not os.path.isdir(self.root):
            return
        for topic in sorted(os.listdir(self.root)):
            tdir = os.path.join(self.root, topic)
            if not os.path.isdir(tdir):
                raise StoreLayoutError(tdir, "not a topic directory")
            for qid in sorted(os.listdir(tdir)):
                if not qid.isdigit():
                    raise StoreLayoutError(os.path.join(tdir, qid), "queue directory name is not a queue id")
                self.queue(topic, int(qid))

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        key = (topic, queue_id)
        cq = self.queues.get(key)
        if cq is None:
            directory = self._queue_dir(topic, queue_id)
            cq = self.queues[key] = ConsumeQueue(directory, topic, queue_id, self.file_size, readonly=self.readonly,
                                                 open_files=self.open_files, new=self._made_topic_dir(topic))
        return cq

    def _queue_dir(self, topic: str, queue_id: int) -> str:
        directory = os.path.join(self.root, topic, str(queue_id))
        if os.path.dirname(os.path.dirname(os.path.abspath(directory))) != os.path.abspath(self.root):
            raise StoreLayoutError(directory, "topic would leave the consumequeue directory")
        return directory

    def new_queues(self, groups: Iterable[QueueUnits]) -> list[NewQueue]:
        """The queues of `groups` this store does not hold yet, each with the file its first unit creates. A
        caller may create their directories and files itself, many at once (each creation waits for the
        file system's journal), and hand them over with `made_queues`; `dispatch` creates any it did not."""
        out = []
        for g in groups:
            key = (g.topic, g.queue_id)
            if key not in self.queues:
                expect = int(g.queue_offset[0]) * CQ_UNIT_SIZE
                first_file = expect - expect % self.file_size
                out.append(NewQueue(key, self._queue_dir(*key), first_file, (expect - first_file) // CQ_UNIT_SIZE))
        return out

    def made_queues(self, made: Iterable[tuple[NewQueue, int]]) -> None:
        """Queues whose directory and first file (sparse, full size, its pre-blank units as the header:
        `create_file(allocate=False)`) the caller has just created, with a read-write descriptor of the file."""
        for q, fd in made:
            self.open_files.adopt(q.path, fd)
            self.queues[q.key] = ConsumeQueue(q.directory, q.key[0], q.key[1], self.file_size,
                                              open_files=self.open_files, new=True, made=q.first_file)

    def _made_topic_dir(self, topic: str) -> bool:
        """Create the topic's directory if it is missing (a writing store only): then its queue has no file
        to recover, which spares a directory listing per queue of a store with 100,000 LMQ queues."""
        if self.readonly:
            return False
        try:
            os.mkdir(os.path.join(self.root, topic))
        except FileExistsError:
            return False
        except FileNotFoundError:  # no consumequeue/ yet
            os.makedirs(os.path.join(self.root, topic), exist_ok=True)
        return True

    def dispatch(self, batch: DispatchBatch, units: Iterable[QueueUnits] | None = None) -> PutStats:
        """Put the units of the batch (`consume_queue_units`), queue by queue; the appends that continue a
        queue are made together at the end, in one call (`OpenFiles.write_later`)."""
        stats = PutStats()
        touched, queues, hold, holding = self.touched, self.queues, self.hold_bytes, self._holding
        try:
            for group in consume_queue_units(batch) if units is None else units:
                key = (group.topic, group.queue_id)
                cq = queues.get(key) or self.queue(*key)
                before = cq.held_bytes
                cq.put_packed(group.queue_offset, group.units, group.ends, group.one_streak, later=True, stats=stats,
                              hold=hold)
                if cq.held_bytes:
                    holding.add(cq)
                self._held_total += cq.held_bytes - before
                touched.add(key)
        finally:
            if self._holding:
                self._held_batches += 1
                if self._held_total > HELD_BYTES_BUDGET or self._held_batches >= HELD_BATCHES:
                    self.release_held()
            self.open_files.flush_writes()
        return stats

    def release_held(self) -> None:
        """Hand every queue's gathered appends to the deferred writes (`ConsumeQueue.release_held`)."""
        for cq in self._holding:
            cq.release_held()
        self._holding.clear()
        self._held_total = self._held_batches = 0

    def write_held(self) -> None:
        """Write every gathered append now: before the files are synced or read by anyone else."""
        self.release_held()
        self.open_files.flush_writes()

    def drop_torn_tails(self, from_phy: int) -> list[str]:
        """`ConsumeQueue.drop_torn_tail` for every queue; the files a unit was removed from."""
        dropped = []
        for cq in self.queues.values():
            path = cq.writing_path
            if cq.drop_torn_tail(from_phy) is not None:
                dropped.append(path)
        return dropped

    def max_physic_offset(self) -> int:
        """Max over all queues of the end of the last unit: where the broker restarts its reput."""
        return max((cq.max_physic_offset for cq in self.queues.values()), default=-1)

    def truncate_to(self, phy_offset: int) -> None:
        for cq in self.queues.values():
            if cq.max_physic_offset > phy_offset or cq.max_physic_offset == -1:
                cq.truncate_to(phy_offset)

    def __iter__(self) -> Iterator[ConsumeQueue]:
        return iter(self.queues.values())

    def flush(self, sync_paths: Callable[[list[str]], None] | None = None) -> None:
        """Sync every queue written since its last sync; `sync_paths`, when given, syncs the list of
        their files itself (in parallel, say: each sync of a file waits for a journal commit)."""
        self.write_held()
        dirty = [cq for cq in self.queues.values() if cq.dirty]
        if sync_paths is None:
            for cq in dirty:
                cq.flush()
            return
        sync_paths([cq.writing_path for cq in dirty])
        for cq in dirty:
            cq.mark_synced()

    def close(self) -> None:
        try:
            self.write_held()
        finally:
            for cq in self.queues.values():
                cq.close()
            self.open_files.close()
