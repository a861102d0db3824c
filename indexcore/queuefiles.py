"""`ConsumeQueue`: one queue's files under `consumequeue/{topic}/{queueId}/` (the layout and the unit are
indexcore/consumequeue.py): recover them as the broker does, put units, read them, truncate, flush."""

from __future__ import annotations

import os

import numpy as np

from indexcore.consumequeue import (
    BLANK_UNIT,
    BLANK_UNIT_MSG_SIZE,
    CQ_UNIT,
    CQ_UNIT_SIZE,
    CREATE_LABEL,
    DEFAULT_MAPPED_FILE_SIZE_CONSUME_QUEUE,
    PRIVATE_OPEN_FILES,
    RECOVER_FROM_LAST_FILES,
    ConsumeQueueUnit,
    PutStats,
    QueueCursor,
    _last_real_unit_end,
    _read_units,
    _valid_prefix,
    pack_units,
    place_units,
    straddles_page,
    torn_unit_at,
)
from indexcore.errors import CorruptEntryError
from indexcore.mappedfile import OpenFiles, check_sizes, list_queue_files, offset_to_file_name, remove_temporaries


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
