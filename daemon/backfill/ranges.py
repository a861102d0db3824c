"""Phase 1 of the backfill: a byte range of a segment, decoded into the final bytes of the output.

Segments are cut into ranges of `backfill.rangeBytes`; a task owns the records whose first byte lies in
its range. A range that starts at a known record boundary (the segment's start, or `--from`) decodes from
there; any other finds its first record by scanning for a header that validates itself: MAGICCODE at +4,
PHYSICALOFFSET at +28 equal to the file offset plus the position, a TOTALSIZE within bounds, and the same
of the record after it (or a BLANK, or the end of the written data). The task then decodes, with the
rebuild's reader rules (`indexcore.reader.read_result`), every record starting before its range's end,
reading past the end to finish the last one, and reports where it started and where it stopped. A body
may hold a forged header; the driver checks the chain (`plan.walk_ranges`) and has a range re-read from
the right boundary where the chain breaks, so the result is that of reading each segment from its start.

What a task emits is staged as files under the job's staging tree (`stage.py`): its ConsumeQueue runs
by queue, its IndexFile keys in `buildIndex` order (with the store time of the record that would create
the next IndexFile if one filled at each key) and its catalog groups; what it hands the JVM is the range's
`RangeOutcome` (pickled by `tasks.py`), so the JVM carries a few hundred bytes per range, never the output.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from daemon.backfill.boundaries import first_entry_in, first_header_in, unwritten
from daemon.backfill.source import S3Options, open_image
from daemon.backfill.stage import KEY_DTYPE, RangeStage, range_dir
from indexcore import _kernels
from indexcore.batchdecode import CATALOG_FIELDS, DecodeScratch
from indexcore.commitlog import RECORD_PREFIX
from indexcore.dispatch import DelayLevelTable, DispatchBatch
from indexcore.dledger import DLEDGER_ENTRIES
from indexcore.errors import CorruptRecordError, StoreError
from indexcore.reader import ReadStatus, decode_segment, read_result

ROLLED, END, LIMIT, CORRUPT, EMPTY = "rolled", "end", "limit", "corrupt", "empty"
NO_CREATOR = -1  # the creator time of a key whose record ends its range (as _kernels.c writes it)
_END_CHECK_SLACK = 64
MAX_LOGGED_MISMATCHES = 1000  # per range: a hostile CommitLog could have one in every record
REMOTE_TAIL_BYTES = 64 * 1024  # read past a remote range's end before the whole look-ahead
# the search for a range's first record looks this far at a time: a magic absent from the data (the v2 one
# in a v1 CommitLog, BLANK's before a segment's end) would otherwise be searched for through a whole read
_FIND_STEP = 64 * 1024


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    """What a decode task needs from the config (the Config itself holds unpicklable mappings)."""

    segment_size: int
    check_crc: bool
    max_message_size: int
    message_delay_level: str
    batch_bytes: int
    read_bytes: int
    index: bool  # emit index keys
    catalog: bool  # emit catalog rows
    catalog_body: bool
    s3: S3Options = field(default_factory=S3Options)
    multi_flags: int = 0  # multidispatch.multi_dispatch_flags of the store settings
    stage_root: str = ""  # where each range's attempt stages its files (`stage.py`)
    dledger_from: int = -1  # DLedger mode: segments from this offset on hold DLedger entries (dledger.py)

    def flags(self, seg_start: int) -> int:
        """The decode flags of a segment: DLEDGER_ENTRIES for a DLedger data file, CATALOG_FIELDS with a catalog."""
        dledger = 0 <= self.dledger_from <= seg_start
        return self.multi_flags | (DLEDGER_ENTRIES if dledger else 0) | (CATALOG_FIELDS if self.catalog else 0)

    @property
    def lookahead(self) -> int:
        """Bytes past a window a decode may read: its last record, then the end-of-data checks."""
        return 2 * self.max_message_size + _END_CHECK_SLACK


@dataclass(frozen=True, slots=True)
class RangeTask:
    """Records starting in [seg_start + begin, seg_start + end) of one segment; `known`: begin is a record
    boundary (the segment's start or --from); `to_limit`: end is --to."""

    number: int
    segment: int
    seg_start: int
    location: str
    begin: int
    end: int
    known: bool
    to_limit: bool
    written_successor: bool


@dataclass(slots=True)
class RangeOutcome:
    """Where a range's decode started and stopped, and what the driver needs to plan the IndexFiles."""

    number: int
    segment: int
    seg_start: int
    location: str
    begin: int
    end: int
    status: str = EMPTY
    first: int | None = None  # CommitLog offset of its first record; None: no record starts in the range
    next_offset: int | None = None  # where reading stopped
    error: StoreError | None = None
    pending: CorruptRecordError | None = None
    records: int = 0
    keys: int = 0
    first_ts: int = 0
    last_key_owner_is_last: bool = False  # no record of the range follows the owner of its last key
    reread: bool = False
    bytes_read: int = 0  # from a remote store
    staged_bytes: int = 0  # units, keys and catalog streams staged as files
    stage_dir: str = ""
    bucket_units: dict = field(default_factory=dict)  # queue bucket (stage.queue_bucket) -> units staged
    catalog_rows: dict = field(default_factory=dict)  # (topic, UTC day) -> catalog rows staged
    seconds: float = 0.0  # the task's decode time
    # records whose multi-dispatch name and offset counts differ (the broker logs each): (offset, topic) of
    # the first MAX_LOGGED_MISMATCHES, and how many more
    count_mismatch: list[tuple[int, str]] = field(default_factory=list)
    count_mismatch_omitted: int = 0


def plan_ranges(segments, segment_size: int, from_offset: int, to_offset: int | None,
                range_bytes: int) -> list[RangeTask]:
    """The ranges of [from, to): cut at multiples of `range_bytes` from each segment's start."""
    tasks: list[RangeTask] = []
    for index, seg in enumerate(segments):
        if seg.start + segment_size <= from_offset or (to_offset is not None and seg.start >= to_offset):
            continue
        lo = max(0, from_offset - seg.start)
        hi = segment_size if to_offset is None else min(segment_size, to_offset - seg.start)
        begin = lo
        while begin < hi:
            end = min(hi, (begin // range_bytes + 1) * range_bytes)
            tasks.append(RangeTask(len(tasks), index, seg.start, seg.location, begin, end, begin == lo,
                                   end == hi and to_offset is not None and seg.start + hi == to_offset,
                                   seg.written_successor))
            begin = end
    return tasks


# --- finding the first record of a range ----------------------------------------------------------------

def find_first_record(image, task: RangeTask, settings: DecodeSettings) -> int | None:
    """The in-segment position of the first self-validating header (a DLedger entry's in a DLedger data file)
    in [begin, end), or None."""
    size, max_size = settings.segment_size, settings.max_message_size
    first_in = first_entry_in if settings.flags(task.seg_start) & DLEDGER_ENTRIES else first_header_in
    pos = task.begin
    while pos < task.end:
        if unwritten(image, pos, min(size, pos + settings.lookahead)):
            # zeros this long cannot lie inside a record: the sequential reader stops (end of the written data,
            # or corruption) at the record boundary within their first maximal message, so nothing from here
            # on is ever dispatched
            return None
        hi = min(task.end, pos + settings.read_bytes)
        image.ensure(pos, hi + settings.lookahead)
        for lo in range(pos, hi, _FIND_STEP):
            found = first_in(image.buffer, lo, min(hi, lo + _FIND_STEP), task.seg_start, size, max_size)
            if found is not None:
                return found
        image.release(pos, hi)
        pos = hi
    return None


class RangeRows:
    """Stages the decoded windows of one range (`stage.RangeStage`); its only row is the outcome."""

    def __init__(self, task: RangeTask, outcome: RangeOutcome, settings: DecodeSettings, stage: RangeStage):
        self.catalog_window = None
        if settings.catalog:  # pyarrow and parquet: only for a run that writes a catalog
            from daemon.backfill.catalog import catalog_window  # noqa: PLC0415

            self.catalog_window = catalog_window
        self.task = task
        self.outcome = outcome
        self.settings = settings
        self.stage = stage
        self.held: np.ndarray | None = None  # the last key, whose creator time waits for the next record
        self.key_scratch = np.empty(0, dtype=KEY_DTYPE)  # each window's key records, reused

    def add(self, batch: DispatchBatch, image) -> None:
        n = len(batch)
        o = self.outcome
        if o.records == 0:
            o.first_ts = int(batch.store_timestamp[0])
        self.stage.add_units(batch)
        for row in batch.multi_count_mismatch.tolist():
            if len(o.count_mismatch) < MAX_LOGGED_MISMATCHES:
                o.count_mismatch.append((int(batch.phy_offset[row]), batch.topic_of(row)))
            else:
                o.count_mismatch_omitted += 1
        if self.held is not None:
            self.held["creator"][-1] = batch.store_timestamp[0]
            self.stage.add_keys(self.held)
            self.held = None
        if self.settings.index:
            self._keys(batch)
        if self.settings.catalog:
            staged = self.catalog_window(batch, image.buffer, self.settings.catalog_body)
            if staged is not None:
                self.stage.add_catalog(*staged)
        o.records += n

    def _keys(self, batch: DispatchBatch) -> None:
        """Stage the window's IndexFile keys (`_kernels.key_records`); the last one waits for the next window when
        its record is the window's last (its creator time is the next record's store time)."""
        o = self.outcome
        if len(self.key_scratch) < len(batch.key_hash):
            self.key_scratch = np.empty(2 * len(batch.key_hash), dtype=KEY_DTYPE)
        k, last_owner_is_last = _kernels.key_records(
            self.key_scratch, _int64(batch.key_hash), _int64(batch.key_owner), batch.index_mask(),
            _int64(batch.phy_offset), _int64(batch.store_timestamp))
        if not k:
            if o.keys:
                o.last_key_owner_is_last = False
            return
        o.keys += k
        o.last_key_owner_is_last = last_owner_is_last
        run = self.key_scratch[: k - 1 if last_owner_is_last else k]
        if len(run):
            self.stage.add_keys(run)
        if last_owner_is_last:
            self.held = self.key_scratch[k - 1 : k].copy()

    def finish(self) -> Iterator:
        if self.held is not None:
            self.stage.add_keys(self.held)
            self.held = None
        self.stage.close()
        o = self.outcome
        o.stage_dir = self.stage.directory
        o.bucket_units = self.stage.bucket_units()
        o.catalog_rows = self.stage.catalog_rows()
        o.staged_bytes = self.stage.unit_bytes + self.stage.key_count * KEY_DTYPE.itemsize + self.stage.catalog_bytes
        yield o


def _int64(column: np.ndarray) -> np.ndarray:
    """A batch column as the kernels read it (the decoder's columns are already: no copy)."""
    return np.ascontiguousarray(column, dtype=np.int64)


def decode_range(task: RangeTask, settings: DecodeSettings, start: int | None = None,
                 attempt_id: int = 0) -> Iterator:
    """Stage one range's output; yields its outcome and returns it. `start`: a record boundary
    (CommitLog offset) to read from instead of scanning (the driver's re-read of a range whose chain broke);
    `attempt_id`: Spark's, so that every attempt stages in a directory of its own."""
    started = time.perf_counter()
    outcome = RangeOutcome(task.number, task.segment, task.seg_start, task.location, task.begin, task.end,
                           reread=start is not None)
    stage = RangeStage(range_dir(settings.stage_root, task.number, attempt_id) + ("-re" if start is not None else ""),
                       settings.catalog)
    rows = RangeRows(task, outcome, settings, stage)
    size = settings.segment_size
    try:
        image = open_image(task.location, size, settings.read_bytes, settings.s3, ahead_limit=task.end)
    except BaseException:
        stage.abandon()
        raise
    try:
        if start is not None:
            first = start - task.seg_start
        elif task.known:
            first = task.begin
        else:
            first = find_first_record(image, task, settings)
        if first is not None and first < task.end:
            outcome.first = task.seg_start + first
            _decode_from(first, task, settings, image, rows, outcome)
        elif first is not None:
            outcome.first = task.seg_start + first  # a re-read from a boundary past the range: nothing owned
            outcome.next_offset = outcome.first
    except BaseException:
        stage.abandon()
        raise
    finally:
        image.close()  # first: a read in flight is counted when it completes
        outcome.bytes_read = getattr(image, "bytes_read", 0)
    outcome.seconds = time.perf_counter() - started
    yield from rows.finish()
    return outcome


def _decided_within(result, seg_start: int, filled: int, lookahead: int) -> bool:
    """Whether a window's decode read only bytes below `filled` (in-segment): every record it took ends
    there, and where it stopped for good (the end of the data, corruption) had the whole look-ahead."""
    batch = result.batch
    if len(batch) and int((batch.phy_offset + batch.msg_size).max()) - seg_start > filled:
        return False
    if result.status is ReadStatus.END or result.status is ReadStatus.CORRUPT:
        return result.next_offset - seg_start + lookahead <= filled
    return result.next_offset - seg_start + RECORD_PREFIX.size <= filled


# The kernel's buffers, one set per process: a worker decodes one window at a time and a batch takes copies of
# what it needs, so the buffers the first range grew (keys, text) and faulted in (the records table) serve every
# range after it. Made anew for each range, they cost 0.3-0.35 instead of 0.26-0.28 us a message in-process.
_SCRATCH = DecodeScratch()
# The topics and queue names found safe, one table per process too (`decode_segment`'s `names`; a name is safe
# whatever the CommitLog): made anew for each range, a range of a store of 2,000 topics checked each again
# (~5 us a name).
_NAMES: dict[bytes, str] = {}


def _decode_from(pos: int, task: RangeTask, settings: DecodeSettings, image, rows: RangeRows,
                 outcome: RangeOutcome) -> None:
    scratch, names = _SCRATCH, _NAMES
    delay_table = DelayLevelTable(settings.message_delay_level)
    size = settings.segment_size
    while True:
        window_end = min(pos + settings.batch_bytes, task.end)
        full = min(size, window_end + settings.lookahead)
        # a remote window is first read only a little past its end: what its last record needs, most of the
        # time; the whole look-ahead (up to two maximal messages) only when that was not enough (a range's last
        # window read it past the range's end, and each window before it into the next one's)
        ensured = min(full, window_end + REMOTE_TAIL_BYTES) if image.remote else full
        while True:
            image.ensure(pos, ensured)
            decoded = decode_segment(image.buffer, pos, segment_offset=task.seg_start, segment_size=size,
                                     max_bytes=window_end - pos, check_crc=settings.check_crc,
                                     max_message_size=settings.max_message_size, delay_table=delay_table,
                                     scratch=scratch, multi_flags=settings.flags(task.seg_start), names=names)
            result = read_result(decoded, image.buffer, task.seg_start, size, task.location,
                                 settings.max_message_size, lambda: task.written_successor)
            if ensured >= full or _decided_within(result, task.seg_start, ensured, settings.lookahead):
                break
            ensured = full
        if len(result.batch):
            rows.add(result.batch, image)
        image.release(pos, decoded.position)
        outcome.next_offset = result.next_offset
        if result.status is ReadStatus.END:
            outcome.status, outcome.pending = END, result.pending
            return
        if result.status is ReadStatus.CORRUPT:
            outcome.status, outcome.error = CORRUPT, result.error
            return
        if result.rolled:
            outcome.status = ROLLED
            return
        pos = result.next_offset - task.seg_start
        if pos >= task.end:
            outcome.status = LIMIT
            return
