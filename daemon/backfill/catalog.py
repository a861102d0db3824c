"""The Parquet catalog `reputd backfill --catalog PATH` writes: one row per dispatched message, typed.

    PATH/topic=<topic>/date=<yyyy-mm-dd>/part-<from>-<to>.parquet   (UTC day of the store time; [from, to)
                                                                     the backfill's CommitLog range)
    PATH/_reputd-backfills/<from>-<to>                             one empty marker per committed backfill

Columns (camelCase, as `reputd query --json` names them): commitLogOffset, msgSize, queueId, queueOffset,
storeTime and bornTime (timestamp, ms), tags, tagsCode, sysFlag, keys (array<string>: the non-empty KEYS
tokens), uniqKey, msgId (the offset msgId), realTopic and realQueueId (a delayed message's own topic and
queue; null for others), bodySize, body (only with `backfill.catalogBody`); `topic` and `date` are the
partition columns, in the directory names only (stored in the files too, they had two types, and pandas
and pyarrow refused the catalog). A later backfill appends: it leaves out the rows of the ranges the
markers name, so a rerun adds nothing and a later range extends each day's partition with a file.

The decode task builds the rows of each window straight from the segment image with numpy and Arrow
compute (fixed-offset fields gathered, properties found by array operations over the batch), groups them by
(topic, day) and ships each group as an Arrow IPC stream; the writer task of a (topic, day) partition
concatenates its groups in CommitLog order into one file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs

from daemon.backfill.source import LOCAL, S3Options, parse_segment_dirs, remote_filesystem
from indexcore.commitlog import (
    BORN_HOST_OFFSET,
    BORN_TIMESTAMP_OFFSET,
    BORNHOST_V6_FLAG,
    HOST_V4_LENGTH,
    HOST_V6_LENGTH,
    MAGIC_CODE_OFFSET,
    MESSAGE_MAGIC_CODE,
    PROPERTIES_LENGTH,
    STOREHOSTADDRESS_V6_FLAG,
    TOPIC_LENGTH_SIZE_V1,
    TOPIC_LENGTH_SIZE_V2,
)
from indexcore.dispatch import DispatchBatch

STORE_HOST_AFTER_BORN_HOST = 8  # STORETIMESTAMP
BODY_LENGTH_AFTER_STORE_HOST = 4 + 8  # RECONSUMETIMES, PREPAREDTRANSACTIONOFFSET
BODY_AFTER_STORE_HOST = BODY_LENGTH_AFTER_STORE_HOST + 4
PHYSICAL_OFFSET_SIZE = 8
MS_PER_DAY = 86_400_000
_HEX = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)
_UTC_MS = pa.timestamp("ms", tz="UTC")
PROPERTY_SEPARATOR = 2

SCHEMA = pa.schema([
    ("commitLogOffset", pa.int64()), ("msgSize", pa.int32()), ("queueId", pa.int32()),
    ("queueOffset", pa.int64()), ("storeTime", _UTC_MS), ("bornTime", _UTC_MS), ("tags", pa.string()),
    ("tagsCode", pa.int64()), ("sysFlag", pa.int32()), ("keys", pa.list_(pa.string())), ("uniqKey", pa.string()),
    ("msgId", pa.string()), ("realTopic", pa.string()), ("realQueueId", pa.int32()), ("bodySize", pa.int32()),
])
BODY_FIELD = pa.field("body", pa.binary())

# docs/backfill.md's examples, over `spark.read.parquet(PATH).createOrReplaceTempView("catalog")`.
CATALOG_QUERIES = {
    "key": ("SELECT commitLogOffset, msgId, queueId, queueOffset, storeTime, tags, keys FROM catalog "
            "WHERE topic = '{topic}' AND array_contains(keys, '{key}') "
            "AND date >= DATE'{start}' AND date < DATE'{end}' ORDER BY storeTime"),
    "per_day": "SELECT topic, date, count(*) AS messages FROM catalog GROUP BY topic, date ORDER BY topic, date",
}


def _be(img: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """Big-endian signed integers of `width` bytes at positions `at`."""
    raw = img[at[:, None] + np.arange(width)]
    return raw.copy().view(f">i{width}").reshape(-1).astype(np.int64)


def _gather(img: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The byte strings img[start:start+length], concatenated, and their int32 offsets."""
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    idx = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1] - starts, lengths)
    return img[idx], offsets.astype(np.int32)


def _binary(data: np.ndarray, offsets: np.ndarray) -> pa.Array:
    return pa.Array.from_buffers(pa.binary(), len(offsets) - 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _text(values: pa.Array) -> pa.Array:
    """Binary as UTF-8 strings; malformed bytes become U+FFFD as Python decodes them."""
    try:
        return values.cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array([None if v is None else v.decode("utf-8", "replace") for v in values.to_pylist()],
                        pa.string())


def _strings(column) -> pa.Array:
    """A StringColumn (KEYS, UNIQ_KEY) as an Arrow string array, nulls where the property is absent."""
    text, at, length = column.arrays()
    absent = at < 0
    data, offsets = _gather(np.frombuffer(text, dtype=np.uint8), np.where(absent, 0, at), np.where(absent, 0, length))
    values = pa.Array.from_buffers(pa.binary(), len(at), [pa.array(~absent).buffers()[1], pa.py_buffer(offsets),
                                                          pa.py_buffer(data)])
    return _text(values)


def _property(data: np.ndarray, offsets: np.ndarray, name: str) -> pa.Array:
    """The last value of a property in each record's properties (null when absent), as the broker's
    properties map keeps it: `name` 0x01 at the start of the properties or right after a 0x02, its value up
    to the next 0x02 or the end of the record's properties. Found with array operations over the batch's
    properties at once (a regular expression per record cost 4.5 us a message)."""
    n = len(offsets) - 1
    pattern = np.frombuffer(name.encode() + b"\x01", dtype=np.uint8)
    width = len(pattern)
    if len(data) < width or n == 0:
        return pa.nulls(n, pa.string())
    hit = data[: len(data) - width + 1] == pattern[0]
    for k in range(1, width):
        hit &= data[k : len(data) - width + 1 + k] == pattern[k]
    at = np.flatnonzero(hit)
    record = np.searchsorted(offsets, at, side="right") - 1
    starts = offsets[record]
    at_start = at == starts
    after_separator = np.zeros(len(at), dtype=bool)
    inner = at > 0
    after_separator[inner] = data[at[inner] - 1] == PROPERTY_SEPARATOR
    keep = (at_start | after_separator) & (at + width <= offsets[record + 1])
    at, record = at[keep], record[keep]
    if len(at) == 0:
        return pa.nulls(n, pa.string())
    last = np.flatnonzero(np.append(record[1:] != record[:-1], True))  # the last one of each record
    at, record = at[last], record[last]
    value_at = at + width
    separators = np.flatnonzero(data == PROPERTY_SEPARATOR)
    following = np.searchsorted(separators, value_at)
    ends = np.where(following < len(separators), separators[np.minimum(following, len(separators) - 1)], len(data))
    ends = np.minimum(ends, offsets[record + 1])
    starts_all = np.zeros(n, dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    present = np.zeros(n, dtype=bool)
    starts_all[record], lengths[record], present[record] = value_at, ends - value_at, True
    values, value_offsets = _gather(data, starts_all, lengths)
    validity = pa.py_buffer(np.packbits(present, bitorder="little"))
    return _text(pa.Array.from_buffers(pa.binary(), n, [validity, pa.py_buffer(value_offsets),
                                                        pa.py_buffer(values)]))


def catalog_table(batch: DispatchBatch, buf, seg_start: int, with_body: bool) -> pa.Table:
    """The catalog rows of a decoded batch, from the segment image it was decoded from."""
    img = np.frombuffer(buf, dtype=np.uint8)
    n = len(batch)
    rel = batch.phy_offset - seg_start
    flags = batch.sys_flag
    born_host = np.where(flags & BORNHOST_V6_FLAG, HOST_V6_LENGTH, HOST_V4_LENGTH)
    store_host = np.where(flags & STOREHOSTADDRESS_V6_FLAG, HOST_V6_LENGTH, HOST_V4_LENGTH)
    store_host_at = rel + BORN_HOST_OFFSET + born_host + STORE_HOST_AFTER_BORN_HOST
    store_end = store_host_at + store_host
    body_len = _be(img, store_end + BODY_LENGTH_AFTER_STORE_HOST, 4)
    body_at = store_end + BODY_AFTER_STORE_HOST
    v1 = _be(img, rel + MAGIC_CODE_OFFSET, 4) == MESSAGE_MAGIC_CODE
    topic_bytes = np.array([len(t.encode("utf-8", "surrogatepass")) for t in batch.topics], dtype=np.int64)
    props_at = (body_at + body_len + np.where(v1, TOPIC_LENGTH_SIZE_V1, TOPIC_LENGTH_SIZE_V2)
                + topic_bytes[batch.topic_id] + PROPERTIES_LENGTH.size)
    props_data, props_offsets = _gather(img, props_at, rel + batch.msg_size - props_at)
    # msgId: store host address and port, then the CommitLog offset, in upper-case hex
    host, host_offsets = _gather(img, store_host_at, store_host)
    id_len = store_host + PHYSICAL_OFFSET_SIZE
    raw = np.empty(int(id_len.sum()), dtype=np.uint8)
    id_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(id_len, out=id_offsets[1:])
    host_dst = np.arange(len(host)) + np.repeat(id_offsets[:-1] - host_offsets[:-1], store_host)
    raw[host_dst] = host
    phy_dst = (id_offsets[:-1] + store_host)[:, None] + np.arange(PHYSICAL_OFFSET_SIZE)
    raw[phy_dst] = batch.phy_offset.astype(">i8").view(np.uint8).reshape(n, PHYSICAL_OFFSET_SIZE)
    hexed = np.empty(2 * len(raw), dtype=np.uint8)
    hexed[0::2], hexed[1::2] = _HEX[raw >> 4], _HEX[raw & 15]
    msg_id = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer((2 * id_offsets).astype(np.int32)),
                                                    pa.py_buffer(hexed)])
    keys_text = _strings(batch.keys)
    keys = pc.split_pattern(keys_text, " ")
    flat = pc.list_flatten(keys)
    owner = np.repeat(np.arange(n), pc.list_value_length(keys).fill_null(0).to_numpy(zero_copy_only=False))
    keep = pc.greater(pc.utf8_length(flat), 0)
    key_offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(owner[keep.to_numpy(zero_copy_only=False)], minlength=n), out=key_offsets[1:])
    key_lists = pa.ListArray.from_arrays(pa.array(key_offsets), flat.filter(keep), mask=keys_text.is_null())
    real_qid = _property(props_data, props_offsets, "REAL_QID")
    real_qid = pc.if_else(pc.match_substring_regex(real_qid, r"^[+-]?[0-9]{1,10}$"), real_qid, None)
    store_ms = batch.store_timestamp
    columns = {
        "commitLogOffset": pa.array(batch.phy_offset), "msgSize": pa.array(batch.msg_size),
        "queueId": pa.array(batch.queue_id), "queueOffset": pa.array(batch.queue_offset),
        "storeTime": pa.array(store_ms).cast(_UTC_MS),
        "bornTime": pa.array(_be(img, rel + BORN_TIMESTAMP_OFFSET, 8)).cast(_UTC_MS),
        "tags": _property(props_data, props_offsets, "TAGS"), "tagsCode": pa.array(batch.tags_code),
        "sysFlag": pa.array(batch.sys_flag), "keys": key_lists,
        "uniqKey": _strings(batch.uniq_key),
        "msgId": msg_id, "realTopic": _property(props_data, props_offsets, "REAL_TOPIC"),
        "realQueueId": real_qid.cast(pa.int32(), safe=False) if n else pa.array([], pa.int32()),
        "bodySize": pa.array(body_len.astype(np.int32)),
    }
    schema = SCHEMA
    if with_body:
        columns["body"] = _binary(*_gather(img, body_at, body_len))
        schema = schema.append(BODY_FIELD)
    return pa.Table.from_pydict(columns, schema=schema)


def catalog_groups(batch: DispatchBatch, buf, seg_start: int, with_body: bool) -> Iterator[tuple[str, int, bytes, int]]:
    """(topic, UTC day, Arrow IPC stream, rows) of each (topic, day) of the batch, in CommitLog order."""
    table = catalog_table(batch, buf, seg_start, with_body)
    day = (batch.store_timestamp // MS_PER_DAY).astype(np.int64)
    key = batch.topic_id.astype(np.int64) * (1 << 40) + day
    order = np.argsort(key, kind="stable")
    cuts = np.flatnonzero(np.diff(key[order])) + 1
    for part in np.split(order, cuts):
        group = table.take(pa.array(part))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, group.schema) as writer:
            writer.write_table(group)
        first = int(part[0])
        yield batch.topics[int(batch.topic_id[first])], int(day[first]), sink.getvalue().to_pybytes(), len(part)


# --- writing ---------------------------------------------------------------------------------------------

# characters Hive-style partition paths escape (as Spark's ExternalCatalogUtils does)
_ESCAPED = frozenset('"#%\'*/:=?\\\x7f{[]^') | {chr(c) for c in range(0x20)}


def escape_partition_value(value: str) -> str:
    return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in value)


def partition_dir(topic: str, day: int) -> str:
    date = np.datetime64(day, "D").astype(str)
    return f"topic={escape_partition_value(topic)}/date={date}"


def read_group(blob: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(blob)).read_all()


def catalog_filesystem(path: str, s3=None):
    """The pyarrow file system and base path of a catalog location (a path, file://, s3:// or hdfs://)."""
    d = parse_segment_dirs(path)[0]
    if d.scheme == LOCAL:
        return fs.LocalFileSystem(), d.path
    return remote_filesystem(d, s3 or S3Options()), d.path


STAGING = "_reputd-staging"  # PATH/_reputd-staging/JOB/...: readers skip names starting with "_"
MARKERS = "_reputd-backfills"
STAGED_SUFFIX = ".staged"  # nor does a `**/*.parquet` glob see a staged file


def file_name(start: int, end: int) -> str:
    return f"part-{start:020d}-{end:020d}.parquet"


class ParquetOut:
    """One staged Parquet file, written a table at a time (a partition is never held whole)."""

    def __init__(self, filesystem, final_relative_path: str):
        self.filesystem = filesystem
        self.path = final_relative_path + STAGED_SUFFIX
        self._writer = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self.filesystem.create_dir(os.path.dirname(self.path), recursive=True)
            self._writer = pq.ParquetWriter(self.path, table.schema, filesystem=self.filesystem, compression="zstd")
        self._writer.write_table(table)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def discard(self) -> None:
        if self._writer is not None:
            self.filesystem.delete_file(self.path)


def uncovered(table: pa.Table, covered) -> np.ndarray:
    """Which rows lie outside every [from, to) of `covered` (the ranges the catalog holds already)."""
    offsets = table.column("commitLogOffset").to_numpy()
    keep = np.ones(len(offsets), dtype=bool)
    for lo, hi in covered:
        keep &= (offsets < lo) | (offsets >= hi)
    return keep


def covered_ranges(filesystem, base: str) -> list[tuple[int, int]]:
    """The CommitLog ranges of the backfills a catalog holds (its markers)."""
    infos = filesystem.get_file_info(fs.FileSelector(f"{base.rstrip('/')}/{MARKERS}", allow_not_found=True))
    ranges = []
    for info in infos:
        lo, _, hi = info.base_name.partition("-")
        if lo.isdigit() and hi.isdigit():
            ranges.append((int(lo), int(hi)))
    return sorted(ranges)


def write_marker(filesystem, base: str, start: int, end: int) -> None:
    """Record, after every file of a backfill is in place, that the catalog holds [start, end)."""
    directory = f"{base.rstrip('/')}/{MARKERS}"
    filesystem.create_dir(directory, recursive=True)
    with filesystem.open_output_stream(f"{directory}/{start:020d}-{end:020d}"):
        pass
