"""The Spark job: a thin adapter that runs the phases as Spark stages and turns Spark's failures into
one-line errors.

    phase 1  decode      one task per segment -> RowChunks (cached) + one SegmentOutcome per segment
             plan        driver: what is dispatched (walk_outcomes), IndexFile roll points and names
    phase 2  consumequeue  pieces by (topic, queue) -> sorted -> one task writes each queue's files
    phase 3  index       keys by file -> sorted -> one task builds each IndexFile
             catalog     optional: the rows as Parquet, partitioned by topic and date

Segments are read by mapping their files, so every executor must see the CommitLog and the output at
the same POSIX path (a local disk with `local[*]`, a shared mount on a cluster).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np
from pyspark import StorageLevel, TaskContext
from pyspark.sql import SparkSession
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from daemon.backfill.commit import attempt_dir, remove_tree, staging_root
from daemon.backfill.plan import (
    BackfillError,
    ChunkRef,
    KeyOwner,
    ReadPlan,
    check_existing_index,
    chunk_refs,
    keys_per_file,
    plan_index_files,
    plan_segments,
    walk_outcomes,
)
from daemon.backfill.rows import ReadSettings, RowChunk, SegmentOutcome, decode_segment_rows
from daemon.backfill.writers import (
    CATALOG_COLUMNS,
    FILE_PLAN,
    Attempt,
    Fault,
    WriteStats,
    catalog_rows,
    index_partition,
    index_pieces,
    queue_partition,
    queue_pieces,
    write_index_files,
    write_queues,
)
from daemon.config import Config
from daemon.dispatchers import ConsumeQueueDispatcher, IndexDispatcher
from daemon.logs import get_logger
from daemon.rebuild import RebuildSummary
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CONSUME_QUEUE_DIR, CQ_UNIT_DTYPE
from indexcore.errors import StoreError
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import list_queue_files
from indexcore.reader import CommitLog

DEFAULT_MASTER = "local[*]"
MIN_JAVA = 17
JAVA_INSTALL_HINT = (f"Spark needs a Java {MIN_JAVA} (or later) runtime: install one (Debian/Ubuntu: apt-get "
                     f"install openjdk-{MIN_JAVA}-jre-headless; RHEL: dnf install java-{MIN_JAVA}-openjdk-headless) "
                     f"or set JAVA_HOME to it")
_JAVA_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')
_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Fault|Failed)): (.+)$")


@dataclass(slots=True)
class BackfillSummary(RebuildSummary):
    """A rebuild's summary plus where and how Spark ran it."""

    master: str = ""
    partitions: int = 0
    catalog: str | None = None
    phases: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            **RebuildSummary.as_dict(self), "master": self.master, "partitions": self.partitions,
            "phaseSeconds": {k: round(v, 3) for k, v in self.phases.items()}, "catalog": self.catalog,
        }


# --- Java and the Spark session ----------------------------------------------------------------------

def check_java(env: Mapping[str, str] | None = None) -> str:
    """The `java` Spark will launch (JAVA_HOME's, else the one on PATH), checked to be Java 17 or later."""
    env = os.environ if env is None else env
    home = env.get("JAVA_HOME")
    if home:
        java = os.path.join(home, "bin", "java")
        if not os.access(java, os.X_OK):
            raise BackfillError(f"JAVA_HOME is {home}, but {java} is not an executable file; {JAVA_INSTALL_HINT}")
    else:
        java = shutil.which("java", path=env.get("PATH", os.defpath))
        if java is None:
            raise BackfillError(f"no Java runtime found (JAVA_HOME is not set and there is no `java` on PATH); "
                                f"{JAVA_INSTALL_HINT}")
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, check=False)
    except OSError as e:
        raise BackfillError(f"{java} does not run ({e}); {JAVA_INSTALL_HINT}") from None
    match = _JAVA_VERSION.search(out.stderr + out.stdout)
    if match:
        major = int(match[1]) if match[1] != "1" else int(match[2] or 0)  # "1.8.0" is Java 8
        if major < MIN_JAVA:
            raise BackfillError(f"{java} is Java {major}; {JAVA_INSTALL_HINT}")
    return java


def create_session(master: str = DEFAULT_MASTER, conf: Mapping[str, str] | None = None):
    """A SparkSession for the backfill. Local workers run this interpreter (so they import reputd and
    numpy from the same environment); on a cluster, PYSPARK_PYTHON or spark.pyspark.python decides."""
    check_java()
    if master.startswith("local") and "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = SparkSession.builder.appName("reputd-backfill").master(master)
    settings = {"spark.ui.showConsoleProgress": "true", "spark.log.level": "FATAL",
                "spark.python.worker.reuse": "true"}
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        return builder.getOrCreate()
    except Exception as e:  # the JVM did not come up: PySparkRuntimeError, Py4JError...
        raise BackfillError(f"Spark did not start with master {master}: {spark_error_line(e)}") from None


def spark_error_line(error: BaseException) -> str:
    """The Python exception a task died of (the last `Name: message` line of the worker's traceback),
    or the first line of what Spark said; never a stack trace."""
    text = str(error)
    found = None
    for line in text.splitlines():
        match = _PY_ERROR.match(line.strip())
        if match and not match[1].startswith(("org.", "java.", "py4j.", "scala.")):
            found = f"{match[1].rsplit('.', 1)[-1]}: {match[2]}"
    if found:
        return found
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return first[:500]


def _task_attempt() -> Attempt:
    ctx = TaskContext.get()
    return Attempt(ctx.partitionId(), ctx.taskAttemptId(), ctx.attemptNumber())


class BackfillTaskError(RuntimeError):
    """What a task died of, with the phase and partition: the one line the driver reports."""


# --- the job -----------------------------------------------------------------------------------------

def commit_log_dirs(config: Config, segments: str | None) -> tuple[str, ...]:
    """The CommitLog directories: `--segments` (paths or file:// URIs, comma-separated) or the store's."""
    if segments is None:
        return config.store.commit_log_dirs
    dirs = []
    for part in (p.strip() for p in segments.split(",")):
        if not part:
            continue
        uri = urlparse(part)
        if uri.scheme in ("", "file"):
            path = uri.path if uri.scheme else part
            if uri.scheme and uri.netloc not in ("", "localhost"):
                raise ValueError(f"--segments {part}: a file:// URI names a local path (file:///dir), not host "
                                 f"{uri.netloc}")
            dirs.append(os.path.abspath(os.path.expanduser(path)))
        else:
            raise ValueError(f"--segments {part}: {uri.scheme}:// cannot be mapped; segments are read by mapping "
                             f"their files, so give a POSIX path every executor sees (a local disk, or NFS, CephFS, "
                             f"Lustre, a FUSE mount of {uri.scheme})")
    if not dirs:
        raise ValueError("--segments names no directory")
    return tuple(dirs)


def backfill(config: Config, *, spark=None, master: str | None = None, segments: str | None = None,
             from_offset: int | None = None, to_offset: int | None = None, partitions: int | None = None,
             catalog: str | None = None, spark_conf: Mapping[str, str] | None = None,
             progress: Callable[[str], None] | None = None, fault: Fault | None = None) -> BackfillSummary:
    """Build consumequeue/ and index/ for [from, to) of the CommitLog with Spark: the files `rebuild`
    writes for the same range and settings, whatever the partitioning. `spark`: an existing session
    (kept open); otherwise one is created with `master` and stopped at the end."""
    log = get_logger(command="backfill")
    if to_offset is not None and from_offset is not None and to_offset <= from_offset:
        raise ValueError(f"--to {to_offset} must be greater than --from {from_offset}")
    out = os.path.abspath(config.output.dir)
    commit_log = CommitLog(commit_log_dirs(config, segments), config.store.mapped_file_size_commit_log)
    start = commit_log.min_offset if from_offset is None else from_offset
    if commit_log.segments and start < commit_log.min_offset:
        log.warning("offset_below_oldest_segment", requested=start, resumed_at=commit_log.min_offset)
        start = commit_log.min_offset
    names = [d.name for d in config.dispatchers]
    build_cq = ConsumeQueueDispatcher.name in names
    build_index = IndexDispatcher.name in names and config.store.message_index_enable
    others = [n for n in names if n not in (ConsumeQueueDispatcher.name, IndexDispatcher.name)]
    if others:
        log.warning("dispatchers_not_run", dispatchers=others, reason="backfill builds consumequeue and index only")
    tasks = plan_segments(commit_log, start, to_offset)
    owns_session = spark is None
    master = master or DEFAULT_MASTER
    summary = BackfillSummary(start_offset=start, end_offset=start, catalog=catalog)
    started = time.perf_counter()
    say = progress or (lambda _text: None)
    if spark is None:
        spark = create_session(master, spark_conf)
        summary.phases["startup"] = time.perf_counter() - started
    sc = spark.sparkContext
    summary.master = sc.master
    summary.partitions = partitions or max(1, sc.defaultParallelism)
    job_id = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
    stage_root = staging_root(out, job_id)
    log.info("backfill_started", segments=len(tasks), from_offset=start, to_offset=to_offset, output=out,
             master=summary.master, partitions=summary.partitions, job=job_id)
    job = _Job(config, commit_log, out, job_id, summary, say, log, fault)
    rows = None
    try:
        if catalog is not None:
            _check_catalog_absent(sc, catalog)
        if tasks:
            rows = job.decode(sc, tasks, build_index, catalog is not None)
            plan = job.read_plan(rows, start, to_offset, from_offset is not None)
            dispatched = rows.flatMap(_planned(job.outcomes, plan.included))
            index_plans = job.plan_index(dispatched, build_index, plan)
            if build_cq:
                job.check_existing_queues(dispatched)
                job.write_consume_queues(dispatched, summary.partitions)
            if build_index:
                job.write_index(sc, dispatched, index_plans, summary.partitions)
            if catalog is not None:
                job.write_catalog(spark, dispatched, catalog)
    except Exception as e:
        if isinstance(e, StoreError | ValueError | OSError):
            raise
        if type(e).__module__.startswith(("py4j", "pyspark")):
            raise BackfillError(f"backfill failed in Spark: {spark_error_line(e)}") from None
        raise
    finally:
        if rows is not None:
            with contextlib.suppress(Exception):  # the context may be gone
                rows.unpersist()
        remove_tree(stage_root)
        if owns_session:
            spark.stop()
        summary.seconds = time.perf_counter() - started
    if summary.pending is not None:
        log.warning("incomplete_record_at_end", error=str(summary.pending))
    log.info("backfill_finished", **summary.as_dict())
    return summary


def first_real_unit(directory: str) -> tuple[str, int] | None:
    """The file and CommitLog offset of a queue's first unit that is neither pre-blank nor unwritten."""
    for _, path in list_queue_files(directory):
        units = np.fromfile(path, dtype=CQ_UNIT_DTYPE)
        blank = ((units["commit_log_offset"] == 0) & (units["msg_size"] == BLANK_UNIT_MSG_SIZE)
                 & (units["tags_code"] == 0))
        real = np.flatnonzero(~blank & (units["msg_size"] > 0))
        if len(real):
            return path, int(units["commit_log_offset"][real[0]])
    return None


def _check_catalog_absent(sc, catalog: str) -> None:
    """Refuse an existing catalog before anything is written (Spark would only refuse at the very end)."""
    jvm = sc._jvm
    path = jvm.org.apache.hadoop.fs.Path(catalog)
    if path.getFileSystem(sc._jsc.hadoopConfiguration()).exists(path):
        raise BackfillError(f"--catalog {catalog}: already exists; give a new path")


def _planned(outcomes: Sequence[SegmentOutcome], included: frozenset[int]) -> Callable[[object], Iterator[RowChunk]]:
    """The chunks phase 1 reported, as it reported them. Spark recomputes a lost cached partition; if the
    broker has appended to the newest segment since, the recomputed last window holds more records."""
    limits = {o.number: (len(o.windows), o.windows[-1].records if o.windows else 0)
              for o in outcomes if o.number in included}

    def keep(item) -> Iterator[RowChunk]:
        if isinstance(item, RowChunk) and item.segment in limits:
            windows, last_records = limits[item.segment]
            if item.window < windows - 1:
                yield item
            elif item.window == windows - 1:
                yield item.head(last_records) if item.records > last_records else item

    return keep


class _Job:
    """The phases, sharing the job's settings; each method runs one or two Spark jobs."""

    def __init__(self, config: Config, commit_log: CommitLog, out: str, job_id: str, summary: BackfillSummary,
                 say: Callable[[str], None], log, fault: Fault | None):
        self.config = config
        self.commit_log = commit_log
        self.out = out
        self.job_id = job_id
        self.summary = summary
        self.say = say
        self.log = log
        self.fault = fault
        self.outcomes: list[SegmentOutcome] = []
        self.refs: list[ChunkRef] = []  # the dispatched chunks, numbered by index keys (plan_index)

    def _timed(self, phase: str, t0: float) -> None:
        self.summary.phases[phase] = self.summary.phases.get(phase, 0.0) + time.perf_counter() - t0

    def decode(self, sc, tasks, build_index: bool, keep_strings: bool):
        """Phase 1: decode every segment in parallel; rows are cached for the later phases."""
        t0 = time.perf_counter()
        store = self.config.store
        settings = ReadSettings(store.check_crc_on_recover, store.max_message_size, store.message_delay_level,
                                self.config.reput.batch_bytes, build_index, keep_strings)
        commit_log = self.commit_log
        self.say(f"phase 1/3: decoding {len(tasks)} segments")

        def run(iterator):
            for task in iterator:
                try:
                    yield from decode_segment_rows(task, commit_log, settings)
                except Exception as e:
                    raise BackfillTaskError(f"decode task for {task.path}: {e}") from e

        rows = sc.parallelize(tasks, len(tasks)).mapPartitions(run).persist(StorageLevel.MEMORY_AND_DISK)
        self.outcomes = sorted(rows.filter(lambda item: isinstance(item, SegmentOutcome)).collect(),
                               key=lambda o: o.number)
        self._timed("decode", t0)
        return rows

    def read_plan(self, rows, start: int, to_offset: int | None, from_given: bool) -> ReadPlan:
        plan = walk_outcomes(self.outcomes, self.commit_log, start, to_offset, self.config.reput.on_corruption,
                             from_given)
        included = plan.included
        s = self.summary
        s.end_offset = plan.end_offset
        s.pending = plan.pending
        s.segments = len(plan.segments)
        s.messages = sum(o.records for o in self.outcomes if o.number in included)
        for lo, hi, error in plan.skipped:
            s.skipped.append((lo, hi, str(error)))
            self.log.warning("segment_skipped", file=getattr(error, "path", None), skipped_from=lo, skipped_to=hi,
                             skipped_bytes=hi - lo, error=str(error))
        self.say(f"decoded {s.messages:,} messages in {s.segments} segments, [{s.start_offset}, {s.end_offset})")
        return plan

    def plan_index(self, dispatched, build_index: bool, plan: ReadPlan):
        if not build_index:
            return []
        t0 = time.perf_counter()
        self.refs = chunk_refs(self.outcomes, plan.included)
        index_num = self.config.store.max_index_num

        def lookup(wanted):
            def owners(chunk):
                ends = chunk.key_count.cumsum()
                for local in wanted.get(chunk.chunk_id, ()):
                    r = int((ends > local).argmax())
                    nxt = int(chunk.store_timestamp[r + 1]) if r + 1 < chunk.records else None
                    yield ((chunk.segment, chunk.window, local),
                           KeyOwner(int(chunk.phy_offset[r]), int(chunk.store_timestamp[r]), bool(ends[r] > local + 1),
                                    nxt))

            return dict(dispatched.filter(lambda c: c.chunk_id in wanted).flatMap(owners).collect())

        plans = plan_index_files(self.refs, index_num, lookup)
        check_existing_index(os.path.join(self.out, INDEX_DIR), plans, self.summary.end_offset)
        self._timed("plan", t0)
        return plans

    def check_existing_queues(self, dispatched) -> None:
        """A queue already in the output must be a daemon's that started at or after the range's end (its
        first unit lies there) or this backfill's own (a rerun: its first unit is ours); anything else,
        older data or an overlap, is refused here, before any file is written."""
        root = os.path.join(self.out, CONSUME_QUEUE_DIR)
        if not os.path.isdir(root):
            return
        existing = {(t, int(q)) for t in os.listdir(root) if os.path.isdir(os.path.join(root, t))
                    for q in os.listdir(os.path.join(root, t)) if q.isdigit() and os.listdir(os.path.join(root, t, q))}
        if not existing:
            return

        def firsts(chunk):
            for (topic, qid, phy), _units in queue_pieces(chunk):
                if (topic, qid) in existing:
                    yield (topic, qid), phy

        ours = dispatched.flatMap(firsts).reduceByKey(min).collectAsMap()
        end = self.summary.end_offset
        for (topic, qid), our_first in sorted(ours.items()):
            directory = os.path.join(root, topic, str(qid))
            found = first_real_unit(directory)
            if found is not None and found[1] < end and found[1] != our_first:
                raise BackfillError(f"{found[0]}: the queue holds a unit for CommitLog offset {found[1]}, inside or "
                                    f"below the backfilled range [{self.summary.start_offset}, {end}); backfill "
                                    f"into an empty output, or below the files of a daemon that started at or "
                                    f"after --to")

    def write_consume_queues(self, dispatched, partitions: int) -> None:
        """Phase 2: one task per group of queues, each queue whole and in CommitLog order."""
        t0 = time.perf_counter()
        self.say(f"phase 2/3: writing ConsumeQueues in {partitions} partitions")
        out, job_id, fault = self.out, self.job_id, self.fault
        file_size = self.config.store.mapped_file_size_consume_queue

        def run(iterator):
            attempt = _task_attempt()
            stage = attempt_dir(out, job_id, "cq", attempt.partition, attempt.attempt_id)
            try:
                yield write_queues(iterator, output_dir=out, stage_dir=stage, file_size=file_size, attempt=attempt,
                                   fault=fault)
            except Exception as e:
                raise BackfillTaskError(f"consumequeue task {attempt.partition}: {e}") from e
            finally:
                remove_tree(stage)

        pieces = dispatched.flatMap(queue_pieces).repartitionAndSortWithinPartitions(partitions, queue_partition)
        stats = WriteStats()
        for s in pieces.mapPartitions(run).collect():
            stats.add(s)
        if stats.out_of_order:
            self.log.warning("logic_queue_order_maybe_wrong", units=stats.out_of_order)
        self.summary.files["consumequeue"] = sum(stats.files.values())
        self.log.info("consumequeues_written", queues=stats.queues, units=stats.units, **stats.files)
        self._timed("consumequeue", t0)

    def write_index(self, sc, dispatched, plans: Sequence, partitions: int) -> None:
        """Phase 3: each IndexFile built whole by one task, files in parallel."""
        if not plans:
            self.summary.files["index"] = 0
            return
        t0 = time.perf_counter()
        self.say(f"phase 3/3: writing {len(plans)} IndexFiles")
        out, job_id, fault = self.out, self.job_id, self.fault
        store = self.config.store
        capacity = keys_per_file(store.max_index_num)
        key_base = sc.broadcast({(r.segment, r.window): r.key_base for r in self.refs})

        def pieces(chunk):
            return index_pieces(chunk, key_base.value, capacity)

        def run(iterator):
            attempt = _task_attempt()
            stage = attempt_dir(out, job_id, "index", attempt.partition, attempt.attempt_id)
            try:
                yield write_index_files(iterator, output_dir=out, stage_dir=stage,
                                        hash_slot_num=store.max_hash_slot_num, index_num=store.max_index_num,
                                        attempt=attempt, fault=fault)
            except Exception as e:
                raise BackfillTaskError(f"index task {attempt.partition}: {e}") from e
            finally:
                remove_tree(stage)

        specs = sc.parallelize([((p.number, FILE_PLAN), p) for p in plans], min(len(plans), partitions))
        keyed = sc.union([specs, dispatched.flatMap(pieces)])
        n = min(partitions, len(plans))
        stats = WriteStats()
        for s in keyed.repartitionAndSortWithinPartitions(n, index_partition).mapPartitions(run).collect():
            stats.add(s)
        self.summary.files["index"] = stats.index_files
        self.log.info("index_files_written", files=stats.index_files, keys=stats.keys, **stats.files)
        self._timed("index", t0)

    def write_catalog(self, spark, dispatched, path: str) -> None:
        t0 = time.perf_counter()
        self.say(f"catalog: writing Parquet to {path}")
        types = {"long": LongType(), "int": IntegerType(), "string": StringType()}
        schema = StructType([StructField(name, types[t], nullable=t == "string") for name, t in CATALOG_COLUMNS])
        frame = spark.createDataFrame(dispatched.flatMap(catalog_rows), schema)
        frame.write.partitionBy("topic", "date").mode("errorifexists").parquet(path)
        self._timed("catalog", t0)
