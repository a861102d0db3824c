"""Comparing a store's ConsumeQueue and IndexFile files with what its CommitLog implies, without writing.

Nothing here states a dispatch rule of its own. The units a batch gives each queue come from
`consume_queue_units` and their positions from `place_units`, exactly as `ConsumeQueue.put_packed` writes
them; the IndexFiles are built by `IndexService.build_index` itself, into `IndexImage`s: in-memory files
that hold the header and the slot table, and of the entries only those of the put in progress, which are
compared with the existing file at once. So a store verifies clean exactly when a rebuild would write
its bytes (IndexFiles compared by content, in name order: their names are clock readings).

The existing files are read through read-only mappings, a window at a time, with no lock and no write,
so a broker's own store can be checked while it runs. Memory is bounded by one batch of records, one
slot table and a bounded number of open mappings, whatever the size of the store.

A difference is a `Finding`: a kind, the file (relative to the verified directory), the byte position of
its first difference there, how many units, entries or slots it covers, their ranges and a few examples.
Differences of one kind are gathered per queue (ConsumeQueue) or per file (IndexFile).

    ConsumeQueue                        IndexFile
    cqUnitMissing    zeros where a unit belongs             indexEntryMissing  zeros where an entry belongs
    cqUnitWrong      another record's unit, or other tags   indexEntryWrong    other key hash, offset or time
    cqUnitDangling   a unit pointing at no record           indexEntryExtra    an entry past the last one
    cqUnitExtra      a unit past the queue's last one       indexChainBroken   a slot or prevIndex off its chain
    cqFileMissing    a file that should hold units          indexHeaderWrong   header fields off the entries
    cqFileExtra      a file with nothing that belongs       indexFileMissing   a file the CommitLog implies
    cqFileSize       a file of the wrong size               indexFileExtra     a file it does not imply
    cqQueueMissing   a queue directory that is absent       indexFileSize      a file of the wrong size
    cqQueueOrphaned  a queue the CommitLog gives no unit    strayFile          a name no broker writes
    outputMissing    neither consumequeue/ nor index/ beside a CommitLog that holds data

This module holds what both checks share (the kinds, `Finding`s, the mappings of the existing files); the
checks are indexcore/queuecheck.py (`ConsumeQueueCheck`) and indexcore/indexcheck.py (`IndexCheck`, with
the in-memory files of indexcore/indeximage.py).
"""

from __future__ import annotations

import mmap
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from indexcore.consumequeue import PRIVATE_OPEN_FILES, ConsumeQueueUnit
from indexcore.dispatch import DispatchBatch
from indexcore.indexfile import (
    IndexEntry,
)
from indexcore.indexservice import INDEX_FILE_NAME_DIGITS
from indexcore.mappedfile import FILE_NAME_DIGITS
from indexcore.queuestore import open_queue_files_limit

CQ_UNIT_MISSING = "cqUnitMissing"
CQ_UNIT_WRONG = "cqUnitWrong"
CQ_UNIT_DANGLING = "cqUnitDangling"
CQ_UNIT_EXTRA = "cqUnitExtra"
CQ_FILE_MISSING = "cqFileMissing"
CQ_FILE_EXTRA = "cqFileExtra"
CQ_FILE_SIZE = "cqFileSize"
CQ_QUEUE_MISSING = "cqQueueMissing"
CQ_QUEUE_ORPHANED = "cqQueueOrphaned"
INDEX_ENTRY_MISSING = "indexEntryMissing"
INDEX_ENTRY_WRONG = "indexEntryWrong"
INDEX_ENTRY_EXTRA = "indexEntryExtra"
INDEX_CHAIN_BROKEN = "indexChainBroken"
INDEX_HEADER_WRONG = "indexHeaderWrong"
INDEX_FILE_MISSING = "indexFileMissing"
INDEX_FILE_EXTRA = "indexFileExtra"
INDEX_FILE_SIZE = "indexFileSize"
STRAY_FILE = "strayFile"
COMMIT_LOG_CORRUPT = "commitLogCorrupt"
OUTPUT_MISSING = "outputMissing"

KINDS = (OUTPUT_MISSING, COMMIT_LOG_CORRUPT, CQ_QUEUE_MISSING, CQ_QUEUE_ORPHANED, CQ_FILE_MISSING, CQ_FILE_EXTRA,
         CQ_FILE_SIZE, CQ_UNIT_MISSING, CQ_UNIT_WRONG, CQ_UNIT_DANGLING, CQ_UNIT_EXTRA, INDEX_FILE_MISSING,
         INDEX_FILE_EXTRA, INDEX_FILE_SIZE, INDEX_HEADER_WRONG, INDEX_ENTRY_MISSING, INDEX_ENTRY_WRONG,
         INDEX_ENTRY_EXTRA, INDEX_CHAIN_BROKEN, STRAY_FILE)

MAX_RANGES = 16  # ranges of queue offsets / entry numbers kept per finding; the count covers them all
MAX_EXAMPLES = 5
# A mapping keeps a descriptor: IndexFiles beyond this many are re-mapped when met again (the ConsumeQueue
# check keeps `queue_mappings_limit`, many more: an LMQ store's queues are met every batch)
OPEN_MAPPINGS = 256
# vm.max_map_count bounds every mapping of a process (one more fails with ENOMEM); Linux's default
MAX_MAP_COUNT_PATH = "/proc/sys/vm/max_map_count"
DEFAULT_MAX_MAP_COUNT = 65530
TAIL_SCAN_UNITS = 1 << 16  # units (or entries) read at a time past the expected end, until one read is all zero
_HEADER_BEGIN = (0, 2)  # begin_timestamp, begin_phy_offset: written by a file's first put only
_HEADER_JSON = ("beginTimestamp", "endTimestamp", "beginPhyOffset", "endPhyOffset", "hashSlotCount", "indexCount")
_HEADER_FIELD_AT = (0, 8, 16, 24, 32, 36)
_PREV_AT = 16  # prev_index inside an entry
_TIME_DIFF = slice(12, 16)
_QUEUE_FILE_NAME = re.compile(rf"\d{{{FILE_NAME_DIGITS}}}")
_INDEX_FILE_NAME = re.compile(rf"\d{{{INDEX_FILE_NAME_DIGITS}}}")


@dataclass(slots=True)
class Finding:
    """One kind of difference in one queue or file: where the first one is, how many, which."""

    kind: str
    file: str
    position: int | None
    details: dict = field(default_factory=dict)
    items: int = 0  # units, entries or slots added
    range_name: str = "ranges"
    ranges: list[list[int]] = field(default_factory=list)  # [lo, hi)
    ranges_left_out: int = 0
    examples: list[dict] = field(default_factory=list)

    @property
    def count(self) -> int:
        """How many units, entries or slots the finding covers; 1 for a finding about a file or a header."""
        return max(self.items, 1)

    def add(self, number: int, n: int = 1, example: dict | None = None) -> None:
        self.items += n
        if self.ranges and self.ranges[-1][1] == number:
            self.ranges[-1][1] = number + n
        elif len(self.ranges) < MAX_RANGES:
            self.ranges.append([number, number + n])
        else:
            self.ranges_left_out += 1
        if example is not None and len(self.examples) < MAX_EXAMPLES:
            self.examples.append(example)

    def as_dict(self) -> dict:
        out = {"kind": self.kind, "file": self.file, "position": self.position, "count": self.count, **self.details}
        if self.ranges:
            out[self.range_name] = self.ranges
            if self.ranges_left_out:
                out[self.range_name + "LeftOut"] = self.ranges_left_out
        if self.examples:
            out["examples"] = self.examples
        return out


class Findings:
    """Findings gathered by (kind, queue or file), in the order first met."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Finding] = {}

    def get(self, kind: str, file: str, position: int | None, *, key: str | None = None, range_name: str = "ranges",
            **details) -> Finding:
        k = (kind, key if key is not None else file)
        f = self._by_key.get(k)
        if f is None:
            f = self._by_key[k] = Finding(kind, file, position, details, range_name=range_name)
        return f

    def add(self, kind: str, file: str, position: int | None, **details) -> Finding:
        """A finding about a file or a queue as a whole."""
        return self.get(kind, file, position, **details)

    def __iter__(self) -> Iterator[Finding]:
        order = {k: i for i, k in enumerate(KINDS)}
        return iter(sorted(self._by_key.values(), key=lambda f: (order.get(f.kind, len(order)), f.file,
                                                                  -1 if f.position is None else f.position)))

    def __len__(self) -> int:
        return len(self._by_key)


class RecordLocator:
    """Whether a CommitLog offset holds a message record of a given size: in the batch being verified by
    a search of its offsets, elsewhere by reading the record (only for units that already differ)."""

    def __init__(self, read_size: Callable[[int], int | None]):
        self._read_size = read_size
        self.batch: DispatchBatch | None = None

    def is_record(self, phy_offset: int, size: int) -> bool:
        b = self.batch
        if b is not None and len(b) and int(b.phy_offset[0]) <= phy_offset <= int(b.phy_offset[-1]):
            i = int(np.searchsorted(b.phy_offset, phy_offset))
            return int(b.phy_offset[i]) == phy_offset and int(b.msg_size[i]) == size
        return phy_offset >= 0 and self._read_size(phy_offset) == size


def queue_mappings_limit(max_map_count_path: str = MAX_MAP_COUNT_PATH) -> int:
    """How many queue files the ConsumeQueue check keeps mapped: as many as a store keeps descriptors for
    (`open_queue_files_limit`), and at most half of vm.max_map_count. With a high descriptor limit (a
    container's 1,048,576) the first alone would allow 65,536 mappings, over the default 65,530, and an
    LMQ store of that many queue files would fail with ENOMEM."""
    try:
        with open(max_map_count_path, encoding="ascii") as f:
            max_map_count = int(f.read())
    except (OSError, ValueError):
        max_map_count = DEFAULT_MAX_MAP_COUNT
    return max(PRIVATE_OPEN_FILES, min(open_queue_files_limit(), max_map_count // 2))


class MappedFiles:
    """Read-only mappings of existing files, at most OPEN_MAPPINGS at a time, pages dropped once compared."""

    def __init__(self, limit: int = OPEN_MAPPINGS):
        self._limit = limit
        self._open: OrderedDict[str, mmap.mmap] = OrderedDict()

    def get(self, path: str) -> mmap.mmap:
        mm = self._open.get(path)
        if mm is not None:
            self._open.move_to_end(path)
            return mm
        with open(path, "rb") as f:
            try:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:  # ENOMEM past vm.max_map_count: name the file and the number held
                raise OSError(e.errno, f"cannot map it with {len(self._open)} files mapped ({e.strerror})",
                              path) from None
        self._open[path] = mm
        if len(self._open) > self._limit:
            self._open.popitem(last=False)[1].close()
        return mm

    def view(self, path: str, position: int, length: int) -> np.ndarray:
        return np.frombuffer(self.get(path), dtype=np.uint8, count=length, offset=position)

    def done_with(self, path: str, start: int, end: int) -> None:
        """Drop the whole pages of [start, end) from this process: they were compared and stay cached."""
        mm = self._open.get(path)
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end - end % mmap.PAGESIZE
        if mm is not None and last > first:
            mm.madvise(mmap.MADV_DONTNEED, first, last - first)

    def close(self) -> None:
        for mm in self._open.values():
            mm.close()
        self._open.clear()


def _unit_json(raw) -> dict:
    u = ConsumeQueueUnit.decode(bytes(raw))
    return {"commitLogOffset": u.commit_log_offset, "msgSize": u.msg_size, "tagsCode": u.tags_code}


def _entry_json(raw) -> dict:
    e = IndexEntry.decode(bytes(raw))
    return {"keyHash": e.key_hash, "phyOffset": e.phy_offset, "timeDiff": e.time_diff, "prevIndex": e.prev_index}


_SMALL_COMPARE = 1 << 16  # below this many bytes a copy and a memcmp beat numpy's per-call cost


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two byte arrays of a length divisible by 4 are equal, the fastest way for their size."""
    if len(a) != len(b):
        return False
    if len(a) < _SMALL_COMPARE:
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def _nonzero_rows(data: np.ndarray, width: int) -> np.ndarray:
    return np.flatnonzero(data.reshape(-1, width).any(axis=1))


__all__ = ["KINDS", "Finding", "Findings", "MappedFiles", "RecordLocator"]


def list_store_files(directory: str, name_pattern: re.Pattern[str], file_size: int, live: bool,
                     findings: Findings, rel: str) -> Iterator[tuple[str, str, int]]:
    """A store directory's files as (name, path, size), in name order. An entry not named as the format names
    its files is a STRAY_FILE finding; on a live store the last file, when it has another size than
    file_size, is left out: the broker is creating it (its mapping sets the size), past the frontier."""
    names = sorted(os.listdir(directory))
    for name in names:
        path = os.path.join(directory, name)
        if not name_pattern.fullmatch(name) or not os.path.isfile(path):
            findings.add(STRAY_FILE, f"{rel}/{name}", None)
            continue
        size = os.path.getsize(path)
        if live and size != file_size and name == names[-1]:
            continue
        yield name, path, size

