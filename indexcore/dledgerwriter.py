"""Appending DLedger entries exactly as DLedger 0.2.3's `DLedgerMmapFileStore.appendAsLeader` lays them out.

Used by tests (a new leader's entries after a truncation) and `make bench` (a DLedger CommitLog holding the same
messages as a plain one). Each entry is the 48-byte header (magic 1, size, index, term, pos, channel 0, chain CRC 0,
body CRC 0, body length) then one CommitLog message whose PHYSICALOFFSET is the entry's pos + 48, as
DLedgerCommitLog's append hook sets it (store/dledger/DLedgerCommitLog.java:100-104). An entry that does not fit
with the 8 bytes of a BLANK (`entrySize + 8 > bytes left`, MmapFileList.java:193-227) moves to the next file and
the rest of the current one becomes a DLedger BLANK: `int -1, int bytes left`. Each entry also gets its 32-byte
unit at `32 x index` in the index file (`magic, pos, size, index, term`, DLedgerEntryCoder.encodeIndex), which
is kept at DLedger's fixed 167,772,160 bytes (created sparse). `truncate_to` is what a follower's
`DLedgerMmapFileStore.truncate` leaves: the data and index cut after an entry, a new entry written there next.
"""

from __future__ import annotations

import os

from indexcore.commitlog import BLANK_MAGIC_CODE, PHYSICAL_OFFSET, PHYSICAL_OFFSET_OFFSET, RECORD_PREFIX
from indexcore.dledger import (
    ENTRY_HEADER_SIZE,
    ENTRY_MAGIC,
    INDEX_FILE_SIZE,
    INDEX_UNIT,
    INDEX_UNIT_SIZE,
    MIN_BLANK_LENGTH,
    encode_blank,
)
from indexcore.dledger import encode_entry as encode_dledger_entry
from indexcore.mappedfile import offset_to_file_name


def encode_entry(record: bytes, *, index: int, term: int, pos: int) -> bytes:
    """One entry at `pos`: the header and `record` with its PHYSICALOFFSET set to pos + 48."""
    body = bytearray(record)
    PHYSICAL_OFFSET.pack_into(body, PHYSICAL_OFFSET_OFFSET, pos + ENTRY_HEADER_SIZE)
    return encode_dledger_entry(index, term, pos, bytes(body))


class DLedgerLogWriter:
    """Appends entries to `<dledger-id>/data` (files of `file_size` bytes named by start offset) and their units to
    `<dledger-id>/index`. `first_offset` is where a new log starts: 0, or the dividedCommitlogOffset of a store
    upgraded from the plain CommitLog."""

    def __init__(self, root: str, file_size: int, *, first_offset: int = 0):
        self.data_dir = os.path.join(root, "data")
        self.index_dir = os.path.join(root, "index")
        self.file_size = file_size
        self.first_offset = first_offset
        self.pos = first_offset  # where the next entry goes (before a roll)
        self.next_index = 0
        os.makedirs(self.data_dir, exist_ok=True)
        os.makedirs(self.index_dir, exist_ok=True)
        self._index_path = os.path.join(self.index_dir, offset_to_file_name(0))
        if not os.path.exists(self._index_path):
            with open(self._index_path, "wb") as f:
                f.truncate(INDEX_FILE_SIZE)

    def _data_file(self, start: int) -> str:
        path = os.path.join(self.data_dir, offset_to_file_name(start))
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.truncate(self.file_size)
        return path

    def append(self, record: bytes, term: int) -> tuple[int, int]:
        """Append one CommitLog message as the next entry of `term`; returns (index, pos)."""
        size = ENTRY_HEADER_SIZE + len(record)
        if size + MIN_BLANK_LENGTH > self.file_size:
            raise ValueError(f"an entry of {size} bytes does not fit a {self.file_size}-byte data file")
        start = self.pos - (self.pos - self.first_offset) % self.file_size
        left = start + self.file_size - self.pos
        if size + MIN_BLANK_LENGTH > left:
            with open(self._data_file(start), "r+b") as f:
                f.seek(self.pos - start)
                f.write(encode_blank(left))
            start += self.file_size
            self.pos = start
        index, pos = self.next_index, self.pos
        with open(self._data_file(start), "r+b") as f:
            f.seek(pos - start)
            f.write(encode_entry(record, index=index, term=term, pos=pos))
        with open(self._index_path, "r+b") as f:
            f.seek(index * INDEX_UNIT_SIZE)
            f.write(INDEX_UNIT.pack(ENTRY_MAGIC, pos, size, index, term))
        self.pos += size
        self.next_index += 1
        return index, pos

    def truncate_to(self, index: int, pos: int) -> None:
        """Cut the log so that entry `index` (at `pos`) is the next one written: later files removed, the rest of
        its file and the index from its unit on zeroed, as a follower's truncate leaves them."""
        start = pos - (pos - self.first_offset) % self.file_size
        for name in os.listdir(self.data_dir):
            if name.isdigit() and int(name) > start:
                os.unlink(os.path.join(self.data_dir, name))
        with open(self._data_file(start), "r+b") as f:
            f.seek(pos - start)
            f.write(bytes(self.file_size - (pos - start)))
        with open(self._index_path, "r+b") as f:
            end = os.fstat(f.fileno()).st_size
            f.seek(index * INDEX_UNIT_SIZE)
            f.write(bytes(min(end, self.next_index * INDEX_UNIT_SIZE + INDEX_UNIT_SIZE) - index * INDEX_UNIT_SIZE))
        self.pos, self.next_index = pos, index


def commitlog_records(directory: str, segment_size: int, start: int = 0, end: int | None = None):
    """The records of a plain CommitLog directory from record boundary `start` to `end` (bytes of each, in order),
    for copying its messages into a DLedger log: every segment walked by TOTALSIZE to its BLANK or zeros."""
    names = sorted(n for n in os.listdir(directory) if n.isdigit())
    for name in names:
        seg = int(name)
        if seg + segment_size <= start:
            continue
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        at = max(start - seg, 0)
        while at + 8 <= len(data) and (end is None or seg + at < end):
            total, magic = RECORD_PREFIX.unpack_from(data, at)
            if total <= 0 or magic == BLANK_MAGIC_CODE:
                break
            yield data[at : at + total]
            at += total


def copy_commitlog(directory: str, segment_size: int, home: str, *, term: int = 0, first_offset: int = 0) -> int:
    """Write the records of the plain CommitLog `directory` as a new DLedger log under `home` (data files of
    `segment_size` bytes, the index file, a checkpoint committing every entry), in one sequential pass: the
    same bytes `DLedgerLogWriter.append` writes entry by entry (tests/test_dledger_writer.py), fast enough for a
    benchmark's millions of messages. Returns the number of entries."""
    data_dir, index_dir = os.path.join(home, "data"), os.path.join(home, "index")
    os.makedirs(data_dir, exist_ok=True)
    os.makedirs(index_dir, exist_ok=True)
    units = bytearray()
    index, start, pos = 0, first_offset, first_offset
    out = open(os.path.join(data_dir, offset_to_file_name(start)), "wb")  # noqa: SIM115 - rolled below
    try:
        out.truncate(segment_size)
        for record in commitlog_records(directory, segment_size):
            size = ENTRY_HEADER_SIZE + len(record)
            left = start + segment_size - pos
            if size + MIN_BLANK_LENGTH > left:
                out.write(encode_blank(left))
                out.close()
                start += segment_size
                pos = start
                out = open(os.path.join(data_dir, offset_to_file_name(start)), "wb")  # noqa: SIM115
                out.truncate(segment_size)
            out.write(encode_entry(record, index=index, term=term, pos=pos))
            units += INDEX_UNIT.pack(ENTRY_MAGIC, pos, size, index, term)
            pos += size
            index += 1
    finally:
        out.close()
    with open(os.path.join(index_dir, offset_to_file_name(0)), "wb") as f:
        f.truncate(INDEX_FILE_SIZE)
        f.write(units)
    write_checkpoint(home, index - 1, index - 1)
    return index


def write_checkpoint(root: str, committed_index: int, end_index: int) -> None:
    """DLedger's `checkpoint` (IOUtils.properties2String of a Hashtable: this key order)."""
    path = os.path.join(root, "checkpoint")
    with open(path + ".tmp", "w") as f:
        f.write(f"committedIndex={committed_index}\nendIndex={end_index}\n")
    os.replace(path + ".tmp", path)
