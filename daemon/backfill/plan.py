"""Driver-side planning of a backfill: no Spark and no CommitLog bytes here, only decisions over the
ranges' outcomes.

* `walk_ranges`: the ranges' outcomes read in CommitLog order as `reputd rebuild` reads the segments. A
  range is taken only when it started where the range before it stopped (the chain); where it did not,
  the range is re-read from that boundary (`Reread`), so what is taken is what a read from each segment's
  start gives. Then, across segments: which ranges are dispatched, where reading ends, what is corruption.
* `plan_index_files`: the IndexFiles a sequential `IndexService.build_index` creates over the dispatched
  keys: file j holds keys [j*(maxIndexNum-1), (j+1)*(maxIndexNum-1)) (entry 0 is never written), is seeded
  with the physical offset and store time of key j*(maxIndexNum-1)-1, and is created by the record after
  that key's owner (or by the owner itself when it owns the next key too); a file that fills at the very
  last record has no successor. Seeds and creators are read by the file's own writer task from the keys
  it receives; the driver names the files afterwards (`index_file_names`).
* `check_existing_index`: where the files stand against IndexFiles already in the output.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from daemon.backfill.ranges import CORRUPT, END, LIMIT, ROLLED, RangeOutcome, RangeTask
from daemon.config import ON_CORRUPTION_SKIP_SEGMENT
from indexcore.errors import CorruptRecordError, StoreError, StoreLayoutError
from indexcore.indexfile import FIRST_INDEX, INDEX_HEADER_SIZE, IndexHeader
from indexcore.indexservice import next_index_file_name


class BackfillError(StoreError):
    """A backfill that cannot run or did not complete; the message names the file and offset at fault."""


class BackfillFailed(BackfillError):
    """Corrupt or missing CommitLog data: nothing was written to the output."""

    def __init__(self, cause: StoreError, hint: str | None = None):
        self.cause = cause
        self.hint = hint
        super().__init__(f"{cause} ({hint})" if hint else str(cause))


@dataclass(frozen=True, slots=True)
class Reread:
    """Decode `tasks` (consecutive ranges of one segment) again from the record boundary `start`, going on
    into the next range while its own first record is not where the previous one stopped (`claimed`)."""

    tasks: tuple[RangeTask, ...]
    start: int
    claimed: tuple[int | None, ...]


@dataclass(slots=True)
class ReadPlan:
    """Which ranges are dispatched, in CommitLog order, and where reading ended."""

    start_offset: int
    end_offset: int
    ranges: list[int] = field(default_factory=list)
    segments: int = 0
    messages: int = 0
    pending: CorruptRecordError | None = None
    skipped: list[tuple[int, int, StoreError]] = field(default_factory=list)  # [from, to) and why


@dataclass(slots=True)
class _SegmentWalk:
    ranges: list[int] = field(default_factory=list)
    last: RangeOutcome | None = None  # the outcome that ended the segment's walk
    end: int = 0
    reread: Reread | None = None


def _walk_segment(tasks: Sequence[RangeTask], outcomes: Mapping[int, RangeOutcome], entry: int) -> _SegmentWalk:
    walk = _SegmentWalk(end=entry)
    offset = entry
    for i, t in enumerate(tasks):
        if offset >= t.seg_start + t.end:
            continue  # a record that started in an earlier range covers this one: it owns nothing
        o = outcomes[t.number]
        if o.first != offset:
            rest = tasks[i:]
            walk.reread = Reread(tuple(rest), offset, tuple(outcomes[r.number].first for r in rest))
            return walk
        walk.ranges.append(t.number)
        walk.last = o
        offset = walk.end = o.next_offset
        if o.status != LIMIT or t.to_limit:
            return walk
    return walk


def walk_ranges(tasks: Sequence[RangeTask], outcomes: Mapping[int, RangeOutcome], segment_size: int,
                missing_name, start_offset: int, to_offset: int | None, on_corruption: str,
                from_given: bool) -> tuple[ReadPlan | None, list[Reread]]:
    """The read plan, or the re-reads needed first. Raises BackfillFailed where the sequential reader stops
    at corrupt data (unless `skip-segment`, which drops the rest of that segment and goes on)."""
    by_segment: dict[int, list[RangeTask]] = {}
    for t in tasks:
        by_segment.setdefault(t.segment, []).append(t)
    walks = []
    for seg_tasks in by_segment.values():
        entry = max(seg_tasks[0].seg_start, start_offset)
        walks.append((seg_tasks[0], _walk_segment(seg_tasks, outcomes, entry)))
    rereads = [w.reread for _, w in walks if w.reread is not None]
    if rereads:
        return None, rereads
    plan = ReadPlan(start_offset, start_offset)
    offset = start_offset
    for first, w in walks:
        if first.seg_start != offset - offset % segment_size:
            # reading went on at a segment start that has no file, and a later segment exists
            raise BackfillFailed(StoreLayoutError(missing_name(offset), "segment is missing between two present ones"))
        plan.segments += 1
        plan.ranges.extend(w.ranges)
        plan.messages += sum(outcomes[n].records for n in w.ranges)
        o = w.last
        plan.end_offset = offset = w.end
        if o is None:
            break  # nothing starts here (an empty range after --from)
        if o.status == ROLLED:
            continue
        if o.status == END:
            plan.pending = o.pending
            break
        if o.status == LIMIT:
            if to_offset is not None and o.next_offset > to_offset:
                raise BackfillFailed(StoreLayoutError(o.location, f"--to {to_offset} is not a record boundary: the "
                                                                  f"record before it ends at {o.next_offset}"))
            break
        assert o.status == CORRUPT
        hint = None
        if from_given and o.next_offset == start_offset:
            hint = f"--from {start_offset} may not be the start of a record"
        if on_corruption != ON_CORRUPTION_SKIP_SEGMENT:
            raise BackfillFailed(o.error, hint)
        seg_end = first.seg_start + segment_size
        skip_to = seg_end if to_offset is None else max(o.next_offset, min(seg_end, to_offset))
        plan.skipped.append((o.next_offset, skip_to, o.error))
        plan.end_offset = offset = seg_end
        if to_offset is not None and offset >= to_offset:
            break
    return plan, []


# --- IndexFiles -------------------------------------------------------------------------------------

class IndexFilePlan(NamedTuple):
    """File `number` holds global keys [key_start, key_end); `creator_ts`: the store time of the record
    that creates it when its writer cannot read it from the keys (the first file, or the creator is the
    first record of the next range)."""

    number: int
    key_start: int
    key_end: int
    creator_ts: int


@dataclass(slots=True)
class IndexLayout:
    key_base: dict[int, int]  # range number -> global number of its first key
    total_keys: int
    files: list[IndexFilePlan]


def keys_per_file(index_num: int) -> int:
    """How many keys an IndexFile holds: entry 0 is never written."""
    return index_num - FIRST_INDEX


def plan_index_files(ranges: Sequence[RangeOutcome], index_num: int) -> IndexLayout:
    """The IndexFiles of a fresh index over the dispatched ranges (in CommitLog order)."""
    capacity = keys_per_file(index_num)
    base = 0
    key_base: dict[int, int] = {}
    next_first_ts: list[int | None] = [None] * len(ranges)
    following: int | None = None
    for i in range(len(ranges) - 1, -1, -1):
        next_first_ts[i] = following
        if ranges[i].records:
            following = ranges[i].first_ts
    for o in ranges:
        key_base[o.number] = base
        base += o.keys
    total = base
    with_records = [i for i, o in enumerate(ranges) if o.records]
    if not with_records:
        return IndexLayout(key_base, 0, [])
    files = [IndexFilePlan(0, 0, min(capacity, total), ranges[with_records[0]].first_ts)]
    bases = [key_base[o.number] for o in ranges]
    for j in range(1, total // capacity + 1):
        e = j * capacity - 1  # the last key of file j-1
        i = bisect_right(bases, e) - 1
        while ranges[i].keys == 0 or e >= bases[i] + ranges[i].keys:  # ranges without keys share a base
            i += 1
        o = ranges[i]
        creator = next_first_ts[i]
        if e == bases[i] + o.keys - 1 and o.last_key_owner_is_last and creator is None:
            break  # the file filled at the very last record: nothing follows to create another
        files.append(IndexFilePlan(j, j * capacity, min((j + 1) * capacity, total), -1 if creator is None else creator))
    return IndexLayout(key_base, total, files)


def index_file_names(creators: Sequence[int]) -> list[str]:
    """The names of files created by records of these store times, in order (strictly increasing)."""
    names: list[str] = []
    for ts in creators:
        names.append(next_index_file_name(names[-1] if names else None, ts))
    return names


def check_existing_index(directory: str, names: Sequence[str], end_offset: int) -> None:
    """Backfilled IndexFiles must sort before every other file in the output's index/ (those of a daemon that
    started at or after the backfill's end), and a file of the same name as one backfill writes must be
    that file (a rerun; the bytes are compared when it is committed), not one with entries past the range."""
    if not names or not os.path.isdir(directory):
        return
    ours = set(names)
    last = names[-1]
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            header = IndexHeader.decode(f.read(INDEX_HEADER_SIZE).ljust(INDEX_HEADER_SIZE, b"\0"))
        has_entries = header.index_count > FIRST_INDEX
        if name in ours:
            if header.end_phy_offset >= end_offset:
                raise BackfillError(f"{path}: backfill would write an IndexFile of this name, but this one indexes "
                                    f"CommitLog offset {header.end_phy_offset}, past the backfilled range ending "
                                    f"at {end_offset}")
        elif name < last:
            raise BackfillError(f"{path}: an IndexFile already sorts among the ones backfill writes (up to {last}); "
                                f"backfill into an empty index/ or below the files of a daemon that started at or "
                                f"after --to")
        elif has_entries and header.begin_phy_offset < end_offset:
            raise BackfillError(f"{path}: holds entries from CommitLog offset {header.begin_phy_offset}, inside the "
                                f"backfilled range ending at {end_offset}")
