"""The phases of one backfill, run by the driver (`Phases`): job 1 decodes every range and checks the chain
(re-reading where it breaks), job 2 runs every writer over the staged runs, balanced over the tasks, then
the commit checks the output and links the staged files into place."""

from __future__ import annotations

import heapq
import itertools
import os
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from pyarrow import fs

from daemon.backfill.catalog import catalog_filesystem, file_name, write_marker
from daemon.backfill.commit import (
    PRESENT,
    commit_index_file,
    commit_queues,
    distinct_count,
    file_counts,
    staging_root,
)
from daemon.backfill.interrupt import CommitInterrupted, commit_where
from daemon.backfill.outputs import first_real_unit
from daemon.backfill.plan import (
    BackfillError,
    IndexLayout,
    ReadPlan,
    check_existing_index,
    index_file_names,
    plan_index_files,
    walk_ranges,
)
from daemon.backfill.queuewriter import QueueWork
from daemon.backfill.ranges import DecodeSettings, RangeOutcome, RangeTask
from daemon.backfill.source import S3Options, SegmentListing
from daemon.backfill.stage import QUEUE_BUCKETS
from daemon.backfill.tasks import (
    CATALOG_FILES,
    INDEX_FILES,
    QUEUES,
    WorkFile,
    WriterSettings,
    decode_partition,
    write_partition,
)
from daemon.backfill.writers import (
    CatalogWork,
    Fault,
    IndexWork,
    StagedIndexChunk,
    WriteStats,
    assemble_index_file,
    create_shared_index_file,
)
from daemon.config import Config
from indexcore.consumequeue import CONSUME_QUEUE_DIR
from indexcore.indexservice import INDEX_DIR

if TYPE_CHECKING:
    from daemon.backfill.brokerwatch import BrokerWatch
    from daemon.backfill.summary import BackfillSummary

WRITE_GROUPS_PER_SLOT = 2
COMMIT_PROGRESS_S = 5.0  # a commit says how far it got this often


def balanced(weights: Mapping, parts: int) -> list[list]:
    """Keys in at most `parts` groups of about equal weight (the heaviest first, each to the lightest group)."""
    groups: list[list] = [[] for _ in range(min(parts, len(weights)))]
    heap = [(0, i) for i in range(len(groups))]
    for key, n in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0])):
        load, i = heapq.heappop(heap)
        groups[i].append(key)
        heapq.heappush(heap, (load + n, i))
    return [g for g in groups if g]


def queue_work(ranges: Sequence[RangeOutcome], dirs: tuple[str, ...], parts: int) -> list[QueueWork]:
    """Whole queues in at most `parts` spans of queue buckets balanced by units: a span is one slice of each
    range's staged units (`stage.py` stages them in bucket order), so each task reads only its own."""
    units = np.zeros(QUEUE_BUCKETS, dtype=np.int64)
    for o in ranges:
        for b, n in o.bucket_units.items():
            units[b] += n
    total = int(units.sum())
    if total == 0:
        return []
    before = np.concatenate(([0], np.cumsum(units)))
    # cut where the units before a bucket pass each part's share; a bucket heavier than a share is a span alone
    cuts = np.searchsorted(before, total * np.arange(1, parts) / parts, side="left")
    edges = sorted({0, QUEUE_BUCKETS, *cuts.tolist()})
    return [QueueWork(dirs, (a, b)) for a, b in itertools.pairwise(edges) if before[b] > before[a]]


# keys of an IndexFile one task puts: a full file (20,000,000 keys by default) is cut into chunks that run in
# parallel, so that no write task takes seconds alone while the others are done (`writers.py`)
INDEX_CHUNK_KEYS = 2_000_000


def index_work(ranges: Sequence[RangeOutcome], layout: IndexLayout, shared_dir: str = "",
               chunk_keys: int | None = None) -> list[IndexWork]:
    """The tasks of the IndexFiles, with the ranges that hold their keys (and the key before them, their seed):
    one per file, or one per chunk of `chunk_keys` keys of a larger one, whose chunks share a file in
    `shared_dir`."""
    chunk_keys = chunk_keys or INDEX_CHUNK_KEYS
    work = []
    for plan in layout.files:
        lo = max(0, plan.key_start - 1)
        sources = tuple((o.stage_dir, layout.key_base[o.number], o.keys) for o in ranges
                        if o.keys and layout.key_base[o.number] < plan.key_end
                        and layout.key_base[o.number] + o.keys > lo)
        keys = plan.key_end - plan.key_start
        if keys <= chunk_keys or not shared_dir:
            work.append(IndexWork(plan, sources))
            continue
        shared = os.path.join(shared_dir, f"{plan.number:010d}")
        cuts = [*range(plan.key_start, plan.key_end, chunk_keys), plan.key_end]
        work.extend(IndexWork(plan, sources, (a, b), shared) for a, b in itertools.pairwise(cuts))
    return work


def catalog_work(ranges: Sequence[RangeOutcome], dirs: tuple[str, ...], parts: int, name: str,
                 covered: tuple[tuple[int, int], ...]) -> list[CatalogWork]:
    """(topic, day) partitions in `parts` groups balanced by rows."""
    rows: dict[tuple[str, int], int] = {}
    for o in ranges:
        for g, n in o.catalog_rows.items():
            rows[g] = rows.get(g, 0) + n
    return [CatalogWork(dirs, tuple(sorted(g)), name, covered) for g in balanced(rows, parts)]


class Phases:
    """The phases of one backfill, sharing the config, the Spark context and the summary."""

    def __init__(self, config: Config, sc, out: str, job_id: str, summary: BackfillSummary,
                 settings: DecodeSettings, say, log, fault: Fault | None, s3: S3Options):
        self.config = config
        self.sc = sc
        self.out = out
        self.job_id = job_id
        self.summary = summary
        self.settings = settings
        self.say = say
        self.log = log
        self.fault = fault
        self.before_commit: Callable[[], None] = lambda: None  # from here a signal stops the commit between files
        self.stop_requested: Callable[[], bool] = lambda: False  # a signal came: stop the commit between two files
        self.broker: BrokerWatch | None = None  # the output's broker lock: asked before each file is put in place
        self.s3 = s3
        self.work_files = 0  # the work items of each job, in a file of the staging root
        self.catalog_covered: tuple[tuple[int, int], ...] = ()
        self.index_plans: list = []
        self.outcomes: dict[int, RangeOutcome] = {}
        self.all_outcomes: list[RangeOutcome] = []  # every decode task's, re-reads included

    def _timed(self, phase: str, t0: float) -> None:
        self.summary.phases[phase] = self.summary.phases.get(phase, 0.0) + time.perf_counter() - t0

    def _work(self, items: Sequence) -> WorkFile:
        """A job's work items, in a file every executor reads (the staging root is on the output's file
        system, shared by the driver and the executors)."""
        root = staging_root(self.out, self.job_id)
        os.makedirs(root, exist_ok=True)
        self.work_files += 1
        return WorkFile.write(os.path.join(root, f"work-{self.work_files}.pickle"), items)

    def _job(self, work: Sequence, run) -> list:
        """One Spark job, a partition per work item: `run` gets the item's number (generated in the Python
        worker: the JVM sends a task nothing) and yields pickled results, unpickled here. An RDD job, not a
        DataFrame's: no SQL session or query planning, which cost the driver JVM seconds of a short backfill,
        and no Arrow conversion of rows that are a few hundred bytes each."""
        rows = self.sc.parallelize(range(len(work)), len(work)).mapPartitions(run).collect()
        self.summary.bytes_to_jvm += sum(len(r) for r in rows)
        return [pickle.loads(r) for r in rows]

    def _decode_job(self, work: Sequence) -> list[RangeOutcome]:
        # each task stages its range's output as files and hands back only the outcome (nothing is cached)
        found = self._job(work, decode_partition(self.settings, self._work(work), self.fault))
        self.all_outcomes.extend(found)
        for o in found:
            self.outcomes[o.number] = o
        return found

    def decode(self, tasks: Sequence[RangeTask], listing: SegmentListing, start: int, to_offset: int | None,
               from_given: bool) -> ReadPlan:
        """Job 1: decode every range in parallel; re-read where the chain breaks; the read plan."""
        t0 = time.perf_counter()
        segments = len({t.segment for t in tasks})
        self.say(f"decoding {len(tasks)} range{'s' * (len(tasks) != 1)} of {segments} segment{'s' * (segments != 1)}")
        self._decode_job(tasks)
        self._timed("decode", t0)
        t0 = time.perf_counter()
        on_corruption = self.config.reput.on_corruption
        while True:
            plan, rereads = walk_ranges(tasks, self.outcomes, listing.segment_size, listing.missing, start, to_offset,
                                        on_corruption, from_given)
            if plan is not None:
                break
            self.log.info("ranges_reread", ranges=[r.tasks[0].number for r in rereads],
                          starts=[r.start for r in rereads])
            self.say(f"re-reading {len(rereads)} ranges whose first record was not where the previous one ended")
            found = self._decode_job(rereads)
            self.summary.reread_ranges += len(found)
        s = self.summary
        s.end_offset = plan.end_offset
        s.pending = plan.pending
        s.segments = plan.segments
        s.messages = s.new_messages = plan.messages  # every file is written anew from `start`
        s.bytes_read_remote = sum(o.bytes_read for o in self.all_outcomes)
        s.staged_bytes = sum(o.staged_bytes for o in self.all_outcomes)
        s.decode_task_seconds = sum(o.seconds for o in self.all_outcomes)
        for lo, hi, error in plan.skipped:
            s.skipped.append((lo, hi, str(error)))
            self.log.warning("segment_skipped", file=getattr(error, "path", None), skipped_from=lo, skipped_to=hi,
                             skipped_bytes=hi - lo, error=str(error))
        for n in plan.ranges:  # the broker logs each such record and writes no extra unit, as rebuild does
            outcome = self.outcomes[n]
            for offset, topic in outcome.count_mismatch:
                self.log.warning("multi_dispatch_count_mismatch", commit_log_offset=offset, topic=topic)
            if outcome.count_mismatch_omitted:
                self.log.warning("multi_dispatch_count_mismatch", range_begin=outcome.seg_start + outcome.begin,
                                 range_end=outcome.seg_start + outcome.end, omitted=outcome.count_mismatch_omitted)
        self.say(f"decoded {s.messages:,} messages in {s.segments} segment{'s' * (s.segments != 1)}, "
                 f"[{s.start_offset}, {s.end_offset})")
        self._timed("plan", t0)
        return plan

    def write(self, plan: ReadPlan, build_cq: bool, build_index: bool, catalog: str | None) -> None:
        """Job 2: every writer in one job, each task reading the staged runs of its share, then the commit."""
        t0 = time.perf_counter()
        s = self.summary
        ranges = [self.outcomes[n] for n in plan.ranges]
        dirs = tuple(o.stage_dir for o in ranges)
        work: list = []
        if ranges and build_index:
            layout = plan_index_files(ranges, self.config.store.max_index_num)
            self.index_plans = layout.files
            shared_dir = os.path.join(staging_root(self.out, self.job_id), "index-shared")
            index_tasks = index_work(ranges, layout, shared_dir)
            store = self.config.store
            for path in sorted({w.shared_path for w in index_tasks if w.chunk is not None}):
                create_shared_index_file(path, store.max_hash_slot_num, store.max_index_num)
            work.extend(index_tasks)  # first: an IndexFile's tasks are the longest
        # the queues and the catalog in twice as many groups as slots: smaller tasks after the IndexFiles' long
        # ones fill the slots evenly, so that the job does not end on one task running alone
        if ranges and build_cq:
            work.extend(queue_work(ranges, dirs, WRITE_GROUPS_PER_SLOT * s.partitions))
        if ranges and catalog is not None:
            work.extend(catalog_work(ranges, dirs, WRITE_GROUPS_PER_SLOT * s.partitions,
                                     file_name(s.start_offset, s.end_offset), self.catalog_covered))
        results: dict[str, list] = {QUEUES: [], INDEX_FILES: [], CATALOG_FILES: []}
        if work:
            store = self.config.store
            settings = WriterSettings(self.out, self.job_id, store.mapped_file_size_consume_queue,
                                      store.max_hash_slot_num, store.max_index_num, catalog, self.s3,
                                      self.settings.catalog_body)
            items = self._work(work)
            self.say(f"writing {len(work)} parts in one job")
            for kind, value in self._job(work, write_partition(settings, items, self.fault)):
                results[kind].append(value)
        self._timed("write", t0)
        self._broker_check()
        self.before_commit()
        t0 = time.perf_counter()
        self._commit(results, build_cq, build_index, catalog)
        self._timed("commit", t0)

    def _commit(self, results: dict[str, list], build_cq: bool, build_index: bool, catalog: str | None) -> None:
        """Check the output, then link every staged file into place (the IndexFiles under their names)."""
        s = self.summary
        staged = [f for _, files in results[INDEX_FILES] for f in files]
        chunks: dict[int, list[StagedIndexChunk]] = {}
        for f in staged:
            if isinstance(f, StagedIndexChunk):
                chunks.setdefault(f.number, []).append(f)
        plans = {p.number: p for p in self.index_plans}
        store = self.config.store
        staged_files = sorted([f for f in staged if not isinstance(f, StagedIndexChunk)]
                              + [assemble_index_file(c, store.max_hash_slot_num, store.max_index_num,
                                                     plans[n].key_start) for n, c in chunks.items()],
                              key=lambda f: f.number)
        names = index_file_names([f.creator_ts for f in staged_files])
        queues = [q for _, staged in results[QUEUES] for q in staged]
        index_dir = os.path.join(self.out, INDEX_DIR)
        check_existing_index(index_dir, names, s.end_offset)
        self._check_existing_queues(queues)
        stats = WriteStats()
        for part, _ in results[QUEUES] + results[INDEX_FILES]:
            stats.add(part)
        if stats.gap_blanks:
            self.log.warning("queue_offsets_blanked", blanks=stats.gap_blanks,
                             detail="units of records the CommitLog no longer holds, blank at their queue offsets")
        s.write_task_seconds = stats.seconds + sum(seconds for _, seconds in results[CATALOG_FILES])
        # an output that has some of these files already (a rerun): the messages new to it are those whose units
        # or keys this commit puts (newMessages, 0 when it held them all, as `rebuild` counts); into an empty
        # output, or merged into a daemon's queues that start after the range, every message is
        merging = self._output_has_any(queues, index_dir, names)
        new_offsets = [] if merging else None
        steps = CommitSteps(self, len(queues), len(names), merging, catalog is not None)
        counts = commit_queues(queues, os.path.join(self.out, CONSUME_QUEUE_DIR), new_offsets,
                               lambda n: steps.between(n, 0))
        if build_cq:
            s.files["consumequeue"] = sum(counts.values())
            self.log.info("consumequeues_written", queues=stats.queues, units=stats.units, **counts)
        index_counts = file_counts()
        for n, (f, name) in enumerate(zip(staged_files, names, strict=True)):
            steps.between(len(queues), n)
            index_counts[commit_index_file(f.path, os.path.join(index_dir, name), new_offsets,
                                           store.max_hash_slot_num)] += 1
        steps.put(len(queues), len(names))
        if new_offsets is not None and counts[PRESENT] + index_counts[PRESENT]:  # a rerun: what it put is new
            s.new_messages = distinct_count(new_offsets)
        if build_index:
            s.files["index"] = len(names)
            self.log.info("index_files_written", files=len(names), keys=stats.keys, **index_counts)
        if catalog is not None:
            steps.between(len(queues), len(names))
            filesystem, base = catalog_filesystem(catalog, self.s3)
            rows = 0
            base = base.rstrip("/")
            for written, _ in results[CATALOG_FILES]:
                for staged, relative, n in written:
                    final = f"{base}/{relative}"
                    filesystem.create_dir(final.rsplit("/", 1)[0], recursive=True)
                    if filesystem.get_file_info(final).type != fs.FileType.NotFound:
                        filesystem.delete_file(final)  # this range's own file, left by a commit a kill stopped
                    filesystem.move(staged, final)
                    rows += n
            filesystem.create_dir(base, recursive=True)
            write_marker(filesystem, base, s.start_offset, s.end_offset)
            s.files["catalog"] = sum(len(w) for w, _ in results[CATALOG_FILES])
            self.log.info("catalog_written", path=catalog, files=s.files["catalog"], rows=rows)

    def _broker_check(self) -> None:
        if self.broker is not None:
            self.broker.check()

    def _output_has_any(self, queues, index_dir: str, names: list[str]) -> bool:
        """Whether any file this commit puts is in the output already (a queue directory, an IndexFile)."""
        root = os.path.join(self.out, CONSUME_QUEUE_DIR)
        return any(os.path.isdir(os.path.join(root, q.topic, str(q.queue_id))) for q in queues) or any(
            os.path.exists(os.path.join(index_dir, name)) for name in names)

    def _check_existing_queues(self, queues) -> None:
        """A queue already in the output must be a daemon's that started at or after the range's end (its
        first unit lies there) or this backfill's own (a rerun: its first unit is ours); anything else,
        older data or an overlap, is refused here, before any file is linked."""
        root = os.path.join(self.out, CONSUME_QUEUE_DIR)
        if not os.path.isdir(root):
            return
        end = self.summary.end_offset
        for q in sorted(queues, key=lambda q: (q.topic, q.queue_id)):
            directory = os.path.join(root, q.topic, str(q.queue_id))
            if not os.path.isdir(directory):
                continue
            found = first_real_unit(directory)
            if found is not None and found[1] < end and found[1] != q.first_phy:
                raise BackfillError(f"{found[0]}: the queue holds a unit for CommitLog offset {found[1]}, inside or "
                                    f"below the backfilled range [{self.summary.start_offset}, {end}); backfill "
                                    f"into an empty output, or below the files of a daemon that started at or "
                                    f"after --to")


class CommitSteps:
    """How far a commit got, asked between two of its files (`between`): a broker that took the output's lock
    or a signal stops it there, where no queue or IndexFile is half put; it says what it does as it starts, and
    every COMMIT_PROGRESS_S how far it got and the time left at its pace."""

    def __init__(self, job: Phases, queues: int, index_files: int, merging: bool, catalog: bool):
        self.job = job
        self.of = (queues, index_files)
        self.catalog = catalog
        job.log.info("backfill_commit_started", queues=queues, index_files=index_files, output=job.out,
                     merging=merging)
        what = (", checking them against the files there and filling those files' blank units (only the bytes "
                "this backfill wrote are read)" if merging else "")
        job.say(f"committing: putting the files of {queues:,} queues and {index_files:,} "
                f"IndexFile{'s' * (index_files != 1)} in place in {job.out}{what}; a signal now stops it between two "
                "queues")
        self.started = self.said = time.monotonic()

    def put(self, queues: int, index_files: int) -> None:
        if self.job.broker is not None:
            self.job.broker.put(queues, self.of[0], index_files, self.of[1])

    def between(self, queues: int, index_files: int) -> None:
        """`queues` and `index_files` are in place; raise to stop before the next."""
        self.put(queues, index_files)
        self.job._broker_check()
        counts = (queues, self.of[0], index_files, self.of[1])
        if self.job.stop_requested():
            self.job.log.warning("backfill_interrupted", stopped=commit_where(*counts), output=self.job.out)
            raise CommitInterrupted(self.job.out, counts, self.catalog)
        now = time.monotonic()
        if now - self.said >= COMMIT_PROGRESS_S and 0 < queues < self.of[0]:
            self.said = now
            left = (now - self.started) * (self.of[0] - queues) / queues
            self.job.say(f"committed {queues:,} of {self.of[0]:,} queues in {now - self.started:.0f} s, about "
                         f"{left:.0f} s left for the rest")
