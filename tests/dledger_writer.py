"""Appending messages to a DLedger CommitLog as DLedgerCommitLog + DLedger 0.2.3 lay them out, for tests.

Each message becomes one entry (48-byte header, then the message with PHYSICALOFFSET = entry pos + 48); an
entry that does not fit with 8 bytes to spare ends the file with the DLedger BLANK; the entry's index unit
is written when the index file is there; `commit()` writes the checkpoint (committedIndex/endIndex) the way
DLedger's flush thread does. Queue offsets continue those found in the log (CommitLogWriter's rules).
"""

from __future__ import annotations

import dataclasses
import os

from indexcore.commitlog import (
    MESSAGE_MAGIC_CODE,
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_NOT_TYPE,
    encode_properties,
    transaction_type,
)
from indexcore.dledger import (
    ENTRY_HEADER_SIZE,
    INDEX_DIR,
    INDEX_UNIT_SIZE,
    MIN_BLANK_LENGTH,
    EntryHeader,
    data_dir,
    encode_blank,
    encode_entry,
    encode_index_unit,
    home_dir,
    last_entry,
)
from indexcore.dledgerlog import DLedgerLog
from indexcore.dledgerwriter import write_checkpoint
from indexcore.msgid import create_offset_msg_id
from indexcore.reader import CommitLogReader, ReadStatus
from indexcore.writer import AppendResult, CommitLogWriter, Message


class DLedgerWriter(CommitLogWriter):
    """A CommitLogWriter whose records are DLedger entries of `dledger-<self_id>` under `root`."""

    def __init__(self, root: str, self_id: str, segment_size: int, *, term: int = 0, commit_on_close: bool = True,
                 **kw):
        self.root, self.self_id, self.term, self.commit_on_close = root, self_id, term, commit_on_close
        self.next_index = 0
        super().__init__(data_dir(root, self_id), segment_size, **kw)

    def _recover(self) -> None:
        log = DLedgerLog(self.root, self.self_id, self.segment_size, committed=False)
        if not log.segments:
            return
        reader = CommitLogReader(log)
        offset = log.min_offset
        while True:
            res = reader.read(offset)
            b = res.batch
            for i in b.consume_queue_mask().nonzero()[0].tolist():
                self.queue_offsets[(b.topic_of(i), int(b.queue_id[i]))] = int(b.queue_offset[i]) + 1
            offset = res.next_offset
            if res.status is not ReadStatus.OK:
                break
        reader.close()
        if res.status is ReadStatus.CORRUPT:
            raise res.error
        last = last_entry(log.segments, self.segment_size)
        self.next_index = last.index + 1 if last is not None else 0
        start = log.segment_start(offset)
        self._open(start)
        self._pos = offset - start

    def append(self, msg: Message) -> AppendResult:
        topic, queue_id, props = self._delayed(msg)
        record = self._new_record(msg, topic, queue_id, encode_properties(props), MESSAGE_MAGIC_CODE)
        sys_flag, queue_offset, store_ts = record.sys_flag, record.queue_offset, record.store_timestamp
        entry_size = ENTRY_HEADER_SIZE + record.total_size
        if self._file is None:
            self._open(0)
        if entry_size + MIN_BLANK_LENGTH > self.segment_size - self._pos:  # MmapFileList.preAppend
            self._file.write(self._pos, encode_blank(self.segment_size - self._pos))
            self._open(self._file_start + self.segment_size)
        pos = self._file_start + self._pos
        body = dataclasses.replace(record, physical_offset=pos + ENTRY_HEADER_SIZE).encode()
        self._file.write(self._pos, encode_entry(self.next_index, self.term, pos, body))
        index_file = os.path.join(home_dir(self.root, self.self_id), INDEX_DIR, f"{0:020d}")
        if os.path.exists(index_file):
            with open(index_file, "r+b") as f:
                os.pwrite(f.fileno(), encode_index_unit(EntryHeader(1, entry_size, self.next_index, self.term, pos,
                                                                    0, 0, 0, record.total_size)),
                          INDEX_UNIT_SIZE * self.next_index)
        self.next_index += 1
        self._pos += entry_size
        if transaction_type(sys_flag) in (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT_TYPE):
            self.queue_offsets[(topic, queue_id)] = queue_offset + 1
        return AppendResult(pos + ENTRY_HEADER_SIZE, record.total_size, queue_offset, store_ts,
                            create_offset_msg_id(self.store_host, pos + ENTRY_HEADER_SIZE), topic, queue_id)

    def commit(self, index: int | None = None) -> None:
        """The checkpoint DLedger persists: committedIndex (default: every entry written) and endIndex."""
        end = self.next_index - 1
        write_checkpoint(home_dir(self.root, self.self_id), end if index is None else index, end)

    def close(self) -> None:
        """Flush; with `commit_on_close`, commit every entry written (a one-node group commits at once)."""
        super().close()
        if self.commit_on_close and self.next_index:
            self.commit()


__all__ = ["DLedgerWriter"]
