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

The decode task builds the rows of each window, grouped by (topic, day), from what the decode found (a window
decoded with `batchdecode.CATALOG_FIELDS`: the kernel copies the catalog's strings while each record is in
the cache): one C pass over the batch (`indexcore._spans`) fills every column's buffers, and the window goes
out as one Arrow IPC record batch message, each group a run of its rows; the writer task of a (topic, day)
partition concatenates its runs in CommitLog order into one file, in row groups of up to ROW_GROUP_ROWS rows.
"""

from __future__ import annotations

import functools
import hashlib
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs

from daemon.backfill.source import LOCAL, S3Options, parse_segment_dirs, remote_filesystem
from indexcore import _spans
from indexcore.dispatch import DispatchBatch

MS_PER_DAY = 86_400_000
_UTC_MS = pa.timestamp("ms", tz="UTC")

# The columns a message may lack (a property it does not carry); every other column is never null, and
# non-nullable here: Parquet stores it `required`, with no definition levels to write (with data pages v2,
# write_catalog on 2.49M rows of the 16M store: 0.579 -> 0.527 us a row, medians of 5 interleaved, each
# pair 0.041-0.053 less; 3.354 -> 3.349 B a row). The four readers take files of either kind in one
# catalog, in any order: one written before (every column `optional`, pages v1) and extended later reads alike.
NULLABLE = frozenset({"tags", "keys", "uniqKey", "realTopic", "realQueueId"})
SCHEMA = pa.schema([pa.field(name, type_, name in NULLABLE) for name, type_ in [
    ("commitLogOffset", pa.int64()), ("msgSize", pa.int32()), ("queueId", pa.int32()),
    ("queueOffset", pa.int64()), ("storeTime", _UTC_MS), ("bornTime", _UTC_MS), ("tags", pa.string()),
    ("tagsCode", pa.int64()), ("sysFlag", pa.int32()), ("keys", pa.list_(pa.string())), ("uniqKey", pa.string()),
    ("msgId", pa.string()), ("realTopic", pa.string()), ("realQueueId", pa.int32()), ("bodySize", pa.int32()),
]])
BODY_FIELD = pa.field("body", pa.binary(), nullable=False)
# the last two columns of every file, constant in it: added by the writer, not staged with each window's rows
GROUP_FIELDS = [pa.field("topic", pa.string(), nullable=False), pa.field("date", pa.date32(), nullable=False)]

# docs/backfill.md's examples, over `spark.read.option("recursiveFileLookup", "true").parquet(PATH)
# .createOrReplaceTempView("catalog")`.
CATALOG_QUERIES = {
    "key": ("SELECT commitLogOffset, msgId, queueId, queueOffset, storeTime, tags, keys FROM catalog "
            "WHERE topic = '{topic}' AND array_contains(keys, '{key}') "
            "AND date >= DATE'{start}' AND date < DATE'{end}' ORDER BY storeTime"),
    "per_day": "SELECT topic, date, count(*) AS messages FROM catalog GROUP BY topic, date ORDER BY topic, date",
}


def _text(values: pa.Array) -> pa.Array:
    """Strings whose bytes may not be UTF-8, checked: malformed bytes become U+FFFD as Python decodes them.
    (validate, not a cast to string: a cast imports pyarrow.compute, 0.12 CPU-s in every worker.)"""
    try:
        values.validate(full=True)
        return values
    except pa.ArrowInvalid:
        raw = values.view(pa.binary())
        return pa.array([None if v is None else v.decode("utf-8", "replace") for v in raw.to_pylist()], pa.string())


def catalog_table(batch: DispatchBatch, buf, with_body: bool, group: np.ndarray | None = None,
                  groups: int = 1) -> pa.Table:
    """The catalog rows of a batch decoded with `batchdecode.CATALOG_FIELDS`, `buf` the segment image it was
    decoded from (read only for the bodies); `group`: each batch row's group (0 <= group < groups), the rows
    coming out group by group, each group's in CommitLog order (all in one group by default). One C pass
    visits each row once (`_spans.catalog_columns`: its fields, properties, msgId, KEYS tokens, strings and
    body) and fills every column's Arrow buffers; a string column is checked as UTF-8 only when it is not
    ASCII. (Six passes over the batch, one per step, each reading every record again, cost 0.45 us a
    message; one pass reading the records again, a window after the decode, 0.24-0.30; reading only what the
    decode copied, 0.14-0.18.)"""
    return _catalog_rows(batch, buf, with_body, group, groups, staged=False)[0]


# How a staged group's rows were left out of its record batch message, for `catalogstage.read_groups` to make
# them again: (the store host all its rows share, whose msgIds were left out; None when they are staged), and
# whether the realTopic and realQueueId columns are staged (not when no row of the batch has either). A msgId
# is 36 of a row's ~125 staged bytes, and made again from the offset in the writer; staged bytes are written
# to page-cache pages, which cost several times more on a host that took them back (page_reporting).
StagedForm = tuple[bytes | None, bool]
FULL_FORM: StagedForm = (None, True)
StagedGroup = tuple[str, int, int, int, StagedForm]  # topic, UTC day, first row in the message, rows, form
_REAL_COLUMNS = ("realTopic", "realQueueId")


def staged_schema(with_body: bool, form: StagedForm) -> pa.Schema:
    """The schema of a staged record batch message of this form."""
    return _staged_schema(with_body, form[0] is not None, form[1])


@functools.cache
def _staged_schema(with_body: bool, without_msg_ids: bool, real: bool) -> pa.Schema:
    schema = SCHEMA.append(BODY_FIELD) if with_body else SCHEMA
    left_out = ({"msgId"} if without_msg_ids else set()) | (set() if real else set(_REAL_COLUMNS))
    return pa.schema([f for f in schema if f.name not in left_out])


_NULLS: dict[pa.DataType, pa.Array] = {}


def _nulls(n: int, type_: pa.DataType) -> pa.Array:
    """n nulls, a slice of one array made for the most rows so far (pa.nulls zeroes n rows' buffers anew)."""
    if type_ not in _NULLS or len(_NULLS[type_]) < n:
        _NULLS[type_] = pa.nulls(max(n, 1 << 16), type_)
    return _NULLS[type_].slice(0, n)


def _msg_id_chars(host_bytes: int, rows: int) -> int:
    """The characters of `rows` offset msgIds whose store hosts take `host_bytes`: each host's hex, then the
    8-byte offset's."""
    return 2 * (int(host_bytes) + 8 * rows)


def msg_id_array(offsets: np.ndarray, host: bytes) -> pa.Array:
    """The offset msgIds of records of one store host (`_spans.msg_ids`), as `catalog_columns` makes them."""
    n, width = len(offsets), _msg_id_chars(len(host), 1)
    data = np.empty(n * width, dtype=np.uint8)
    _spans.msg_ids(np.ascontiguousarray(offsets, dtype=np.int64), host, data)
    ends = np.arange(n + 1, dtype=np.int32) * np.int32(width)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(ends), pa.py_buffer(data)])


def _catalog_rows(batch: DispatchBatch, buf, with_body: bool, group: np.ndarray | None,
                  groups: int, staged: bool) -> tuple[pa.Table, list[StagedForm]]:
    """`catalog_table`'s rows and each group's form; `staged`: without the columns a writer makes again (the
    msgIds when each group's records share a store host, the real columns when no row has them)."""
    S = _spans  # the C pass's column numbers
    n = len(batch)
    if batch.catalog_fields is None:
        raise ValueError("catalog rows need a batch decoded with CATALOG_FIELDS")
    group = np.zeros(n, dtype=np.int32) if group is None else np.ascontiguousarray(group, dtype=np.int32)
    text, keys_at, keys_len = batch.keys.arrays()
    uniq_text, uniq_at, uniq_len = batch.uniq_key.arrays()
    if uniq_text is not text:
        raise ValueError("catalog rows need the decode's one text buffer")
    fields = np.ascontiguousarray(batch.catalog_fields, dtype=np.int64)
    spans = [np.ascontiguousarray(a, dtype=np.int64) for a in (keys_at, keys_len, uniq_at, uniq_len)]
    keys_bytes = int(spans[1].sum())  # a span's length is 0 where the property is absent
    out64 = np.empty((S.C64, n), dtype=np.int64)
    out32 = np.empty((S.C32, n), dtype=np.int32)
    offsets = np.empty((S.S_TOKENS, n + 1), dtype=np.int32)
    token_offsets = np.empty(keys_bytes + 1, dtype=np.int32)  # a token is at least a byte
    valid = np.empty((S.NVALID, (n + 7) // 8), dtype=np.uint8)
    data = [np.empty(int(size), dtype=np.uint8) for size in (
        fields[S.F_TAGS_LEN].sum(), keys_bytes, spans[3].sum(), _msg_id_chars(fields[S.F_HOST_LEN].sum(), n),
        fields[S.F_REAL_TOPIC_LEN].sum(), fields[S.F_BODY_LEN].sum() if with_body else 0,
    )]  # S_TAGS, S_KEYS, S_UNIQ, S_MSGID, S_REAL_TOPIC, S_BODY
    columns_in = (*(np.ascontiguousarray(c, dtype=t) for c, t in (
        (batch.phy_offset, np.int64), (batch.msg_size, np.int32), (batch.queue_id, np.int32),
        (batch.queue_offset, np.int64), (batch.sys_flag, np.int32), (batch.store_timestamp, np.int64),
        (batch.tags_code, np.int64))), fields, text)
    used, tokens, nulls, non_ascii, hosts = S.catalog_columns(
        buf, group, groups, *columns_in, *spans, with_body, not staged, out64, out32, offsets, token_offsets, valid,
        *data)
    with_msg_ids = not staged or None in hosts
    if staged and with_msg_ids:  # a group of records of two store hosts (rare): the pass again, with its msgIds
        used, tokens, nulls, non_ascii, hosts = S.catalog_columns(
            buf, group, groups, *columns_in, *spans, with_body, True, out64, out32, offsets, token_offsets, valid,
            *data)
    real = not staged or nulls[S.V_REAL_TOPIC] < n or nulls[S.V_REAL_QID] < n

    def validity(v: int | None):
        return pa.py_buffer(valid[v]) if v is not None and nulls[v] else None

    def binary(s: int, v: int | None, count: int, offsets_: np.ndarray, text_: bool = True) -> pa.Array:
        """Column s's values; checked as UTF-8 (and malformed bytes replaced) only when not ASCII."""
        values = pa.Array.from_buffers(pa.string() if text_ else pa.binary(), count, [
            validity(v), pa.py_buffer(offsets_), pa.py_buffer(data[s][: used[s]])])
        return _text(values) if text_ and non_ascii >> s & 1 else values

    def ints(row: np.ndarray, arrow_type, v: int | None = None) -> pa.Array:
        return pa.Array.from_buffers(arrow_type, n, [validity(v), pa.py_buffer(row)])

    tokens_ = binary(S.S_KEYS, None, tokens, token_offsets[: tokens + 1])
    keys = pa.Array.from_buffers(pa.list_(pa.string()), n, [validity(S.V_KEYS), pa.py_buffer(offsets[S.S_KEYS])],
                                 children=[tokens_])
    columns = [
        ints(out64[S.C_OFFSET], pa.int64()), ints(out32[S.C_SIZE], pa.int32()), ints(out32[S.C_QUEUE_ID], pa.int32()),
        ints(out64[S.C_QUEUE_OFFSET], pa.int64()), ints(out64[S.C_STORE_TIME], _UTC_MS),
        ints(out64[S.C_BORN_TIME], _UTC_MS), binary(S.S_TAGS, S.V_TAGS, n, offsets[S.S_TAGS]),
        ints(out64[S.C_TAGS_CODE], pa.int64()), ints(out32[S.C_SYS_FLAG], pa.int32()), keys,
        binary(S.S_UNIQ, S.V_UNIQ, n, offsets[S.S_UNIQ]),
        *([binary(S.S_MSGID, None, n, offsets[S.S_MSGID])] if with_msg_ids else []),
        *([binary(S.S_REAL_TOPIC, S.V_REAL_TOPIC, n, offsets[S.S_REAL_TOPIC]),
           ints(out32[S.C_REAL_QID], pa.int32(), S.V_REAL_QID)] if real else []),
        ints(out32[S.C_BODY_SIZE], pa.int32()),
    ]
    if with_body:
        columns.append(binary(S.S_BODY, None, n, offsets[S.S_BODY], text_=False))
    forms = [(None if with_msg_ids else host, real) for host in hosts]
    return pa.Table.from_arrays(columns, schema=staged_schema(with_body, forms[0] if forms else FULL_FORM)), forms


GROUP_KEYS_SMALL = 1 << 16  # (topic, day) pairs a batch's groups are counted over rather than sorted


def _groups(topic_id: np.ndarray, day: np.ndarray,
            topics: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each row's (topic, day) group, the groups numbered in (topic, day) order, and each group's topic id,
    day and rows. Counted, not sorted, when the batch's (topic, day) pairs are few (a stable argsort of the
    rows cost 20-57 ns a row); numpy's unique otherwise (days far apart, thousands of topics)."""
    first = int(day.min())
    days = int(day.max()) - first + 1
    if topics * days <= GROUP_KEYS_SMALL:
        key = topic_id.astype(np.int64) * days + (day - first)
        counts = np.bincount(key)
        present = np.flatnonzero(counts)
        number = np.zeros(len(counts), dtype=np.int32)
        number[present] = np.arange(len(present), dtype=np.int32)
        return number[key], present // days, present % days + first, counts[present]
    key = topic_id.astype(np.int64) * (1 << 40) + day  # |day| < 2**37: a day of an int64 ms time
    _, index, group, counts = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    return group.astype(np.int32), topic_id[index], day[index], counts


def catalog_window(batch: DispatchBatch, buf, with_body: bool) -> tuple[pa.RecordBatch, list[StagedGroup]] | None:
    """The window's catalog rows as one record batch, grouped by (topic, UTC day) in that order, each group's
    rows in CommitLog order, without the columns the writer makes again (`catalogstage.read_groups`); and
    (topic, day, first row, rows, StagedForm) of each group. None for an empty batch. Staged as one message a
    window (`catalogstage.StagedMessages`), not one a group: a message (serialised, written, read back) cost
    ~18 us whatever its rows, so a CommitLog of 2,000 topics, a few rows of each in every window, paid 1.5 us
    a message in the decode alone."""
    if not len(batch):
        return None
    day = (batch.store_timestamp // MS_PER_DAY).astype(np.int64)
    group, topic_ids, days, counts = _groups(batch.topic_id, day, len(batch.topics))
    table, forms = _catalog_rows(batch, buf, with_body, group, len(counts), staged=True)
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
    groups = [(batch.topics[topic_id], day_, first, count, form) for topic_id, day_, first, count, form in zip(
        topic_ids.tolist(), days.tolist(), firsts, counts.tolist(), forms, strict=True)]
    return table.to_batches()[0], groups  # one chunk


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


def _int64s(values: pa.Array) -> np.ndarray:
    """A never-null int64 column's values, its buffer as it is (Array.to_numpy imports pandas: 0.4 CPU-s)."""
    return np.frombuffer(values.buffers()[1], np.int64, len(values), 8 * values.offset)


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
        self.flushes = 0  # row groups written so far
        self._held: list[pa.Table] = []
        self._held_rows = self._held_bytes = 0
        self._topic = topic.encode("utf-8", "surrogatepass")
        self._day = day
        self._constants: list[pa.Array] = []

    def write(self, table: pa.Table, nbytes: int) -> None:
        """Hold `table` (of about `nbytes`: `catalogstage.read_groups`) for the next row group."""
        self._held.append(table)
        self._held_rows += table.num_rows
        self._held_bytes += nbytes
        if self._held_bytes >= ROW_GROUP_BYTES:
            self._flush()
        elif self._held_rows >= ROW_GROUP_ROWS:
            self._flush(rest=False)

    def _constant_columns(self, n: int) -> list[pa.Array]:
        """`topic` and `date` for n rows, built once for the largest row group and sliced (pa.repeat: 0.5 s
        on its first call in a fresh process)."""
        if not self._constants or len(self._constants[0]) < n:
            offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(self._topic))  # n <= _constant_rows()
            topic = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(self._topic * n)])
            date = pa.Array.from_buffers(pa.date32(), n, [None, pa.py_buffer(np.full(n, self._day, np.int32))])
            self._constants = [topic, date]
        return [c.slice(0, n) for c in self._constants]

    def _flush(self, rest: bool = True) -> None:
        """Write the held rows in row groups of ROW_GROUP_ROWS; without `rest`, the rows past the last whole
        one stay held for the next (written, they made a row group of their own: 131072, 201, 131072, 2304,
        46074 rows in a file of 310723)."""
        if not self._held:
            return
        table = pa.concat_tables(self._held)
        tail = 0 if rest else table.num_rows % ROW_GROUP_ROWS
        self._held = [table.slice(table.num_rows - tail)] if tail else []
        self._held_rows, self._held_bytes = tail, self._held_bytes * tail // max(table.num_rows, 1)
        table = table.slice(0, table.num_rows - tail)
        step = min(table.num_rows, self._constant_rows())
        for at in range(0, table.num_rows, step):
            part = table.slice(at, step)
            for f, column in zip(GROUP_FIELDS, self._constant_columns(part.num_rows), strict=True):
                part = part.append_column(f, column)
            if self._writer is None:
                self.filesystem.create_dir(os.path.dirname(self.path), recursive=True)
                self._writer = pq.ParquetWriter(self.path, part.schema, filesystem=self.filesystem,
                                                compression="zstd", use_dictionary=DICTIONARY_COLUMNS,
                                                column_encoding=DELTA_COLUMNS, data_page_version="2.0",
                                                write_statistics=[
                                                    n for n in part.schema.names if n not in NO_STATISTICS])
            self._writer.write_table(part, row_group_size=ROW_GROUP_ROWS)
            self.flushes += 1

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
    column = table.column("commitLogOffset")
    offsets = np.concatenate([_int64s(chunk) for chunk in column.chunks]) if column.num_chunks else \
        np.empty(0, np.int64)
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
