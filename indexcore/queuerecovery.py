"""How a ConsumeQueue's files are put back to a consistent state (indexcore/queuefiles.py holds the queue):
recovery at load as the broker's `ConsumeQueue.recover` does it, removing what a creation cut short,
dropping a torn last unit, truncating to a CommitLog offset, correcting the minimum offset, and forgetting
the oldest files once retention removed them."""

from __future__ import annotations

import os

import numpy as np

from indexcore.consumequeue import (
    BLANK_UNIT_MSG_SIZE,
    CQ_UNIT,
    CQ_UNIT_SIZE,
    RECOVER_FROM_LAST_FILES,
    _last_real_unit_end,
    _read_units,
    _valid_prefix,
    straddles_page,
    torn_unit_at,
)
from indexcore.errors import CorruptEntryError
from indexcore.mappedfile import check_sizes, list_queue_files, remove_temporaries


class QueueRecovery:
    """The recovery half of `ConsumeQueue`: it works on the queue's files (`_files`, `_open`) and its write position."""

    __slots__ = ()

    def _recover(self) -> None:
        """`ConsumeQueue.recover`: scan from the third-newest file to the first invalid unit, after
        removing (or, read-only, passing over) what a creation cut short left."""
        self.removed = [] if self.readonly else remove_temporaries(self.directory)
        self.torn = []
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
        self._files_changed()
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
        self._files_changed()
        if self._files:
            self._write_pos = end - self._files[-1]
        self._writing = self._path(self._files[-1]) if self._files else None

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
                self._files_changed()
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
