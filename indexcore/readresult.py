"""What one read of the CommitLog returns, and how a decoded window becomes it: `SegmentDecode` (where
and why a segment decode stopped), `ReadStatus`/`ReadResult`, `read_result` (go on, roll, the end of the
written data, a torn tail or corruption), the test of where written data ends in a segment, and giving
read pages back to the kernel. `CommitLogReader` (indexcore/reader.py) reads through it."""

from __future__ import annotations

import dataclasses
import enum
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from indexcore.batchdecode import (
    STOP_BLANK,
    STOP_END,
    STOP_ERROR,
    STOP_LIMIT,
)
from indexcore.commitlog import (
    END_FILE_MIN_BLANK_LENGTH,
    MIN_RECORD_SIZE,
    RECORD_PREFIX,
)
from indexcore.dispatch import DispatchBatch
from indexcore.errors import CorruptRecordError, StoreError


class Stop(enum.Enum):
    """Why a segment decode stopped."""

    LIMIT = "limit"  # the batch is full; more records follow
    BLANK = "blank"  # end-of-segment record: continue at the next segment
    END = "end"  # zero TOTALSIZE: nothing written here yet
    ERROR = "error"  # the record here does not decode


_STOPS = {STOP_LIMIT: Stop.LIMIT, STOP_BLANK: Stop.BLANK, STOP_END: Stop.END, STOP_ERROR: Stop.ERROR}


@dataclass(slots=True)
class SegmentDecode:
    """The records one `decode_segment` call decoded, and where and why it stopped."""

    batch: DispatchBatch
    stop: Stop
    position: int  # in-segment position where decoding stopped
    error: CorruptRecordError | None = None


class ReadStatus(enum.Enum):
    OK = "ok"  # records were read (possibly none, after a roll); call again from next_offset
    END = "end"  # nothing more is written at next_offset yet
    CORRUPT = "corrupt"  # `error` describes what is wrong at next_offset


@dataclass(frozen=True, slots=True)
class ReadResult:
    """One read: the batch to dispatch, where to read next, and why the read stopped."""

    batch: DispatchBatch
    next_offset: int
    status: ReadStatus
    error: StoreError | None = None
    pending: CorruptRecordError | None = None  # END at a record that is not complete (a torn tail)
    rolled: bool = False  # next_offset is the start of the next segment
    skipped_from: int | None = None  # the requested offset was below the oldest segment


def read_result(result: SegmentDecode, image, seg_start: int, size: int, path: str, max_message_size: int,
                written_successor: Callable[[], bool] | None,
                decode_again: Callable[[], SegmentDecode] | None = None) -> ReadResult:
    """What a segment decode means for the reader: go on, roll to the next segment, the end of the written
    data (with a torn tail as `pending`), or corruption. `image` holds the segment's bytes at least one
    maximal message past the stop twice over; `written_successor` says whether a later segment holds data
    (None: do not verify, report END). The one rule for `reputd rebuild`, `run` and the backfill's tasks.

    A file being written changes between the decode and the look at what follows it: the record at the
    stop may be written in that time, and with it the BLANK and the next segment's first record. The
    evidence against the stop (data after it, a successor with data) is therefore gathered first and the
    stop decoded again last with `decode_again` (a live image): corruption is only what still fails after
    the evidence was seen; a stop that decodes now is read again (OK, at the stop). A writer that writes
    record after record cannot show later data before the record at the stop is in, so for it the verdict
    is sound; a record whose own bytes arrive out of order is the caller's to wait for (`reputd run`
    holds a verdict near the head for a grace period). A fixed image (rebuild, backfill) keeps the strict
    rule: nothing changes between the two decodes."""
    batch, at = result.batch, seg_start + result.position
    if result.stop is Stop.LIMIT:
        return ReadResult(batch, at, ReadStatus.OK)
    if result.stop is Stop.BLANK:
        nxt = seg_start + size
        return ReadResult(dataclasses.replace(batch, end_offset=nxt), nxt, ReadStatus.OK, rolled=True)
    if written_successor is None:
        pending = None if result.stop is Stop.END else result.error.located(path, at)
        return ReadResult(batch, at, ReadStatus.END, pending=pending)
    last = not written_successor()
    if result.stop is Stop.END:
        if last and _zeros_from(image, result.position, size, max_message_size):
            return ReadResult(batch, at, ReadStatus.END)
        where = "before the end of a segment that has a successor" if not last else "with data after it"
        err = CorruptRecordError("total_size", f"zero TOTALSIZE {where}", path=path, offset=at)
    else:
        err = result.error.located(path, at)
        if last and _unwritten_after(image, result.position, size, max_message_size):
            return ReadResult(batch, at, ReadStatus.END, pending=err)
    if decode_again is not None:
        again = decode_again()
        if len(again.batch) or again.stop is not result.stop:  # written since the decode: read it again
            return ReadResult(batch, at, ReadStatus.OK)
    return ReadResult(batch, at, ReadStatus.CORRUPT, err)


def release_pages(mm: mmap.mmap, start: int, end: int) -> None:
    """Drop the whole pages of [start, end) from this mapping once decoded: the batch holds copies,
    the page cache keeps the data, and the process stays small whatever the segment's size."""
    _release(mm, start, end)


def _release(mm: mmap.mmap, start: int, end: int) -> None:
    """Drop the whole pages of [start, end) from this mapping once decoded: the batch holds copies,
    the page cache keeps the data, and the process stays small whatever the segment's size."""
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end - end % mmap.PAGESIZE
    if last > first:
        mm.madvise(mmap.MADV_DONTNEED, first, last - first)


def at_written_end(buf, pos: int, file_size: int, max_message_size: int, *, bad_record: bool) -> bool:
    """Whether a segment decode that stopped at `pos` (on a zero TOTALSIZE, or with `bad_record` on a
    record that does not decode) stopped at the end of the written data rather than at damage: the rule
    `CommitLogReader.read` applies to the newest segment (`_unwritten_after`, `_zeros_from`)."""
    if bad_record:
        return _unwritten_after(buf, pos, file_size, max_message_size)
    return _zeros_from(buf, pos, file_size, max_message_size)


def _unwritten_after(buf, pos: int, file_size: int, max_message_size: int) -> bool:
    """Whether a bad record at `pos` is a torn tail, i.e. still being copied in.

    A record is copied front to back, so a torn one has not received its last byte yet: that byte
    is still zero (or TOTALSIZE itself is not plausible yet), and so is everything after it, over
    one maximal message. A bad record whose last byte is written, or with newer data after it, is
    corrupt.
    """
    total = RECORD_PREFIX.unpack_from(buf, pos)[0] if pos + RECORD_PREFIX.size <= file_size else 0
    plausible = MIN_RECORD_SIZE <= total <= min(file_size - pos, max_message_size)
    if plausible and buf[pos + total - 1] != 0:
        return False
    return _zeros_from(buf, pos + total if plausible else pos + RECORD_PREFIX.size, file_size, max_message_size)


def _zeros_from(buf, pos: int, file_size: int, max_message_size: int) -> bool:
    """Whether the next maximal message's worth of bytes from `pos` is unwritten (all zero). A writer
    appends front to back, so data beyond a zero gap means the gap is damage, not the head."""
    end = min(file_size, pos + max_message_size + END_FILE_MIN_BLANK_LENGTH)
    if end <= pos:
        return True
    return not np.frombuffer(buf, dtype=np.uint8, count=end - pos, offset=pos).any()
