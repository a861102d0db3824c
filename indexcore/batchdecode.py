"""One pass in C over a window of CommitLog records: the reput path's hot loop.

Everything the dispatchers need from a record is found by `_kernels.decode_window` (indexcore/_kernels.c)
without a Python object per record: the header fields, the body CRC check, the TOPIC, the four properties
that matter (KEYS, UNIQ_KEY, TAGS, DELAY), the TAGS hash and the IndexFile hash of every `topic#key`; and,
only when multi-dispatch is on, the target queues and offsets of INNER_MULTI_DISPATCH (multidispatch.py).
Java hashes the UTF-16 code units of a string decoded from UTF-8 with malformed sequences replaced by
U+FFFD, so the kernel runs such a decoder inline instead of building strings. The rules are the ones
`commitlog.locate_parts`, `commitlog.find_properties` and `dispatch.index_keys_of` state for a single
record; tests hold the two readings to each other.

The kernel writes into buffers owned here. When one is full it stops before the record that does not fit,
and `decode_window` grows that buffer and goes on from there.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from indexcore import _kernels
from indexcore._kernels import (
    CATALOG_FIELDS,
    FULL_KEYS,
    FULL_MULTI,
    FULL_RECORDS,
    FULL_TABLE,
    FULL_TEXT,
    FULL_TOPICS,
    K_HASH,
    K_OWNER,
    KEY_COLUMNS,
    M_OWNER,
    M_QUEUE_ID,
    M_QUEUE_OFFSET,
    M_TOPIC_ID,
    MIN_RECORD_SIZE,
    MULTI_COLUMNS,
    R_BORN_TIMESTAMP,
    R_DELAY_AT,
    R_DELAY_LEN,
    R_HOST_LEN,
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
    RECORD_COLUMNS,
    ROLE_MULTI_DISPATCH,
    STATE_COLUMNS,
    STOP_BLANK,
    STOP_END,
    STOP_ERROR,
    STOP_FULL,
    STOP_LIMIT,
    T_AT,
    T_FIRST,
    T_LEN,
    T_ROLE,
    TOPIC_COLUMNS,
)

_S_RECORDS, _S_KEYS, _S_TEXT, _S_TOPICS, _S_MULTI = range(STATE_COLUMNS)
# the record rows CATALOG_FIELDS adds (`DispatchBatch.catalog_fields`); the catalog's C pass knows their order
CATALOG_FIELD_ROWS = slice(R_BORN_TIMESTAMP, R_HOST_LEN + 1)
_KEYS_FIRST_GUESS = 4096
_MULTI_FIRST_GUESS = 4096
_TEXT_FIRST_GUESS = 1 << 16
_INITIAL_TOPICS = 16


@dataclass(slots=True)
class WindowDecode:
    """What the kernel found: `records` (R_* rows, one column per record), `keys` (K_* rows, one column per
    key, in `buildIndex` order: UNIQ_KEY first, then each non-empty KEYS token), the bytes of the KEYS and
    UNIQ_KEY values, the T_* columns of each distinct topic spelling (record topics and multi-dispatch
    queue names alike), numbered in order of first appearance, and `multi` (M_* rows, one column per
    multi-dispatch target, records in order). The arrays are views of the scratch buffers: valid until the
    next decode with them."""

    records: np.ndarray  # int64 [RECORD_COLUMNS, n]
    keys: np.ndarray  # int64 [KEY_COLUMNS, k]
    multi: np.ndarray  # int64 [MULTI_COLUMNS, m]
    text: bytes
    topics: np.ndarray  # int64 [t, TOPIC_COLUMNS]
    stop: int  # STOP_LIMIT, STOP_BLANK, STOP_END or STOP_ERROR
    position: int  # in the segment: where decoding stopped
    error: int  # with STOP_ERROR: a commitlog.RECORD_ERRORS code, described by `details`
    details: tuple[int, int, int]


def _sparse_table(rows: int, columns: int) -> np.ndarray:
    """An int64 table [rows, columns] in an anonymous private mapping of its own, read-write and zero, whose
    pages are allocated as they are first written, 4 KiB at a time. The records table is sized for the
    most records a window could hold (its bytes over the smallest record) and a window fills a fraction
    of each row; numpy's allocator asks for transparent huge pages on arrays this large, and the first
    write to each 2 MiB page then clears all of it: the first window of a rebuild took 27 to 160 ms
    instead of 30 (a rebuild's first window is decoded before anything else can run)."""
    size = max(rows * columns * np.dtype(np.int64).itemsize, 1)
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE), dtype=np.int64, count=rows * columns).reshape(
        rows, columns)


def _wider(table: np.ndarray, columns: int) -> np.ndarray:
    """A column-major table with room for at least `columns` (and twice as many) entries per row."""
    out = np.empty((table.shape[0], max(columns, 2 * table.shape[1])), dtype=table.dtype)
    out[:, : table.shape[1]] = table
    return out


def _longer(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.empty((max(rows, 2 * len(a)), *a.shape[1:]), dtype=a.dtype)
    out[: len(a)] = a
    return out


class DecodeScratch:
    """The buffers the kernel writes into, kept from one window to the next so that a reader neither
    allocates nor faults in fresh memory for every batch."""

    __slots__ = ("keys", "multi", "records", "table", "text", "topics")

    def __init__(self) -> None:
        self.records = np.empty((RECORD_COLUMNS, 0), dtype=np.int64)
        self.keys = np.empty((KEY_COLUMNS, _KEYS_FIRST_GUESS), dtype=np.int64)
        self.multi = np.empty((MULTI_COLUMNS, 0), dtype=np.int64)  # grown on first use
        self.text = np.empty(_TEXT_FIRST_GUESS, dtype=np.uint8)
        self.topics = np.empty((_INITIAL_TOPICS, TOPIC_COLUMNS), dtype=np.int64)
        self.table = np.empty(4 * _INITIAL_TOPICS, dtype=np.int64)


def decode_window(image, start: int, stop_at: int, file_size: int, base: int, max_size: int, check_crc: bool,
                  scratch: DecodeScratch | None = None, multi_flags: int = 0) -> WindowDecode:
    """Decode the records of the segment image `image` (any byte buffer) from `start`, stopping before the
    first record that starts at or after `stop_at`, at a BLANK, at a zero TOTALSIZE or at a record that
    does not decode. `base` is the segment's CommitLog offset; `multi_flags` (multidispatch.py) turns on
    the extraction of multi-dispatch targets."""
    s = scratch or DecodeScratch()
    # records never outnumber the window's bytes over the smallest record: room for that many (only the
    # entries written are ever touched); keys, text and topics grow when a window needs more
    rows = max(0, stop_at - start) // MIN_RECORD_SIZE + 1
    if s.records.shape[1] < rows:
        s.records = _sparse_table(RECORD_COLUMNS, rows)
    state = np.zeros(STATE_COLUMNS, dtype=np.int64)
    pos = start
    while True:
        stop, pos, error, e1, e2, e3 = _kernels.decode_window(
            image, pos, stop_at, file_size, base, max_size, check_crc, multi_flags, s.records, s.keys, s.text,
            s.topics, s.table, s.multi, state)
        if stop != STOP_FULL:
            break
        if e1 & FULL_RECORDS:
            s.records = _wider(s.records, s.records.shape[1] + 1)
        if e1 & FULL_KEYS:
            s.keys = _wider(s.keys, int(state[_S_KEYS]) + e2)
        if e1 & FULL_TEXT:
            s.text = _longer(s.text, int(state[_S_TEXT]) + e3)
        if e1 & FULL_TOPICS:
            s.topics = _longer(s.topics, len(s.topics) + 1)
        if e1 & FULL_TABLE:
            s.table = np.empty(2 * len(s.table), dtype=np.int64)
        if e1 & FULL_MULTI:
            s.multi = _wider(s.multi, max(_MULTI_FIRST_GUESS, int(state[_S_MULTI]) + 1))
    n, nkeys, ntext, ntopics, nmulti = (int(x) for x in state)
    return WindowDecode(s.records[:, :n], s.keys[:, :nkeys], s.multi[:, :nmulti], s.text[:ntext].tobytes(),
                        s.topics[:ntopics], stop, pos, error, (e1, e2, e3))


__all__ = [
    "CATALOG_FIELDS", "CATALOG_FIELD_ROWS",
    "K_HASH", "K_OWNER", "M_OWNER", "M_QUEUE_ID", "M_QUEUE_OFFSET", "M_TOPIC_ID", "ROLE_MULTI_DISPATCH", "R_DELAY_AT",
    "R_DELAY_LEN", "R_KEYS_AT", "R_KEYS_LEN", "R_MULTI", "R_PHY", "R_PREPARED_OFFSET", "R_QUEUE_ID", "R_QUEUE_OFFSET",
    "R_SIZE",
    "R_STORE_TIMESTAMP", "R_SYS_FLAG", "R_TAGS_CODE", "R_TOPIC_ID", "R_UNIQ_AT", "R_UNIQ_LEN",
    "STOP_BLANK", "STOP_END", "STOP_ERROR", "STOP_LIMIT", "T_AT", "T_FIRST", "T_LEN", "T_ROLE",
    "DecodeScratch", "WindowDecode", "decode_window",
]
