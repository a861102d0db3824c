"""One pass in C over a window of CommitLog records: the reput path's hot loop.

Everything the dispatchers need from a record is found by `_kernels.decode_window` (indexcore/_kernels.c)
without a Python object per record: the header fields, the body CRC check, the TOPIC, the four properties
that matter (KEYS, UNIQ_KEY, TAGS, DELAY), the TAGS hash and the IndexFile hash of every `topic#key`.
Java hashes the UTF-16 code units of a string decoded from UTF-8 with malformed sequences replaced by
U+FFFD, so the kernel runs such a decoder inline instead of building strings. The rules are the ones
`commitlog.locate_parts`, `commitlog.find_properties` and `dispatch.index_keys_of` state for a single
record; tests hold the two readings to each other.

The kernel writes into buffers owned here. When one is full it stops before the record that does not fit,
and `decode_window` grows that buffer and goes on from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from indexcore import _kernels
from indexcore._kernels import (
    FULL_KEYS,
    FULL_RECORDS,
    FULL_TABLE,
    FULL_TEXT,
    FULL_TOPICS,
    K_HASH,
    K_OWNER,
    KEY_COLUMNS,
    R_DELAY_AT,
    R_DELAY_LEN,
    R_KEYS_AT,
    R_KEYS_LEN,
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
    STATE_COLUMNS,
    STOP_BLANK,
    STOP_END,
    STOP_ERROR,
    STOP_FULL,
    STOP_LIMIT,
    T_AT,
    T_LEN,
    TOPIC_COLUMNS,
)

_S_RECORDS, _S_KEYS, _S_TEXT, _S_TOPICS = range(STATE_COLUMNS)
_ROWS_PER_MIB = 2048  # a first guess at records per MiB of window (256-byte bodies give about 2,400)
_MIN_ROWS = 64
_INITIAL_TOPICS = 16


@dataclass(slots=True)
class WindowDecode:
    """What the kernel found: `records` rows of R_* columns, `keys` rows of K_* columns in `buildIndex`
    order (UNIQ_KEY first, then each non-empty KEYS token), the bytes of the KEYS and UNIQ_KEY values,
    and the T_* spans of each distinct topic spelling, numbered in order of first appearance."""

    records: np.ndarray  # int64 [n, RECORD_COLUMNS]
    keys: np.ndarray  # int64 [k, KEY_COLUMNS]
    text: bytes
    topics: np.ndarray  # int64 [t, TOPIC_COLUMNS]
    stop: int  # STOP_LIMIT, STOP_BLANK, STOP_END or STOP_ERROR
    position: int  # in the segment: where decoding stopped
    error: int  # with STOP_ERROR: a commitlog.RECORD_ERRORS code, described by `details`
    details: tuple[int, int, int]


def _grown(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.empty((max(rows, 2 * len(a)), *a.shape[1:]), dtype=a.dtype)
    out[: len(a)] = a
    return out


def decode_window(image, start: int, stop_at: int, file_size: int, base: int, max_size: int,
                  check_crc: bool) -> WindowDecode:
    """Decode the records of the segment image `image` (any byte buffer) from `start`, stopping before the
    first record that starts at or after `stop_at`, at a BLANK, at a zero TOTALSIZE or at a record that
    does not decode. `base` is the segment's CommitLog offset."""
    rows = max(_MIN_ROWS, min((stop_at - start) // 2**20 + 1, 64) * _ROWS_PER_MIB)
    records = np.empty((rows, RECORD_COLUMNS), dtype=np.int64)
    keys = np.empty((2 * rows, KEY_COLUMNS), dtype=np.int64)
    text = np.empty(64 * rows, dtype=np.uint8)
    topics = np.empty((_INITIAL_TOPICS, TOPIC_COLUMNS), dtype=np.int64)
    table = np.empty(4 * _INITIAL_TOPICS, dtype=np.int64)
    state = np.zeros(STATE_COLUMNS, dtype=np.int64)
    pos = start
    while True:
        stop, pos, error, e1, e2, e3 = _kernels.decode_window(
            image, pos, stop_at, file_size, base, max_size, check_crc, records, keys, text, topics, table, state)
        if stop != STOP_FULL:
            break
        if e1 & FULL_RECORDS:
            records = _grown(records, len(records) + 1)
        if e1 & FULL_KEYS:
            keys = _grown(keys, int(state[_S_KEYS]) + e2)
        if e1 & FULL_TEXT:
            text = _grown(text, int(state[_S_TEXT]) + e3)
        if e1 & FULL_TOPICS:
            topics = _grown(topics, len(topics) + 1)
        if e1 & FULL_TABLE:
            table = np.empty(2 * len(table), dtype=np.int64)
    n, nkeys, ntext, ntopics = (int(x) for x in state)
    return WindowDecode(records[:n], keys[:nkeys], text[:ntext].tobytes(), topics[:ntopics], stop, pos, error,
                        (e1, e2, e3))


java_hash_utf8 = _kernels.java_hash_utf8

__all__ = [
    "K_HASH", "K_OWNER", "R_DELAY_AT", "R_DELAY_LEN", "R_KEYS_AT", "R_KEYS_LEN", "R_PHY", "R_PREPARED_OFFSET",
    "R_QUEUE_ID", "R_QUEUE_OFFSET", "R_SIZE", "R_STORE_TIMESTAMP", "R_SYS_FLAG", "R_TAGS_CODE", "R_TOPIC_ID",
    "R_UNIQ_AT", "R_UNIQ_LEN", "STOP_BLANK", "STOP_END", "STOP_ERROR", "STOP_LIMIT", "T_AT", "T_LEN",
    "WindowDecode", "decode_window", "java_hash_utf8",
]
