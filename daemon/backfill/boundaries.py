"""Where records and DLedger entries start in a byte range whose first boundary is unknown: a header that
validates itself (MAGICCODE at +4, PHYSICALOFFSET at +28 naming its own offset, a TOTALSIZE within bounds,
and the same of what follows it), and whether the rest of a segment is unwritten. `ranges.find_first_record`
walks a range with them."""

from __future__ import annotations

import struct

import numpy as np

from indexcore.commitlog import (
    BLANK_MAGIC_CODE,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    MIN_RECORD_SIZE,
    PHYSICAL_OFFSET,
    PHYSICAL_OFFSET_OFFSET,
    RECORD_PREFIX,
)
from indexcore.dledger import BLANK as DLEDGER_BLANK
from indexcore.dledger import BLANK_MAGIC as DLEDGER_BLANK_MAGIC
from indexcore.dledger import ENTRY_HEADER, ENTRY_HEADER_SIZE, ENTRY_MAGIC, EntryHeader

_MAGICS = tuple(struct.pack(">i", m) for m in (MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2, BLANK_MAGIC_CODE))
_MAGIC_AT = 4  # MAGICCODE's offset in a record
_ZERO_PROBE = 1 << 20
_ENTRY_MAGIC_BYTES = struct.pack(">i", ENTRY_MAGIC)


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


def entry_at(buf, p: int, seg_start: int, seg_size: int, max_size: int, follow: int = 1) -> bool:
    """Whether a DLedger entry (or DLedger BLANK) that validates itself starts at p: magic 1, a size within
    bounds, bodyLen = size - 48 and its pos field equal to its own offset (which DLedger writes in every entry,
    so a forged one inside a body must also name its place); `follow` deep, the one after too."""
    if p + DLEDGER_BLANK.size > seg_size:
        return False
    magic, size = DLEDGER_BLANK.unpack_from(buf, p)
    if magic == DLEDGER_BLANK_MAGIC:
        return size == seg_size - p
    if magic != ENTRY_MAGIC or p + ENTRY_HEADER_SIZE > seg_size:
        return False
    if not ENTRY_HEADER_SIZE + MIN_RECORD_SIZE <= size <= min(max_size + ENTRY_HEADER_SIZE, seg_size - p):
        return False
    header = EntryHeader._make(ENTRY_HEADER.unpack_from(buf, p))
    if header.pos != seg_start + p or header.body_length != size - ENTRY_HEADER_SIZE:
        return False
    if follow == 0:
        return True
    nxt = p + size
    if nxt + DLEDGER_BLANK.size > seg_size:
        return False
    if DLEDGER_BLANK.unpack_from(buf, nxt) == (0, 0):
        return True  # the end of the written data
    return entry_at(buf, nxt, seg_start, seg_size, max_size, follow - 1)


def first_entry_in(buf, lo: int, hi: int, seg_start: int, seg_size: int, max_size: int) -> int | None:
    """The first position in [lo, hi) where a self-validating DLedger entry starts, found by its magic."""
    at = buf.find(_ENTRY_MAGIC_BYTES, lo, hi + len(_ENTRY_MAGIC_BYTES) - 1)
    while 0 <= at < hi:
        if entry_at(buf, at, seg_start, seg_size, max_size):
            return at
        at = buf.find(_ENTRY_MAGIC_BYTES, at + 1, hi + len(_ENTRY_MAGIC_BYTES) - 1)
    return None


def first_header_in(buf, lo: int, hi: int, seg_start: int, seg_size: int, max_size: int) -> int | None:
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


def unwritten(image, start: int, end: int) -> bool:
    """Whether [start, end) holds only zeros (a hole, by SEEK_DATA, or read a MiB at a time)."""
    if image.next_data(start) >= end:
        return True
    image.ensure(start, end)
    view = np.frombuffer(image.buffer, dtype=np.uint8, count=end - start, offset=start)
    return not any(np.count_nonzero(view[i : i + _ZERO_PROBE]) for i in range(0, len(view), _ZERO_PROBE))


# --- the decode ------------------------------------------------------------------------------------------
