"""`ConsumeQueue`: one queue's files under `consumequeue/{topic}/{queueId}/` (the layout and the unit are
indexcore/consumequeue.py): recover them as the broker does, put units, read them, truncate, flush."""

from __future__ import annotations

import os

import numpy as np

from indexcore.consumequeue import (
    BLANK_UNIT,
    CQ_UNIT,
    CQ_UNIT_SIZE,
    CREATE_LABEL,
    DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE,
    PRIVATE_OPEN_FILES,
    ConsumeQueueUnit,
    PutStats,
    QueueCursor,
    pack_units,
    place_units,
)
from indexcore.mappedfile import offset_to_file_name
from indexcore.openfiles import OpenFiles
from indexcore.queuerecovery import QueueRecovery
from indexcore.queuetable import QueueRow, QueueTable

NOTHING: list[str] = []  # shared, never appended to: `removed` and `torn` of a queue whose load found nothing


class ConsumeQueue(QueueRecovery, QueueRow):
    """One topic/queue: loads and recovers its files, appends units, reads units, truncates.

    Where it writes next lives in a row of a `QueueTable` (`indexcore.queuetable`): its store's, shared by
    all its queues so that a batch's appends to thousands of them are placed at once, or one of its own."""

    # a store holds one per queue (100,000 of them with LMQ): slots, and no container made until it is needed
    __slots__ = ("_files", "_open", "_slot", "_table", "_writing", "directory", "file_size", "min_logic_offset",
                 "queue_id", "readonly", "removed", "topic", "torn")

    def __init__(self, directory: str, topic: str, queue_id: int,
                 file_size: int = DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE, *, readonly: bool = False,
                 open_files: OpenFiles | None = None, new: bool = False, table: QueueTable | None = None):
        if file_size <= 0 or file_size % CQ_UNIT_SIZE:
            raise ValueError(f"ConsumeQueue file size {file_size} is not a positive multiple of {CQ_UNIT_SIZE}")
        self.directory = directory
        self.topic = topic
        self.queue_id = queue_id
        self.file_size = file_size
        self.readonly = readonly
        self.min_logic_offset = 0
        self._table = table if table is not None else QueueTable()
        self._slot = self._table.add(self)  # max_physic_offset, the write position, dirty, gathered appends
        self._files: list[int] = []  # start offsets, ascending (the last one's in the table too)
        self._open = open_files if open_files is not None else OpenFiles(PRIVATE_OPEN_FILES)
        self._writing: str | None = None  # the last file's path
        self.removed: list[str] = NOTHING  # what loading removed: leftovers of creations cut short
        self.torn: list[str] = NOTHING  # files where loading zeroed a unit a kill left half written
        if not new:  # `new`: the caller knows the directory holds no file (it just made it)
            self._recover()

    @classmethod
    def made(cls, directory: str, topic: str, queue_id: int, file_size: int, open_files: OpenFiles, first_file: int,
             blanks: int, table: QueueTable | None = None, path: str | None = None) -> ConsumeQueue:
        """A new queue whose first file (`path`) the caller has just created (sparse, full size, its `blanks`
        pre-blank units written: `ConsumeQueueStore._create`); its first unit goes after them."""
        cq = cls(directory, topic, queue_id, file_size, open_files=open_files, new=True, table=table)
        cq._files.append(first_file)
        cq._writing = path or cq._path(first_file)
        t, slot = cq._table, cq._slot
        t.last_start[slot] = first_file
        t.write_pos[slot] = blanks * CQ_UNIT_SIZE
        cq.min_logic_offset = first_file + blanks * CQ_UNIT_SIZE
        return cq

    # --- the queue's row of its table (the rest: `QueueRow`) ---------------------------------------

    def _files_changed(self) -> None:
        """Tell the table where the last file starts, after `_files` changed at its end."""
        self._table.last_start[self._slot] = self._files[-1] if self._files else -1

    # --- load and recovery ----------------------------------------------------------------------

    def _path(self, start: int) -> str:
        return os.path.join(self.directory, offset_to_file_name(start))

    def _new_file(self, start: int, blanks: int) -> None:
        """Create the next file, with its `blanks` pre-blank units, and make it the one units go to. The one
        before is synced first: a file is flushed when the next one is opened, so only the last can hold
        unflushed units."""
        self.flush()
        if self._writing is not None:
            self._open.discard(self._writing)
        path = self._path(start)
        self._open.fd(path, create_size=self.file_size, header=BLANK_UNIT * blanks, label=CREATE_LABEL)
        self._files.append(start)
        self._files_changed()
        self._writing = path
        self._write_pos = blanks * CQ_UNIT_SIZE

    def _write(self, position: int, data: bytes) -> None:
        """Write into the last file at `position`."""
        self.release_held()
        self._dirty = True
        self._open.write(self._writing, data, position)

    def write_later(self, data, position: int) -> None:
        """Write `data` (a buffer or a list of them, back to back) at `position` in the last file at the next
        `OpenFiles.flush_writes` (`QueueTable.release` hands the gathered appends over through this)."""
        self._open.write_later(self._writing, data, position)

    def _gather(self, units: np.ndarray, hold: int) -> None:
        """Add `units`, which go at the write position, to the gathered appends (the arrays themselves, not
        copies: copying costs a fresh page per 4 KiB), and let them go once they are `hold` bytes."""
        slot = np.array([self._slot])
        self._table.gather(units, slot, np.zeros(1, np.int64), np.array([len(units)]), np.array([self._write_pos]))
        if self.held_bytes >= hold:
            self.release_held()

    def release_held(self) -> None:
        """Hand the gathered appends to the deferred writes (`OpenFiles.write_later`, one vectored write per
        queue): whatever writes, syncs, reads or closes the last file does this first, so the file is written in
        order. In a store, every queue's gathered appends go."""
        if self._table.held.item(self._slot):
            self._table.release()

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
        if not self._files:
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
                if hold and (self.held_bytes or n * CQ_UNIT_SIZE < hold):
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

    @property
    def file_count(self) -> int:
        return len(self._files)

    @property
    def file_starts(self) -> list[int]:
        """The start offsets of the queue's files, oldest first (a copy)."""
        return list(self._files)

    def file_path(self, start: int) -> str:
        return self._path(start)

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
