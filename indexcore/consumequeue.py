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

A file is created complete (its pre-blank units written) or not at all (`mappedfile.create_file`).
Loading removes what a creation cut short by an older reputd left: a 0-byte newest file, or a queue's
only file allocated but left without its pre-blank units (all zeros: a first file always gets its
first unit or its blanks). Truncating removes a first file left with nothing but pre-blank units, as
a run that stopped there would not have made it yet.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from indexcore.dispatch import DispatchBatch
from indexcore.errors import StoreLayoutError
from indexcore.mappedfile import MappedFile, check_sizes, list_queue_files, offset_to_file_name, remove_temporaries

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
    at `file_start` (`created`: made for this put), after `blanks` pre-blank units written before them.
    first == last when the put only creates a file."""

    file_start: int
    created: bool
    blanks: int
    logical: int
    first: int
    last: int


class QueueUnits(NamedTuple):
    """The units one queue gets from a batch, in CommitLog order, with each unit's CommitLog end."""

    topic: str
    queue_id: int
    queue_offset: np.ndarray
    units: np.ndarray  # CQ_UNIT_DTYPE
    ends: np.ndarray


@dataclass(slots=True)
class PutStats:
    """What a put did: units written, units already present, units appended off their queue offset."""

    written: int = 0
    already_built: int = 0
    out_of_order: int = 0

    def add(self, other: PutStats) -> None:
        self.written += other.written
        self.already_built += other.already_built
        self.out_of_order += other.out_of_order


def _last_real_unit_end(units: np.ndarray) -> int:
    """offset + size of the last unit that is not a pre-blank unit, or -1: a blank (size 0x7FFFFFFF) says
    nothing about the CommitLog, and taken as a real unit it would mark 2 GiB of it as already built."""
    real = np.flatnonzero((units["commit_log_offset"] != 0) | (units["msg_size"] != BLANK_UNIT_MSG_SIZE)
                          | (units["tags_code"] != 0))
    if len(real) == 0:
        return -1
    last = units[real[-1]]
    return int(last["commit_log_offset"]) + int(last["msg_size"])


def _read_units(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        data = f.read()
    return np.frombuffer(data, dtype=CQ_UNIT_DTYPE, count=len(data) // CQ_UNIT_SIZE)


def _valid_prefix(units: np.ndarray, below_phy: int | None = None) -> int:
    """How many leading units are valid (offset >= 0 and size > 0, so blank units count), and, with
    `below_phy`, also point below that CommitLog offset."""
    stop = (units["commit_log_offset"] < 0) | (units["msg_size"] <= 0)
    if below_phy is not None:
        stop |= units["commit_log_offset"] >= below_phy
    first = np.flatnonzero(stop)
    return int(first[0]) if len(first) else len(units)


def pack_units(commit_log_offset: np.ndarray, msg_size: np.ndarray, tags_code: np.ndarray) -> np.ndarray:
    """Units as they lie in the file, big-endian, one per element."""
    units = np.empty(len(commit_log_offset), dtype=CQ_UNIT_DTYPE)
    units["commit_log_offset"] = commit_log_offset
    units["msg_size"] = msg_size
    units["tags_code"] = tags_code
    return units


def _group_by_queue(rows: np.ndarray, topic_id: np.ndarray, queue_id: np.ndarray, topics: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """`rows` reordered queue by queue, CommitLog order kept inside a queue, with each row's queue key.

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
    return rows[order], key[order]


def place_units(cursor: QueueCursor, qo: np.ndarray, ends: np.ndarray, file_size: int,
                stats: PutStats) -> Iterator[Placement]:
    """`putMessagePositionInfo` for units in CommitLog order, without touching a file: where each run of
    consecutive queue offsets goes, advancing `cursor`. The writer (`ConsumeQueue.put_packed`) and the
    verifier (`reputd verify`) both follow these placements. Repeats are skipped, as the broker skips them;
    a unit off its queue offset is appended at the write position, as the broker appends it."""
    n = len(qo)
    if n == 0:
        return
    breaks = np.flatnonzero(np.diff(qo) != 1) + 1
    i = 0
    while i < n:
        if ends[i] <= cursor.max_physic_offset:
            stats.already_built += 1
            i += 1
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
        if q != 0 and expect < current:
            stats.already_built += 1
            if created:
                yield Placement(cursor.file_start, True, blanks, current, i, i)
            i += 1
            continue
        k = np.searchsorted(breaks, i, side="right")
        # queue offset 0 skips the order check (§7.5); the units after it are each checked again
        streak_end = i + 1 if q == 0 else int(breaks[k]) if k < len(breaks) else n
        j = min(streak_end, i + (file_size - (current - cursor.file_start)) // CQ_UNIT_SIZE)
        if q != 0 and expect > current:
            stats.out_of_order += j - i
        yield Placement(cursor.file_start, created, blanks, current, i, j)
        cursor.write_offset += (j - i) * CQ_UNIT_SIZE
        cursor.max_physic_offset = int(ends[j - 1])
        stats.written += j - i
        i = j


def consume_queue_units(batch: DispatchBatch) -> Iterator[QueueUnits]:
    """`CommitLogDispatcherBuildConsumeQueue` for a batch: the units of every NOT_TYPE/COMMIT_TYPE record,
    queue by queue, packed as they lie in the file. What the writer writes and the verifier expects."""
    idx = np.flatnonzero(batch.consume_queue_mask())
    if len(idx) == 0:
        return
    idx, group = _group_by_queue(idx, batch.topic_id[idx], batch.queue_id[idx], len(batch.topics))
    phy, size = batch.phy_offset[idx], batch.msg_size[idx]
    units = pack_units(phy, size, batch.tags_code[idx])
    qo, ends = batch.queue_offset[idx], phy + size
    starts = np.flatnonzero(group[1:] != group[:-1]) + 1
    for lo, hi in zip([0, *starts.tolist()], [*starts.tolist(), len(idx)], strict=True):
        first = int(idx[lo])
        yield QueueUnits(batch.topic_of(first), int(batch.queue_id[first]), qo[lo:hi], units[lo:hi], ends[lo:hi])


class ConsumeQueue:
    """One topic/queue: loads and recovers its files, appends units, reads units, truncates."""

    def __init__(self, directory: str, topic: str, queue_id: int,
                 file_size: int = DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE, *, readonly: bool = False):
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
        self._last: MappedFile | None = None
        self._write_pos = 0  # in the last file
        self.removed: list[str] = []  # what loading removed: leftovers of creations cut short
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
                # units are appended in order and truncation zeroes what it removes: written bytes after
                # the first invalid unit are damage, and taking the queue as ending there would lose them
                raise StoreLayoutError(path, f"unit {start // CQ_UNIT_SIZE + n} is not a valid unit, and "
                                             "written units follow it")
            max_phy = _last_real_unit_end(units[:n])
            if max_phy >= 0:
                self.max_physic_offset = max_phy
            end = start + n * CQ_UNIT_SIZE
            if n * CQ_UNIT_SIZE < self.file_size:
                break
        self._truncate_files_after(end)
        self.min_logic_offset = self._files[0] if self._files else 0

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
        if self.readonly:
            while self._files and self._files[-1] > end:
                self._files.pop()
            if self._files:
                self._write_pos = end - self._files[-1]
            return
        while self._files and self._files[-1] > end:
            os.unlink(self._path(self._files.pop()))
        if self._files:
            self._open_last(self._files[-1])
            self._write_pos = end - self._files[-1]

    def _open_last(self, start: int, *, create: bool = False, blanks: int = 0) -> None:
        if self._last is not None:
            self._last.flush()
            self._last.close()
            self._last = None
        if create:
            self._last = MappedFile.create(self._path(start), self.file_size, BLANK_UNIT * blanks,
                                           label="consumequeue")
        else:
            self._last = MappedFile(self._path(start), self.file_size)

    # --- appending --------------------------------------------------------------------------------

    @property
    def _last_start(self) -> int:
        return self._files[-1]

    def _create_file(self, start: int, blanks: int = 0) -> None:
        """A new newest file, created complete with its `blanks` pre-blank units (a queue's first file)."""
        if not self._files:
            os.makedirs(self.directory, exist_ok=True)
        self._open_last(start, create=True, blanks=blanks)
        self._files.append(start)
        self._write_pos = blanks * CQ_UNIT_SIZE

    def put_units(self, queue_offset: np.ndarray, commit_log_offset: np.ndarray, msg_size: np.ndarray,
                  tags_code: np.ndarray) -> PutStats:
        """`putMessagePositionInfo` for units in CommitLog order, writing each run of consecutive
        queue offsets with one copy. Repeats are skipped, as the broker skips them."""
        ends = commit_log_offset.astype(np.int64) + msg_size
        return self.put_packed(queue_offset.astype(np.int64, copy=False), pack_units(commit_log_offset, msg_size,
                                                                                     tags_code), ends)

    def put_packed(self, qo: np.ndarray, units: np.ndarray, ends: np.ndarray) -> PutStats:
        """`put_units` with the units already laid out (CQ_UNIT_DTYPE) and each one's CommitLog end."""
        stats = PutStats()
        cursor = QueueCursor(self._last_start if self._files else None,
                             self._last_start + self._write_pos if self._files else 0, self.max_physic_offset)
        for p in place_units(cursor, qo, ends, self.file_size, stats):
            if p.created:
                if not self._files:
                    self.min_logic_offset = p.logical
                self._create_file(p.file_start, p.blanks)  # blanks are only ever the first file's
            if p.last > p.first:
                self._last.write(p.logical - p.file_start, units[p.first : p.last].tobytes())
            self._write_pos = p.logical - p.file_start + (p.last - p.first) * CQ_UNIT_SIZE
            self.max_physic_offset = int(ends[p.last - 1]) if p.last > p.first else self.max_physic_offset
        return stats

    # --- reading ----------------------------------------------------------------------------------

    @property
    def max_offset(self) -> int:
        """Queue offset after the last unit (`getMaxOffsetInQueue`)."""
        return (self._last_start + self._write_pos) // CQ_UNIT_SIZE if self._files else 0

    @property
    def min_offset(self) -> int:
        return self.min_logic_offset // CQ_UNIT_SIZE

    def correct_min_offset(self, commit_log_min_offset: int) -> None:
        """`correctMinOffset`: the first unit of the first file that points at or past the CommitLog's
        oldest offset; blank units (offset 0) before a queue's first real unit are passed over once the
        CommitLog no longer starts at 0."""
        if not self._files:
            return
        start = self._files[0]
        units = _read_units(self._path(start))
        at = np.flatnonzero(units["commit_log_offset"] >= commit_log_min_offset)
        if len(at):
            self.min_logic_offset = start + int(at[0]) * CQ_UNIT_SIZE

    def read_units(self, queue_offset: int, max_count: int | None = None) -> list[ConsumeQueueUnit]:
        """Units from `queue_offset` to the end of the written data of the file holding it."""
        if not self.min_offset <= queue_offset < self.max_offset:
            return []
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

    def truncate_to(self, phy_offset: int) -> None:
        """Remove every unit whose commit_log_offset >= phy_offset (`truncateDirtyLogicFiles`).

        Unlike the broker, removed units are zeroed and a file left empty is deleted, so the queue
        reads, byte for byte, as if they had never been written.
        """
        while self._files:
            start = self._last_start
            units = _read_units(self._path(start))
            keep = _valid_prefix(units, below_phy=phy_offset)
            if keep == 0:
                if self._last is not None:
                    self._last.close()
                    self._last = None
                os.unlink(self._path(self._files.pop()))
                self.max_physic_offset = -1
                continue
            self._open_last(start)
            self._write_pos = keep * CQ_UNIT_SIZE
            self._last.write(self._write_pos, bytes(self.file_size - self._write_pos))
            self.max_physic_offset = _last_real_unit_end(units[:keep])
            break
        if not self._files:
            self.min_logic_offset = 0

    @property
    def file_count(self) -> int:
        return len(self._files)

    @property
    def write_offset(self) -> int:
        return self._last_start + self._write_pos if self._files else 0

    @property
    def writing_path(self) -> str | None:
        """The file new units go to: the only one that can hold unflushed units, since a file is
        flushed when the next one is opened."""
        return self._path(self._last_start) if self._files else None

    def release(self) -> None:
        """Unmap the pages of the writing file from this process (`MappedFile.release`)."""
        if self._last is not None:
            self._last.release()

    def flush(self) -> None:
        if self._last is not None:
            self._last.flush()

    def close(self) -> None:
        if self._last is not None:
            self._last.flush()
            self._last.close()
            self._last = None


class ConsumeQueueStore:
    """Every ConsumeQueue under `{root}/consumequeue/`, created on first use."""

    def __init__(self, root: str, file_size: int = DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE, *,
                 readonly: bool = False):
        self.root = os.path.join(root, CONSUME_QUEUE_DIR)
        self.file_size = file_size
        self.readonly = readonly
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
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
            directory = os.path.join(self.root, topic, str(queue_id))
            if os.path.dirname(os.path.dirname(os.path.abspath(directory))) != os.path.abspath(self.root):
                raise StoreLayoutError(directory, "topic would leave the consumequeue directory")
            cq = self.queues[key] = ConsumeQueue(directory, topic, queue_id, self.file_size, readonly=self.readonly)
        return cq

    def dispatch(self, batch: DispatchBatch) -> PutStats:
        """Write the units of every NOT_TYPE/COMMIT_TYPE record of the batch, queue by queue."""
        stats = PutStats()
        for group in consume_queue_units(batch):
            cq = self.queue(group.topic, group.queue_id)
            stats.add(cq.put_packed(group.queue_offset, group.units, group.ends))
        return stats

    def max_physic_offset(self) -> int:
        """Max over all queues of the end of the last unit: where the broker restarts its reput."""
        return max((cq.max_physic_offset for cq in self.queues.values()), default=-1)

    def truncate_to(self, phy_offset: int) -> None:
        for cq in self.queues.values():
            if cq.max_physic_offset > phy_offset or cq.max_physic_offset == -1:
                cq.truncate_to(phy_offset)

    def __iter__(self) -> Iterator[ConsumeQueue]:
        return iter(self.queues.values())

    def flush(self) -> None:
        for cq in self.queues.values():
            cq.flush()

    def close(self) -> None:
        for cq in self.queues.values():
            cq.close()
