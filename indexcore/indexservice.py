"""IndexService: the directory of IndexFiles, rolled when full, queried newest first.

Files live in `{root}/index/`, named `yyyyMMddHHmmssSSS` in local time. The broker names a file by the
wall clock at its creation, which no rebuild can reproduce; reputd names it by the store timestamp of
the record being dispatched when it is created (the next free millisecond on a clash, and always after
the newest existing name), so two rebuilds of one CommitLog give the same names and name order stays
creation order. Contents are what the broker writes, byte for byte.

As in `IndexService.buildIndex`, every dispatched record first makes sure a non-full last file exists
(so a new file appears as soon as anything follows a full one), records below the last file's
end_phy_offset are skipped as already indexed, ROLLBACK records are not indexed, and a key that does
not fit is retried in a new file created from the full one's end values.

Recovery after a kill: `state()` is a small JSON-friendly snapshot of the newest file's in-memory header,
taken by the caller when it checkpoints; `truncate_to(state)` deletes newer files and removes the
entries put since, so that dispatching again from the checkpoint writes what an uninterrupted run would.
Without a state, `resume_point()` reads from the files where indexing stopped, down to the key: the last
record indexed and how many of its keys the files hold (a record's keys may straddle two files), and
`resume_from` makes `build_index` go on from exactly there. Files are created complete or not at all
(`mappedfile.create_file`); `load` removes what a creation cut short left.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields

from indexcore.errors import CorruptEntryError, SizeMismatchError, StoreLayoutError
from indexcore.indexbuild import IndexBuild
from indexcore.indexfile import (
    DEFAULT_MAX_HASH_SLOT_NUM,
    DEFAULT_MAX_INDEX_NUM,
    FIRST_INDEX,
    INDEX_HEADER_SIZE,
    INT32_MAX,
    INT64_MAX,
    IndexFile,
    IndexHeader,
    header_fault,
    index_file_size,
)
from indexcore.indexresults import IndexQueryDamaged, IndexResume, IndexStats, QueryOffsetResult, TruncateReport
from indexcore.mappedfile import is_temporary, remove_temporaries

INDEX_DIR = "index"
INDEX_FILE_NAME_DIGITS = 17
DEFAULT_MAX_MSGS_NUM_BATCH = 64
_INDEX_FILE_NAME = re.compile(rf"\d{{{INDEX_FILE_NAME_DIGITS}}}")


def index_file_name(timestamp_ms: int) -> str:
    """`UtilAll.timeMillisToHumanString` in local time: yyyyMMddHHmmssSSS."""
    return time.strftime("%Y%m%d%H%M%S", time.localtime(timestamp_ms // 1000)) + f"{timestamp_ms % 1000:03d}"


def index_file_time(name: str) -> int:
    """The local-time millisecond a file name stands for (inverse of `index_file_name`)."""
    return int(time.mktime(time.strptime(name[:14], "%Y%m%d%H%M%S"))) * 1000 + int(name[14:])


def next_index_file_name(previous_name: str | None, store_timestamp: int,
                         taken: Callable[[str], bool] = lambda _name: False) -> str:
    """The name of a file created by a record with this store time: its local time, but strictly after
    the previous file's name (the next free millisecond), and skipping names `taken` says are in use."""
    ms = store_timestamp
    if previous_name is not None:
        ms = max(ms, index_file_time(previous_name) + 1)
    name = index_file_name(ms)
    while taken(name) or (previous_name is not None and name <= previous_name):
        ms += 1
        name = index_file_name(ms)
    return name


@dataclass(frozen=True, slots=True)
class IndexState:
    """The newest IndexFile's name and in-memory header (index_count starts at 1): enough to put the
    index back to this moment with `IndexService.truncate_to`."""

    name: str
    begin_timestamp: int
    end_timestamp: int
    begin_phy_offset: int
    end_phy_offset: int
    hash_slot_count: int
    index_count: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _INDEX_FILE_NAME.fullmatch(self.name):
            raise ValueError(f"IndexState name {self.name!r} is not a 17-digit IndexFile name")
        bounds = {"begin_timestamp": (0, INT64_MAX), "end_timestamp": (0, INT64_MAX),
                  "begin_phy_offset": (0, INT64_MAX), "end_phy_offset": (0, INT64_MAX),
                  "hash_slot_count": (0, INT32_MAX), "index_count": (FIRST_INDEX, INT32_MAX)}
        for field, (low, high) in bounds.items():
            value = getattr(self, field)
            if type(value) is not int:
                raise ValueError(f"IndexState {field} must be an int, not {type(value).__name__}")
            if not low <= value <= high:
                raise ValueError(f"IndexState {field} {value} is outside [{low}, {high}]")
        if self.hash_slot_count > self.index_count:
            raise ValueError(f"IndexState hash_slot_count {self.hash_slot_count} > index_count {self.index_count}")
        if self.begin_phy_offset > self.end_phy_offset:
            raise ValueError(f"IndexState begin_phy_offset {self.begin_phy_offset} > end_phy_offset "
                             f"{self.end_phy_offset}")

    @property
    def header(self) -> IndexHeader:
        return IndexHeader(self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset,
                           self.hash_slot_count, self.index_count)

    def as_dict(self) -> dict[str, str | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> IndexState:
        """The state `as_dict` gave; ValueError for anything else (missing, extra or mistyped fields)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"IndexState must be a mapping, not {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(f"IndexState fields must be exactly {sorted(names)}, got {sorted(map(str, data))}")
        return cls(**data)


class IndexService(IndexBuild):
    """Writes and queries the IndexFiles of one store; only the newest file stays mapped for writing."""

    def __init__(self, root: str, hash_slot_num: int = DEFAULT_MAX_HASH_SLOT_NUM,
                 index_num: int = DEFAULT_MAX_INDEX_NUM, max_msgs_num_batch: int = DEFAULT_MAX_MSGS_NUM_BATCH):
        self.directory = os.path.join(root, INDEX_DIR)
        self.hash_slot_num = hash_slot_num
        self.index_num = index_num
        self.max_msgs_num_batch = max_msgs_num_batch
        self.file_size = index_file_size(hash_slot_num, index_num)
        self.names: list[str] = []
        self._last: IndexFile | None = None
        # set when going on from a checkpoint or from the files: the broker's `< end_phy_offset` dedupe
        # would index the record at the end again, and knows nothing of a record cut at a roll
        self.resume: IndexResume | None = None
        self.removed: list[str] = []  # what `load` removed: leftovers of creations cut short
        # read-only: files whose header no writer can have left, by name; a query reports one when it gets
        # there, after what the newer files gave
        self.damaged: dict[str, CorruptEntryError] = {}

    def load(self, *, readonly: bool = False) -> None:
        """Open the existing files in name order; a foreign name, a wrong size or a header no writer can
        have left is a layout error.

        Writable, it first removes what a kill during a creation left: temporary files, and, from an
        older reputd or a broker, a newest file of 0 bytes or one allocated but never given its header.
        Each holds nothing. A put cut short in the newest file (entries past its header's count) is
        undone, as `truncate_to` does it, so the files read as the puts the header records. The newest
        file's slots and recorded entries must then be what puts leave (`IndexFile.structure_fault`), or
        it is a CorruptEntryError: puts would go on into a damaged chain.
        """
        self.close()
        self.removed = [] if readonly else remove_temporaries(self.directory)
        self.names = self._scan(drop_empty_newest=not readonly)
        self.damaged = {}
        for name in self.names:
            try:
                self._check_header(name)
            except CorruptEntryError as e:
                if not readonly:
                    raise
                self.damaged[name] = e
        if self.names and self.names[-1] not in self.damaged:
            self._last = IndexFile(self._path(self.names[-1]), self.hash_slot_num, self.index_num, readonly=readonly)
            if not readonly and len(self.names) > 1 and self._last.is_unwritten():
                self._last.close()
                self._remove(self.names.pop())
                self._last = IndexFile(self._path(self.names[-1]), self.hash_slot_num, self.index_num)
            if not readonly:
                try:
                    self._last.undo_cut_short_put()
                    bad = self._last.structure_fault()  # the file puts go on into: not built on damage
                    if bad is not None:
                        raise bad
                except BaseException:
                    self._release()
                    raise

    def _remove(self, name: str) -> None:
        os.remove(self._path(name))
        self.removed.append(self._path(name))

    def _scan(self, *, drop_empty_newest: bool = False) -> list[str]:
        """The file names in the index directory, sorted, after checking names and sizes; files still
        being created are passed over. With `drop_empty_newest`, a 0-byte newest file is removed."""
        names = []
        if os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                path = os.path.join(self.directory, name)
                if is_temporary(name):
                    continue
                if not _INDEX_FILE_NAME.fullmatch(name):
                    raise StoreLayoutError(path, "not an IndexFile: names are 17-digit yyyyMMddHHmmssSSS")
                names.append(name)
        names.sort()
        if names and os.path.getsize(self._path(names[-1])) == 0:
            if drop_empty_newest:
                self._remove(names.pop())
            else:
                names.pop()  # a creation cut short: it holds nothing
        for name in names:
            size = os.path.getsize(self._path(name))
            if size != self.file_size:
                raise SizeMismatchError(self._path(name), f"IndexFile is {size} bytes; maxHashSlotNum "
                                                         f"{self.hash_slot_num} and maxIndexNum {self.index_num} "
                                                         f"give {self.file_size}")
        return names

    def _check_header(self, name: str) -> None:
        path = self._path(name)
        with open(path, "rb") as f:
            header = IndexHeader.decode(f.read(INDEX_HEADER_SIZE))
        fault = header_fault(header, self.hash_slot_num, self.index_num)
        if fault is not None:
            raise CorruptEntryError(path, "header", *fault)

    def state(self) -> IndexState | None:
        """The newest file's name and in-memory header, or None when there is no file."""
        if self._last is None:
            if self.names:
                raise RuntimeError("IndexService.state() needs a loaded service")
            return None
        return IndexState(self.names[-1], *self._last.header)

    def resume_point(self) -> IndexResume | None:
        """Where indexing stopped, read from the files (no checkpoint): the last record indexed is at the
        newest file's end_phy_offset, and the files hold as many of its keys as there are entries at that
        offset counting back from the newest one, across files (its keys may straddle a roll). None when
        nothing is indexed."""
        last = self._last
        if last is None:
            return None
        at = last.end_phy_offset
        keys = 0
        for name in reversed(self.names):
            f = last if name == self.names[-1] else IndexFile(self._path(name), self.hash_slot_num, self.index_num,
                                                               readonly=True)
            try:
                entries = f.index_count - FIRST_INDEX
                found = f.count_last_entries(at)
            finally:
                if f is not last:
                    f.close()
            keys += found
            if found < entries:
                break
        if keys == 0 and at == 0:
            return None
        return IndexResume(at, keys)

    def resume_from(self, resume: IndexResume | None) -> None:
        """Go on from `resume` (a checkpoint's offset, or `resume_point()`); None: the broker's dedupe alone."""
        self.resume = resume

    def truncate_to(self, state: IndexState | None) -> TruncateReport:
        """Put the index back as it was when `state` was taken (None: before the first file): delete
        every newer file, remove the newer entries of `state.name` (IndexFile.truncate), and leave the
        service loaded. StoreLayoutError, before anything is changed, when the files cannot have grown
        from that state (missing file, fewer entries, other header): rebuild the index instead.
        """
        self._release()
        names = self._scan()
        if state is None:
            kept, truncation, last = [], None, None
        else:
            if state.name not in names:
                raise StoreLayoutError(self._path(state.name), "the IndexFile of the state to restore is missing")
            kept = [n for n in names if n <= state.name]
            for name in kept[:-1]:
                self._check_header(name)
            last = IndexFile(self._path(state.name), self.hash_slot_num, self.index_num)
            try:
                truncation = last.truncate(state.header)
            except BaseException:
                last.close()
                raise
        kept_set = set(kept)
        deleted = tuple(n for n in names if n not in kept_set)
        for name in deleted:
            os.remove(self._path(name))
        self.names = kept
        self._last = last
        return TruncateReport(state.name if state else None, deleted,
                              truncation.entries_removed if truncation else 0,
                              truncation.slots_restored if truncation else 0)

    def end_phy_offset_of(self, name: str) -> int:
        """The endPhyOffset a file's header holds (the newest file's in memory, as the broker keeps it)."""
        if self._last is not None and name == self.names[-1]:
            return self._last.end_phy_offset
        with open(self._path(name), "rb") as f:
            return IndexHeader.decode(f.read(INDEX_HEADER_SIZE)).end_phy_offset

    def forget_oldest(self, n: int) -> list[str]:
        """Stop listing the `n` oldest files (never the newest) and return their paths, for the caller to
        delete (retention: `indexcore.retention`). Only the newest file is ever open for writing."""
        n = min(n, len(self.names) - 1)
        if n <= 0:
            return []
        paths = [self._path(name) for name in self.names[:n]]
        del self.names[:n]
        return paths

    def _release(self) -> None:
        """Unmap the newest file without writing anything to it."""
        if self._last is not None:
            self._last.close()
            self._last = None

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    @property
    def last_file(self) -> IndexFile | None:
        return self._last

    @property
    def end_phy_offset(self) -> int:
        """end_phy_offset of the newest file: records below it are already indexed."""
        return self._last.end_phy_offset if self._last is not None else 0

    def _new_name(self, store_timestamp: int) -> str:
        return next_index_file_name(self.names[-1] if self.names else None, store_timestamp,
                                    lambda name: os.path.exists(self._path(name)))

    def _roll(self, store_timestamp: int, stats: IndexStats) -> IndexFile:
        """`getAndCreateLastIndexFile`: a new file seeded with the previous one's end values."""
        prev = self._last
        end_phy, end_ts = (prev.end_phy_offset, prev.end_timestamp) if prev is not None else (0, 0)
        if prev is not None:
            prev.flush()  # before its successor exists: the newest file is the only one that can be partial
        name = self._new_name(store_timestamp)
        created = self._create_file(name, end_phy, end_ts)
        if prev is not None:
            prev.close()
        self.names.append(name)
        self._last = created
        stats.files_created += 1
        return created

    def _create_file(self, name: str, end_phy_offset: int, end_timestamp: int) -> IndexFile:
        """A new file seeded with its predecessor's end values (the verifier creates an image instead)."""
        os.makedirs(self.directory, exist_ok=True)
        return IndexFile(self._path(name), self.hash_slot_num, self.index_num, create=True,
                         end_phy_offset=end_phy_offset, end_timestamp=end_timestamp)

    def _sync_last(self) -> None:
        """Make the newest file durable as the broker leaves it: a full file is flushed when it is
        replaced (`FlushIndexFileThread`), a non-full one only ever reaches disk through the OS."""
        if self._last is not None:
            if self._last.is_write_full():
                self._last.flush()
            else:
                self._last.sync()

    def flush(self) -> None:
        self._sync_last()

    def close(self) -> None:
        if self._last is not None:
            self._sync_last()
            self._last.close()
            self._last = None


__all__ = ["INDEX_DIR", "IndexQueryDamaged", "IndexResume", "IndexService", "IndexState", "QueryOffsetResult",
           "TruncateReport", "index_file_name", "index_file_time", "next_index_file_name"]

