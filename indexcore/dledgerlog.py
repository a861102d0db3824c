"""A DLedger data directory read as the CommitLog record stream, as DLedgerCommitLog hands it to the reput.

`DLedgerLog` is a `reader.CommitLog` whose segments are DLedger data files (dledger.py), decoded by the same
C kernel with `DLEDGER_ENTRIES`: reput offsets are entry positions, every record's store offset is entry pos
+ 48, a DLedger BLANK rolls to the next file. A store switched from the plain CommitLog keeps its old
`commitlog/` below `dividedCommitlogOffset` (the first DLedger data file's start): those segments are read
as plain records, rolled at their CommitLog BLANK, and the DLedger entries follow (DLedgerCommitLog.recover
and checkMessageAndReturnSize). A reader stops at `read_limit`, the committed position: the broker
dispatches only committed entries (getMaxOffset = committedPos).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Sequence

from indexcore.commitlog import DEFAULT_MAX_MESSAGE_SIZE, MessageRecord
from indexcore.dledger import (
    CHECKPOINT_BAK_SUFFIX,
    CHECKPOINT_FILE,
    DLEDGER_ENTRIES,
    ENTRY_HEADER_SIZE,
    CommittedPosition,
    CorruptEntryHeaderError,
    committed_position,
    data_dir,
    decode_entry_header,
    home_dir,
    is_blank,
)
from indexcore.errors import CorruptRecordError, StoreLayoutError
from indexcore.mappedfile import list_queue_files, offset_to_file_name
from indexcore.reader import CommitLog, ReadResult, ReadStatus


class DLedgerLog(CommitLog):
    """The DLedger data files of `dledger-<self_id>` under `store_path_root_dir`, after the plain CommitLog
    segments of `commit_log_dirs` when the store was switched to DLedger (a mixed store).

    `committed=True` stops readers at the committed position read from DLedger's checkpoint at every
    `refresh()`; `committed=False` reads every entry written (for `inspect`)."""

    def __init__(self, store_path_root_dir: str, self_id: str, segment_size: int, *,
                 commit_log_dirs: Sequence[str] = (), follow: bool = False, committed: bool = True):
        self.root = store_path_root_dir
        self.self_id = self_id
        self.data_dir = data_dir(store_path_root_dir, self_id)
        self.home = home_dir(store_path_root_dir, self_id)
        self.old_dirs = tuple(d for d in commit_log_dirs if os.path.isdir(d))
        self.use_committed = committed
        self.committed: CommittedPosition | None = None
        self.divided_offset = -1
        self.read_limit = None
        self._stamp: tuple = ()
        self._old_end = 0
        self._has_dledger = False
        super().__init__((*self.old_dirs, self.data_dir), segment_size, follow=follow)

    def refresh(self) -> list[tuple[int, str]]:
        if not os.path.isdir(self.data_dir):
            raise StoreLayoutError(self.data_dir, "DLedger data directory does not exist or is not a directory")
        dledger = sorted(list_queue_files(self.data_dir))
        old = sorted(f for d in self.old_dirs for f in list_queue_files(d))
        # dividedCommitlogOffset: the first DLedger file's start, or, before any, the end of the old CommitLog
        if dledger:
            divided = dledger[0][0]
        elif old:
            divided = old[-1][0] + self.segment_size
        else:
            divided = 0
        for start, path in old:
            if start >= divided:
                raise StoreLayoutError(path, f"a plain CommitLog segment at or above the first DLedger data file "
                                             f"({divided}): the old commitlog/ must end where DLedger starts")
        self.divided_offset = divided
        self._old_end = old[-1][0] + self.segment_size if old else 0
        self._has_dledger = bool(dledger)
        # the files' sizes first: the committed position is found at offsets computed with the segment size,
        # so files of another size (mappedFileSizeCommitLog not the broker's) must be refused before it
        segments = super().refresh()
        if self.use_committed:
            self._update_committed()
        return segments

    def _checkpoint_stamp(self) -> tuple:
        """What changes when DLedger rewrites its checkpoint (it renames a new file in)."""
        out = []
        for name in (CHECKPOINT_FILE, CHECKPOINT_FILE + CHECKPOINT_BAK_SUFFIX):
            try:
                st = os.stat(os.path.join(self.home, name))
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def _update_committed(self) -> None:
        self._stamp = self._checkpoint_stamp()
        self.committed = committed_position(self.root, self.self_id, self.segment_size, self.committed)
        self.read_limit = max(self.committed.position, self.divided_offset) if self._has_dledger else self._old_end

    def decode_flags(self, offset: int) -> int:
        return DLEDGER_ENTRIES if offset >= self.divided_offset else 0

    def at_end(self, result: ReadResult) -> ReadResult:
        """The data ends before the committed position: committed entries are missing (a data file cut short
        or zeroed), which the broker could not have dispatched either."""
        limit = self.read_limit
        if limit is not None and result.next_offset >= limit and self._checkpoint_stamp() != self._stamp:
            self._update_committed()  # DLedger committed more since: read on (a data file may be new too)
            if self.read_limit > result.next_offset:
                super().refresh()
                return dataclasses.replace(result, status=ReadStatus.OK)
            return result
        if limit is None or result.next_offset >= limit or result.pending is not None or result.error is not None:
            return result
        at = result.next_offset
        path = self.find_segment(at) or os.path.join(self.data_dir, offset_to_file_name(self.segment_start(at)))
        c = self.committed
        err = CorruptEntryHeaderError(
            "entry.magic", f"no entry here, but the committed position is {limit} (committedIndex "
                           f"{c.committed_index if c else '?'} in {c.source if c else '?'})", path=path, offset=at)
        return dataclasses.replace(result, status=ReadStatus.CORRUPT, error=err)

    def record_around(self, offset: int) -> tuple[int, int]:
        if offset < self.divided_offset:
            return super().record_around(offset)
        path = self.find_segment(offset)
        if path is None:
            return offset, offset
        seg = self.segment_start(offset)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return self._entry_around(data, path, seg, offset)

    def _entry_around(self, data, path: str, seg: int, offset: int) -> tuple[int, int]:
        pos = 0
        while pos + 8 <= len(data) and seg + pos <= offset:
            if is_blank(data, pos):
                return (offset, offset) if seg + pos == offset else (seg + pos, seg + self.segment_size)
            try:
                h = decode_entry_header(data, pos, seg + pos, path=path)
            except CorruptRecordError:
                return offset, offset
            if seg + pos == offset or seg + pos + ENTRY_HEADER_SIZE == offset:
                return offset, offset
            if seg + pos + h.size > offset:
                return seg + pos, seg + pos + h.size
            pos += h.size
        return offset, offset

    def dir_label(self, offset: int) -> str:
        """The directory of the file holding `offset`, relative to the store root: `dledger-<id>/data`, or
        `commitlog` below dividedCommitlogOffset (a mixed store)."""
        if offset < self.divided_offset:
            return "commitlog"
        return os.path.relpath(self.data_dir, self.root)

    def entry_start(self, offset: int) -> int:
        """`offset` when an entry (or anything but a message) starts there; the entry's position when `offset` is
        the store offset of its message (pos + 48): the reput offset of that message."""
        if offset < self.divided_offset or offset - ENTRY_HEADER_SIZE < self.divided_offset:
            return offset
        entry = offset - ENTRY_HEADER_SIZE
        path = self.find_segment(entry)
        if path is None or self.segment_start(entry) != self.segment_start(offset):
            return offset
        at = entry - self.segment_start(entry)
        with open(path, "rb") as f:
            head = os.pread(f.fileno(), ENTRY_HEADER_SIZE, at)
        try:
            decode_entry_header(head, 0, entry, path=path, bytes_left=self.segment_size - at)
        except CorruptRecordError:
            return offset
        return entry

    def read_record(self, offset: int, *, check_crc: bool = True,
                    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> MessageRecord:
        """The message at store offset `offset` (entry pos + 48 above dividedCommitlogOffset), its entry header
        checked first."""
        if offset < self.divided_offset:
            return super().read_record(offset, check_crc=check_crc, max_message_size=max_message_size)
        entry = offset - ENTRY_HEADER_SIZE
        path = self.find_segment(entry)
        if path is None or self.segment_start(entry) != self.segment_start(offset):
            raise StoreLayoutError(offset_to_file_name(self.segment_start(offset)),
                                   f"no DLedger data file holds an entry for offset {offset}")
        pos = entry - self.segment_start(entry)
        with open(path, "rb") as f:
            head = os.pread(f.fileno(), ENTRY_HEADER_SIZE, pos)
            h = decode_entry_header(head, 0, entry, path=path, bytes_left=self.segment_size - pos)
            data = os.pread(f.fileno(), h.body_length, pos + ENTRY_HEADER_SIZE)
        try:
            rec = MessageRecord.decode(data, 0, check_crc=check_crc, max_message_size=max_message_size)
        except CorruptRecordError as e:
            raise e.located(path, offset) from None
        if rec.total_size != h.body_length:
            raise CorruptEntryHeaderError("entry.body_length", f"the message's TOTALSIZE {rec.total_size} is not "
                                          f"the entry's bodyLen {h.body_length}", path=path, offset=entry)
        if rec.physical_offset != offset:
            raise CorruptRecordError("physical_offset", f"record says {rec.physical_offset}", path=path, offset=offset)
        return rec


__all__ = ["DLedgerLog"]
