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
"""

from __future__ import annotations

import mmap
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from indexcore.consumequeue import (
    BLANK_UNIT,
    BLANK_UNIT_MSG_SIZE,
    CONSUME_QUEUE_DIR,
    CQ_UNIT_DTYPE,
    CQ_UNIT_SIZE,
    PRIVATE_OPEN_FILES,
    ConsumeQueueUnit,
    PutStats,
    QueueCursor,
    consume_queue_units,
    open_queue_files_limit,
    place_units,
)
from indexcore.dispatch import DispatchBatch, index_keys_of
from indexcore.indexfile import (
    FIRST_INDEX,
    HASH_SLOT_SIZE,
    INDEX_ENTRY_DTYPE,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER_SIZE,
    INVALID_INDEX,
    IndexEntry,
    IndexFile,
    IndexHeader,
)
from indexcore.indexservice import INDEX_DIR, INDEX_FILE_NAME_DIGITS, IndexService
from indexcore.javahash import index_key_hash
from indexcore.mappedfile import FILE_NAME_DIGITS, offset_to_file_name

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


# --- ConsumeQueue ---------------------------------------------------------------------------------------------

class _Queue:
    """One queue as the verifier follows it: the put cursor and the files that exist."""

    __slots__ = ("cursor", "directory", "exists", "expected_files", "files", "queue_id", "rel", "topic")

    def __init__(self, root: str, topic: str, queue_id: int):
        self.topic = topic
        self.queue_id = queue_id
        self.directory = os.path.join(root, topic, str(queue_id))
        self.rel = f"{CONSUME_QUEUE_DIR}/{topic}/{queue_id}"
        self.exists = os.path.isdir(self.directory)
        self.files: dict[int, tuple[str, int]] = {}  # start -> (path, size)
        self.expected_files: set[int] = set()
        self.cursor = QueueCursor()

    def file_rel(self, start: int) -> str:
        return f"{self.rel}/{offset_to_file_name(start)}"


class ConsumeQueueCheck:
    """Follows the ConsumeQueue dispatch of each batch and compares every unit with the existing files.

    `from_offset` > 0 starts in the middle of the store's history: a queue met for the first time continues
    at its record's queue offset, the files before it are history and not judged. With `live`, what lies past
    the dispatched frontier (units after a queue's last expected one) is the broker's work in progress and is
    not judged either.
    """

    def __init__(self, root: str, file_size: int, findings: Findings, locate: RecordLocator, *,
                 from_offset: int = 0, live: bool = False, frontier: int | None = None):
        self.root = os.path.join(root, CONSUME_QUEUE_DIR)
        self.file_size = file_size
        self.findings = findings
        self.locate = locate
        self.from_offset = from_offset
        self.live = live
        self.frontier = frontier
        self.queues: dict[tuple[str, int], _Queue] = {}
        self.maps = MappedFiles(queue_mappings_limit())  # an LMQ store's thousands of queues
        self.stats = PutStats()
        self.units = 0
        self.spread = (0, 0)  # (queues, units) of the last batch, as `ConsumeQueueDispatcher.spread`
        self.files_checked = 0

    # --- the stream -------------------------------------------------------------------------------------

    def check(self, batch: DispatchBatch) -> None:
        queues, units = 0, self.units
        for group in consume_queue_units(batch):
            queues += 1
            q = self.queues.get((group.topic, group.queue_id))
            if q is None:
                q = self._open_queue(group.topic, group.queue_id, int(group.queue_offset[0]))
            self.units += len(group.units)
            for p in place_units(q.cursor, group.queue_offset, group.ends, self.file_size, self.stats,
                                 group.one_streak):
                q.expected_files.add(p.file_start)
                if p.blanks:
                    at = p.logical - p.blanks * CQ_UNIT_SIZE
                    self._compare(q, p.file_start, at, np.frombuffer(BLANK_UNIT * p.blanks, dtype=np.uint8))
                if p.last > p.first:
                    self._compare(q, p.file_start, p.logical, group.units[p.first : p.last].view(np.uint8))
        self.spread = (queues, self.units - units)

    def _open_queue(self, topic: str, queue_id: int, first_queue_offset: int) -> _Queue:
        q = self.queues[(topic, queue_id)] = _Queue(self.root, topic, queue_id)
        self._list_files(q)
        if self.from_offset > 0 and q.files:
            # the queue's history is not read: its next unit goes where its record's queue offset says
            expect = first_queue_offset * CQ_UNIT_SIZE
            q.cursor = QueueCursor(expect - expect % self.file_size, expect)
        return q

    def _list_files(self, q: _Queue) -> None:
        if not q.exists:
            return
        names = sorted(os.listdir(q.directory))
        for name in names:
            path = os.path.join(q.directory, name)
            if not _QUEUE_FILE_NAME.fullmatch(name) or not os.path.isfile(path):
                self.findings.add(STRAY_FILE, f"{q.rel}/{name}", None)
                continue
            size = os.path.getsize(path)
            if self.live and size != self.file_size and name == names[-1]:
                continue  # a file the broker is creating (it maps it, which sets its size): past the frontier
            q.files[int(name)] = (path, size)
            if size != self.file_size:
                self.findings.add(CQ_FILE_SIZE, f"{q.rel}/{name}", size, expectedSize=self.file_size,
                                  actualSize=size, topic=q.topic, queueId=q.queue_id).range_name = "queueOffsetsLost"

    def _compare(self, q: _Queue, file_start: int, logical: int, expected: np.ndarray) -> None:
        n = len(expected) // CQ_UNIT_SIZE
        first = logical // CQ_UNIT_SIZE
        pos = logical - file_start
        held = q.files.get(file_start)
        if held is None:
            if q.exists:
                f = self.findings.get(CQ_FILE_MISSING, q.file_rel(file_start), pos, topic=q.topic, queueId=q.queue_id,
                                      range_name="queueOffsets")
            else:
                f = self.findings.get(CQ_QUEUE_MISSING, q.rel, None, topic=q.topic, queueId=q.queue_id,
                                      range_name="queueOffsets")
            f.add(first, n)
            return
        path, size = held
        fit = max(0, min(n, (size - pos) // CQ_UNIT_SIZE))
        if fit < n:
            self.findings.get(CQ_FILE_SIZE, q.file_rel(file_start), size).add(first + fit, n - fit)
        if fit == 0:
            return
        actual = self.maps.view(path, pos, fit * CQ_UNIT_SIZE)
        want = expected[: fit * CQ_UNIT_SIZE]
        if not same_bytes(actual, want):
            a, w = actual.reshape(-1, CQ_UNIT_SIZE), want.reshape(-1, CQ_UNIT_SIZE)
            for r in np.flatnonzero((a != w).any(axis=1)).tolist():
                self._unit_differs(q, file_start, pos + r * CQ_UNIT_SIZE, first + r, a[r], w[r])
        self.maps.done_with(path, pos, pos + fit * CQ_UNIT_SIZE)

    def _unit_differs(self, q: _Queue, file_start: int, pos: int, queue_offset: int, actual: np.ndarray,
                      expected: np.ndarray | None) -> None:
        if not actual.any():
            kind = CQ_UNIT_MISSING
        else:
            u = ConsumeQueueUnit.decode(actual.tobytes())
            if not self.locate.is_record(u.commit_log_offset, u.msg_size):
                kind = CQ_UNIT_DANGLING
            else:
                kind = CQ_UNIT_WRONG if expected is not None else CQ_UNIT_EXTRA
        example = {"queueOffset": queue_offset, "position": pos,
                   "expected": None if expected is None else _unit_json(expected),
                   "actual": _unit_json(actual) if actual.any() else None}
        f = self.findings.get(kind, q.file_rel(file_start), pos, key=q.rel, topic=q.topic, queueId=q.queue_id,
                              range_name="queueOffsets")
        f.add(queue_offset, 1, example)

    # --- after the stream ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """What lies past each queue's expected end, queues the CommitLog gave nothing, stray files."""
        for q in self.queues.values():
            self.files_checked += len(q.files)
            self._check_tail(q)
        self._check_untouched()
        self.maps.close()

    def _check_tail(self, q: _Queue) -> None:
        if not q.expected_files:
            return
        first_expected, last_expected = min(q.expected_files), max(q.expected_files)
        for start, (path, size) in sorted(q.files.items()):
            if start < first_expected:
                if self.from_offset == 0:  # with the whole history read, nothing comes before the first file
                    self._extra_file(q, start, path, size, 0)
            elif start == last_expected:
                if not self.live:
                    self._scan_extra_units(q, start, path, size, q.cursor.write_offset - start)
            elif start > last_expected and not self.live:
                self._extra_file(q, start, path, size, 0)
        for start in q.expected_files:  # a file created by a put that wrote nothing in it
            if start not in q.files and q.exists:
                self.findings.get(CQ_FILE_MISSING, q.file_rel(start), 0, topic=q.topic, queueId=q.queue_id,
                                  range_name="queueOffsets")

    def _extra_file(self, q: _Queue, start: int, path: str, size: int, pos: int) -> None:
        if not self._scan_extra_units(q, start, path, size, pos):
            self.findings.add(CQ_FILE_EXTRA, q.file_rel(start), None, topic=q.topic, queueId=q.queue_id)

    def _scan_extra_units(self, q: _Queue, start: int, path: str, size: int, pos: int) -> bool:
        """Report the units written from `pos` on, reading until a stretch of TAIL_SCAN_UNITS is all zero.
        Whether any was found."""
        found = False
        end = size - size % CQ_UNIT_SIZE
        while pos < end:
            n = min(TAIL_SCAN_UNITS * CQ_UNIT_SIZE, end - pos)
            data = self.maps.view(path, pos, n)
            rows = _nonzero_rows(data, CQ_UNIT_SIZE)
            for r in rows.tolist():
                at = pos + r * CQ_UNIT_SIZE
                self._unit_differs(q, start, at, (start + at) // CQ_UNIT_SIZE, data[r * CQ_UNIT_SIZE:
                                                                                    (r + 1) * CQ_UNIT_SIZE], None)
            self.maps.done_with(path, pos, pos + n)
            if len(rows) == 0:
                break
            found = True
            pos += n
        return found

    def _check_untouched(self) -> None:
        if not os.path.isdir(self.root):
            return
        for topic in sorted(os.listdir(self.root)):
            tdir = os.path.join(self.root, topic)
            if not os.path.isdir(tdir):
                self.findings.add(STRAY_FILE, f"{CONSUME_QUEUE_DIR}/{topic}", None)
                continue
            for name in sorted(os.listdir(tdir)):
                if not name.isdigit() or not os.path.isdir(os.path.join(tdir, name)):
                    self.findings.add(STRAY_FILE, f"{CONSUME_QUEUE_DIR}/{topic}/{name}", None)
                    continue
                if (topic, int(name)) not in self.queues:
                    self._check_orphan(topic, int(name))

    def _check_orphan(self, topic: str, queue_id: int) -> None:
        q = _Queue(self.root, topic, queue_id)
        self._list_files(q)
        self.files_checked += len(q.files)
        if not q.files:
            return
        _, (path, size) = max(q.files.items())
        units = 0
        last_phy = -1
        if size >= CQ_UNIT_SIZE:
            data = self.maps.get(path)
            u = np.frombuffer(data, dtype=CQ_UNIT_DTYPE, count=size // CQ_UNIT_SIZE)
            real = (u["commit_log_offset"] >= 0) & (u["msg_size"] > 0) & (u["msg_size"] != BLANK_UNIT_MSG_SIZE)
            units = int(np.count_nonzero(real))
            if units:
                last_phy = int(u["commit_log_offset"][np.flatnonzero(real)[-1]])
        if self.from_offset == 0 and not self.live:
            orphaned = True  # every queue the CommitLog implies was met
        else:
            orphaned = last_phy >= self.from_offset and (self.frontier is None or last_phy < self.frontier)
        if orphaned:
            self.findings.add(CQ_QUEUE_ORPHANED, q.rel, None, topic=topic, queueId=queue_id, files=len(q.files),
                              unitsInLastFile=units)


# --- IndexFile ------------------------------------------------------------------------------------------------

class _Image:
    """The buffer an IndexImage puts into: header, slot table, and a window of entries."""

    __slots__ = ("buffer", "entries_at", "readonly")

    def __init__(self, hash_slot_num: int):
        self.entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * hash_slot_num
        self.buffer = bytearray(self.entries_at + INDEX_ENTRY_SIZE * 1024)
        self.readonly = False

    def window(self, entries: int) -> bytearray:
        need = self.entries_at + INDEX_ENTRY_SIZE * entries
        if len(self.buffer) < need:
            grown = bytearray(max(need, self.entries_at + 2 * (len(self.buffer) - self.entries_at)))
            grown[: self.entries_at] = self.buffer[: self.entries_at]
            self.buffer = grown
        return self.buffer

    def slots(self) -> np.ndarray:
        return np.frombuffer(self.buffer, dtype=np.uint8, count=self.entries_at - INDEX_HEADER_SIZE,
                             offset=INDEX_HEADER_SIZE)

    def entries(self, n: int) -> np.ndarray:
        return np.frombuffer(self.buffer, dtype=np.uint8, count=INDEX_ENTRY_SIZE * n, offset=self.entries_at)

    def write(self, position: int, data: bytes) -> None:
        self.buffer[position : position + len(data)] = data

    def flush(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class IndexImage(IndexFile):
    """An IndexFile built in memory by the same puts as a real one: the header and slot table in full, of
    the entries only the window of the current put, which `on_put` compares before the next put.

    `first_checked` is the first entry number judged (entries below it are history when verifying from an
    offset); `seed_known` is False when the file was created from a predecessor that is not read, so its
    first entry's time_diff and its header before the first put cannot be derived.
    """

    def __init__(self, hash_slot_num: int, index_num: int, end_phy_offset: int, end_timestamp: int,
                 on_put: Callable[[IndexImage, int, int], None], on_close: Callable[[IndexImage], None]):
        self.path = None
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self._file = _Image(hash_slot_num)
        self._entries_at = self._file.entries_at
        self._seed(end_phy_offset, end_timestamp)
        self._on_put = on_put
        self._on_close = on_close
        self.first_checked = FIRST_INDEX
        self.seed_known = True
        self.actual: _ActualIndexFile | None = None
        self.matched = False
        self.ordinal = 0
        self.closed = False

    def _put_target(self, keys: int) -> tuple[object, int]:
        return self._file.window(keys), self.index_count

    def put_keys(self, key_hash: np.ndarray, phy_offset: np.ndarray, store_timestamp: np.ndarray) -> int:
        first = self.index_count
        put = super().put_keys(key_hash, phy_offset, store_timestamp)
        if put:
            self._on_put(self, first, put)
        return put

    def window_entries(self, n: int) -> np.ndarray:
        return self._file.entries(n)

    def slot_table(self) -> np.ndarray:
        return self._file.slots()

    def flush(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._on_close(self)


class _Predecessor:
    """Stands for a deleted IndexFile in `IndexService.build_index`: it takes keys, compared with nothing, until
    the key the first existing file starts with (the last `tail` keys of the record at `first_phy_offset`
    went there), then is full. Its end values, when it took a key, seed the next file as the real one did."""

    def __init__(self, first_phy_offset: int, tail: int):
        self.first_phy_offset = first_phy_offset
        self.tail = tail
        self.full = False
        self.put = 0
        self.end_phy_offset = 0
        self.end_timestamp = 0

    def is_write_full(self) -> bool:
        return self.full

    def put_keys(self, key_hash: np.ndarray, phy_offset: np.ndarray, store_timestamp: np.ndarray) -> int:
        at = np.flatnonzero(phy_offset == self.first_phy_offset)
        if len(at):
            cut = max(int(at[0]), int(at[-1]) + 1 - self.tail)
        else:
            cut = int(np.searchsorted(phy_offset, self.first_phy_offset))
        if cut:
            self.put += cut
            self.end_phy_offset, self.end_timestamp = int(phy_offset[cut - 1]), int(store_timestamp[cut - 1])
        self.full = cut < len(key_hash)
        return cut

    def flush(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _ActualIndexFile:
    name: str
    path: str
    size: int
    header: IndexHeader | None
    first_entry: IndexEntry | None

    def identities(self) -> set[int]:
        """The CommitLog offset the file starts at, as its header and its first entry say (either may be
        damaged): how an expected file finds its existing counterpart."""
        out = set()
        if self.header is not None:
            out.add(self.header.begin_phy_offset)
        if self.first_entry is not None and any(self.first_entry):
            out.add(self.first_entry.phy_offset)
        return out

    @property
    def identity(self) -> int | None:
        """The lowest of them."""
        ids = self.identities()
        return min(ids) if ids else None


class IndexCheck(IndexService):
    """`IndexService.build_index` into IndexImages, each compared with the existing file it stands for.

    Existing files are taken in name order and matched to the images by the CommitLog offset they start at,
    so a missing or an extra file is one finding, not a shift of everything after it.
    """

    def __init__(self, root: str, hash_slot_num: int, index_num: int, findings: Findings, *,
                 live: bool = False, frontier: int | None = None,
                 keys_at: Callable[[int], list[str]] | None = None):
        super().__init__(root, hash_slot_num, index_num)
        self.findings = findings
        self.keys_at = keys_at  # the `topic#key`s of the record at an offset: names what an existing entry holds
        self.live = live
        self.frontier = frontier
        self.maps = MappedFiles()
        self.batch: DispatchBatch | None = None
        self.actual: list[_ActualIndexFile] = []
        self._next = 0  # the next existing file not matched yet
        self._images = 0
        self.entries = 0
        self._scan_actual()

    # --- the existing files ---------------------------------------------------------------------------

    def _scan_actual(self) -> None:
        if not os.path.isdir(self.directory):
            return
        names = sorted(os.listdir(self.directory))
        for name in names:
            path = os.path.join(self.directory, name)
            if not _INDEX_FILE_NAME.fullmatch(name) or not os.path.isfile(path):
                self.findings.add(STRAY_FILE, f"{INDEX_DIR}/{name}", None)
                continue
            size = os.path.getsize(path)
            if self.live and size != self.file_size and name == names[-1]:
                continue  # being created by the broker: past the frontier
            if size != self.file_size:
                self.findings.add(INDEX_FILE_SIZE, f"{INDEX_DIR}/{name}", size, expectedSize=self.file_size,
                                  actualSize=size)
            header = entry = None
            with open(path, "rb") as f:
                head = f.read(INDEX_HEADER_SIZE)
                if len(head) == INDEX_HEADER_SIZE:
                    header = IndexHeader.decode(head)
                raw = os.pread(f.fileno(), INDEX_ENTRY_SIZE, self._entry_at(FIRST_INDEX))
                if len(raw) == INDEX_ENTRY_SIZE:
                    entry = IndexEntry.decode(raw)
            self.actual.append(_ActualIndexFile(name, path, size, header, entry))

    def _entry_at(self, n: int) -> int:
        return INDEX_HEADER_SIZE + HASH_SLOT_SIZE * self.hash_slot_num + INDEX_ENTRY_SIZE * n

    def _rel(self, actual: _ActualIndexFile) -> str:
        return f"{INDEX_DIR}/{actual.name}"

    def _view(self, actual: _ActualIndexFile, position: int, length: int) -> np.ndarray:
        """The bytes [position, position + length) of an existing file, cut at its end."""
        length = max(0, min(length, actual.size - position))
        if length == 0:
            return np.zeros(0, dtype=np.uint8)
        return self.maps.view(actual.path, position, length)

    # --- starting in the middle of the history ----------------------------------------------------------

    def start_at(self, from_offset: int, store_timestamp_at: Callable[[int], int | None]) -> None:
        """Take up the index as it stood just before `from_offset`: the newest existing file that starts below
        it, cut back to its entries below it (slots restored along their chains), as the image to continue.
        Files before that one are history. With none, the first file's deleted predecessor stands before it."""
        usable = [i for i, a in enumerate(self.actual) if a.size == self.file_size and a.identity is not None
                  and a.header is not None]
        before = [i for i in usable if self.actual[i].identity < from_offset]
        if not before:
            if usable:
                self._last = self._predecessor_of(self.actual[usable[0]])
                self.names.append("deleted-predecessor")
            return
        i = before[-1]
        actual = self.actual[i]
        count = max(actual.header.index_count, FIRST_INDEX)
        n0 = self._first_entry_at_or_after(actual, from_offset, count)
        image = self._create_file("", 0, 0)
        h = actual.header
        image.begin_timestamp, image.begin_phy_offset = h.begin_timestamp, h.begin_phy_offset
        image.index_count = n0
        last = self._entry(actual, n0 - 1) if n0 > FIRST_INDEX else None
        image.end_phy_offset = last.phy_offset if last is not None else h.end_phy_offset
        ts = None if last is None or n0 == count else store_timestamp_at(last.phy_offset)
        image.end_timestamp = h.end_timestamp if ts is None else ts
        slots = np.frombuffer(self._view(actual, INDEX_HEADER_SIZE, HASH_SLOT_SIZE * self.hash_slot_num),
                              dtype=">i4").copy()
        started = 0
        for hi in range(count, n0, -TAIL_SCAN_UNITS):  # newest first: the oldest entry of a slot wins
            lo = max(n0, hi - TAIL_SCAN_UNITS)
            entries = np.frombuffer(self._view(actual, self._entry_at(lo), INDEX_ENTRY_SIZE * (hi - lo)),
                                    dtype=INDEX_ENTRY_DTYPE)
            slot = entries["key_hash"].astype(np.int64) % self.hash_slot_num
            ids, first = np.unique(slot, return_index=True)
            slots[ids] = entries["prev_index"][first]
            started += int(np.count_nonzero(entries["prev_index"] == INVALID_INDEX))
        image.slot_table()[:] = slots.view(np.uint8)
        image.hash_slot_count = max(0, h.hash_slot_count - started)
        image.first_checked = n0
        image.actual, image.matched = actual, True
        self.names.append(f"history-{actual.name}")
        self._last = image
        self._next = i + 1

    def _predecessor_of(self, first: _ActualIndexFile) -> _Predecessor:
        """The full file the first existing one was rolled from, deleted since (the broker deletes IndexFiles
        that end below its oldest segment). It takes the keys that precede the first existing file's first
        entry, among them the leading keys of a record whose keys the roll split between the two."""
        e1 = self._entry(first, FIRST_INDEX)
        p1 = e1.phy_offset if any(e1) else first.header.begin_phy_offset
        tail = 0
        while FIRST_INDEX + tail < max(first.header.index_count, FIRST_INDEX) and \
                self._entry(first, FIRST_INDEX + tail).phy_offset == p1:
            tail += 1
        return _Predecessor(p1, tail)

    def _entry(self, actual: _ActualIndexFile, n: int) -> IndexEntry:
        return IndexEntry.decode(self._view(actual, self._entry_at(n), INDEX_ENTRY_SIZE).tobytes())

    def _first_entry_at_or_after(self, actual: _ActualIndexFile, offset: int, count: int) -> int:
        lo, hi = FIRST_INDEX, count
        while lo < hi:
            mid = (lo + hi) // 2
            if self._entry(actual, mid).phy_offset < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    # --- IndexService hooks --------------------------------------------------------------------------

    _finishing = False

    def _new_name(self, store_timestamp: int) -> str:
        return f"expected-{len(self.names)}"

    def _create_file(self, name: str, end_phy_offset: int, end_timestamp: int) -> IndexImage:
        image = IndexImage(self.hash_slot_num, self.index_num, end_phy_offset, end_timestamp, self._put, self._closed)
        image.ordinal = self._images
        self._images += 1
        if isinstance(self._last, _Predecessor):
            image.seed_known = self._last.put > 0
        return image

    def check(self, batch: DispatchBatch) -> None:
        self.batch = batch
        self.build_index(batch)

    # --- comparing ---------------------------------------------------------------------------------------

    def _match(self, image: IndexImage, identity: int) -> None:
        """The next existing file (in name order) that starts where the image starts; the ones passed over
        are extra. None found: the image's file is missing."""
        image.matched = True
        for j in range(self._next, len(self.actual)):
            a = self.actual[j]
            if identity in a.identities():
                for extra in self.actual[self._next : j]:
                    self._extra(extra)
                self._next = j + 1
                image.actual = a
                return

    def _extra(self, actual: _ActualIndexFile) -> None:
        self.findings.add(INDEX_FILE_EXTRA, self._rel(actual), None,
                          beginPhyOffset=None if actual.header is None else actual.header.begin_phy_offset,
                          indexCount=None if actual.header is None else actual.header.index_count)

    def _put(self, image: IndexImage, first: int, n: int) -> None:
        self.entries += n
        if not image.matched:
            self._match(image, image.begin_phy_offset)
        actual = image.actual
        if actual is None:
            return
        want = image.window_entries(n)
        if not image.seed_known and first == FIRST_INDEX:
            want = want.copy()  # the first entry's time_diff counts from the unread predecessor's end
            got = self._view(actual, self._entry_at(FIRST_INDEX) + _TIME_DIFF.start, 4)
            if len(got) == 4:
                want[_TIME_DIFF] = got
        at = self._entry_at(first)
        got = self._view(actual, at, INDEX_ENTRY_SIZE * n)
        fit = len(got) // INDEX_ENTRY_SIZE
        got = got[: fit * INDEX_ENTRY_SIZE]
        if not same_bytes(got, want[: fit * INDEX_ENTRY_SIZE]):
            g, w = got.reshape(-1, INDEX_ENTRY_SIZE), want[: fit * INDEX_ENTRY_SIZE].reshape(-1, INDEX_ENTRY_SIZE)
            for r in np.flatnonzero((g != w).any(axis=1)).tolist():
                self._entry_differs(actual, first + r, g[r], w[r])
        if fit < n:
            self.findings.get(INDEX_FILE_SIZE, self._rel(actual), actual.size).add(first + fit, n - fit)
        self.maps.done_with(actual.path, at, at + INDEX_ENTRY_SIZE * fit)

    def _key_of(self, phy_offset: int, key_hash: int) -> str | None:
        """The `topic#key` of an expected entry, from the batch being dispatched (for examples only)."""
        b = self.batch
        if b is None or not len(b):
            return None
        i = int(np.searchsorted(b.phy_offset, phy_offset))
        if i >= len(b) or int(b.phy_offset[i]) != phy_offset:
            return None
        for key in index_keys_of(b.topic_of(i), b.uniq_key[i], b.keys[i]):
            if index_key_hash(key) == key_hash:
                return key
        return None

    def _entry_differs(self, actual: _ActualIndexFile, n: int, got: np.ndarray, want: np.ndarray | None) -> None:
        pos = self._entry_at(n)
        if want is None:
            kind = INDEX_ENTRY_EXTRA
        elif not got.any():
            kind = INDEX_ENTRY_MISSING
        elif np.array_equal(got[:_PREV_AT], want[:_PREV_AT]):
            kind, pos = INDEX_CHAIN_BROKEN, pos + _PREV_AT
        else:
            kind = INDEX_ENTRY_WRONG
        finding = self.findings.get(kind, self._rel(actual), pos, range_name="entries")
        example = None
        if len(finding.examples) < MAX_EXAMPLES:
            example = {"entry": n, "position": pos, "expected": None if want is None else _entry_json(want),
                       "actual": _entry_json(got) if got.any() else None}
            if want is not None:
                w = IndexEntry.decode(want.tobytes())
                example["key"] = self._key_of(w.phy_offset, w.key_hash)
            if got.any() and self.keys_at is not None:
                g = IndexEntry.decode(got.tobytes())
                example["actualKey"] = next((k for k in self.keys_at(g.phy_offset) if index_key_hash(k) == g.key_hash),
                                            None)
        finding.add(n, 1, example)

    def _closed(self, image: IndexImage) -> None:
        """The image is complete (rolled or at the end): its slots, header and what follows its entries."""
        if not image.matched:
            self._match(image, image.begin_phy_offset)
        actual = image.actual
        if actual is None:
            self.findings.add(INDEX_FILE_MISSING, f"{INDEX_DIR}/", None, key=f"{INDEX_DIR}/#{image.ordinal}",
                              ordinal=image.ordinal, indexEntries=image.index_count - image.first_checked,
                              beginPhyOffset=image.begin_phy_offset, endPhyOffset=image.end_phy_offset,
                              after=self._name_before(image))
            return
        frontier = self.live and self._finishing
        entry0 = self._view(actual, self._entry_at(INVALID_INDEX), INDEX_ENTRY_SIZE)
        if entry0.any():  # entry numbers start at 1: entry 0 is never written
            self._entry_differs(actual, INVALID_INDEX, entry0, None)
        self._compare_slots(image, actual, frontier)
        if not frontier:
            self._compare_header(image, actual)
            self._scan_extra_entries(image, actual)
        elif image.index_count > image.first_checked:
            # a put in progress writes hashSlotCount, then indexCount, then the end values: only the begin
            # values, fixed by the first put, can be held to the image while the broker writes
            self._compare_header(image, actual, begin_only=True)

    def _name_before(self, image: IndexImage) -> str | None:
        return self.actual[self._next - 1].name if self._next > 0 else None

    def _compare_slots(self, image: IndexImage, actual: _ActualIndexFile, frontier: bool) -> None:
        want = image.slot_table()
        got = self._view(actual, INDEX_HEADER_SIZE, len(want))
        if len(got) % HASH_SLOT_SIZE == 0 and same_bytes(got, want[: len(got)]):
            return
        w = np.frombuffer(want[: len(got) - len(got) % HASH_SLOT_SIZE], dtype=">i4")
        g = np.frombuffer(got[: len(w) * HASH_SLOT_SIZE], dtype=">i4")
        bad = g != w
        if frontier:  # a broker still writing: a slot may already lead to an entry past the frontier
            bad &= g < image.index_count
        for s in np.flatnonzero(bad).tolist():
            pos = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * s
            self.findings.get(INDEX_CHAIN_BROKEN, self._rel(actual), pos, range_name="slots").add(
                s, 1, {"slot": s, "position": pos, "expected": int(w[s]), "actual": int(g[s])})
        self.maps.done_with(actual.path, INDEX_HEADER_SIZE, INDEX_HEADER_SIZE + len(got))

    def _compare_header(self, image: IndexImage, actual: _ActualIndexFile, *, begin_only: bool = False) -> None:
        if actual.header is None:
            return
        got = actual.header
        if image.index_count > image.first_checked or image.first_checked > FIRST_INDEX:
            want = image.written_header()
        elif not image.seed_known:
            return
        else:
            want = image.written_header()
            if got.index_count == FIRST_INDEX:  # a created file flushed before its first put (5.x shutdown)
                want = want._replace(index_count=FIRST_INDEX)
        if begin_only:
            want, got = (tuple(v if i in _HEADER_BEGIN else None for i, v in enumerate(h)) for h in (want, got))
        if tuple(got) == tuple(want):
            return
        diff = {f: {"expected": e, "actual": a} for f, e, a in zip(_HEADER_JSON, want, got, strict=True) if e != a}
        first = _HEADER_JSON.index(next(iter(diff)))
        self.findings.add(INDEX_HEADER_WRONG, self._rel(actual), _HEADER_FIELD_AT[first], fields=diff)

    def _scan_extra_entries(self, image: IndexImage, actual: _ActualIndexFile) -> None:
        n = image.index_count
        while n < self.index_num:
            k = min(TAIL_SCAN_UNITS, self.index_num - n)
            at = self._entry_at(n)
            data = self._view(actual, at, INDEX_ENTRY_SIZE * k)
            rows = _nonzero_rows(data[: len(data) - len(data) % INDEX_ENTRY_SIZE], INDEX_ENTRY_SIZE)
            for r in rows.tolist():
                self._entry_differs(actual, n + r, data[r * INDEX_ENTRY_SIZE : (r + 1) * INDEX_ENTRY_SIZE], None)
            self.maps.done_with(actual.path, at, at + len(data))
            if len(rows) == 0:
                break
            n += k

    def finish(self) -> None:
        """Close the last image; existing files left unmatched are extra (past the frontier of a live
        broker, its newest work)."""
        self._finishing = True
        self.close()
        if not self.live:  # files after the last one expected: a broker still writing may have made them since
            for a in self.actual[self._next :]:
                self._extra(a)
        self._next = len(self.actual)
        self.maps.close()

    def files_checked(self) -> int:
        return len(self.actual)


__all__ = ["KINDS", "ConsumeQueueCheck", "Finding", "Findings", "IndexCheck", "IndexImage", "MappedFiles",
           "RecordLocator"]
