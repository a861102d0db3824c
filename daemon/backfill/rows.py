"""Phase 1 of the backfill: one CommitLog segment, decoded into compact dispatch rows.

A task maps its segment (`CommitLogReader` keeps one segment mapped and releases each decoded window),
reads it window by window from its first record (or `--from`) to its BLANK, the end of the written data,
a corrupt record or `--to`, and yields one `RowChunk` per window, then one `SegmentOutcome` saying where
and why it stopped. A record never spans two segments, so segments decode independently; whether a stop
is the end of the data or corruption is decided exactly as `reputd rebuild` decides it, by the same
reader, against the same directory.

A chunk is columnar: the dispatch fields of each record (numpy arrays), and, for the index, how many
keys each record puts (`topic#UNIQ_KEY`, then `topic#token` for every KEYS token, nothing for ROLLBACK)
and the `index_key_hash` of every key in that order. The key strings are dropped unless a catalog is
written: the index needs only their hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from indexcore.dispatch import DelayLevelTable, DispatchBatch
from indexcore.errors import CorruptRecordError, StoreError
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus

ROLLED, END, LIMIT, CORRUPT = "rolled", "end", "limit", "corrupt"


@dataclass(frozen=True, slots=True)
class ReadSettings:
    """What a decode task needs from the config (the Config itself holds unpicklable mappings)."""

    check_crc: bool
    max_message_size: int
    message_delay_level: str
    batch_bytes: int
    index: bool  # compute index key hashes
    keep_strings: bool  # keep KEYS and UNIQ_KEY (for the catalog)


@dataclass(frozen=True, slots=True)
class SegmentTask:
    """One segment to decode: `number` orders segments, `read_from`/`read_to` clip it to the range."""

    number: int
    start: int
    path: str
    read_from: int
    read_to: int | None  # stop before the first record starting at or after it


class RowChunk(NamedTuple):
    """The dispatch rows of one decoded window, columnar."""

    segment: int
    window: int
    phy_offset: np.ndarray  # int64
    msg_size: np.ndarray  # int32
    queue_id: np.ndarray  # int32
    queue_offset: np.ndarray  # int64
    sys_flag: np.ndarray  # int32
    store_timestamp: np.ndarray  # int64
    tags_code: np.ndarray  # int64
    topic_id: np.ndarray  # int32, into `topics`
    topics: tuple[str, ...]
    consume_queue: np.ndarray  # bool, the record gets a ConsumeQueue unit (NOT_TYPE, COMMIT_TYPE)
    key_count: np.ndarray  # int32, index keys of each record
    key_hash: np.ndarray  # int32, index_key_hash of each key, in record order
    keys: list[str | None] | None
    uniq_key: list[str | None] | None

    @property
    def records(self) -> int:
        return len(self.phy_offset)

    @property
    def chunk_id(self) -> tuple[int, int]:
        return self.segment, self.window

    def head(self, n: int) -> RowChunk:
        """The first n records (a CommitLog only grows at its end, so a re-decoded window that found more
        records than the first decode is cut back to them)."""
        keys = int(self.key_count[:n].sum())
        return self._replace(
            phy_offset=self.phy_offset[:n], msg_size=self.msg_size[:n], queue_id=self.queue_id[:n],
            queue_offset=self.queue_offset[:n], sys_flag=self.sys_flag[:n], store_timestamp=self.store_timestamp[:n],
            tags_code=self.tags_code[:n], topic_id=self.topic_id[:n], consume_queue=self.consume_queue[:n],
            key_count=self.key_count[:n], key_hash=self.key_hash[:keys],
            keys=self.keys[:n] if self.keys is not None else None,
            uniq_key=self.uniq_key[:n] if self.uniq_key is not None else None)


class WindowMeta(NamedTuple):
    """What the driver needs of a chunk to plan the IndexFiles: its size in records (never 0) and keys,
    and the store time of its first record (a file created by that record is named after it)."""

    records: int
    keys: int
    first_ts: int


@dataclass(slots=True)
class SegmentOutcome:
    """Where and why a segment's decode stopped; `windows` describes the chunks it emitted, in order
    (`windows[w]` is the chunk of window w)."""

    number: int
    start: int
    path: str
    status: str  # ROLLED (BLANK), END (end of written data), LIMIT (reached read_to), CORRUPT
    next_offset: int  # where reading stopped: the next segment's start after a BLANK
    error: StoreError | None = None
    pending: CorruptRecordError | None = None  # a torn record at the end of the written data
    windows: list[WindowMeta] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(w.records for w in self.windows)


def row_chunk(segment: int, window: int, batch: DispatchBatch, settings: ReadSettings) -> RowChunk:
    """Compact rows of a decoded batch: the numeric columns, and the index keys as hashes."""
    n = len(batch)
    if settings.index:
        key_hash, owners = batch.index_keys(batch.index_mask())
        key_count = np.bincount(owners, minlength=n).astype(np.int32)
    else:
        key_hash, key_count = np.zeros(0, dtype=np.int32), np.zeros(n, dtype=np.int32)
    return RowChunk(segment, window, batch.phy_offset, batch.msg_size, batch.queue_id, batch.queue_offset,
                    batch.sys_flag, batch.store_timestamp, batch.tags_code, batch.topic_id, batch.topics,
                    batch.consume_queue_mask(), key_count, key_hash, batch.keys if settings.keep_strings else None,
                    batch.uniq_key if settings.keep_strings else None)


def decode_segment_rows(task: SegmentTask, log: CommitLog, settings: ReadSettings):
    """Yield the RowChunks of one segment, then its SegmentOutcome (always last)."""
    reader = CommitLogReader(log, check_crc=settings.check_crc, max_message_size=settings.max_message_size,
                             delay_table=DelayLevelTable(settings.message_delay_level),
                             batch_bytes=settings.batch_bytes)
    offset = task.read_from
    windows: list[WindowMeta] = []
    status = None
    try:
        while status is None:
            if task.read_to is not None:
                # a window stops before the first record starting `batch_bytes` or more past its start
                reader.batch_bytes = max(1, min(settings.batch_bytes, task.read_to - offset))
            result = reader.read(offset)
            batch = result.batch
            if len(batch):
                chunk = row_chunk(task.number, len(windows), batch, settings)
                windows.append(WindowMeta(len(batch), len(chunk.key_hash), int(batch.store_timestamp[0])))
                yield chunk
            offset = result.next_offset
            if result.status is ReadStatus.END:
                status = END
            elif result.status is ReadStatus.CORRUPT:
                status = CORRUPT
            elif result.rolled:
                status = ROLLED
            elif task.read_to is not None and offset >= task.read_to:
                status = LIMIT
    finally:
        reader.close()
    # a reader sets `error` only with CORRUPT and `pending` only with END
    yield SegmentOutcome(task.number, task.start, task.path, status, offset, error=result.error,
                         pending=result.pending, windows=windows)
