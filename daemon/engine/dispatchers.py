"""Dispatchers: what the reput loop hands each decoded batch to.

A dispatcher is anything with `dispatch(batch)`, `flush()` and `close()`. The built-ins write the
broker's ConsumeQueue and IndexFile; a third party plugs in by naming `package.module:Class` in the
config's `dispatchers:` list. The class is constructed as `Class(options=..., store=..., output_dir=...)`
with the entry's `options` mapping, the `StoreConfig` and the output directory; naming a class in the
config runs its code, so the config file is trusted input.
"""

from __future__ import annotations

import importlib
import mmap
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from daemon.config import Config, ConfigError, DispatcherSpec, StoreConfig
from daemon.engine.dledgerfence import fence_for
from daemon.engine.writebehind import WriteBehind
from daemon.ops.logs import get_logger
from indexcore.consumequeue import PutStats
from indexcore.dispatch import DispatchBatch
from indexcore.indexfile import RELEASE_AFTER_KEYS
from indexcore.indexservice import IndexResume, IndexService, IndexState, IndexStats
from indexcore.mappedfile import sync_file
from indexcore.queuestore import ConsumeQueueStore, FlatUnits, consume_queue_units_flat

PAGE_SIZE = mmap.PAGESIZE  # the unit of flushConsumeQueueLeastPages, as the broker's OS_PAGE_SIZE
GATHER_BYTES = 32 * 1024  # a queue's appends gathered (`ConsumeQueueDispatcher.gather_appends`) are written from here
MS_PER_SECOND = 1000
# files made in one go while a rebuild's dispatching thread would wait for its read-ahead (`idle`): a batch that
# comes meanwhile waits for the piece, 2-15 ms here (60-400 us a file, with the file system's state)
MAKE_AHEAD_FILES = 32


@runtime_checkable
class Dispatcher(Protocol):
    """Takes every batch in CommitLog order. `dispatch` may raise; the loop then stops at that batch."""

    name: str

    def dispatch(self, batch: DispatchBatch) -> None: ...

    def flush(self) -> None:
        """Make everything dispatched so far durable; the checkpoint is written only after this returns."""

    def close(self) -> None: ...


# Files synced at once: each fdatasync waits for the disk, and concurrent ones share a journal commit, which
# matters with thousands of LMQ queues (1,064 files synced: 3.4 s one after the other here, 0.5 s in parallel).
SYNC_THREADS = 16


def sync_paths(paths: list[str]) -> None:
    """fdatasync every file, SYNC_THREADS at a time, through descriptors of our own; the first error
    is raised once all are done."""
    if len(paths) <= 1:
        for path in paths:
            sync_file(path)
        return
    with ThreadPoolExecutor(min(SYNC_THREADS, len(paths)), thread_name_prefix="reputd-sync") as pool:
        for _ in pool.map(sync_file, paths):
            pass


@dataclass(slots=True)
class FlushPlan:
    """Files to fsync outside the dispatch lock. `complete` is False when dispatched data is left
    unflushed on purpose (fewer dirty pages than flushConsumeQueueLeastPages), so no checkpoint may
    cover it yet; `done` runs once the files are synced."""

    paths: list[str] = field(default_factory=list)
    complete: bool = True
    done: Callable[[], None] | None = None
    # waits, outside the dispatch lock, until the writes the files' sync must cover are made (`run`'s writer
    # thread: `OpenFiles.barrier`); it raises if one failed
    ready: Callable[[], None] | None = None


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`np.union1d` of two arrays of slots, without `np.unique`, whose check for a masked array imports numpy.ma
    (8 ms of a rebuild's CPU, at its final flush)."""
    both = np.concatenate((a, b))
    both.sort()
    return both[np.concatenate(([True], both[1:] != both[:-1]))] if len(both) else both


class ConsumeQueueDispatcher:
    """`CommitLogDispatcherBuildConsumeQueue`: one unit per NOT_TYPE/COMMIT_TYPE record."""

    name = "consumequeue"

    def __init__(self, store: StoreConfig, output_dir: str):
        self.queues = ConsumeQueueStore(output_dir, store.mapped_file_size_consume_queue)
        self.queues.load()
        # `run` writes a queue's appends once they come to GATHER_BYTES or are a flush interval old: over 10,000
        # queues at 100,000 msgs/s a write per queue a batch cost more than the rest of the daemon
        self.gather_appends(GATHER_BYTES, store.flush_interval_consume_queue / MS_PER_SECOND)
        # An output that holds queues already goes on from what it dispatched: a queue it meets now whose first
        # unit is past queue offset 0 lost its earlier units to a gap (retention deleted their records before
        # they were read), and its pre-blank units are blanked units like those of a gap inside a queue. In a
        # new output they are the broker's own pre-blank of a queue whose history began before the data read.
        self._continues_output = bool(self.queues.queues)
        self.stats = PutStats()
        self.spread = (0, 0)  # (queues, units) the last batch put units into
        self._log = get_logger(dispatcher=self.name)
        # per queue (by its slot in the store's table): its write offset at its last sync, and at the sync of the
        # last flush plan that synced it (-1: none); the queues the last plan left with unsynced units
        self._flushed = np.zeros(0, dtype=np.int64)
        self._plan_synced = np.zeros(0, dtype=np.int64)
        self._unsynced = np.zeros(0, dtype=np.int64)
        self._prepared: dict[int, tuple[DispatchBatch, FlatUnits]] = {}
        self.missing_queues = 0  # queues a checkpoint counted that the output no longer holds (`recover`)
        self._writer: WriteBehind | None = None

    def write_behind(self) -> None:
        """Make the queues' writes on a writer thread of their own from now on (`daemon.engine.writebehind`):
        `run`, whose dispatching thread they delayed. `close` ends it."""
        if self._writer is None:
            self._writer = WriteBehind(under=self.queues.root)
            self.queues.open_files.write_behind(self._writer)

    def prepare(self, batch: DispatchBatch) -> None:
        """Group the batch's units ahead of its dispatch (a rebuild's read-ahead thread calls this)."""
        self._prepared[id(batch)] = (batch, consume_queue_units_flat(batch))

    def dispatch(self, batch: DispatchBatch) -> None:
        prepared = self._prepared.pop(id(batch), None)
        units = prepared[1] if prepared is not None and prepared[0] is batch else consume_queue_units_flat(batch)
        stats = self.queues.dispatch(batch, units)
        self.spread = (len(units), stats.written + stats.already_built)
        blanks = stats.gap_blanks + (stats.pre_blanks if self._continues_output else 0)
        if blanks:
            self._log.warning("queue_offsets_blanked", blanks=blanks, batch_start=batch.start_offset,
                              detail="units of records the output never got (deleted before reputd read them), "
                                     "blank at their queue offsets")
        for row in batch.multi_count_mismatch.tolist():  # the broker logs it and writes no extra unit
            self._log.warning("multi_dispatch_count_mismatch", commit_log_offset=int(batch.phy_offset[row]),
                              topic=batch.topic_of(row))
        self.stats.add(stats)

    def idle(self) -> bool:
        """Create some of the files the queues' first writes are to create (`OpenFiles.make_ahead`), while the
        dispatching thread would wait for the next batch; True while more are left. Each made here is opened
        once more for its write, so only waiting time is spent on them."""
        return bool(self.queues.open_files.make_ahead(MAKE_AHEAD_FILES))

    def gather_appends(self, least: int, seconds: float | None = None) -> None:
        """Gather each queue's appends until `least` bytes before writing them (`ConsumeQueueStore.hold_bytes`),
        and, with `seconds`, for no longer than that (`hold_seconds`); without, until a thorough flush or the
        store's budget (a rebuild, whose files nobody reads before its end)."""
        self.queues.hold_bytes = least
        self.queues.hold_seconds = seconds
        # a rebuild: each new queue's file is created by its first write (`ConsumeQueueStore.create_on_write`)
        self.queues.create_on_write = seconds is None

    def held_queues(self) -> np.ndarray:
        """The slots of the queues holding gathered appends (`daemon.engine.flusher.release_ahead`)."""
        table = self.queues.table
        return np.flatnonzero(table.held[: len(table)])

    def release_queues(self, slots: np.ndarray) -> None:
        """Hand the gathered appends of `slots` to their writes now (those that hold none any more are skipped)."""
        self.queues.table.release(slots)
        self.queues.open_files.submit_writes()

    def files(self) -> int:
        """Read by the metrics thread while the loop adds queues: iterate a copy."""
        return sum(cq.file_count for cq in list(self.queues.queues.values()))

    def _rows(self) -> int:
        """Grow the per-queue arrays to the store's table."""
        n = len(self.queues.table)
        if len(self._flushed) < n:
            grow = max(n, 2 * len(self._flushed)) - len(self._flushed)  # doubling: queues come a few at a time
            self._flushed = np.concatenate((self._flushed, np.zeros(grow, np.int64)))
            self._plan_synced = np.concatenate((self._plan_synced, np.full(grow, -1, np.int64)))
        return n

    def _mark_flushed(self) -> None:
        """Every queue as flushed where it ends now (after a load, a recovery or a whole flush)."""
        n = self._rows()
        self._flushed[:n] = self.queues.table.write_end(np.arange(n))
        self._plan_synced[:n] = -1
        self._unsynced = np.zeros(0, dtype=np.int64)
        self.queues.take_touched()

    def flush(self) -> None:
        self.queues.flush(sync_paths)
        self._mark_flushed()

    def prepare_flush(self, thorough: bool, least_pages: int) -> FlushPlan:
        """`ConsumeQueue.flush(flushLeastPages)` for every queue: sync a queue's writing file when it has
        at least `least_pages` dirty pages, or whatever it has when `thorough`. Only the queues written since
        the last plan, or left unsynced by it, are looked at: tens of thousands of idle queues cost nothing.

        The appends a queue to be synced still gathers are written first (every queue's when `thorough`), and
        so are those gathered longer than the store's `hold_seconds` once the dispatch pauses that long: while it
        goes on, each batch writes some of them (`RELEASE_OLD_QUEUES`); doing it here, under the dispatch lock,
        wrote 2,000-6,000 queues at once over 10,000 (0.1-6 s without a batch dispatched)."""
        store = self.queues
        table = store.table
        now = time.monotonic()
        if thorough or store.hold_seconds is None:
            store.release_held()  # written below (`barrier`)
        elif now - store.last_put >= store.hold_seconds:
            table.release_older(now - store.hold_seconds)
        self._rows()
        candidates = _union(self._unsynced, store.take_touched())
        end = table.write_end(candidates)
        start = self._flushed[candidates]
        changed = end != start
        if thorough or least_pages <= 0:
            due = changed
        else:
            due = changed & (end // PAGE_SIZE - start // PAGE_SIZE >= least_pages)
        plan = FlushPlan()
        plan.complete = not (changed & ~due).any()
        synced, synced_end = candidates[due], end[due]
        held = synced[table.held[synced] > 0]
        if len(held):
            table.release(held)
        # made here, or handed to `run`'s writer thread and waited for by `sync_plans` with the lock released: the
        # writes of a thorough flush over 10,000 queues held it for all of them
        plan.ready = store.open_files.barrier()
        paths = [table.queues[slot].writing_path for slot in synced.tolist()]
        plan.paths = [p for p in paths if p is not None]
        self._unsynced = candidates[changed]  # a sync that fails leaves them for the next plan

        def done() -> None:
            self._flushed[synced] = synced_end
            self._plan_synced[synced] = synced_end
            self._unsynced = np.setdiff1d(self._unsynced, synced, assume_unique=True)

        plan.done = done
        return plan

    def checkpoint_state(self) -> dict:
        """How many queues the output holds: a start that finds fewer knows a queue was deleted since."""
        return {"queues": len(self.queues.queues)}

    def recover(self, reput_from_offset: int, state: Any) -> None:
        """Remove every unit at or past the checkpoint: those records are dispatched again. Queues the
        checkpoint counted that are gone now (`missing_queues`) need the CommitLog from its first offset."""
        held = state.get("queues") if isinstance(state, dict) else None
        self.missing_queues = max(0, held - len(self.queues.queues)) if isinstance(held, int) else 0
        self.queues.truncate_to(reput_from_offset)
        self._mark_flushed()

    def resume_offset(self) -> int | None:
        """Where the broker would restart its reput: the end of the last unit over all queues; None when
        there is no unit, i.e. from the CommitLog's first offset. A queue whose files end before it (or that
        has none) is completed only by a start from the CommitLog's first offset (`recover_output`'s
        `rescan`), each queue then skipping the units it holds."""
        end = self.queues.max_physic_offset()
        return end if end >= 0 else None

    def output_end(self) -> int:
        """Records from here on have no unit yet."""
        return max(self.queues.max_physic_offset(), 0)

    @property
    def removed(self) -> list[str]:
        """Files the load removed: leftovers of creations a kill cut short."""
        return [path for cq in self.queues.queues.values() for path in cq.removed]

    @property
    def torn(self) -> list[str]:
        """Files where the load zeroed the first bytes of a unit whose write a kill stopped."""
        return [path for cq in self.queues.queues.values() for path in cq.torn]

    def drop_torn_tails(self, from_offset: int) -> list[str]:
        """Before a replay from `from_offset` (a replay marker's): remove each queue's last unit that a kill
        may have torn (`ConsumeQueue.drop_torn_tail`), for the replay to write again."""
        return self.queues.drop_torn_tails(from_offset)

    def close(self) -> None:
        """Close every queue; one that a flush plan synced and nothing was written to since is not synced
        again (after a rebuild's or a stopping `run`'s last flush, that is every queue: 100,000 of them
        took 5 s of fdatasync here)."""
        n = self._rows()
        table = self.queues.table
        slots = np.arange(n)
        table.dirty[slots[table.dirty[:n] & (self._plan_synced[:n] == table.write_end(slots))]] = False
        try:
            self.queues.close()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


class IndexDispatcher:
    """`CommitLogDispatcherBuildIndex`: UNIQ_KEY and KEYS of every record but ROLLBACK."""

    name = "index"
    # A rebuild may run this dispatch on a thread of its own while the others take the same batch: it shares
    # nothing with them, and its hashing and putting run in C without the GIL.
    dispatch_alongside = True

    def __init__(self, store: StoreConfig, output_dir: str):
        self.service = IndexService(output_dir, store.max_hash_slot_num, store.max_index_num, store.max_msgs_num_batch)
        self.service.load()
        self.stats = IndexStats()
        self._log = get_logger(dispatcher=self.name)
        self._flushed: IndexState | None = None  # the newest file's state at its last sync
        self._keys_since_release = 0

    def dispatch(self, batch: DispatchBatch) -> None:
        stats = self.service.build_index(batch)
        if stats.files_created:
            self._log.info("index_file_rolled", files=self.service.names[-stats.files_created:])
        self.stats.keys_put += stats.keys_put
        self.stats.files_created += stats.files_created
        self._keys_since_release += stats.keys_put
        if self._keys_since_release >= RELEASE_AFTER_KEYS and self.service.last_file is not None:
            self.service.last_file.release_entries()
            self._keys_since_release = 0

    def files(self) -> int:
        return len(self.service.names)

    def flush(self) -> None:
        self.service.flush()
        self._flushed = self.service.state()

    def prepare_flush(self, thorough: bool, least_pages: int) -> FlushPlan:
        """Sync the newest IndexFile when it changed; a full one was flushed when it was replaced."""
        state = self.service.state()
        if state is None or state == self._flushed:
            return FlushPlan()
        # written entries leave the RSS (the page cache keeps them); the slot table, at most 4 bytes a hash slot,
        # stays mapped: the next batch's keys would fault its pages back in under the dispatch lock
        self.service.last_file.release_entries()
        self._keys_since_release = 0

        def done() -> None:
            self._flushed = state

        return FlushPlan([self.service.last_file.path], done=done)

    def checkpoint_state(self) -> dict | None:
        state = self.service.state()
        return state.as_dict() if state is not None else None

    def recover(self, reput_from_offset: int, state: Any) -> None:
        """Put the IndexFiles back exactly as they were at the checkpoint (RocketMQ deletes the newest
        file instead, losing its entries until they are rebuilt)."""
        try:
            self.service.truncate_to(IndexState.from_dict(state) if state is not None else None)
        except Exception:
            self.service.load()  # as the files are, for the fallback that resumes from them
            raise
        self.service.resume_from(IndexResume(reput_from_offset))
        self._flushed = self.service.state()

    def resume_offset(self) -> int | None:
        """Without a checkpoint: from the last record indexed, putting only the keys of it that the files
        do not hold (`IndexService.resume_point`); None when nothing is indexed yet."""
        point = self.service.resume_point()
        self.service.resume_from(point)
        return None if point is None else point.phy_offset

    def output_end(self) -> int:
        """Records past the last one indexed are new."""
        point = self.service.resume_point()
        return 0 if point is None else point.phy_offset + 1

    @property
    def removed(self) -> list[str]:
        return self.service.removed

    def close(self) -> None:
        self.service.close()


def load_plugin(spec: DispatcherSpec, index: int) -> type:
    module_name, _, class_name = spec.name.partition(":")
    key = f"dispatchers[{index}].name"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, f"cannot import dispatcher module {module_name!r}: {e}") from None
    target: Any = module
    for part in class_name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(key, f"module {module_name!r} has no {class_name!r}")
    return target


def build_dispatchers(config: Config, output_dir: str, options: Mapping[str, Any] | None = None) -> list[Dispatcher]:
    """The configured dispatchers, in order; `index` is left out when messageIndexEnable is false. In DLedger
    mode the fence (`daemon.engine.dledgerfence`) comes first."""
    out: list[Dispatcher] = list(fence_for(config, output_dir))
    for i, spec in enumerate(config.dispatchers):
        if spec.name == ConsumeQueueDispatcher.name:
            out.append(ConsumeQueueDispatcher(config.store, output_dir))
        elif spec.name == IndexDispatcher.name:
            if config.store.message_index_enable:
                out.append(IndexDispatcher(config.store, output_dir))
        else:
            cls = load_plugin(spec, i)
            instance = cls(options=spec.options, store=config.store, output_dir=output_dir)
            if not isinstance(instance, Dispatcher):
                raise ConfigError(f"dispatchers[{i}].name",
                                  f"{spec.name} lacks dispatch(batch), flush() or close()")
            out.append(instance)
    return out
