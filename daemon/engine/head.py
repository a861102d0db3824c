"""The CommitLog's head: where the written data ends, and records that were still being written.

A broker writes through a memory mapping, front to back or not, and pre-creates its next segments, so
the newest bytes of a CommitLog may be a record half copied in or files of zeros. The reput loop uses
`written_below` and `hold_torn_tail` to dispatch only records that were complete when read; the lag
gauges use `written_end`, `segments_now` and `oldest_undispatched_timestamp`.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import mmap
import os
import struct

import numpy as np

from daemon.engine.session import Session
from indexcore.commitlog import (
    BLANK_MAGIC_CODE,
    BORNHOST_V6_FLAG,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    RECORD_PREFIX,
    STOREHOSTADDRESS_V6_FLAG,
    SYS_FLAG_OFFSET,
    MessageRecord,
    fixed_part_struct,
)
from indexcore.dispatch import DispatchBatch
from indexcore.errors import CorruptRecordError, StoreError
from indexcore.mappedfile import FILE_NAME_DIGITS
from indexcore.reader import CommitLog, ReadResult, ReadStatus

MESSAGE_MAGIC_CODES = (MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2)
SYS_FLAG = struct.Struct(">i")
PHYSICAL_OFFSET_FIELD, STORE_TIMESTAMP_FIELD = 6, 11  # in fixed_part_struct's fields
FIXED_PART_MAX = fixed_part_struct(BORNHOST_V6_FLAG | STOREHOSTADDRESS_V6_FLAG).size  # up to BODYLENGTH, IPv6 hosts


def _data_frontier(path: str, start: int, size: int, offset: int, horizon: int | None = None,
                   head: HeadDescriptor | None = None) -> int:
    """In the segment file `path` (CommitLog offsets [start, start + size)): the end of the last non-zero
    byte before the first all-zero page past `offset`'s page, found by galloping then bisecting pages (a
    zero page inside a record only makes it lower); with `horizon`, simply a written page that many bytes
    on when there is one. `offset` itself on any error. With `head`, through its descriptor of `path`."""
    page = mmap.PAGESIZE
    try:
        fd = open_head(path) if head is None else head.fd(path)
    except OSError:
        return offset

    def zero(n: int) -> bool:
        data = os.pread(fd, page, n * page)
        return data.count(0) == len(data)

    try:
        first, pages = (offset - start) // page, -(-size // page)
        if horizon is not None:
            far = (offset - start + horizon) // page
            if far < pages and not zero(far):  # catching up: the writer is far ahead
                return start + far * page
        lo, step = first, 1  # page lo holds data (or is offset's own page); find a zero page above it
        hi = min(lo + step, pages)
        while hi < pages and not zero(hi):
            lo, step = hi, step * 2
            hi = min(lo + step, pages)
        # page lo: data or offset's page; page hi: zero (or the end); the first zero page between them
        lo += bisect.bisect_left(range(lo + 1, hi), True, key=zero)
        tail = os.pread(fd, page, lo * page).rstrip(b"\0")
        return start + lo * page + len(tail)
    except OSError:
        if head is not None:
            head.close()  # opened again next time
        return offset
    finally:
        if head is None:
            os.close(fd)


def open_head(path: str) -> int:
    """A read-only descriptor of a segment for small reads at and past the writer's head, without readahead.

    A page past the head of a pre-allocated segment is not in the page cache yet: a plain read of it starts
    the device's readahead (`read_ahead_kb`, 8 MiB on the benchmark machine), which fills up to that many
    pages of zeros before the read returns (~10 ms for 8 MiB) and leaves them in the page cache
    (bench/results/latency.md). The frontier looks and record checks read one page or one record where they
    read; POSIX_FADV_RANDOM makes the read fetch only that."""
    fd = os.open(path, os.O_RDONLY)
    with contextlib.suppress(OSError):  # advice only: a file system without it reads as before
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class HeadDescriptor:
    """One read-only descriptor of the segment the loop reads, kept open from read to read: the loop looks
    for the data frontier (`written_below`) before every read, several hundred times a second when
    following a broker, and opening and closing the file each time cost more than the look itself (and
    raised two file events). Used by the loop's thread only; a new path closes the old descriptor."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._fd = -1

    def fd(self, path: str) -> int:
        if path != self._path:
            self.close()
            self._fd = open_head(path)
            self._path = path
        return self._fd

    def close(self) -> None:
        if self._path is not None:
            self._path = None
            fd, self._fd = self._fd, -1
            os.close(fd)


def written_below(commit_log: CommitLog, offset: int, horizon: int, head: HeadDescriptor | None = None) -> int:
    """A point of the segment holding `offset` below which every byte a front-to-back writer meant to write
    is in (`_data_frontier`, or a written page `horizon` bytes on: no read ends past it). A record copied
    in another order (TOTALSIZE last) does not decode before it is complete: only front-to-back copies
    need it. `head`: a descriptor kept open for the loop."""
    path = commit_log.find_segment(offset)
    if path is None:
        return offset
    return _data_frontier(path, commit_log.segment_start(offset), commit_log.segment_size, offset, horizon, head)


def hold_torn_tail(s: Session, offset: int, result: ReadResult, written: int) -> ReadResult:
    """Dispatch only records that were complete when they were decoded.

    A record copied front to back decodes as soon as its header, body (CRC-checked), topic and properties
    length are in, while its properties still end in unwritten zeros: dispatched then, its KEYS, UNIQ_KEY
    or TAGS would be cut short. `written` was taken before the read (`written_below`): records ending
    below it were complete. The others were written while the read ran: the last one must be complete
    now (its final byte written, or data after it, or no NUL in its properties: a record without
    properties ends in its zero length), then all of them are decoded again and must match what the read
    saw. The batch is cut before the first that fails; the rest is read again. Whatever ended the read
    (a roll, or the writer's next bytes looking corrupt a moment later) does not exempt its batch: the
    cut read ends at the cut. (tests/test_torn_writes.py)
    """
    batch = result.batch
    n = len(batch)
    if not n:
        return result
    late = batch.phy_offset.astype(np.int64) + batch.msg_size > written
    if not late.any():
        return result
    first = int(np.argmax(late))  # records lie in offset order: the late ones are a suffix
    cut, pending = n, None
    at, size = int(batch.phy_offset[n - 1]), int(batch.msg_size[n - 1])
    path = s.commit_log.find_segment(at)
    try:
        fd = open_head(path)  # before reading it again: what is complete now reads complete then
        try:
            data = os.pread(fd, size + RECORD_PREFIX.size, at - s.commit_log.segment_start(at))
        finally:
            os.close(fd)
        if len(data) >= size and not data[size - 1] and not any(data[size:]):
            properties = MessageRecord.decode(data[:size], check_crc=False, max_message_size=size).properties
            if b"\0" in properties:
                cut = n - 1
                pending = CorruptRecordError("properties", "last byte not written yet (properties end in zeros)",
                                             path=path, offset=at)
    except (OSError, TypeError, StoreError):
        cut = n - 1  # the next read decides
    start = int(batch.phy_offset[first])
    again = _read_records(s, start, result.next_offset - start)
    cut = first + _rows_alike(again.batch, batch, first, cut - first)
    if cut == n:
        return result
    head = _read_records(s, offset, int(batch.phy_offset[cut]) - offset) if cut else None
    if head is None or head.next_offset != int(batch.phy_offset[cut]):
        head = ReadResult(DispatchBatch.empty(offset), offset, ReadStatus.OK)
    return dataclasses.replace(result, batch=head.batch, next_offset=head.next_offset, error=None, pending=pending,
                               status=ReadStatus.OK if pending is None else ReadStatus.END, rolled=False)


def _read_records(s: Session, offset: int, max_bytes: int) -> ReadResult:
    """The records that start in [offset, offset + max_bytes), decoded now."""
    limit = s.reader.batch_bytes
    s.reader.batch_bytes = max(max_bytes, 1)
    try:
        return s.reader.read(offset, verify_end=False)
    finally:
        s.reader.batch_bytes = limit


def _rows_alike(a: DispatchBatch, b: DispatchBatch, first: int, n: int) -> int:
    """How many rows, from the first, of batch `a` dispatch as the `n` rows of batch `b` from row `first`:
    the same topic, KEYS, UNIQ_KEY and numeric columns. Compared column by column over the whole run (a
    writer's copy caught by a read is hundreds of records: a row-by-row comparison in Python cost
    milliseconds of the loop)."""
    m = min(n, len(a))
    if m <= 0:
        return 0
    rows = slice(first, first + m)
    differ = np.zeros(m, dtype=bool)
    for c in _DISPATCH_COLUMNS:
        differ |= getattr(a, c)[:m] != getattr(b, c)[rows]
    differ |= _topic_names(a)[:m] != _topic_names(b)[rows]
    differ |= _strings_differ(a.keys, 0, b.keys, first, m)
    differ |= _strings_differ(a.uniq_key, 0, b.uniq_key, first, m)
    hit = np.flatnonzero(differ)
    return int(hit[0]) if len(hit) else m


def _topic_names(batch: DispatchBatch) -> np.ndarray:
    """Each row's topic name (two reads may number topics differently)."""
    if not batch.topics:
        return np.full(len(batch), None, dtype=object)
    return np.array(batch.topics, dtype=object)[batch.topic_id]


def _strings_differ(a, i0: int, b, j0: int, m: int) -> np.ndarray:
    """For each of `m` rows, whether StringColumn `a` from row `i0` and `b` from row `j0` hold different
    values (None, or other bytes), compared as arrays."""
    text_a, at_a, len_a = a.arrays()
    text_b, at_b, len_b = b.arrays()
    at_a, len_a = at_a[i0 : i0 + m], len_a[i0 : i0 + m]
    at_b, len_b = at_b[j0 : j0 + m], len_b[j0 : j0 + m]
    differ = ((at_a < 0) != (at_b < 0)) | (len_a != len_b)
    rows = np.flatnonzero(~differ & (at_a >= 0) & (len_a > 0))
    if len(rows):
        lengths = len_a[rows].astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        bytes_a = np.frombuffer(text_a, dtype=np.uint8)[np.repeat(at_a[rows].astype(np.int64), lengths) + within]
        bytes_b = np.frombuffer(text_b, dtype=np.uint8)[np.repeat(at_b[rows].astype(np.int64), lengths) + within]
        differ[rows] |= np.logical_or.reduceat(bytes_a != bytes_b, starts)
    return differ


_DISPATCH_COLUMNS = ("phy_offset", "msg_size", "queue_id", "queue_offset", "sys_flag", "store_timestamp",
                     "tags_code", "prepared_transaction_offset")


def written_end(commit_log: CommitLog, offset: int, segments: list[tuple[int, str]] | None = None) -> int:
    """The CommitLog's max offset as a broker's operators read it: the end of the written data, wherever the
    files end. A broker creates its next segment (and the one after) before it needs them, so the newest
    files may hold nothing yet: the end is in the newest segment with data, and never below `offset`.
    Exact unless a message ends in zero bytes; it costs a few page reads per scrape. `segments` (default:
    the CommitLog's last scan) as `segments_now` lists them."""
    size = commit_log.segment_size
    for start, path in reversed(commit_log.segments if segments is None else segments):
        if start + size <= offset:
            break
        end = _data_frontier(path, start, size, max(offset, start))
        if end > start or start <= offset:
            return max(offset, end)
    return offset


def segments_now(commit_log: CommitLog, offset: int) -> list[tuple[int, str]]:
    """The segment files from the one holding `offset` on, as the directories hold them now. The loop scans
    the directories only when reading reaches the head, so while it is segments behind its scan misses
    every segment the writer added since: a scrape lists them itself (one listdir, no stat; a file that
    is not a segment is the loop's to report, not the scrape's)."""
    first = commit_log.segment_start(offset)
    found = []
    for d in commit_log.dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        found += [(int(n), os.path.join(d, n)) for n in names
                  if len(n) == FILE_NAME_DIGITS and n.isdigit() and int(n) >= first]
    return sorted(found)


def oldest_undispatched_timestamp(commit_log: CommitLog, offset: int, segments: list[tuple[int, str]]) -> int | None:
    """STORETIMESTAMP (ms) of the oldest record not dispatched yet: the one at `offset`, past a BLANK or a
    segment deleted meanwhile (the first record of the next segment listed in `segments`). None when no
    complete record head is there (caught up, or a record being written this instant)."""
    size = commit_log.segment_size
    at = offset
    for start, path in segments:
        if start + size <= at:
            continue
        at = max(at, start)
        try:
            fd = open_head(path)
            try:
                head = os.pread(fd, FIXED_PART_MAX, at - start)
            finally:
                os.close(fd)
        except OSError:
            continue  # deleted by retention since the listing: the next one
        if len(head) < RECORD_PREFIX.size:
            return None
        total, magic = RECORD_PREFIX.unpack_from(head)
        if magic == BLANK_MAGIC_CODE:
            at = start + size
            continue
        if total <= 0 or magic not in MESSAGE_MAGIC_CODES:
            return None
        fixed = fixed_part_struct(SYS_FLAG.unpack_from(head, SYS_FLAG_OFFSET)[0])
        if len(head) < fixed.size:
            return None
        fields = fixed.unpack_from(head)
        if fields[PHYSICAL_OFFSET_FIELD] != at:
            return None  # not a record head (yet): a copy in flight
        return fields[STORE_TIMESTAMP_FIELD]
    return None
