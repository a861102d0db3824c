"""Following a DLedger CommitLog across a leader change: what reputd dispatched must still be in the log.

A DLedger leader appends an entry before a quorum commits it, and a node that led and then follows a new leader
has its uncommitted tail cut and rewritten with the new leader's entries (DLedgerMmapFileStore.truncate). reputd
dispatches only committed entries (`daemon.engine.dledgermode`), but a node can count entries as committed that its new
leader then replaces (DLedger 0.2.3 caps a follower's committedIndex at its own ledgerEndIndex, stale entries
included, DLedgerEntryPusher.java:833-860), and a data directory can be re-synced or restored under reputd. So
the output must never keep a unit or key of an entry the log no longer holds.

The *fence* is a dispatcher that runs first in DLedger mode and remembers the last entry dispatched: its
(index, term, pos, size), and the first index of every term seen (`terms`). It is saved in reputd's checkpoint
with the other dispatchers' states, so it always describes the checkpointed offset. Raft's log matching property
makes one entry enough to check a whole prefix: two logs holding an entry with the same index and term hold the
same entries up to it. The fence is checked
- on every batch: the batch's first entry must follow the last one dispatched (index + 1, term not lower);
- at the head, once a second: the last entry dispatched is still there, same index, term and size;
- at every start, against the checkpoint (`repair_truncation`, before recovery).
A failed check ends the session without a checkpoint past it; the next start finds the last entry both logs
share (a binary search on index, comparing terms) and writes a checkpoint at that entry's end, with the
ConsumeQueue and IndexFile states derived from the files there; recovery then cuts every output file back to it
(`recovery.recover_output`) and the loop dispatches the new entries: the files a clean rebuild of the new log
writes. A kill at any moment of the repair leaves either the old checkpoint (the repair is found again) or the
new one (recovery cuts again, which is idempotent).

A start without fence state (no checkpoint, a replay marker) checks the output files instead
(`daemon.engine.dledgeroutput`). Plug-ins keep their checkpoint states across a repair, so recovery calls their
`recover(cut, state)`.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.config import Config, StoreConfig
from daemon.engine.checkpoint import Checkpoint, CheckpointError, read_checkpoint, write_checkpoint
from daemon.ops.logs import get_logger
from indexcore import _failpoints
from indexcore.commitlog import MessageRecord
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CONSUME_QUEUE_DIR, CQ_UNIT, CQ_UNIT_SIZE
from indexcore.dledger import (
    ENTRY_HEADER,
    ENTRY_HEADER_SIZE,
    ENTRY_MAGIC,
    INDEX_FILE_SIZE,
    INDEX_UNIT,
    INDEX_UNIT_SIZE,
    data_dir,
    home_dir,
)
from indexcore.indexfile import FIRST_INDEX, INVALID_INDEX, IndexFile
from indexcore.indexservice import INDEX_DIR, IndexState
from indexcore.mappedfile import list_queue_files, offset_to_file_name

FENCE = "dledger"  # the dispatcher's name, and its key in the checkpoint
CHECK_INTERVAL_S = 1.0  # at the head, how often the last entry dispatched is looked at again
MAX_TERMS = 4096  # term starts kept; older ones are dropped (a divergence below them re-reads the DLedger log)


class TruncatedError(Exception):
    """Entries already dispatched are no longer in the DLedger log: a new leader replaced or cut them."""


@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    term: int
    pos: int
    size: int

    @property
    def end(self) -> int:
        return self.pos + self.size


class DLedgerLogView:
    """Entry headers of `dledger-<selfId>/` by position or by index, read with pread (never mapped)."""

    def __init__(self, store: StoreConfig):
        self.root = home_dir(store.store_path_root_dir, store.d_leger_self_id)
        self.data = data_dir(store.store_path_root_dir, store.d_leger_self_id)
        self.size = store.mapped_file_size_commit_log

    def first_offset(self) -> int | None:
        """The first data file's start: dividedCommitlogOffset on a store upgraded from the plain CommitLog."""
        files = list_queue_files(self.data) if os.path.isdir(self.data) else []
        return min((start for start, _ in files), default=None)

    def at(self, pos: int) -> Entry | None:
        """The entry whose header is at `pos`, or None when none is written there."""
        start = pos - pos % self.size
        try:
            with open(os.path.join(self.data, offset_to_file_name(start)), "rb") as f:
                head = os.pread(f.fileno(), ENTRY_HEADER_SIZE, pos - start)
        except OSError:
            return None
        if len(head) < ENTRY_HEADER_SIZE:
            return None
        magic, size, index, term, entry_pos, *_ = ENTRY_HEADER.unpack(head)
        if magic != ENTRY_MAGIC or entry_pos != pos or size <= ENTRY_HEADER_SIZE:
            return None
        return Entry(index, term, pos, size)

    def by_index(self, index: int) -> Entry | None:
        """Entry `index`, found through its unit in the index file and checked against the data."""
        at = index * INDEX_UNIT_SIZE
        path = os.path.join(self.root, "index", offset_to_file_name(at - at % INDEX_FILE_SIZE))
        try:
            with open(path, "rb") as f:
                unit = os.pread(f.fileno(), INDEX_UNIT_SIZE, at % INDEX_FILE_SIZE)
        except OSError:
            unit = b""
        if len(unit) == INDEX_UNIT_SIZE:
            magic, pos, size, unit_index, _term = INDEX_UNIT.unpack(unit)
            if magic == ENTRY_MAGIC and unit_index == index:
                entry = self.at(pos)
                if entry is not None and entry.index == index and entry.size == size:
                    return entry
        return self._walk_to(index)

    def _walk_to(self, index: int) -> Entry | None:
        """Without a usable index unit: the data file whose first entry is the last at or below `index`, walked."""
        files = sorted(list_queue_files(self.data)) if os.path.isdir(self.data) else []
        holder = None
        for start, _ in files:
            first = self.at(start)
            if first is None or first.index > index:
                break
            holder = first
        entry = holder
        while entry is not None and entry.index < index:
            nxt = self.at(entry.end)
            if nxt is None:  # a BLANK or the end: the next file
                nxt = self.at(entry.end - entry.end % self.size + self.size)
            if nxt is None or nxt.index != entry.index + 1:
                return None
            entry = nxt
        return entry if entry is not None and entry.index == index else None


class DLedgerFence:
    """The dispatcher that remembers the last DLedger entry dispatched (module docstring). It writes nothing."""

    name = FENCE

    def __init__(self, store: StoreConfig, output_dir: str):
        self.view = DLedgerLogView(store)
        self.first_offset = self.view.first_offset()
        self.last: Entry | None = None
        self.terms: list[list[int]] = []  # [term, first index], ascending
        self._checked = 0.0
        self._replay_from: Entry | None = None  # the last entry fenced, found in the log when a replay began

    def dispatch(self, batch) -> None:
        phy = batch.phy_offset
        if not len(phy) or self.first_offset is None or int(phy[-1]) - ENTRY_HEADER_SIZE < self.first_offset:
            return  # records of the plain CommitLog below dividedCommitlogOffset
        first_row = int((phy - ENTRY_HEADER_SIZE >= self.first_offset).argmax())
        first = self.view.at(int(phy[first_row]) - ENTRY_HEADER_SIZE)
        last = self.view.at(int(phy[-1]) - ENTRY_HEADER_SIZE)
        if first is None or last is None:
            raise TruncatedError(f"the DLedger entries of the batch from {batch.start_offset} are gone")
        if self.last is not None and first.index <= self.last.index and self._replaying():
            # a replay from below the last entry dispatched (a queue the checkpoint counted is gone: from the
            # first offset): the entries up to it were fenced already
            if last.index <= self.last.index:
                return
            first_row = int(np.searchsorted(phy, self.last.pos + ENTRY_HEADER_SIZE, side="right"))
            first = self.view.at(int(phy[first_row]) - ENTRY_HEADER_SIZE)
            if first is None:
                raise TruncatedError(f"the DLedger entry at {int(phy[first_row]) - ENTRY_HEADER_SIZE} is gone")
        if self.last is not None and (first.index != self.last.index + 1 or first.term < self.last.term) \
                and not self._after_retention(first):
            raise TruncatedError(f"entry {first.index} (term {first.term}) at {first.pos} does not follow the last "
                                 f"one dispatched, {self.last.index} (term {self.last.term})")
        if not self.terms or self.terms[-1][0] != first.term:
            self._term_start(first.term, first.index)
        if last.term != first.term:  # new terms begin inside the batch: find where (terms never decrease)
            self._term_starts(batch, first_row, first, last)
        self.last = last

    def _replaying(self) -> bool:
        """Whether the last entry fenced is still in the log, looked at once a replay (not once a batch): while
        it lasts, `still_there` keeps looking every CHECK_INTERVAL_S."""
        if self._replay_from is not self.last:
            if self.view.at(self.last.pos) != self.last:
                return False
            self._replay_from = self.last
        return True

    def _after_retention(self, first: Entry) -> bool:
        """Whether `first` is the log's first entry and retention deleted the file of the last one dispatched: the
        entries between them are gone, as the records of a plain CommitLog's deleted segments are (a restart
        across a retention gap reads on from the first offset)."""
        lowest = self.view.first_offset()
        return (lowest is not None and first.pos == lowest and self.last.pos < lowest
                and first.index > self.last.index and first.term >= self.last.term)

    def _term_start(self, term: int, index: int) -> None:
        self.terms.append([term, index])
        del self.terms[:-MAX_TERMS]

    def _term_starts(self, batch, lo_row: int, lo: Entry, hi: Entry) -> None:
        """Binary search on rows for each entry whose term differs from its predecessor's."""
        phy = batch.phy_offset
        rows = {lo_row: lo, len(phy) - 1: hi}

        def entry(row: int) -> Entry:
            if row not in rows:
                found = self.view.at(int(phy[row]) - ENTRY_HEADER_SIZE)
                if found is None:
                    raise TruncatedError(f"the DLedger entry at {int(phy[row]) - ENTRY_HEADER_SIZE} is gone")
                rows[row] = found
            return rows[row]

        a = lo_row
        while entry(a).term != hi.term:
            b = len(phy) - 1  # the first row past `a` whose term is above entry(a)'s
            low = a
            while b - low > 1:
                mid = (low + b) // 2
                if entry(mid).term == entry(a).term:
                    low = mid
                else:
                    b = mid
            self._term_start(entry(b).term, entry(b).index)
            a = b

    def still_there(self, *, now: bool = False) -> bool:
        """Whether the last entry dispatched is in the log as it was; looked at once a CHECK_INTERVAL_S, or at
        once with `now` (the log reads as corrupt where the next entry should be)."""
        t = time.monotonic()
        if self.last is None or (not now and t - self._checked < CHECK_INTERVAL_S):
            return True
        self._checked = t
        return self.view.at(self.last.pos) == self.last

    def checkpoint_state(self) -> dict | None:
        if self.last is None:
            return None
        e = self.last
        return {"index": e.index, "term": e.term, "pos": e.pos, "size": e.size, "terms": [list(t) for t in self.terms]}

    def recover(self, reput_from_offset: int, state: Any) -> None:
        self.last, self.terms = parse_state(state)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def parse_state(state: Any) -> tuple[Entry | None, list[list[int]]]:
    """The fence's checkpoint state; ValueError for anything it never writes."""
    if state is None:
        return None, []
    try:
        entry = Entry(int(state["index"]), int(state["term"]), int(state["pos"]), int(state["size"]))
        terms = [[int(t), int(i)] for t, i in state["terms"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the {FENCE} checkpoint state is not one reputd writes: {e}") from None
    return entry, terms


def truncated(dispatchers, *, now: bool = False) -> bool:
    """Where a read stops: whether the fence finds the last entry dispatched gone (module docstring)."""
    for d in dispatchers:
        if isinstance(d, DLedgerFence):
            return not d.still_there(now=now)
    return False


def fence_for(config: Config, output_dir: str) -> list:
    """The fence, first of the dispatchers, in DLedger mode; nothing otherwise."""
    return [DLedgerFence(config.store, output_dir)] if config.store.enable_d_leger_commit_log else []


# --- the repair at start ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Repair:
    """What a start found and did: the entry dispatched that is gone, the last one both logs share, the new
    checkpoint offset."""

    gone: Entry | None  # None: found from the output files, without fence state
    now_there: Entry | None  # what the log holds at the gone entry's position now
    shared: Entry | None  # the last entry both logs hold (None: none known)
    reput_from_offset: int
    old_offset: int


def _old_term(terms: list[list[int]], index: int) -> int | None:
    """The term the dispatched log had at `index`, from the term starts; None below the first one known."""
    found = None
    for term, first in terms:
        if first > index:
            break
        found = term
    return found


def find_shared(view: DLedgerLogView, gone: Entry, terms: list[list[int]]) -> Entry | None:
    """The last entry the new log shares with the one dispatched: the highest index at or below the fence whose
    term is the same in both (log matching makes it a binary search)."""
    lo = terms[0][1] if terms else gone.index  # no term known below it
    hi = gone.index

    def same(i: int) -> Entry | None:
        e = view.by_index(i)
        return e if e is not None and e.term == _old_term(terms, i) else None

    shared = bisect.bisect_left(range(lo, hi + 1), True, key=lambda i: same(i) is None)
    return same(lo + shared - 1) if shared else None


def _store_timestamp(config: Config, view: DLedgerLogView, phy: int) -> int:
    """STORETIMESTAMP of the message at store offset `phy`: in a DLedger entry, or in the plain CommitLog below
    the DLedger log of an upgraded store."""
    size = config.store.mapped_file_size_commit_log
    first = view.first_offset()
    if first is not None and phy - ENTRY_HEADER_SIZE >= first:
        directory = view.data
    else:
        directory = next(d for d in config.store.commit_log_dirs
                         if os.path.exists(os.path.join(d, offset_to_file_name(phy - phy % size))))
    with open(os.path.join(directory, offset_to_file_name(phy - phy % size)), "rb") as f:
        at = phy % size
        total = int.from_bytes(os.pread(f.fileno(), 4, at), "big", signed=True)
        record = MessageRecord.decode(os.pread(f.fileno(), total, at), check_crc=False)
    return record.store_timestamp


def index_state_at(config: Config, output_dir: str, view: DLedgerLogView, cut: int) -> dict | None:
    """The IndexFile state (`IndexState.as_dict`) holding exactly the keys of records below store offset `cut`:
    the newest file with such a key, its entries up to the last of them, its header as that put left it and its
    hashSlotCount less the chains the later entries started. None when no key is below `cut`."""
    directory = os.path.join(output_dir, INDEX_DIR)
    names = sorted(n for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []
    store = config.store
    for name in reversed(names):
        f = IndexFile(os.path.join(directory, name), store.max_hash_slot_num, store.max_index_num, readonly=True)
        try:
            keep = f.index_count
            started = 0
            while keep > FIRST_INDEX and f.entry(keep - 1).phy_offset >= cut:
                started += f.entry(keep - 1).prev_index == INVALID_INDEX
                keep -= 1
            if keep == FIRST_INDEX:
                continue
            if keep == f.index_count:
                header = f.header
            else:
                phy = f.entry(keep - 1).phy_offset
                header = f.header._replace(end_phy_offset=phy, end_timestamp=_store_timestamp(config, view, phy),
                                           hash_slot_count=f.hash_slot_count - started, index_count=keep)
            return IndexState(name, *header).as_dict()
        finally:
            f.close()
    return None


def _first_unit(path: str) -> int | None:
    """The store offset of a ConsumeQueue file's first unit past its blank units; None when it holds none."""
    chunk = CQ_UNIT_SIZE * 256
    with open(path, "rb") as f:
        at = 0
        while data := os.pread(f.fileno(), chunk, at):
            for i in range(0, len(data) - CQ_UNIT_SIZE + 1, CQ_UNIT_SIZE):
                phy, size, _ = CQ_UNIT.unpack_from(data, i)
                if size != BLANK_UNIT_MSG_SIZE:
                    return phy if size > 0 else None
            at += len(data)
    return None


def drop_queues_without_units_below(output_dir: str, cut: int) -> tuple[list[str], int]:
    """Remove each queue whose first unit (after its blank units) is at or past store offset `cut`: every record
    it holds was cut, and what recovery's truncation would leave of it is its first file's blank units, which a
    rebuild of the new log never writes. Done before the repair's checkpoint: a kill redoes it. Returns the
    queues removed and the number left."""
    root = os.path.join(output_dir, CONSUME_QUEUE_DIR)
    dropped, left = [], 0
    for topic in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for queue in sorted(os.listdir(os.path.join(root, topic))):
            directory = os.path.join(root, topic, queue)
            files = sorted(n for n in os.listdir(directory) if n.isdigit())
            first = None
            if files:
                first = _first_unit(os.path.join(directory, files[0]))
            if first is not None and first < cut:
                left += 1
                continue
            shutil.rmtree(directory)
            dropped.append(f"{topic}/{queue}")
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(root, topic))  # only when no queue is left in it
    return dropped, left


BUILT_IN = ("consumequeue", "index", FENCE)


def cut_states(config: Config, output_dir: str, view: DLedgerLogView, cut: int, names, log,
               old_queues: int | None = None) -> dict[str, Any]:
    """The ConsumeQueue and IndexFile states of the output cut back to store offset `cut` (an entry position),
    for the dispatchers `names`. `old_queues`: the queue count of the checkpoint being cut back, if it had one."""
    states: dict[str, Any] = {}
    if "consumequeue" in names:
        dropped, queues = drop_queues_without_units_below(output_dir, cut + ENTRY_HEADER_SIZE)
        if dropped:
            log.info("dledger_queues_removed", queues=dropped, reput_from_offset=cut,
                     detail="queues whose every record was cut: a rebuild of the new log has none")
        if old_queues is not None:
            # a queue the old checkpoint counted and the files lack (an operator deleted it) stays counted, so
            # recovery reads the log again from its first offset for it (`queues_missing`)
            queues = max(queues, old_queues - len(dropped))
        states["consumequeue"] = {"queues": queues}
    if "index" in names:
        states["index"] = index_state_at(config, output_dir, view, cut + ENTRY_HEADER_SIZE)
    return states


def plugin_states(old: dict[str, Any]) -> dict[str, Any]:
    """Plug-ins' states, carried into the repair's checkpoint unchanged: recovery then calls their
    `recover(cut, state)`, which must drop what they hold at or past the cut (docs/recovery.md)."""
    return {name: state for name, state in old.items() if name not in BUILT_IN}


def repair_truncation(config: Config, metrics=None, log=None) -> Repair | None:
    """At a start in DLedger mode, before recovery: if the checkpoint's last entry is no longer in the log,
    write a checkpoint at the end of the last entry both logs share, with the dispatchers' states there
    (module docstring); recovery then cuts the output back to it. None when nothing was cut or the checkpoint
    has no fence state (`daemon.engine.dledgeroutput` checks the files then)."""
    if not config.store.enable_d_leger_commit_log:
        return None
    log = log or get_logger(component="recovery")
    out = config.output.dir
    try:
        checkpoint = read_checkpoint(out)
    except CheckpointError:
        return None  # recovery reports it and rebuilds from the files
    if checkpoint is None or FENCE not in checkpoint.dispatchers:
        return None
    try:
        gone, terms = parse_state(checkpoint.dispatchers[FENCE])
    except ValueError:
        return None
    view = DLedgerLogView(config.store)
    if gone is None:
        return None
    now_there = view.at(gone.pos)
    if now_there == gone:
        return None
    if view.first_offset() is None or view.first_offset() > gone.pos:
        return None  # retention deleted its data file: old entries are committed, none is cut
    shared = find_shared(view, gone, terms)
    cut = shared.end if shared is not None else view.first_offset()
    old = checkpoint.dispatchers
    cq_state = old.get("consumequeue")
    old_queues = cq_state.get("queues") if isinstance(cq_state, dict) else None
    states = cut_states(config, out, view, cut, old, log, old_queues if isinstance(old_queues, int) else None)
    if shared is not None:
        states[FENCE] = {"index": shared.index, "term": shared.term, "pos": shared.pos, "size": shared.size,
                         "terms": [t for t in terms if t[1] <= shared.index]}
    states.update(plugin_states(old))
    write_checkpoint(out, Checkpoint(cut, states, int(time.time() * 1000)))
    _failpoints.reached("dledger.after_repair_checkpoint")  # recovery, not done yet, cuts the files next
    repair = Repair(gone, now_there, shared, cut, checkpoint.reput_from_offset)
    log.warning("dledger_truncation_repaired", dispatched_entry=gone.index, dispatched_term=gone.term,
                dispatched_pos=gone.pos, now_at_pos=None if now_there is None else
                {"index": now_there.index, "term": now_there.term, "size": now_there.size},
                shared_entry=None if shared is None else shared.index, reput_from_offset=cut,
                old_reput_from_offset=checkpoint.reput_from_offset, found_by="checkpoint",
                detail="entries already dispatched are no longer in the DLedger log (a new leader cut them): the "
                       "output is cut back to the last entry both logs hold and the new entries dispatched")
    if metrics is not None:
        metrics.dledger_truncations.inc()
        metrics.dledger_truncated_bytes.inc(max(0, checkpoint.reput_from_offset - cut))
    return repair
