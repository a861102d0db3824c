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

Units are appended with `pwrite` through a bounded set of descriptors (`openfiles.OpenFiles`), not a
mapping per queue: an LMQ broker has tens of thousands of queues, more than a process may map
(vm.max_map_count) or keep open, and a write into a fresh mapped page costs a page fault that a
`pwrite` does not. Files are created sparse, as the broker's are (100,000 queues of 6,000,000-byte
files take a few hundred megabytes, not 600 GB); no room is then an OSError from the write, naming
the file, never a SIGBUS.

A file is created in place, as the broker creates its own (`mappedfile.create_in_place`: opened O_EXCL,
sized sparse, a queue's first file with its pre-blank units as the header), with no rename and no sync:
loading removes what a creation cut short left, a 0-byte newest file or a queue's only file left without
its pre-blank units (all zeros: a first file always gets its first unit or its blanks), and a first file
left with a part of its pre-blank units ends where they end, the next put laying down the rest as the
blanks of a gap. Truncating removes a first file left with nothing but pre-blank units, as a run that
stopped there would not have made it yet.
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

CQ_UNIT = struct.Struct(">qiq")
CQ_UNIT_SIZE = CQ_UNIT.size
# a numpy dtype spec, made into a dtype where it is used, so that importing the format needs no numpy
CQ_UNIT_DTYPE = [("commit_log_offset", ">i8"), ("msg_size", ">i4"), ("tags_code", ">i8")]
BLANK_UNIT_MSG_SIZE = 0x7FFFFFFF
BLANK_UNIT = CQ_UNIT.pack(0, BLANK_UNIT_MSG_SIZE, 0)
DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE = 300_000 * CQ_UNIT_SIZE
RECOVER_FROM_LAST_FILES = 3  # ConsumeQueue.recover starts at the third-newest file
CONSUME_QUEUE_DIR = "consumequeue"
PRIVATE_OPEN_FILES = 2  # a queue on its own: its writing file, and the one before it while rolling
CREATE_LABEL = "consumequeue"  # names the steps of a file's creation (`mappedfile.create_in_place`'s fail points)
# The kernel copies a write into the page cache page by page, and a SIGKILL can stop it between two pages:
# a unit that straddles a page boundary is the one a kill can leave torn, its first bytes written and the
# rest not (`torn_unit_at`, `ConsumeQueue.drop_torn_tail`).
WRITE_PAGE_SIZE = mmap.PAGESIZE


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


@dataclass(slots=True)
class PutStats:
    """What a put did: units written, units already present, and the blank units written for units whose
    records the output never got (`place_units`): in gaps of a queue's offsets, and the pre-blank units before
    the first unit of a queue whose first file starts below it (`blanks` counts both, as the files hold them)."""

    written: int = 0
    already_built: int = 0
    gap_blanks: int = 0
    pre_blanks: int = 0

    def add(self, other: PutStats) -> None:
        self.written += other.written
        self.already_built += other.already_built
        self.gap_blanks += other.gap_blanks
        self.pre_blanks += other.pre_blanks

    @property
    def blanks(self) -> int:
        return self.gap_blanks + self.pre_blanks


def _last_real_unit_end(units: np.ndarray) -> int:
    """offset + size of the last unit that is not a pre-blank unit, or -1: a blank (size 0x7FFFFFFF) says
    nothing about the CommitLog, and taken as a real unit it would mark 2 GiB of it as already built."""
    real = np.flatnonzero((units["commit_log_offset"] != 0) | (units["msg_size"] != BLANK_UNIT_MSG_SIZE)
                          | (units["tags_code"] != 0))
    if len(real) == 0:
        return -1
    last = units[real[-1]]
    return int(last["commit_log_offset"]) + int(last["msg_size"])


def _unit_at(fd: int, i: int) -> tuple[int, int, int]:
    return CQ_UNIT.unpack(os.pread(fd, CQ_UNIT_SIZE, i * CQ_UNIT_SIZE))


def _written_units(fd: int) -> int:
    def invalid(i: int) -> bool:
        phy, msg_size, _ = _unit_at(fd, i)
        return phy < 0 or msg_size <= 0

    return bisect.bisect_left(range(os.fstat(fd).st_size // CQ_UNIT_SIZE), True, key=invalid)


def written_units(path: str) -> int:
    """How many units a ConsumeQueue file holds from its start: its write position as the broker's recovery
    finds it (the first invalid unit ends them), by bisection over a few reads."""
    with open(path, "rb") as f:
        return _written_units(f.fileno())


def last_written_unit(path: str) -> tuple[int, int] | None:
    """(commit_log_offset, msg_size) of a ConsumeQueue file's last unit (`written_units`); None when it holds
    no unit or ends in a pre-blank unit, which says nothing about the CommitLog."""
    with open(path, "rb") as f:
        n = _written_units(f.fileno())
        if n == 0:
            return None
        phy, msg_size, _ = _unit_at(f.fileno(), n - 1)
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


def _streak_breaks(queue_offset: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Where a streak ends: the queue offsets stop being consecutive, or the ends stop growing (a name
    repeated in one record: its second unit is not past maxPhysicOffset)."""
    return np.flatnonzero((np.diff(queue_offset) != 1) | (np.diff(ends) <= 0)) + 1


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
                stats.pre_blanks += blanks
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
