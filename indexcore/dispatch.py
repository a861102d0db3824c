"""From CommitLog records to dispatch requests, and which dispatcher takes which request.

`DispatchBatch` is the columnar form of the broker's `DispatchRequest`s for the records of one read:
numeric fields are numpy arrays so dispatchers can group, sort and pack them without a per-record
Python loop; strings stay in lists. The rules here are `checkMessageAndReturnSize` (tagsCode and the
delay-level special case), `CommitLogDispatcherBuildConsumeQueue` (which transaction types get a unit)
and `IndexService.buildIndex` (which keys are indexed, in which order).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from indexcore.commitlog import (
    KEY_SEPARATOR,
    SCHEDULE_TOPIC,
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_NOT_TYPE,
    TRANSACTION_ROLLBACK_TYPE,
    TRANSACTION_TYPE_MASK,
)
from indexcore.javahash import index_key_hash_many

DEFAULT_MESSAGE_DELAY_LEVEL = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
DELAY_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
UNKNOWN_LEVEL_DELAY_MS = 1000
INDEX_KEY_SEPARATOR = "#"


_DELAY_TOKEN = re.compile(r"([0-9]+)([smhd])", re.ASCII)


def _no_rows(dtype=None) -> np.ndarray:
    return np.zeros(0, dtype=dtype or np.int32)


def parse_delay_levels(spec: str) -> tuple[int, ...]:
    """`ScheduleMessageService.parseDelayLevel`: the delay in ms of each level, level 1 first."""
    tokens = spec.split()
    if not tokens:
        raise ValueError("no delay levels given")
    delays = []
    for token in tokens:
        match = _DELAY_TOKEN.fullmatch(token)
        if match is None:
            raise ValueError(f"bad delay level {token!r}: expected digits followed by one of s, m, h, d")
        delays.append(int(match[1]) * DELAY_UNIT_MS[match[2]])
    return tuple(delays)


class DelayLevelTable:
    """Level n (1-based) -> delay in ms, from a `messageDelayLevel` string."""

    __slots__ = ("delays_ms",)

    def __init__(self, spec: str = DEFAULT_MESSAGE_DELAY_LEVEL):
        self.delays_ms = parse_delay_levels(spec)

    @property
    def max_level(self) -> int:
        return len(self.delays_ms)

    def deliver_timestamp(self, level: int, store_timestamp: int) -> int:
        """`computeDeliverTimestamp`: store time plus the level's delay (1 s for a level with no entry)."""
        if 1 <= level <= len(self.delays_ms):
            return store_timestamp + self.delays_ms[level - 1]
        return store_timestamp + UNKNOWN_LEVEL_DELAY_MS


def parse_java_int(text: str) -> int | None:
    """`Integer.parseInt`, or None where Java would throw NumberFormatException."""
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not digits.isdecimal():
        return None
    value = int(text)
    return value if -(2**31) <= value < 2**31 else None


def delay_tags_code(level: int, store_timestamp: int, table: DelayLevelTable) -> int | None:
    """The tagsCode of a `SCHEDULE_TOPIC_XXXX` record with DELAY=level, or None to keep the tag hash."""
    level = min(level, table.max_level)
    if level > 0:
        return table.deliver_timestamp(level, store_timestamp)
    return None


def index_keys_of(topic: str, uniq_key: str | None, keys: str | None) -> list[str]:
    """`buildIndex` order: `topic#UNIQ_KEY` first, then `topic#token` for each non-empty KEYS token."""
    out = []
    if uniq_key is not None:
        out.append(topic + INDEX_KEY_SEPARATOR + uniq_key)
    if keys:
        out.extend(topic + INDEX_KEY_SEPARATOR + k for k in keys.split(KEY_SEPARATOR) if k)
    return out


class StringColumn(Sequence):
    """A column of optional strings kept as UTF-8 bytes and decoded only when read.

    The dispatch path needs the hashes of KEYS and UNIQ_KEY, never the strings; plug-ins and tools that
    want the strings get them here, malformed bytes replaced by U+FFFD as Python replaces them (Java differs
    only on an encoded surrogate: one U+FFFD for its three bytes, which is what the hashes follow).
    """

    __slots__ = ("_at", "_length", "_text")
    __hash__ = None  # compares equal to lists

    def __init__(self, text: bytes, at: np.ndarray, length: np.ndarray):
        self._text = text
        self._at = at  # -1: None
        self._length = length

    @classmethod
    def of(cls, values: Sequence[str | None]) -> StringColumn:
        encoded = [None if v is None else v.encode("utf-8", "surrogatepass") for v in values]
        length = np.array([0 if e is None else len(e) for e in encoded], dtype=np.int64)
        at = np.cumsum(length) - length
        at[[i for i, e in enumerate(encoded) if e is None]] = -1
        return cls(b"".join(e for e in encoded if e is not None), at, length)

    def __len__(self) -> int:
        return len(self._at)

    def arrays(self) -> tuple[bytes, np.ndarray, np.ndarray]:
        """The UTF-8 bytes and each value's start in them (-1: None) and length, for columnar consumers."""
        return self._text, self._at, self._length

    def _get(self, i: int) -> str | None:
        at = int(self._at[i])
        if at < 0:
            return None
        return self._text[at : at + int(self._length[i])].decode("utf-8", "replace")

    def __getitem__(self, i):
        if isinstance(i, slice):
            return StringColumn(self._text, self._at[i], self._length[i])
        return self._get(i)

    def __iter__(self):
        return map(self._get, range(len(self)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (StringColumn, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StringColumn({list(self)!r})"


def _index_keys_of_strings(topic_id: np.ndarray, topics: Sequence[str], keys: Sequence[str | None],
                           uniq_key: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
    """Key hashes and owners from string columns (hand-built batches); the reader computes them itself."""
    all_keys: list[str] = []
    owners: list[int] = []
    for i, (u, k) in enumerate(zip(uniq_key, keys, strict=True)):
        if u is None and not k:
            continue
        ks = index_keys_of(topics[topic_id[i]], u, k)
        all_keys.extend(ks)
        owners.extend([i] * len(ks))
    return index_key_hash_many(all_keys), np.asarray(owners, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class DispatchBatch:
    """The dispatch requests of consecutive CommitLog records, one array element per record.

    `key_hash`/`key_owner` list the IndexFile keys of the batch in `buildIndex` order (each record's
    UNIQ_KEY, then its KEYS tokens, records in CommitLog order) with the row of the record each belongs
    to, whatever the record's transaction type: the index dispatcher picks the rows it indexes.

    `end_offset` is the CommitLog offset just after the last record of the batch (after a BLANK it
    is the next segment's start), i.e. the reput_from_offset once the batch has been dispatched.

    `multi_*` list the multi-dispatch targets (multidispatch.py) when the batch was read with
    multi-dispatch on: the row of the record, the queue (its name is `topics[multi_topic_id]`, the queue
    id already resolved) and the queue offset, records in CommitLog order and each record's targets in
    property order. `multi_count_mismatch` holds the rows whose name and offset counts differ (no extra
    unit, as on the broker, which logs it).
    """

    phy_offset: np.ndarray  # int64, PHYSICALOFFSET
    msg_size: np.ndarray  # int32, TOTALSIZE
    queue_id: np.ndarray  # int32
    queue_offset: np.ndarray  # int64, consumeQueueOffset
    sys_flag: np.ndarray  # int32
    store_timestamp: np.ndarray  # int64
    tags_code: np.ndarray  # int64
    prepared_transaction_offset: np.ndarray  # int64
    topic_id: np.ndarray  # int32, index into `topics`
    topics: tuple[str, ...]
    keys: StringColumn  # property KEYS
    uniq_key: StringColumn  # property UNIQ_KEY
    key_hash: np.ndarray  # int32, index_key_hash("topic#key")
    key_owner: np.ndarray  # int32, row of the record the key belongs to
    start_offset: int
    end_offset: int
    multi_owner: np.ndarray = field(default_factory=_no_rows)  # int32, row of the record
    multi_topic_id: np.ndarray = field(default_factory=_no_rows)  # int32, into `topics`
    multi_queue_id: np.ndarray = field(default_factory=_no_rows)  # int32
    multi_queue_offset: np.ndarray = field(default_factory=lambda: _no_rows(np.int64))  # int64
    multi_count_mismatch: np.ndarray = field(default_factory=_no_rows)  # int32, rows
    # read with `batchdecode.CATALOG_FIELDS` only: the kernel's rows R_BORN_TIMESTAMP .. R_HOST_LEN (int64
    # [CATALOG_FIELD_ROWS, n]), their spans into the text of `keys` (the backfill's catalog)
    catalog_fields: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.phy_offset)

    @classmethod
    def of(cls, *, keys: Sequence[str | None], uniq_key: Sequence[str | None], **columns) -> DispatchBatch:
        """A batch from columns with KEYS and UNIQ_KEY as strings (tests, the backfill's rows)."""
        key_hash, key_owner = _index_keys_of_strings(columns["topic_id"], columns["topics"], keys, uniq_key)
        return cls(keys=StringColumn.of(keys), uniq_key=StringColumn.of(uniq_key), key_hash=key_hash,
                   key_owner=key_owner, **columns)

    @classmethod
    def empty(cls, offset: int) -> DispatchBatch:
        z64, z32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        none = StringColumn(b"", z64, z64)
        return cls(z64, z32, z32, z64, z32, z64, z64, z64, z32, (), none, none, z32, z32, offset, offset)

    def topic_of(self, i: int) -> str:
        return self.topics[self.topic_id[i]]

    def transaction_type(self) -> np.ndarray:
        return self.sys_flag & TRANSACTION_TYPE_MASK

    def consume_queue_mask(self) -> np.ndarray:
        """Records that get a ConsumeQueue unit: NOT_TYPE and COMMIT_TYPE."""
        t = self.transaction_type()
        return (t == TRANSACTION_NOT_TYPE) | (t == TRANSACTION_COMMIT_TYPE)

    def index_mask(self) -> np.ndarray:
        """Records whose keys are indexed: everything but ROLLBACK_TYPE (PREPARED is indexed)."""
        return self.transaction_type() != TRANSACTION_ROLLBACK_TYPE

    def index_keys(self, selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The key hashes of the selected records in dispatch order, and the record each belongs to."""
        picked = selected[self.key_owner]
        return self.key_hash[picked], self.key_owner[picked]

    def head(self, n: int, end_offset: int) -> DispatchBatch:
        """The first `n` records, as a batch ending at `end_offset`."""
        keep = int(np.searchsorted(self.key_owner, n))
        multi = int(np.searchsorted(self.multi_owner, n))
        mismatch = int(np.searchsorted(self.multi_count_mismatch, n))
        return DispatchBatch(
            self.phy_offset[:n], self.msg_size[:n], self.queue_id[:n], self.queue_offset[:n], self.sys_flag[:n],
            self.store_timestamp[:n], self.tags_code[:n], self.prepared_transaction_offset[:n], self.topic_id[:n],
            self.topics, self.keys[:n], self.uniq_key[:n], self.key_hash[:keep], self.key_owner[:keep],
            self.start_offset, end_offset, self.multi_owner[:multi], self.multi_topic_id[:multi],
            self.multi_queue_id[:multi], self.multi_queue_offset[:multi], self.multi_count_mismatch[:mismatch],
            None if self.catalog_fields is None else self.catalog_fields[:, :n])


__all__ = [
    "DEFAULT_MESSAGE_DELAY_LEVEL",
    "SCHEDULE_TOPIC",
    "DelayLevelTable",
    "DispatchBatch",
    "StringColumn",
    "delay_tags_code",
    "index_keys_of",
    "parse_delay_levels",
    "parse_java_int",
]
