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

What a task emits is the output itself, as Arrow rows (`DECODED_SCHEMA`), never per-record objects:

    UNITS    a run of ConsumeQueue units of one queue with consecutive queue offsets: the 20-byte units as
             they lie in the file, keyed by (topic, queue id, physical offset of the first unit, row
             sequence: a name repeated in one record starts two runs at one offset) and the first queue
             offset; units come from `consumequeue.consume_queue_units` (multi-dispatch targets included,
             with `multi_flags`), as the rebuild's do
    KEYS     the IndexFile keys of a window in `buildIndex` order: hash (int32), physical offset and store
             time (int64) of the owning record, and the store time of the record that would create the next
             IndexFile if one filled at this key (int64; -1 when that record is in the next range)
    CATALOG  the window's catalog rows of one (topic, day), an Arrow IPC stream (`catalog.py`)
    META     the range's `RangeOutcome`, pickled, always the last row
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from daemon.backfill.source import S3Options, open_image
from indexcore.batchdecode import DecodeScratch
from indexcore.commitlog import (
    BLANK_MAGIC_CODE,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    MIN_RECORD_SIZE,
    PHYSICAL_OFFSET_OFFSET,
    RECORD_PREFIX,
)
from indexcore.consumequeue import CQ_UNIT_SIZE, consume_queue_units
from indexcore.dispatch import DelayLevelTable, DispatchBatch
from indexcore.errors import CorruptRecordError, StoreError
from indexcore.reader import ReadStatus, decode_segment, read_result

ROLLED, END, LIMIT, CORRUPT, EMPTY = "rolled", "end", "limit", "corrupt", "empty"
META, UNITS, KEYS, CATALOG = 0, 1, 2, 3
DECODED_DDL = ("kind tinyint, range int, seq int, topic string, queue int, pos bigint, aux bigint, count int, "
               "data binary")
NO_CREATOR = -1
KEY_RECORD_BYTES = 4 + 8 + 8 + 8  # hash, physical offset, store time, creator time
PHYSICAL_OFFSET = struct.Struct(">q")
_MAGICS = tuple(struct.pack(">i", m) for m in (MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2, BLANK_MAGIC_CODE))
_MAGIC_AT = 4  # MAGICCODE's offset in a record
_END_CHECK_SLACK = 64
MAX_ROW_ITEMS = 16384  # units or keys per row: rows of at most 448 KiB
BINARY_MAX_BYTES = 2**31 - 1  # an Arrow binary column's int32 offsets
MAX_LOGGED_MISMATCHES = 1000  # per range: a hostile CommitLog could have one in every record
_ZERO_PROBE = 1 << 20
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
    arrow_bytes: int = 0  # the Arrow batches this task handed to the JVM
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

def header_at(buf, p: int, seg_start: int, seg_size: int, max_size: int, follow: int = 1) -> bool:
    """Whether a record (or BLANK) that validates itself starts at p, and, `follow` deep, the one after."""
    if p + RECORD_PREFIX.size > seg_size:
        return False
    total, magic = RECORD_PREFIX.unpack_from(buf, p)
    if magic == BLANK_MAGIC_CODE:
        return total == seg_size - p
    if magic not in (MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2):
        return False
    if not MIN_RECORD_SIZE <= total <= min(max_size, seg_size - p):
        return False
    if PHYSICAL_OFFSET.unpack_from(buf, p + PHYSICAL_OFFSET_OFFSET)[0] != seg_start + p:
        return False
    if follow == 0:
        return True
    nxt = p + total
    if nxt + RECORD_PREFIX.size > seg_size:
        return False
    if RECORD_PREFIX.unpack_from(buf, nxt)[0] == 0:
        return True  # the end of the written data
    return header_at(buf, nxt, seg_start, seg_size, max_size, follow - 1)


def find_first_record(image, task: RangeTask, settings: DecodeSettings) -> int | None:
    """The in-segment position of the first self-validating header in [begin, end), or None."""
    size, max_size = settings.segment_size, settings.max_message_size
    pos = task.begin
    while pos < task.end:
        if _unwritten(image, pos, min(size, pos + settings.lookahead)):
            # zeros this long cannot lie inside a record: the sequential reader stops (end of the written data,
            # or corruption) at the record boundary within their first maximal message, so nothing from here
            # on is ever dispatched
            return None
        hi = min(task.end, pos + settings.read_bytes)
        image.ensure(pos, hi + settings.lookahead)
        for lo in range(pos, hi, _FIND_STEP):
            found = _first_header_in(image.buffer, lo, min(hi, lo + _FIND_STEP), task.seg_start, size, max_size)
            if found is not None:
                return found
        image.release(pos, hi)
        pos = hi
    return None


def _first_header_in(buf, lo: int, hi: int, seg_start: int, seg_size: int, max_size: int) -> int | None:
    """The first position p in [lo, hi) where a self-validating header starts, found by its MAGICCODE at
    p + 4 (each magic's search may end 4 bytes past hi, so that no p below hi is missed)."""
    end = {m: hi + _MAGIC_AT + len(m) - 1 for m in _MAGICS}
    upcoming = {m: buf.find(m, lo + _MAGIC_AT, end[m]) for m in _MAGICS}
    while True:
        live = [at for at in upcoming.values() if at >= 0]
        if not live:
            return None
        at = min(live)
        p = at - _MAGIC_AT
        if header_at(buf, p, seg_start, seg_size, max_size):
            return p
        for m, found in upcoming.items():
            if found == at:
                upcoming[m] = buf.find(m, at + 1, end[m])


def _unwritten(image, start: int, end: int) -> bool:
    """Whether [start, end) holds only zeros (a hole, by SEEK_DATA, or read a MiB at a time)."""
    if image.next_data(start) >= end:
        return True
    image.ensure(start, end)
    view = np.frombuffer(image.buffer, dtype=np.uint8, count=end - start, offset=start)
    return not any(np.count_nonzero(view[i : i + _ZERO_PROBE]) for i in range(0, len(view), _ZERO_PROBE))


# --- the decode ------------------------------------------------------------------------------------------

class RangeRows:
    """Turns the decoded windows of one range into Arrow record batches of DECODED_SCHEMA."""

    def __init__(self, task: RangeTask, outcome: RangeOutcome, settings: DecodeSettings):
        import pyarrow as pa  # noqa: PLC0415

        self.pa = pa
        self.catalog_groups = None
        if settings.catalog:  # pyarrow.compute and parquet: only for a run that writes a catalog
            from daemon.backfill.catalog import catalog_groups  # noqa: PLC0415

            self.catalog_groups = catalog_groups
        self.task = task
        self.outcome = outcome
        self.settings = settings
        self.seq = 0
        self.held: dict | None = None  # the last key run, whose final creator time waits for the next record
        self.schema = decoded_arrow_schema()

    def add(self, batch: DispatchBatch, image) -> Iterator:
        n = len(batch)
        o = self.outcome
        if o.records == 0:
            o.first_ts = int(batch.store_timestamp[0])
        rows = self._units(batch)
        for row in batch.multi_count_mismatch.tolist():
            if len(o.count_mismatch) < MAX_LOGGED_MISMATCHES:
                o.count_mismatch.append((int(batch.phy_offset[row]), batch.topic_of(row)))
            else:
                o.count_mismatch_omitted += 1
        if self.held is not None:
            self.held["creators"][-1] = batch.store_timestamp[0]
            rows.extend(self._key_rows(self.held))
            self.held = None
        if self.settings.index:
            hashes, owners = batch.index_keys(batch.index_mask())
            k = len(hashes)
            if k:
                last_of_owner = np.ones(k, dtype=bool)
                last_of_owner[:-1] = owners[1:] != owners[:-1]
                ts = batch.store_timestamp
                following = np.minimum(owners + 1, n - 1)
                creators = np.where(last_of_owner, ts[following], ts[owners]).astype(np.int64)
                key_run = {"pos": o.keys, "hashes": hashes, "phy": batch.phy_offset[owners], "ts": ts[owners],
                           "creators": creators}
                o.keys += k
                if int(owners[-1]) == n - 1:
                    creators[-1] = NO_CREATOR
                    self.held = key_run
                    o.last_key_owner_is_last = True
                else:
                    rows.extend(self._key_rows(key_run))
                    o.last_key_owner_is_last = False
            elif o.keys:
                o.last_key_owner_is_last = False
        if self.settings.catalog:
            for topic, day, blob, count in self.catalog_groups(batch, image.buffer, self.task.seg_start,
                                                               self.settings.catalog_body):
                rows.append({"kind": CATALOG, "topic": topic, "aux": day, "count": count, "data": blob})
        o.records += n
        if rows:
            yield self._batch(rows)

    def finish(self) -> Iterator:
        rows = []
        if self.held is not None:
            rows.extend(self._key_rows(self.held))
            self.held = None
        rows.append({"kind": META, "data": pickle.dumps(self.outcome)})
        yield self._batch(rows)

    def _units(self, batch: DispatchBatch) -> list[dict]:
        """One row per run of a queue's units with consecutive queue offsets (at most MAX_ROW_ITEMS), in
        CommitLog order."""
        rows = []
        for q in consume_queue_units(batch):
            n = len(q.units)
            cut = np.ones(n, dtype=bool)
            cut[1:] = np.diff(q.queue_offset) != 1
            cut[::MAX_ROW_ITEMS] = True
            starts = np.flatnonzero(cut)
            ends = np.append(starts[1:], n)
            data = q.units.view(np.uint8).reshape(-1)
            phy = q.units["commit_log_offset"]
            rows.extend({"kind": UNITS, "topic": q.topic, "queue": q.queue_id, "pos": int(phy[a]),
                         "aux": int(q.queue_offset[a]), "count": int(b - a),
                         "data": data[a * CQ_UNIT_SIZE : b * CQ_UNIT_SIZE]}
                        for a, b in zip(starts.tolist(), ends.tolist(), strict=True))
        return rows

    def _key_rows(self, run: dict) -> list[dict]:
        """A key run as rows of at most MAX_ROW_ITEMS keys (large values strain the JVM's heap)."""
        rows = []
        for a in range(0, len(run["hashes"]), MAX_ROW_ITEMS):
            b = a + MAX_ROW_ITEMS
            data = b"".join((run["hashes"][a:b].astype("<i4").tobytes(), run["phy"][a:b].astype("<i8").tobytes(),
                             run["ts"][a:b].astype("<i8").tobytes(), run["creators"][a:b].astype("<i8").tobytes()))
            rows.append({"kind": KEYS, "pos": run["pos"] + a, "count": len(run["hashes"][a:b]), "data": data})
        return rows

    def _batch(self, rows: list[dict]):
        batch = self._arrow(rows)
        self.outcome.arrow_bytes += batch.nbytes
        return batch

    def _arrow(self, rows: list[dict]):
        pa = self.pa
        n = len(rows)
        seq = range(self.seq, self.seq + n)
        self.seq += n
        return pa.RecordBatch.from_arrays([
            arrow_column([r["kind"] for r in rows], pa.int8()),
            arrow_column([self.task.number] * n, pa.int32()),
            arrow_column(seq, pa.int32()),
            arrow_column([r.get("topic") for r in rows], pa.string()),
            arrow_column([r.get("queue") for r in rows], pa.int32()),
            arrow_column([r.get("pos") for r in rows], pa.int64()),
            arrow_column([r.get("aux") for r in rows], pa.int64()),
            arrow_column([r.get("count") for r in rows], pa.int32()),
            arrow_column([r["data"] for r in rows], pa.binary()),
        ], schema=self.schema)


def arrow_column(values, arrow_type):
    """An Arrow array of `values` (None for null) built from its buffers: ints of an integer type, or str, bytes
    and slices of numpy arrays for a string or binary type, copied once into one buffer.

    Not `pa.array`: its first call imports pandas when pandas is installed (a quarter of a second in every
    Python worker), and it keeps a reference to every buffer-protocol object it is given (the memoryview
    of a numpy slice), so each window's unit array stayed alive and a worker grew by it range after range."""
    import pyarrow as pa  # noqa: PLC0415

    values = list(values)
    n = len(values)
    present = [v is not None for v in values]
    validity = None if all(present) else pa.py_buffer(np.packbits(present, bitorder="little"))
    if pa.types.is_integer(arrow_type):
        data = np.array([0 if v is None else v for v in values], dtype=arrow_type.to_pandas_dtype())
        return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(data)])
    pieces = [b"" if v is None else v.encode() if isinstance(v, str) else v for v in values]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(p) if isinstance(p, bytes) else p.nbytes for p in pieces], out=offsets[1:])
    if offsets[-1] > BINARY_MAX_BYTES:
        raise ValueError(f"{offsets[-1]} bytes in one Arrow column: over the {BINARY_MAX_BYTES} its offsets reach")
    return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(offsets.astype(np.int32)),
                                                 pa.py_buffer(b"".join(pieces))])


def decoded_arrow_schema():
    import pyarrow as pa  # noqa: PLC0415

    return pa.schema([("kind", pa.int8()), ("range", pa.int32()), ("seq", pa.int32()), ("topic", pa.string()),
                      ("queue", pa.int32()), ("pos", pa.int64()), ("aux", pa.int64()), ("count", pa.int32()),
                      ("data", pa.binary())])


def decode_range(task: RangeTask, settings: DecodeSettings, start: int | None = None) -> Iterator:
    """The Arrow batches of one range, its META row last. `start`: a record boundary (CommitLog offset)
    to read from instead of scanning (the driver's re-read of a range whose chain broke)."""
    started = time.perf_counter()
    outcome = RangeOutcome(task.number, task.segment, task.seg_start, task.location, task.begin, task.end,
                           reread=start is not None)
    rows = RangeRows(task, outcome, settings)
    size = settings.segment_size
    image = open_image(task.location, size, settings.read_bytes, settings.s3)
    try:
        if start is not None:
            first = start - task.seg_start
        elif task.known:
            first = task.begin
        else:
            first = find_first_record(image, task, settings)
        if first is not None and first < task.end:
            outcome.first = task.seg_start + first
            yield from _decode_from(first, task, settings, image, rows, outcome)
        elif first is not None:
            outcome.first = task.seg_start + first  # a re-read from a boundary past the range: nothing owned
            outcome.next_offset = outcome.first
    finally:
        outcome.bytes_read = getattr(image, "bytes_read", 0)
        image.close()
    outcome.seconds = time.perf_counter() - started
    yield from rows.finish()
    return outcome


def _decode_from(pos: int, task: RangeTask, settings: DecodeSettings, image, rows: RangeRows,
                 outcome: RangeOutcome) -> Iterator:
    scratch = DecodeScratch()
    names: dict[bytes, str] = {}
    delay_table = DelayLevelTable(settings.message_delay_level)
    size = settings.segment_size
    while True:
        window_end = min(pos + settings.batch_bytes, task.end)
        image.ensure(pos, window_end + settings.lookahead)
        decoded = decode_segment(image.buffer, pos, segment_offset=task.seg_start, segment_size=size,
                                 max_bytes=window_end - pos, check_crc=settings.check_crc,
                                 max_message_size=settings.max_message_size, delay_table=delay_table,
                                 scratch=scratch, multi_flags=settings.multi_flags, names=names)
        result = read_result(decoded, image.buffer, task.seg_start, size, task.location, settings.max_message_size,
                             lambda: task.written_successor)
        if len(result.batch):
            yield from rows.add(result.batch, image)
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
