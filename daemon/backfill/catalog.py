"""The Parquet catalog `reputd backfill --catalog PATH` writes: one row per dispatched message, typed.

    PATH/<topic>/<yyyy-mm-dd>/part-<from>-<to>.parquet   (the topic's name made path-safe, see topic_dir; the
                                                          UTC day of the store time; [from, to) the backfill's
                                                          CommitLog range)
    PATH/_reputd-backfills/<from>-<to>                   one empty marker per committed backfill

Columns (camelCase, as `reputd query --json` names them): commitLogOffset, msgSize, queueId, queueOffset,
storeTime and bornTime (timestamp, ms), tags, tagsCode, sysFlag, keys (array<string>: the non-empty KEYS
tokens), uniqKey, msgId (the offset msgId), realTopic and realQueueId (a delayed message's own topic and
queue; null for others), bodySize, body (only with `backfill.catalogBody`), topic (string) and date (date32,
the UTC day). `topic` and `date` are stored in the files only: the directory names are not `key=value`, so
no reader infers partition columns from them (inferred, `date` was a date in Spark and duckdb but a string
in pyarrow, and `topic` a category in pandas; stored in both places, pandas and pyarrow refused the
catalog). Each file holds one (topic, day), so the two columns' statistics let readers skip the others'
row groups, and a glob over the directories reads only some topics or days. A later backfill appends: it
leaves out the rows of the ranges the markers name, so a rerun adds nothing and a later range extends each
day's directory with a file. A catalog in the earlier `topic=T/date=D/` layout is refused (LEGACY_PREFIX).

The decode task builds the rows of each window straight from the segment image, already ordered by (topic,
day): the fixed-offset fields with numpy, every per-byte step (properties, msgIds, KEYS tokens, strings and
bodies) in one C pass each over the batch (`indexcore._spans`), and ships each group as an Arrow IPC stream;
the writer task of a (topic, day) partition concatenates its groups in CommitLog order into one file, in row
groups of up to ROW_GROUP_ROWS rows.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs

from daemon.backfill.source import LOCAL, S3Options, parse_segment_dirs, remote_filesystem
from indexcore import _spans
from indexcore.commitlog import (
    BORN_HOST_OFFSET,
    BORN_TIMESTAMP_OFFSET,
    BORNHOST_V6_FLAG,
    HOST_V4_LENGTH,
    HOST_V6_LENGTH,
    KEY_SEPARATOR,
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
_UTC_MS = pa.timestamp("ms", tz="UTC")

SCHEMA = pa.schema([
    ("commitLogOffset", pa.int64()), ("msgSize", pa.int32()), ("queueId", pa.int32()),
    ("queueOffset", pa.int64()), ("storeTime", _UTC_MS), ("bornTime", _UTC_MS), ("tags", pa.string()),
    ("tagsCode", pa.int64()), ("sysFlag", pa.int32()), ("keys", pa.list_(pa.string())), ("uniqKey", pa.string()),
    ("msgId", pa.string()), ("realTopic", pa.string()), ("realQueueId", pa.int32()), ("bodySize", pa.int32()),
])
BODY_FIELD = pa.field("body", pa.binary())
# the last two columns of every file, constant in it: added by the writer, not staged with each window's rows
GROUP_FIELDS = [pa.field("topic", pa.string()), pa.field("date", pa.date32())]

# docs/backfill.md's examples, over `spark.read.option("recursiveFileLookup", "true").parquet(PATH)
# .createOrReplaceTempView("catalog")`.
CATALOG_QUERIES = {
    "key": ("SELECT commitLogOffset, msgId, queueId, queueOffset, storeTime, tags, keys FROM catalog "
            "WHERE topic = '{topic}' AND array_contains(keys, '{key}') "
            "AND date >= DATE'{start}' AND date < DATE'{end}' ORDER BY storeTime"),
    "per_day": "SELECT topic, date, count(*) AS messages FROM catalog GROUP BY topic, date ORDER BY topic, date",
}


def _be(buf, at: np.ndarray, width: int) -> np.ndarray:
    """Big-endian signed integers of `width` (4 or 8) bytes at positions `at`."""
    out = np.empty(len(at), dtype=np.int64)
    _spans.read_be(buf, np.ascontiguousarray(at, dtype=np.int64), width, out)
    return out


def _binary(source, at: np.ndarray, length: np.ndarray) -> pa.Array:
    """The spans [at, at + length) of `source` as an Arrow binary column, null where at < 0."""
    n = len(at)
    absent = at < 0
    data = np.empty(int(np.where(absent, 0, length).sum()), dtype=np.uint8)
    offsets = np.empty(n + 1, dtype=np.int32)
    _spans.gather(source, at, length, data, offsets)
    validity = pa.py_buffer(np.packbits(~absent, bitorder="little")) if absent.any() else None
    return pa.Array.from_buffers(pa.binary(), n, [validity, pa.py_buffer(offsets), pa.py_buffer(data)])


def _text(values: pa.Array) -> pa.Array:
    """Binary as UTF-8 strings; malformed bytes become U+FFFD as Python decodes them."""
    try:
        return values.cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array([None if v is None else v.decode("utf-8", "replace") for v in values.to_pylist()],
                        pa.string())


def _int_column(values: np.ndarray, arrow_type) -> pa.Array:
    """A numpy column as an Arrow one, from its buffer (not `pa.array`: its first call imports pandas, a
    quarter of a second in every Python worker)."""
    data = np.ascontiguousarray(values, dtype=np.int64 if arrow_type in (_UTC_MS, pa.int64()) else np.int32)
    return pa.Array.from_buffers(arrow_type, len(data), [None, pa.py_buffer(data)])


def _keys(text: bytes, at: np.ndarray, length: np.ndarray) -> pa.Array:
    """KEYS as list<string> of its non-empty tokens (split on " "), null where the property is absent.
    Split before decoding: a space never lies inside a malformed sequence, so each token decodes as it
    would inside the whole value."""
    n = len(at)
    total = int(np.where(at < 0, 0, length).sum())
    data = np.empty(total, dtype=np.uint8)
    token_offsets = np.empty(total + 1, dtype=np.int32)
    first = np.empty(n + 1, dtype=np.int32)
    tokens = _spans.split_tokens(text, at, length, ord(KEY_SEPARATOR), data, token_offsets, first)
    # only the bytes the tokens fill: the separators left the end of `data` unwritten, and its bytes would
    # otherwise reach the staged streams (which then differed from one run to the next)
    values = _text(pa.Array.from_buffers(pa.binary(), tokens, [None, pa.py_buffer(token_offsets[: tokens + 1]),
                                                               pa.py_buffer(data[: token_offsets[tokens]])]))
    absent = at < 0
    validity = pa.py_buffer(np.packbits(~absent, bitorder="little")) if absent.any() else None
    return pa.Array.from_buffers(pa.list_(pa.string()), n, [validity, pa.py_buffer(first)], children=[values])


_PROPERTY_NAMES = (b"TAGS", b"REAL_TOPIC", b"REAL_QID")


def property_values(buf, props_at: np.ndarray, props_end: np.ndarray, names: tuple[bytes, ...]) -> list[pa.Array]:
    """Each record's value of each property (null when absent), as the broker's properties map keeps it: the
    last `name` 0x01 at the start of the properties [props_at, props_end) or right after a 0x02, its value up
    to the next 0x02 or the end of the properties. One C pass over the batch (a regular expression per
    record cost 4.5 us a message, array operations over the batch 0.6 us)."""
    n = len(props_at)
    spans = np.empty((2 * len(names), n), dtype=np.int64)
    _spans.property_spans(buf, props_at, props_end, names, spans)
    return [_text(_binary(buf, spans[2 * j], spans[2 * j + 1])) for j in range(len(names))]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _queue_ids(values: pa.Array) -> pa.Array:
    """REAL_QID as int32 as Integer.parseInt reads it (an optional sign, decimal digits, within int32), null
    for anything else. (Arrow's cast refused "+7" and 10-digit values past int32, which failed the backfill.)"""
    if values.null_count == len(values):
        return pa.nulls(len(values), pa.int32())
    number = pc.match_substring_regex(values, r"^[+-]?[0-9]{1,10}$")
    wide = pc.if_else(number, pc.replace_substring_regex(values, r"^\+", ""), None).cast(pa.int64())
    within = pc.and_(pc.greater_equal(wide, INT32_MIN), pc.less_equal(wide, INT32_MAX))
    return pc.if_else(within, wide, None).cast(pa.int32())


def catalog_table(batch: DispatchBatch, buf, seg_start: int, with_body: bool,
                  order: np.ndarray | None = None) -> pa.Table:
    """The catalog rows of a decoded batch, from the segment image it was decoded from; `order`: the
    batch's rows to take, in that order (all, in CommitLog order, by default). Every per-byte step (the
    properties, the msgId, KEYS, the strings and bodies) is one C pass over the batch (indexcore._spans);
    what is left here is numpy over the records' fixed fields."""
    def rows(column: np.ndarray) -> np.ndarray:
        return column if order is None else column[order]

    phy = rows(batch.phy_offset)
    n = len(phy)
    rel = phy - seg_start
    flags = rows(batch.sys_flag)
    msg_size = rows(batch.msg_size)
    store_ms = rows(batch.store_timestamp)
    born_host = np.where(flags & BORNHOST_V6_FLAG, HOST_V6_LENGTH, HOST_V4_LENGTH)
    store_host = np.where(flags & STOREHOSTADDRESS_V6_FLAG, HOST_V6_LENGTH, HOST_V4_LENGTH).astype(np.int64)
    store_host_at = rel + BORN_HOST_OFFSET + born_host + STORE_HOST_AFTER_BORN_HOST
    store_end = store_host_at + store_host
    body_len = _be(buf, store_end + BODY_LENGTH_AFTER_STORE_HOST, 4)
    body_at = store_end + BODY_AFTER_STORE_HOST
    v1 = _be(buf, rel + MAGIC_CODE_OFFSET, 4) == MESSAGE_MAGIC_CODE
    topic_bytes = np.array([len(t.encode("utf-8", "surrogatepass")) for t in batch.topics], dtype=np.int64)
    props_at = (body_at + body_len + np.where(v1, TOPIC_LENGTH_SIZE_V1, TOPIC_LENGTH_SIZE_V2)
                + topic_bytes[rows(batch.topic_id)] + PROPERTIES_LENGTH.size)
    props_end = rel + msg_size
    tags, real_topic, real_qid = property_values(buf, props_at, props_end, _PROPERTY_NAMES)
    # msgId: store host address and port, then the CommitLog offset, in upper-case hex
    id_offsets = np.empty(n + 1, dtype=np.int32)
    hexed = np.empty(int(2 * (store_host + PHYSICAL_OFFSET_SIZE).sum()), dtype=np.uint8)
    _spans.offset_msg_ids(buf, store_host_at, store_host, phy, hexed, id_offsets)
    msg_id = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(id_offsets), pa.py_buffer(hexed)])
    keys_text, keys_at, keys_len = batch.keys.arrays()
    uniq_text, uniq_at, uniq_len = batch.uniq_key.arrays()
    columns = {
        "commitLogOffset": _int_column(phy, pa.int64()), "msgSize": _int_column(msg_size, pa.int32()),
        "queueId": _int_column(rows(batch.queue_id), pa.int32()),
        "queueOffset": _int_column(rows(batch.queue_offset), pa.int64()),
        "storeTime": _int_column(store_ms, _UTC_MS),
        "bornTime": _int_column(_be(buf, rel + BORN_TIMESTAMP_OFFSET, 8), _UTC_MS),
        "tags": tags, "tagsCode": _int_column(rows(batch.tags_code), pa.int64()),
        "sysFlag": _int_column(flags, pa.int32()), "keys": _keys(keys_text, rows(keys_at), rows(keys_len)),
        "uniqKey": _text(_binary(uniq_text, rows(uniq_at), rows(uniq_len))),
        "msgId": msg_id, "realTopic": real_topic,
        "realQueueId": _queue_ids(real_qid),
        "bodySize": _int_column(body_len, pa.int32()),
    }
    schema = SCHEMA
    if with_body:
        columns["body"] = _binary(buf, body_at, body_len)
        schema = schema.append(BODY_FIELD)
    return pa.Table.from_arrays(list(columns.values()), schema=schema)


def catalog_groups(batch: DispatchBatch, buf, seg_start: int,
                   with_body: bool) -> Iterator[tuple[str, int, pa.Buffer, int]]:
    """(topic, UTC day, Arrow IPC stream, rows) of each (topic, day) of the batch, in CommitLog order. The
    rows are built already grouped (a stable sort of the records by group), so each group is a slice."""
    day = (batch.store_timestamp // MS_PER_DAY).astype(np.int64)
    key = batch.topic_id.astype(np.int64) * (1 << 40) + day
    order = None
    if len(key) and (key != key[0]).any():
        order = np.argsort(key, kind="stable")
        key, day, topic_id = key[order], day[order], batch.topic_id[order]
    else:
        topic_id = batch.topic_id
    table = catalog_table(batch, buf, seg_start, with_body, order)
    cuts = [0, *(np.flatnonzero(np.diff(key)) + 1).tolist(), len(key)]
    for a, b in itertools.pairwise(cuts):
        group = table.slice(a, b - a)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, group.schema) as writer:
            writer.write_table(group)
        yield batch.topics[int(topic_id[a])], int(day[a]), sink.getvalue(), b - a  # a pa.Buffer: not copied to bytes


# --- writing ---------------------------------------------------------------------------------------------

# characters escaped in a topic's directory name: those Spark escapes in partition paths (path separators,
# glob and URI characters, "=", which would make the directory a partition column), and a leading "." or "_",
# which every reader skips as a hidden name
_ESCAPED = frozenset('"#%\'*/:=?\\\x7f{[]^') | {chr(c) for c in range(0x20)}
_HIDDEN = frozenset("._")
LEGACY_PREFIX = "topic="  # the directories of the earlier layout, PATH/topic=T/date=D/


NAME_MAX = 255  # bytes in one directory name (ext4, xfs and most others: a longer one is ENAMETOOLONG)
_DIGEST_CHARS = 32  # hex digits of the SHA-256 of the topic that end a shortened name


def topic_dir(topic: str) -> str:
    """A topic's directory name: %XX for the characters above, so that distinct topics never share one (the
    real name is the `topic` column); "%" alone for an empty name, which no escaping produces. A name over
    NAME_MAX bytes (a long topic of escaped or non-ASCII characters: a CommitLog holds up to 127 bytes, v2
    records more) keeps its first characters, up to a whole escape, then "%~" and a digest of the topic:
    escaping never writes "%~" (a "%" is always "%25"), so no other topic's name is the same."""
    if not topic:
        return "%"
    name = "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in topic)
    if name[0] in _HIDDEN:
        name = f"%{ord(name[0]):02X}{name[1:]}"
    if len(name.encode("utf-8", "surrogatepass")) <= NAME_MAX:
        return name
    digest = hashlib.sha256(topic.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    keep = name.encode("utf-8", "surrogatepass")[:NAME_MAX - 2 - _DIGEST_CHARS].decode("utf-8", "ignore")
    cut = keep.rfind("%", len(keep) - 2)  # an escape cut short: leave it out whole
    return f"{keep[:cut] if cut >= 0 else keep}%~{digest}"


def partition_dir(topic: str, day: int) -> str:
    return f"{topic_dir(topic)}/{np.datetime64(day, 'D')}"


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


# Row groups of up to this many rows (or bytes, with bodies): a window's group of a few thousand rows written
# as a row group of its own cost 0.8-1.0 us a row to encode and made files 2.6x larger.
ROW_GROUP_ROWS = 1 << 17
ROW_GROUP_BYTES = 64 << 20
# Dictionary-encoded columns: the few-valued strings, which readers can filter by their dictionary. On the
# unique columns (offsets, times, msgIds, keys) a dictionary grows to its page limit and is thrown away; on
# the few-valued numbers and the constant topic and date, zstd makes plain pages as small and hashing each
# value cost more (256b-1key, with the two statistics below: 526 -> 440 ns a row to encode in one run, 335 ->
# 295 in another; 3.37 B a row either way).
DICTIONARY_COLUMNS = ["tags", "realTopic"]
# Row-group statistics, which let readers skip row groups, on the columns they help: KEYS tokens and UNIQ_KEYs
# have no order, so their min and max span everything.
NO_STATISTICS = frozenset({"keys", "uniqKey", BODY_FIELD.name})
# The columns that grow with the CommitLog, stored as deltas: half the file size, and cheaper to encode.
DELTA_COLUMNS = {c: "DELTA_BINARY_PACKED" for c in ("commitLogOffset", "queueOffset", "storeTime", "bornTime")}


class ParquetOut:
    """One staged Parquet file of one (topic, day), written a row group at a time (a partition is never held
    whole); the constant `topic` and `date` columns are added to each row group as it is written."""

    def __init__(self, filesystem, final_relative_path: str, topic: str, day: int):
        self.filesystem = filesystem
        self.path = final_relative_path + STAGED_SUFFIX
        self._writer = None
        self._held: list[pa.Table] = []
        self._held_rows = self._held_bytes = 0
        self._topic = topic.encode("utf-8", "surrogatepass")
        self._day = day
        self._constants: list[pa.Array] = []

    def write(self, table: pa.Table) -> None:
        self._held.append(table)
        self._held_rows += table.num_rows
        self._held_bytes += table.nbytes
        if self._held_rows >= ROW_GROUP_ROWS or self._held_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _constant_columns(self, n: int) -> list[pa.Array]:
        """`topic` and `date` for n rows, built once for the largest row group and sliced (pa.repeat: 0.5 s
        on its first call in a fresh process)."""
        if not self._constants or len(self._constants[0]) < n:
            offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(self._topic))  # n <= _constant_rows()
            topic = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(self._topic * n)])
            date = pa.Array.from_buffers(pa.date32(), n, [None, pa.py_buffer(np.full(n, self._day, np.int32))])
            self._constants = [topic, date]
        return [c.slice(0, n) for c in self._constants]

    def _flush(self) -> None:
        if not self._held:
            return
        table = pa.concat_tables(self._held)
        self._held, self._held_rows, self._held_bytes = [], 0, 0
        step = min(table.num_rows, self._constant_rows())
        for at in range(0, table.num_rows, step):
            part = table.slice(at, step)
            for f, column in zip(GROUP_FIELDS, self._constant_columns(part.num_rows), strict=True):
                part = part.append_column(f, column)
            if self._writer is None:
                self.filesystem.create_dir(os.path.dirname(self.path), recursive=True)
                self._writer = pq.ParquetWriter(self.path, part.schema, filesystem=self.filesystem,
                                                compression="zstd", use_dictionary=DICTIONARY_COLUMNS,
                                                column_encoding=DELTA_COLUMNS, write_statistics=[
                                                    n for n in part.schema.names if n not in NO_STATISTICS])
            self._writer.write_table(part, row_group_size=ROW_GROUP_ROWS)

    def _constant_rows(self) -> int:
        """The most rows whose `topic` column fits a string column's 32-bit offsets (a topic is < 32 KiB)."""
        return (2**31 - 1) // max(len(self._topic), 1)

    def close(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()

    def discard(self) -> None:
        self._held = []
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
