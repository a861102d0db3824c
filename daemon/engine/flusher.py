"""The flush thread: RocketMQ's FlushConsumeQueueService for every dispatcher, then reputd's checkpoint.

Every `flushIntervalConsumeQueue` ms it takes, under the dispatch lock and between two batches, the
dispatched offset, each dispatcher's checkpoint state and the list of files to sync; it syncs them with
the lock released (fdatasync on a descriptor of its own, so dispatch goes on and a file rolled in the
meantime is still synced), and only when every dispatcher flushed everything dispatched up to that
offset does it write the checkpoint. As on the broker, a queue with fewer than
`flushConsumeQueueLeastPages` dirty pages waits, except on a thorough flush
(`flushConsumeQueueThoroughInterval`), so the checkpoint may trail by up to that interval.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from daemon.engine.checkpoint import Checkpoint, write_checkpoint
from daemon.engine.dispatchers import FlushPlan, sync_paths
from daemon.ops.logs import get_logger
from daemon.ops.periodic import Periodic
from indexcore import _kernels  # noqa: F401 (the syncfs the tests count: flusher._kernels.syncfs)
from indexcore.mappedfile import SYNCFS_MIN_FILES, sync_file, sync_file_system

if TYPE_CHECKING:
    from daemon.engine.dispatchers import Dispatcher
    from daemon.engine.session import Session

MS_PER_SECOND = 1000
# Before a thorough flush plans (under the dispatch lock), the appends its dispatchers still gather are handed to
# their writes this many queues at a time, the lock released between two slices (`release_ahead`): all of them in
# the plan held the lock 90 ms over 10,000 queues here, every thorough interval; a slice holds it about 5 ms.
RELEASE_SLICE = 512


def new_entries(paths: list[str], root: str, known: set[str]) -> set[str]:
    """The directories that gained an entry since `known` was last updated (which this updates): each
    file's own and those between it and `root` first seen now. Level by level, each new directory once: a
    walk per file cost 1.45 s of a rebuild of 100,000 queues (the `abspath` of every directory of every path)."""
    fresh = [path for path in paths if path not in known]
    known.update(fresh)
    dirs: set[str] = set()
    level = {os.path.dirname(path) for path in fresh}
    top = os.path.abspath(root)
    while level:
        dirs |= level
        up = set()
        for d in level:
            if d in known or d == root or d == os.path.dirname(d) or os.path.abspath(d) == top:
                continue
            known.add(d)
            up.add(os.path.dirname(d))
        level = up
    return dirs


def sync_new_entries(paths: list[str], root: str, known: set[str]) -> None:
    """fsync the directories that gained an entry since `known` was last updated: a file the checkpoint
    covers must still be found after a power loss, not only hold its data."""
    for d in sorted(new_entries(paths, root, known), key=len, reverse=True):
        sync_file(d, data_only=False)


def sync_file_systems(paths: list[str] | set[str], root: str | None = None) -> None:
    """syncfs once for each file system holding one of `paths`: every file and directory on it is then
    durable, what else it holds included. With `root`, a path under it counts by the entry of `root` it lies
    in (`consumequeue`, `index`): one stat each, not one per queue file and directory (18,000 of them for a
    rebuild of 8,000 queues), a file system mounted deeper down than those is not looked for."""
    if root is not None:
        prefix, entries, others = os.path.join(root, ""), set(), {root}
        n = len(prefix)
        for p in paths:
            if p.startswith(prefix):
                entries.add(p[n:].partition(os.sep)[0])
            else:
                others.add(p)
        paths = others | {os.path.join(root, entry) for entry in entries}
    devices: dict[int, str] = {}
    for path in paths:
        devices.setdefault(os.stat(path).st_dev, path)
    for path in devices.values():
        sync_file_system(path)


def prepare_flush(dispatchers: list[Dispatcher], thorough: bool, least_pages: int) -> tuple[list[FlushPlan], dict]:
    """Each dispatcher's flush plan and checkpoint state; called between two batches (under the dispatch
    lock while a loop runs). A dispatcher without `prepare_flush` is flushed here."""
    plans: list[FlushPlan] = []
    for d in dispatchers:
        prepare = getattr(d, "prepare_flush", None)
        if prepare is None:
            d.flush()
            plans.append(FlushPlan())
        else:
            plans.append(prepare(thorough, least_pages))
    states = {d.name: d.checkpoint_state() for d in dispatchers if hasattr(d, "checkpoint_state")}
    return plans, states


def release_ahead(session: Session, slice_size: int | None = None) -> None:
    """Hand the appends the dispatchers gather (`held_queues`, `release_queues`) to their writes `slice_size`
    queues at a time, each slice under the dispatch lock, so that the plan that follows has only what was gathered
    since to hand over. Writing gathered appends early is always allowed; what the checkpoint covers is still
    decided by the plan alone."""
    slice_size = slice_size or RELEASE_SLICE
    for d in session.dispatchers:
        held_queues = getattr(d, "held_queues", None)
        if held_queues is None:
            continue
        with session.lock:
            if session.poisoned:
                return
            held = held_queues()
        for start in range(0, len(held), slice_size):
            if start:
                time.sleep(0.001)  # the dispatching thread takes the lock between two slices
            with session.lock:
                if session.poisoned:
                    return
                d.release_queues(held[start : start + slice_size])


def sync_plans(plans: list[FlushPlan], output_dir: str, synced_paths: set[str], *, whole_fs: bool = False) -> None:
    """Sync the planned files and the directories that gained entries, then tell each dispatcher. With
    `whole_fs` (the last flush of a session), a flush of at least SYNCFS_MIN_FILES files syncs their file systems
    whole. The writes the syncs
    must cover are waited for first (`FlushPlan.ready`: `run`'s writer thread makes them)."""
    for plan in plans:
        if plan.ready is not None:
            plan.ready()
    paths = [path for plan in plans for path in plan.paths]
    if whole_fs and len(paths) >= SYNCFS_MIN_FILES:
        # their directories lie in the same entries of `output_dir` (`consumequeue`, `index`) as they do, so on the
        # same file systems; `synced_paths` is not kept up to date: this is the last flush of the session
        sync_file_systems(paths, output_dir)
    else:
        sync_paths(paths)  # thousands of LMQ queues: in parallel
        for plan in plans:
            sync_new_entries(plan.paths, output_dir, synced_paths)
    for plan in plans:
        if plan.done is not None:
            plan.done()


def final_checkpoint(output_dir: str, dispatchers: list[Dispatcher], offset: int) -> Checkpoint:
    """Flush everything dispatched below `offset` and checkpoint it: how `reputd rebuild` ends, so that
    the next `rebuild` or `run` goes on from `offset` (with nothing dispatched concurrently)."""
    plans, states = prepare_flush(dispatchers, True, 0)
    sync_plans(plans, output_dir, set(), whole_fs=True)
    checkpoint = Checkpoint(offset, states, int(time.time() * MS_PER_SECOND))
    write_checkpoint(output_dir, checkpoint)
    return checkpoint


class Flusher(Periodic):
    """Flushes a session's dispatchers on a timer and checkpoints what the flushes made durable."""

    def __init__(self, session: Session, on_error: Callable[[Exception], None],
                 on_success: Callable[[], None] | None = None):
        store = session.config.store
        super().__init__("reputd-flusher", store.flush_interval_consume_queue / MS_PER_SECOND)
        self.session = session
        self.least_pages = store.flush_consume_queue_least_pages
        self.thorough_interval = store.flush_consume_queue_thorough_interval / MS_PER_SECOND
        self._on_error = on_error
        self._on_success = on_success
        self._last_thorough = time.monotonic()
        self._log = get_logger(component="flusher")

    def tick(self) -> None:
        try:
            self.flush_once()
        except Exception as e:  # keep flushing; the error is reported and health goes degraded
            self._on_error(e)
        else:
            if self._on_success is not None:
                self._on_success()

    def flush_once(self, *, thorough: bool = False, whole_fs: bool = False) -> bool:
        """One flush cycle; True when it wrote a checkpoint. `whole_fs`: as `sync_plans`, for the last one."""
        s = self.session
        now = time.monotonic()
        # the clean-up asks for a checkpoint when expired files wait for one (`Session.checkpoint_wanted`)
        thorough = thorough or now - self._last_thorough >= self.thorough_interval or s.checkpoint_wanted.is_set()
        if thorough:
            s.checkpoint_wanted.clear()
        least_pages = 0 if thorough else self.least_pages
        if thorough:
            release_ahead(s)
        with s.files_lock:  # from plan to sync, the cleaner deletes none of the files planned (`daemon.engine.cleaner`)
            with s.lock:
                if s.poisoned:
                    return False
                offset = s.dispatched_offset
                plans, states = prepare_flush(s.dispatchers, thorough, least_pages)
            started = time.perf_counter()
            sync_plans(plans, s.output_dir, s.synced_paths, whole_fs=whole_fs)
        s.metrics.flush_duration.observe(time.perf_counter() - started)
        if thorough:
            self._last_thorough = now
        if not all(p.complete for p in plans):
            return False
        s.flushed_offset = offset
        if offset == s.checkpoint_offset and states == s.checkpoint_states:
            return False
        write_checkpoint(s.output_dir, Checkpoint(offset, states, int(time.time() * MS_PER_SECOND)))
        s.checkpoint_offset, s.checkpoint_states, s.checkpoint_written_at = offset, states, time.time()
        s.metrics.checkpoints.inc()
        return True
