"""Driver-side planning of a backfill: no Spark here, only decisions over small summaries.

* `plan_segments`: the segment tasks of `[from, to)`.
* `walk_outcomes`: the segments' stop reasons, read in CommitLog order as `reputd rebuild` reads them:
  which segments' rows are dispatched, where reading ends, what is corruption.
* `plan_index_files`: the IndexFiles a sequential `IndexService.build_index` would create, fixed from
  the global order of keys. File j holds keys [j*(maxIndexNum-1), (j+1)*(maxIndexNum-1)) (entry 0 is never
  written); it is created by the first record of any kind that follows the record that filled file j-1
  (or by that record itself when its next key is the one that did not fit), named after that record's
  store time, strictly after the previous name, and seeded with the end values of file j-1, i.e. the
  physical offset and store time of the record owning its last key.
* `check_existing_index`: where the planned files stand against IndexFiles already in the output.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from daemon.backfill.rows import CORRUPT, END, LIMIT, ROLLED, SegmentOutcome, SegmentTask
from daemon.config import ON_CORRUPTION_SKIP_SEGMENT
from indexcore.errors import CorruptRecordError, StoreError, StoreLayoutError
from indexcore.indexfile import FIRST_INDEX, INDEX_HEADER_SIZE, IndexHeader
from indexcore.indexservice import next_index_file_name
from indexcore.mappedfile import offset_to_file_name
from indexcore.reader import CommitLog


class BackfillError(StoreError):
    """A backfill that cannot run or did not complete; the message names the file and offset at fault."""


class BackfillFailed(BackfillError):
    """Corrupt or missing CommitLog data: nothing was written to the output."""

    def __init__(self, cause: StoreError, hint: str | None = None):
        self.cause = cause
        self.hint = hint
        super().__init__(f"{cause} ({hint})" if hint else str(cause))


def plan_segments(log: CommitLog, from_offset: int, to_offset: int | None) -> list[SegmentTask]:
    """One task per segment holding data of [from_offset, to_offset), in offset order."""
    tasks = []
    size = log.segment_size
    for start, path in log.segments:
        if start + size <= from_offset or (to_offset is not None and start >= to_offset):
            continue
        tasks.append(SegmentTask(len(tasks), start, path, max(start, from_offset), to_offset))
    return tasks


@dataclass(slots=True)
class ReadPlan:
    """Which segments' rows are dispatched and where reading ended."""

    start_offset: int
    end_offset: int
    segments: list[int] = field(default_factory=list)  # numbers of the segments read, in order
    pending: CorruptRecordError | None = None
    skipped: list[tuple[int, int, StoreError]] = field(default_factory=list)  # [from, to) and why

    @property
    def included(self) -> frozenset[int]:
        return frozenset(self.segments)


def walk_outcomes(outcomes: Sequence[SegmentOutcome], log: CommitLog, start_offset: int, to_offset: int | None,
                  on_corruption: str, from_given: bool) -> ReadPlan:
    """Follow the segments in order as the sequential reader would; raise BackfillFailed where it would
    stop at corrupt data (unless `skip-segment`, which drops the rest of that segment and goes on)."""
    plan = ReadPlan(start_offset, start_offset)
    size = log.segment_size
    offset = start_offset
    for o in sorted(outcomes, key=lambda o: o.number):
        if o.start != log.segment_start(offset):
            # reading went on at a segment start that has no file, and a later segment exists
            missing = os.path.join(log.dirs[0], offset_to_file_name(log.segment_start(offset)))
            raise BackfillFailed(StoreLayoutError(missing, "segment is missing between two present ones"))
        plan.segments.append(o.number)
        plan.end_offset = offset = o.next_offset
        if o.status == ROLLED:
            continue
        if o.status == END:
            plan.pending = o.pending
            break
        if o.status == LIMIT:
            if to_offset is not None and o.next_offset > to_offset:
                raise BackfillFailed(StoreLayoutError(o.path, f"--to {to_offset} is not a record boundary: the "
                                                              f"record before it ends at {o.next_offset}"))
            break
        assert o.status == CORRUPT
        hint = None
        if from_given and o.next_offset == start_offset:
            hint = f"--from {start_offset} may not be the start of a record"
        if on_corruption != ON_CORRUPTION_SKIP_SEGMENT:
            raise BackfillFailed(o.error, hint)
        seg_end = o.start + size
        skip_to = seg_end if to_offset is None else max(o.next_offset, min(seg_end, to_offset))
        plan.skipped.append((o.next_offset, skip_to, o.error))
        plan.end_offset = offset = seg_end
    return plan


# --- IndexFiles -------------------------------------------------------------------------------------

class ChunkRef(NamedTuple):
    """A chunk in CommitLog order, with the global number of its first index key."""

    segment: int
    window: int
    records: int
    keys: int
    first_ts: int
    key_base: int


class KeyOwner(NamedTuple):
    """What the owner record of one key says about a roll right after that key."""

    phy_offset: int
    store_timestamp: int
    owns_next_key: bool  # the same record owns the following key too
    next_record_ts: int | None  # store time of the next record of the same chunk, if any


class IndexFilePlan(NamedTuple):
    number: int
    name: str
    seed_phy_offset: int  # end values of the previous file, written as begin and end of this one
    seed_timestamp: int
    key_start: int  # global key numbers [key_start, key_end)
    key_end: int


def chunk_refs(outcomes: Sequence[SegmentOutcome], included: frozenset[int]) -> list[ChunkRef]:
    """Every dispatched chunk in CommitLog order, numbered by keys."""
    refs = []
    base = 0
    for o in sorted(outcomes, key=lambda o: o.number):
        if o.number not in included:
            continue
        for window, w in enumerate(o.windows):
            refs.append(ChunkRef(o.number, window, w.records, w.keys, w.first_ts, base))
            base += w.keys
    return refs


def keys_per_file(index_num: int) -> int:
    """How many keys an IndexFile holds: entry 0 is never written."""
    return index_num - FIRST_INDEX


def plan_index_files(refs: Sequence[ChunkRef], index_num: int,
                     lookup: Callable[[Mapping[tuple[int, int], list[int]]], Mapping[tuple[int, int, int], KeyOwner]]
                     ) -> list[IndexFilePlan]:
    """The IndexFiles of a fresh index over these chunks. `lookup({(segment, window): [local key
    numbers]})` answers, for the last key of each full file, what its owner record says."""
    if not refs:
        return []
    capacity = keys_per_file(index_num)
    total = refs[-1].key_base + refs[-1].keys
    bases = [r.key_base for r in refs]
    full_ends = list(range(capacity - 1, total, capacity))  # the last key of every file that fills up
    wanted: dict[tuple[int, int], list[int]] = {}
    located = []
    for e in full_ends:
        i = bisect_right(bases, e) - 1
        while refs[i].keys == 0 or e >= refs[i].key_base + refs[i].keys:  # chunks without keys share a base
            i += 1
        located.append((e, i))
        wanted.setdefault((refs[i].segment, refs[i].window), []).append(e - refs[i].key_base)
    owners = lookup(wanted) if wanted else {}
    files = [(refs[0].first_ts, 0, 0)]
    for e, i in located:
        r = refs[i]
        owner = owners[(r.segment, r.window, e - r.key_base)]
        if owner.owns_next_key:
            creator_ts = owner.store_timestamp
        elif owner.next_record_ts is not None:
            creator_ts = owner.next_record_ts
        else:
            if i + 1 == len(refs):
                break  # the file filled at the very last record: nothing follows to create another
            creator_ts = refs[i + 1].first_ts
        files.append((creator_ts, owner.phy_offset, owner.store_timestamp))
    plans = []
    name = None
    for j, (creator_ts, seed_phy, seed_ts) in enumerate(files):
        name = next_index_file_name(name, creator_ts)
        plans.append(IndexFilePlan(j, name, seed_phy, seed_ts, min(j * capacity, total),
                                   min((j + 1) * capacity, total)))
    return plans


def check_existing_index(directory: str, plans: Sequence[IndexFilePlan], end_offset: int) -> None:
    """Backfilled IndexFiles must sort before every other file in the output's index/ (those of a daemon that
    started at or after the backfill's end), and a file of the same name as one backfill writes must be
    that file (a rerun; the bytes are compared when it is committed), not one with entries past the range."""
    if not plans or not os.path.isdir(directory):
        return
    ours = {p.name for p in plans}
    last = plans[-1].name
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
