"""Reading a CommitLog directory in batches, as ReputMessageService does, but from outside the broker.

The broker's reader never passes its own in-memory write position; reputd does not know that
position, so it tells *not written yet* from *corrupt* by what surrounds a bad record (the LevelDB
log-reader rule): in the newest segment, a zero TOTALSIZE, or a record that fails to decode with only
zeros after it, is the end of the written data and is read again on the next call. A failure with
data after it, or in a segment that has a successor, is corruption and is returned as a typed error
naming the file, offset and field. A record never spans two segments, so every segment can be
decoded on its own (the Spark backfill relies on it).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import numpy as np

from indexcore import _kernels
from indexcore.batchdecode import (
    CATALOG_FIELD_ROWS,
    CATALOG_FIELDS,
    K_HASH,
    K_OWNER,
    M_OWNER,
    M_QUEUE_ID,
    M_QUEUE_OFFSET,
    M_TOPIC_ID,
    R_DELAY_AT,
    R_DELAY_LEN,
    R_KEYS_AT,
    R_KEYS_LEN,
    R_MULTI,
    R_PHY,
    R_PREPARED_OFFSET,
    R_QUEUE_ID,
    R_QUEUE_OFFSET,
    R_SIZE,
    R_STORE_TIMESTAMP,
    R_SYS_FLAG,
    R_TAGS_CODE,
    R_TOPIC_ID,
    R_UNIQ_AT,
    R_UNIQ_LEN,
    ROLE_MULTI_DISPATCH,
    STOP_ERROR,
    T_AT,
    T_FIRST,
    T_LEN,
    T_ROLE,
    DecodeScratch,
    decode_window,
)
from indexcore.commitlog import (
    BLANK_MAGIC_CODE,
    DEFAULT_MAX_MESSAGE_SIZE,
    MAX_TOPIC_LENGTH_V1,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    MIN_RECORD_SIZE,
    RECORD_ERRORS,
    RECORD_PREFIX,
    RECORD_START_SIZE,
    SCHEDULE_TOPIC,
    MessageRecord,
    check_topic,
    is_record_start,
    record_error,
)
from indexcore.dispatch import DelayLevelTable, DispatchBatch, StringColumn, delay_tags_code, parse_java_int
from indexcore.dledger import DLEDGER_ENTRIES, ENTRY_ERRORS, ENTRY_HEADER_SIZE, entry_error
from indexcore.errors import CorruptRecordError, SizeMismatchError, StoreLayoutError
from indexcore.mappedfile import list_queue_files, offset_to_file_name
from indexcore.multidispatch import MULTI_COUNT_MISMATCH, check_queue_name, multi_dispatch_error
from indexcore.readresult import (
    _STOPS,
    ReadResult,
    ReadStatus,
    SegmentDecode,
    Stop,
    _release,
    at_written_end,
    read_result,
    release_pages,
)

DEFAULT_BATCH_BYTES = 4 * 1024 * 1024
MAX_KNOWN_NAMES = 1 << 20  # topics and queue names a reader remembers as checked


def decode_segment(buf, start: int, *, segment_offset: int, segment_size: int, max_bytes: int,
                   check_crc: bool = True, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
                   delay_table: DelayLevelTable | None = None, scratch: DecodeScratch | None = None,
                   multi_flags: int = 0, names: dict[bytes, str] | None = None) -> SegmentDecode:
    """Decode records of one mapped segment from `start` into a DispatchBatch.

    Stops before the first record that starts `max_bytes` or more past `start`, at a BLANK, at a zero
    TOTALSIZE, or at a record that fails to decode (the error is returned, not raised, with the
    records before it, so they can still be dispatched). `scratch`, when given, is reused for the kernel's
    buffers; the batch owns copies of what it needs. `multi_flags` (`multidispatch.multi_dispatch_flags`)
    makes the batch carry the multi-dispatch targets. `names`, when given, keeps the topics and queue names
    found safe from one window to the next (a store with thousands of LMQ queues meets each in every
    window); a name is only ever added once checked. With `dledger.DLEDGER_ENTRIES` in `multi_flags` the
    segment is a DLedger data file: positions are entry positions, the records' offsets entry pos + 48. With
    `batchdecode.CATALOG_FIELDS` the batch carries what the backfill's catalog reads (`catalog_fields`).
    """
    base = segment_offset
    w = decode_window(buf, start, min(segment_size, start + max_bytes), segment_size, base, max_message_size,
                      check_crc, scratch, multi_flags)
    rec = w.records
    n, stop, end = rec.shape[1], w.stop, w.position
    error = None
    if stop == STOP_ERROR:
        if w.error in RECORD_ERRORS:
            error = record_error(w.error, *w.details)
        elif w.error in ENTRY_ERRORS:
            error = entry_error(w.error, *w.details)
        else:
            error = multi_dispatch_error(w.error, *w.details)
    found = w.topics[:, [T_AT, T_LEN, T_FIRST, T_ROLE]]  # each topic's first appearance
    taken = rec.shape[1]
    # the names checked in earlier windows, looked up in one call; the others are checked here
    topics: list[str] = _kernels.known_names(buf, np.ascontiguousarray(found[:, 0]), np.ascontiguousarray(found[:, 1]),
                                             names) if names is not None else [None] * len(found)
    for i in np.flatnonzero(found[:, 2] >= taken).tolist():  # met in a record the kernel did not take
        topics[i] = ""
    for i in [i for i, known in enumerate(topics) if known is None]:
        at, length, first, role = found[i].tolist()
        raw = bytes(buf[at : at + length])
        magic = RECORD_PREFIX.unpack_from(buf, int(rec[R_PHY, first]) - base)[1]
        try:
            topics[i] = check_queue_name(raw) if role == ROLE_MULTI_DISPATCH else check_topic(raw, magic)
            if names is not None and len(raw) <= MAX_TOPIC_LENGTH_V1:  # safe as a v1 topic and as a name
                if len(names) >= MAX_KNOWN_NAMES:
                    names.clear()
                names[raw] = topics[i]
        except CorruptRecordError as e:
            if first < n:
                n, stop, error = first, STOP_ERROR, e
            topics[i] = ""
    tags_code = rec[R_TAGS_CODE, :n].copy()
    if SCHEDULE_TOPIC in topics:
        delay_table = delay_table or DelayLevelTable()
        scheduled = (rec[R_TOPIC_ID, :n] == topics.index(SCHEDULE_TOPIC)) & (rec[R_DELAY_AT, :n] >= 0)
        for i in np.flatnonzero(scheduled).tolist():
            at, length = int(rec[R_DELAY_AT, i]), int(rec[R_DELAY_LEN, i])
            raw = bytes(buf[at : at + length])
            level = parse_java_int(raw.decode("utf-8", "replace"))
            if level is None:
                n, stop = i, STOP_ERROR
                error = CorruptRecordError("properties.DELAY", f"{raw!r} is not an integer")
                break
            code = delay_tags_code(level, int(rec[R_STORE_TIMESTAMP, i]), delay_table)
            if code is not None:
                tags_code[i] = code
    if n < rec.shape[1]:  # the record's start, or its DLedger entry's
        end = int(rec[R_PHY, n]) - base - (ENTRY_HEADER_SIZE if multi_flags & DLEDGER_ENTRIES else 0)
    if error is not None:
        error = error.located(None, base + end)
    rec = rec[:, :n]
    keys = w.keys[:, : int(np.searchsorted(w.keys[K_OWNER], n))]
    multi = w.multi[:, : int(np.searchsorted(w.multi[M_OWNER], n))]
    mismatch = np.flatnonzero(rec[R_MULTI] == MULTI_COUNT_MISMATCH).astype(np.int32) if multi_flags else None
    batch = DispatchBatch(
        phy_offset=rec[R_PHY].copy(),
        msg_size=rec[R_SIZE].astype(np.int32),
        queue_id=rec[R_QUEUE_ID].astype(np.int32),
        queue_offset=rec[R_QUEUE_OFFSET].copy(),
        sys_flag=rec[R_SYS_FLAG].astype(np.int32),
        store_timestamp=rec[R_STORE_TIMESTAMP].copy(),
        tags_code=tags_code[:n],
        prepared_transaction_offset=rec[R_PREPARED_OFFSET].copy(),
        topic_id=rec[R_TOPIC_ID].astype(np.int32),
        topics=tuple(topics),
        keys=StringColumn(w.text, rec[R_KEYS_AT].copy(), rec[R_KEYS_LEN].copy()),
        uniq_key=StringColumn(w.text, rec[R_UNIQ_AT].copy(), rec[R_UNIQ_LEN].copy()),
        key_hash=keys[K_HASH].astype(np.int32),
        key_owner=keys[K_OWNER].astype(np.int32),
        start_offset=base + start,
        end_offset=base + end,
        multi_owner=multi[M_OWNER].astype(np.int32),
        multi_topic_id=multi[M_TOPIC_ID].astype(np.int32),
        multi_queue_id=multi[M_QUEUE_ID].astype(np.int32),
        multi_queue_offset=multi[M_QUEUE_OFFSET].copy(),
        **({} if mismatch is None else {"multi_count_mismatch": mismatch}),
        catalog_fields=rec[CATALOG_FIELD_ROWS].copy() if multi_flags & CATALOG_FIELDS else None,
    )
    return SegmentDecode(batch, _STOPS[stop], end, error)


class CommitLog:
    """The segments of a CommitLog, possibly spread over several directories (RocketMQ multi-path).

    `follow=True` is for a CommitLog that a broker is still writing: a newest segment shorter than
    the configured size is taken to be still being created and is not read yet; `short_newest` names it
    (path, size), so that a follower can tell one that stays short (cut short: the broker would refuse to
    load it, as a reader without `follow` does at once) from one a broker is creating.
    """

    def __init__(self, dirs: str | Sequence[str], segment_size: int, *, follow: bool = False):
        self.dirs = (dirs,) if isinstance(dirs, str) else tuple(dirs)
        self.segment_size = segment_size
        self.follow = follow
        self._segments: list[tuple[int, str]] = []
        self._by_start: dict[int, str] = {}
        self.short_newest: tuple[str, int] | None = None
        self.refresh()

    # where a reader stops: None, or a DLedger log's committed position (dledgerlog.py)
    read_limit: int | None = None

    def decode_flags(self, offset: int) -> int:
        """The decode flags of the segment holding `offset`: 0, or DLEDGER_ENTRIES in a DLedger log."""
        return 0

    def at_end(self, result: ReadResult) -> ReadResult:
        """What an END read means for this log (a DLedger log checks it against its committed position)."""
        return result

    def refresh(self) -> list[tuple[int, str]]:
        """Rescan the directories: segment files appear at the head and vanish at the tail."""
        for d in self.dirs:
            if not os.path.isdir(d):
                raise StoreLayoutError(d, "CommitLog directory does not exist or is not a directory")
        found = sorted(f for d in self.dirs for f in list_queue_files(d))
        segments = []
        self.short_newest = None
        for i, (start, path) in enumerate(found):
            if start % self.segment_size:
                raise self._refused(found, path, f"start offset is not a multiple of the segment size "
                                                 f"{self.segment_size}")
            # a segment already seen at full size keeps it: only new files need a stat
            size = self.segment_size if self._by_start.get(start) == path else os.path.getsize(path)
            if size != self.segment_size:
                if self.follow and i == len(found) - 1 and size < self.segment_size:
                    self.short_newest = (path, size)
                    break
                raise self._refused(found, path, f"segment is {size} bytes, mappedFileSizeCommitLog is "
                                                 f"{self.segment_size}")
            segments.append((start, path))
        self._segments = segments
        self._by_start = dict(segments)
        return segments

    def _refused(self, found: list[tuple[int, str]], path: str, detail: str) -> StoreLayoutError:
        """A SizeMismatchError when the segments agree with each other on another size (the setting is not
        the broker's), a StoreLayoutError when they do not (damage)."""
        sizes = {os.path.getsize(p) for _, p in found}
        size = sizes.pop() if len(sizes) == 1 else 0
        if size > 0 and all(start % size == 0 for start, _ in found):
            return SizeMismatchError(path, f"{detail}; the segments here are {size} bytes")
        return StoreLayoutError(path, detail)

    @property
    def segments(self) -> list[tuple[int, str]]:
        return self._segments

    @property
    def min_offset(self) -> int:
        return self._segments[0][0] if self._segments else 0

    @property
    def max_offset(self) -> int:
        """End of the newest segment file: an upper bound on the written data."""
        return self._segments[-1][0] + self.segment_size if self._segments else 0

    def segment_start(self, offset: int) -> int:
        return offset - offset % self.segment_size

    def find_segment(self, offset: int) -> str | None:
        return self._by_start.get(self.segment_start(offset))

    def has_segment_after(self, offset: int) -> bool:
        return bool(self._segments) and self._segments[-1][0] > self.segment_start(offset)

    def has_written_segment_after(self, offset: int) -> bool:
        """Whether a later segment holds data. A broker pre-allocates its next file (zeros) before the
        current one is full, so an existing successor whose first TOTALSIZE is 0 does not count."""
        start = self.segment_start(offset)
        for s, path in reversed(self._segments):
            if s <= start:
                return False
            try:
                with open(path, "rb") as f:
                    head = f.read(RECORD_PREFIX.size)
            except FileNotFoundError:  # a pre-created file the broker deleted (its shutdown does) since the scan
                continue
            if len(head) == RECORD_PREFIX.size and RECORD_PREFIX.unpack(head)[0] != 0:
                return True
        return False

    def record_around(self, offset: int) -> tuple[int, int]:
        """Where the record holding `offset` starts and ends: (offset, offset) when a record starts there (or
        a BLANK, or the written data ends there, or no segment holds it), else [start, end) of the record or
        BLANK it falls inside, found by following TOTALSIZE from the segment's start: the nearest record
        boundaries, for an offset that must be one. Damage on the way is left to the reader: (offset, offset)."""
        path = self.find_segment(offset)
        if path is None:
            return offset, offset
        seg, target = self.segment_start(offset), offset - self.segment_start(offset)
        with open(path, "rb") as f:
            if is_record_start(os.pread(f.fileno(), RECORD_START_SIZE, target), offset):
                return offset, offset
            size = os.fstat(f.fileno()).st_size
            if size < RECORD_PREFIX.size:
                return offset, offset
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                pos = 0
                while pos < target and pos + RECORD_PREFIX.size <= size:
                    total, magic = RECORD_PREFIX.unpack_from(mm, pos)
                    if magic == BLANK_MAGIC_CODE:
                        return seg + pos, seg + self.segment_size
                    if magic not in (MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2) or total < MIN_RECORD_SIZE:
                        return offset, offset  # the end of the written data, or damage
                    if pos + total > target:
                        return seg + pos, seg + pos + total
                    pos += total
        return offset, offset

    def read_record(self, offset: int, *, check_crc: bool = True,
                    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> MessageRecord:
        """Decode the whole message record at `offset` (for queries and inspection)."""
        path = self.find_segment(offset)
        if path is None:
            raise StoreLayoutError(offset_to_file_name(self.segment_start(offset)),
                                   f"no CommitLog segment holds offset {offset}")
        pos = offset - self.segment_start(offset)
        with open(path, "rb") as f:
            head = os.pread(f.fileno(), RECORD_PREFIX.size, pos)
            if len(head) < RECORD_PREFIX.size:
                raise CorruptRecordError("total_size", "offset is past the end of the segment",
                                         path=path, offset=offset)
            total = RECORD_PREFIX.unpack(head)[0]
            if not MIN_RECORD_SIZE <= total <= min(max_message_size, self.segment_size - pos):
                raise CorruptRecordError("total_size", f"{total} is not a plausible record size",
                                         path=path, offset=offset)
            data = os.pread(f.fileno(), total, pos)
        try:
            rec = MessageRecord.decode(data, 0, check_crc=check_crc, max_message_size=max_message_size)
        except CorruptRecordError as e:
            raise e.located(path, offset) from None
        if rec.physical_offset != offset:
            raise CorruptRecordError("physical_offset", f"record says {rec.physical_offset}",
                                     path=path, offset=offset)
        return rec


class CommitLogReader:
    """Reads a CommitLog in batches from any record boundary, keeping one segment mapped at a time."""

    def __init__(self, commit_log: CommitLog, *, check_crc: bool = True,
                 max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE, delay_table: DelayLevelTable | None = None,
                 batch_bytes: int = DEFAULT_BATCH_BYTES, multi_flags: int = 0):
        self.commit_log = commit_log
        self.multi_flags = multi_flags
        self.check_crc = check_crc
        self.max_message_size = max_message_size
        self.delay_table = delay_table or DelayLevelTable()
        self.batch_bytes = batch_bytes
        self._mapped: tuple[str, mmap.mmap] | None = None
        self._scratch = DecodeScratch()
        self._names: dict[bytes, str] = {}

    def _map(self, path: str) -> mmap.mmap:
        if self._mapped is not None and self._mapped[0] == path:
            return self._mapped[1]
        self.close()
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._mapped = (path, mm)
        return mm

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped[1].close()
            self._mapped = None

    def probe(self, offset: int) -> bool:
        """Whether a read at `offset` may find something new: a cheap look at the TOTALSIZE there in the
        segment already mapped, for tailing a CommitLog that a broker writes through its own mapping
        (which raises no file-system event). True whenever it cannot tell without a full read."""
        limit = self.commit_log.read_limit
        if limit is not None and offset >= limit:  # a DLedger log: new only once more is committed
            at_limit = ReadResult(DispatchBatch.empty(offset), offset, ReadStatus.END)
            return self.commit_log.at_end(at_limit).status is not ReadStatus.END
        path = self.commit_log.find_segment(offset)
        if path is None:
            return False  # no segment yet: a file event or the periodic verified read finds it
        if self._mapped is None or self._mapped[0] != path:
            return True
        pos = offset - self.commit_log.segment_start(offset)
        mm = self._mapped[1]
        if pos + RECORD_PREFIX.size > len(mm):
            return True
        return RECORD_PREFIX.unpack_from(mm, pos)[0] != 0

    def read(self, offset: int, *, verify_end: bool = True) -> ReadResult:
        """Read the next batch starting at record boundary `offset`.

        Where the data stops without a BLANK, telling the end of the written data from damage means a
        directory rescan and a look at the next maximal message's worth of bytes. `verify_end=False`
        skips both and reports END (with `pending` for a bad record): for a tail that reads the head
        many times a second and verifies it now and then.
        """
        log = self.commit_log
        size = log.segment_size
        empty = DispatchBatch.empty(offset)
        path = log.find_segment(offset)
        mm = None
        for _ in range(2):
            if path is None:
                log.refresh()
                path = log.find_segment(offset)
            if path is None:
                if log.segments and offset < log.min_offset:
                    return ReadResult(DispatchBatch.empty(log.min_offset), log.min_offset, ReadStatus.OK,
                                      skipped_from=offset)
                if log.has_segment_after(offset):
                    missing = os.path.join(log.dirs[0], offset_to_file_name(log.segment_start(offset)))
                    return ReadResult(empty, offset, ReadStatus.CORRUPT,
                                      StoreLayoutError(missing, "segment is missing between two present ones"))
                return ReadResult(empty, offset, ReadStatus.END)
            try:
                mm = self._map(path)
                break
            except FileNotFoundError:
                path = None  # deleted (retention) since the last scan: look again
            except OSError as e:
                return ReadResult(empty, offset, ReadStatus.CORRUPT, StoreLayoutError(path, f"cannot map: {e}"))
        if mm is None:
            return ReadResult(empty, offset, ReadStatus.END)
        seg_start = log.segment_start(offset)
        limit, flags = log.read_limit, self.multi_flags | log.decode_flags(offset)
        if limit is not None and offset >= limit:  # a DLedger log: nothing committed there yet
            return log.at_end(ReadResult(empty, offset, ReadStatus.END))
        result = decode_segment(mm, offset - seg_start, segment_offset=seg_start, segment_size=size,
                                max_bytes=self.batch_bytes if limit is None else min(self.batch_bytes, limit - offset),
                                check_crc=self.check_crc,
                                max_message_size=self.max_message_size, delay_table=self.delay_table,
                                scratch=self._scratch, multi_flags=flags, names=self._names)
        _release(mm, offset - seg_start, result.position)

        def decode_again() -> SegmentDecode:
            return decode_segment(mm, result.position, segment_offset=seg_start, segment_size=size, max_bytes=1,
                                  check_crc=self.check_crc, max_message_size=self.max_message_size,
                                  delay_table=self.delay_table, scratch=self._scratch,
                                  multi_flags=flags, names=self._names)

        res = read_result(result, mm, seg_start, size, path, self.max_message_size,
                          (lambda: self._written_successor(offset)) if verify_end else None, decode_again)
        return log.at_end(res) if res.status is ReadStatus.END else res

    def _written_successor(self, offset: int) -> bool:
        """Whether data exists past this segment, looking again at the directory first: a successor
        may have appeared since the last scan."""
        self.commit_log.refresh()
        return self.commit_log.has_written_segment_after(offset)


__all__ = ["CommitLog", "CommitLogReader", "ReadResult", "ReadStatus", "SegmentDecode", "Stop", "at_written_end",
           "decode_segment", "read_result", "release_pages"]
