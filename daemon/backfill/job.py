"""The Spark job: a thin adapter that runs the phases as two Spark jobs and turns Spark's failures into
one-line errors.

    job 1  decode   one task per byte range (`ranges.py`) -> Arrow rows of final bytes, cached in the JVM;
                    the driver collects each range's outcome and checks the chain (`plan.walk_ranges`);
                    a broken link is re-read from the right boundary (a small extra job, rarely needed)
    job 2  write    the cached rows, partitioned and sorted by Spark's shuffle: ConsumeQueue runs by
                    (topic, queue), IndexFile key runs by file, catalog groups by (topic, day); every
                    writer task stages its files (`writers.py`)
           commit   the driver names the IndexFiles, checks the output and links everything into place

Local segments are mapped, so with a cluster they must be on a mount every executor sees at the same
path; s3:// and hdfs:// segments are read by each task from the store. The output directory must be
shared by the driver and the executors (the staged files are linked into place).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import pathlib
import pickle
import re
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from pyarrow import fs
from pyspark.sql import SparkSession

from daemon.backfill import dledger
from daemon.backfill.catalog import catalog_filesystem, file_name, write_marker
from daemon.backfill.commit import (
    commit_index_file,
    commit_queue_dir,
    file_counts,
    remove_tree,
    staging_root,
)
from daemon.backfill.jvm import ClassArchive, choose_archive, end_gateway, java_version_text, save_archive
from daemon.backfill.plan import (
    BackfillError,
    IndexLayout,
    ReadPlan,
    check_existing_index,
    index_file_names,
    plan_index_files,
    walk_ranges,
)
from daemon.backfill.ranges import (
    OUTCOME_DDL,
    DecodeSettings,
    RangeOutcome,
    RangeTask,
    plan_ranges,
)
from daemon.backfill.source import LOCAL, S3Options, SegmentDir, SegmentListing, parse_segment_dirs
from daemon.backfill.tasks import (
    CATALOG_FILES,
    INDEX_FILES,
    QUEUES,
    WriterSettings,
    decode_rows,
    write_rows,
)
from daemon.backfill.writers import (
    CatalogWork,
    Fault,
    IndexWork,
    QueueWork,
    StagedIndexChunk,
    WriteStats,
    assemble_index_file,
    create_shared_index_file,
)
from daemon.config import Config
from daemon.engine.dispatchers import ConsumeQueueDispatcher, IndexDispatcher
from daemon.engine.rebuild import RebuildSummary
from daemon.ops.logs import get_logger
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CONSUME_QUEUE_DIR, CQ_UNIT_DTYPE, CQ_UNIT_SIZE
from indexcore.errors import StoreError
from indexcore.indexfile import FIRST_INDEX, INDEX_HEADER_SIZE, IndexHeader
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import list_queue_files
from indexcore.multidispatch import multi_dispatch_flags

DEFAULT_MASTER = "local[*]"
MIN_JAVA = 17
JAVA_INSTALL_HINT = (f"Spark needs a Java {MIN_JAVA} (or later) runtime: install one (Debian/Ubuntu: apt-get "
                     f"install openjdk-{MIN_JAVA}-jre-headless; RHEL: dnf install java-{MIN_JAVA}-openjdk-headless) "
                     f"or set JAVA_HOME to it")
ARROW_BATCH_BYTES = 4 * 1024 * 1024
LOCAL_DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"
STANDALONE_PREFIX = "spark://"
MASTER_CONNECT_TIMEOUT_S = 5.0
# the driver JVM's logging: Spark's errors only, not its start-up chatter (the file says why)
DRIVER_LOG_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")
_JAVA_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')
_JAVA_ERROR = re.compile(r"^(?:: |Caused by: )?((?:java|org|scala)\.[\w.$]*(?:Exception|Error)): (.+)$", re.M)
_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Fault|Failed)): (.+)$")


@dataclass(slots=True)
class BackfillSummary(RebuildSummary):
    """A rebuild's summary plus where and how Spark ran it."""

    master: str = ""
    partitions: int = 0
    catalog: str | None = None
    ranges: int = 0
    reread_ranges: int = 0
    spark_jobs: int = 0
    bytes_read_remote: int = 0
    arrow_bytes_to_jvm: int = 0
    arrow_bytes_from_jvm: int = 0
    staged_bytes: int = 0
    decode_task_seconds: float = 0.0
    write_task_seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    # the class-data archive the first local backfill saved as it ended (jvm.py): a one-off of seconds that
    # `seconds` and the rate leave out (phases["saveClassArchive"]), or None
    class_archive_saved: str | None = None

    @property
    def class_archive_seconds(self) -> float:
        return self.phases.get("saveClassArchive", 0.0)

    def as_dict(self) -> dict:
        return {
            **RebuildSummary.as_dict(self), "master": self.master, "partitions": self.partitions,
            "ranges": self.ranges, "rereadRanges": self.reread_ranges, "sparkJobs": self.spark_jobs,
            "bytesReadRemote": self.bytes_read_remote, "arrowBytesToJvm": self.arrow_bytes_to_jvm,
            "arrowBytesFromJvm": self.arrow_bytes_from_jvm, "stagedBytes": self.staged_bytes,
            "decodeTaskSeconds": round(self.decode_task_seconds, 3),
            "writeTaskSeconds": round(self.write_task_seconds, 3),
            "phaseSeconds": {k: round(v, 3) for k, v in self.phases.items()}, "catalog": self.catalog,
            "classArchiveSaved": self.class_archive_saved,
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
        text = java_version_text(java)
    except OSError as e:
        raise BackfillError(f"{java} does not run ({e}); {JAVA_INSTALL_HINT}") from None
    match = _JAVA_VERSION.search(text)
    if match:
        major = int(match[1]) if match[1] != "1" else int(match[2] or 0)  # "1.8.0" is Java 8
        if major < MIN_JAVA:
            raise BackfillError(f"{java} is Java {major}; {JAVA_INSTALL_HINT}")
    return java


def check_master_answers(master: str, timeout: float = MASTER_CONNECT_TIMEOUT_S) -> None:
    """A standalone master (`spark://HOST:PORT`, or several, comma-separated, for a master with standbys)
    must accept a connection at one of its addresses. Spark itself retries for over a minute, then fails
    with "Cannot call methods on a stopped SparkContext", the reason (no master answered) being a log line
    the backfill keeps quiet; a wrong port is the usual cause. Other masters are left to Spark."""
    if not master.startswith(STANDALONE_PREFIX):
        return
    failures = []
    for address in master[len(STANDALONE_PREFIX):].split(","):
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            raise BackfillError(f"--master {master}: {address!r} is not HOST:PORT")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            return
        except OSError as e:
            failures.append(f"{address.strip()} ({e.strerror or e})")
    raise BackfillError(f"no Spark master answers at {', '.join(failures)}: is the master running, and is "
                        "that its port (the one its web UI shows as spark://HOST:PORT)?")


def create_session(master: str = DEFAULT_MASTER, conf: Mapping[str, str] | None = None,
                   archive: ClassArchive | None = None):
    """A SparkSession for the backfill. Local workers run this interpreter (so they import reputd and
    numpy from the same environment); on a cluster, PYSPARK_PYTHON or spark.pyspark.python decides.
    `archive`: the class-data archive a local driver JVM maps or records (`jvm.py`)."""
    check_java()
    check_master_answers(master)
    if master.startswith("local") and "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = SparkSession.builder.appName("reputd-backfill").master(master)
    # Spark's stage progress bar on a terminal only, as `reputd rebuild` draws its own: written into a log
    # file or the journal it is a stream of carriage-return lines
    settings = {"spark.ui.showConsoleProgress": str(sys.stderr.isatty()).lower(), "spark.log.level": "FATAL",
                "spark.python.worker.reuse": "true",
                # one job per action: adaptive execution would run every shuffle stage as a job of its own
                "spark.sql.adaptive.enabled": "false",
                # rows are runs of units (a few KB) or keys (up to 448 KiB): batches bounded by bytes, not by
                # a handful of rows (8 rows made a writer take thousands of tiny batches)
                "spark.sql.execution.arrow.maxRecordsPerBatch": "10000",
                "spark.sql.execution.arrow.maxBytesPerBatch": str(ARROW_BATCH_BYTES),
                # a Python worker talks to its JVM over a Unix socket (Spark 4.1+; older ones ignore it): over
                # loopback TCP every task's short last write waited for a delayed ACK, about 40 ms a task
                "spark.python.unix.domain.socket.enabled": "true",
                # the rows are few and large (runs of units and keys), so evaluating their expressions costs
                # nothing, while compiling generated code for each stage cost seconds in a short job
                "spark.sql.codegen.wholeStage": "false",
                "spark.sql.codegen.factoryMode": "NO_CODEGEN",
                # PySpark's daemon, but a worker whose task was cancelled ends without a BrokenPipeError traceback
                "spark.python.daemon.module": "daemon.backfill.pydaemon"}
    driver_options = [driver_log_option()]
    if master.startswith("local"):
        # the driver JVM runs the tasks too: a short job spends seconds in the optimising JIT (C2) on cores the
        # decode needs; the quick compiler alone cut the work after start-up by about a quarter here
        driver_options.append(LOCAL_DRIVER_JAVA_OPTIONS)
    if archive is not None:  # a cluster's driver starts the same way (it spent 12.3 of its 19.4 CPU-s without)
        driver_options.append(archive.java_options())
    settings["spark.driver.extraJavaOptions"] = " ".join(driver_options)
    settings.update(conf or {})
    quiet_pyspark_servers()
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        return builder.getOrCreate()
    except Exception as e:  # the JVM did not come up: PySparkRuntimeError, Py4JError...
        raise BackfillError(f"Spark did not start with master {master}: {spark_error_line(e)}") from None


def archive_key(master: str) -> str:
    """What a driver's class archive is made for besides Java and Spark: a local driver runs the tasks (and
    its JVM options), a cluster's driver only schedules them, so each kind records an archive of its own."""
    return LOCAL_DRIVER_JAVA_OPTIONS if master.startswith("local") else "cluster-driver"


def driver_log_option() -> str:
    """The JVM option that makes the driver log with DRIVER_LOG_CONFIG (a URI: the path may hold spaces)."""
    return f"-Dlog4j2.configurationFile={pathlib.Path(DRIVER_LOG_CONFIG).as_uri()}"


MEMORY_HINT = ("raise spark.driver.memory (a local master runs the tasks in the driver JVM) or, on a cluster, "
               "spark.executor.memory, e.g. --conf spark.driver.memory=4g")
_OUT_OF_MEMORY = re.compile(r"java\.lang\.OutOfMemoryError(?::\s*([^\n]+))?")


def quiet_pyspark_servers() -> None:
    """When the JVM dies (out of memory, killed), PySpark's accumulator server printed a traceback ("Exception
    occurred during processing of request from") and py4j logged its own: the backfill's one line says it."""
    import logging  # noqa: PLC0415
    import socketserver  # noqa: PLC0415

    from pyspark import accumulators  # noqa: PLC0415

    logging.getLogger("py4j").setLevel(logging.CRITICAL)
    for value in vars(accumulators).values():
        if isinstance(value, type) and issubclass(value, socketserver.BaseServer):
            value.handle_error = lambda *_args: None


def spark_error_line(error: BaseException) -> str:
    """The Python exception a task died of (the last `Name: message` line of the worker's traceback),
    or the first line of what Spark said; never a stack trace. A JVM out of memory, or gone, says which
    setting to raise."""
    text = str(error)
    memory = _OUT_OF_MEMORY.search(text)
    if memory:
        return f"Spark's JVM ran out of memory (java.lang.OutOfMemoryError: {memory[1] or 'no detail'}): {MEMORY_HINT}"
    if isinstance(error, ConnectionError) or type(error).__name__ == "Py4JNetworkError":
        return (f"Spark's JVM ended during the backfill ({type(error).__name__}: {text.splitlines()[0] if text else ''}"
                f"); if it ran out of memory, {MEMORY_HINT}")
    found = None
    for line in text.splitlines():
        match = _PY_ERROR.match(line.strip())
        if match and not match[1].startswith(("org.", "java.", "py4j.", "scala.")):
            found = f"{match[1].rsplit('.', 1)[-1]}: {match[2]}"
    if found:
        return found
    java = _JAVA_ERROR.search(text)
    if java:
        return f"{java[1]}: {java[2].strip()}"[:500]
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return first[:500]


# --- the job -----------------------------------------------------------------------------------------

RESULT_DDL = "kind string, value binary"
# A decode task reads this much per window (at least reput.batchBytes): large enough that per-window Python
# costs little, small enough that a worker's mapped pages and decoded columns stay well under its budget.
DECODE_WINDOW_BYTES = 8 * 1024 * 1024


def segment_dirs(config: Config, segments: str | None) -> tuple[SegmentDir, ...]:
    """The CommitLog directories: `--segments` (paths or file://, s3://, hdfs:// URIs, comma-separated)
    or the store's."""
    if segments is None:
        if dledger.enabled(config):  # the old commitlog/ of an upgraded store, then dledger-<id>/data
            return dledger.segment_dirs(config)
        return tuple(SegmentDir(LOCAL, d) for d in config.store.commit_log_dirs)
    return parse_segment_dirs(segments)


def commit_log_dirs(config: Config, segments: str | None) -> tuple[str, ...]:
    """The CommitLog directories as paths or URIs."""
    return tuple(d.uri for d in segment_dirs(config, segments))


def backfill(config: Config, *, spark=None, master: str | None = None, segments: str | None = None,
             from_offset: int | None = None, to_offset: int | None = None, partitions: int | None = None,
             catalog: str | None = None, spark_conf: Mapping[str, str] | None = None,
             progress: Callable[[str], None] | None = None, fault: Fault | None = None) -> BackfillSummary:
    """Build consumequeue/ and index/ for [from, to) of the CommitLog with Spark: the files `rebuild`
    writes for the same range and settings, whatever the ranges and partitions. `spark`: an existing
    session (kept open); otherwise one is created with `master` and stopped at the end."""
    log = get_logger(command="backfill")
    if to_offset is not None and from_offset is not None and to_offset <= from_offset:
        raise ValueError(f"--to {to_offset} must be greater than --from {from_offset}")
    out = os.path.abspath(config.output.dir)
    s3 = S3Options.resolve(config.backfill)
    listing = SegmentListing(segment_dirs(config, segments), config.store.mapped_file_size_commit_log, s3)
    start = listing.min_offset if from_offset is None else from_offset
    dledger_from = dledger.dledger_from(listing) if dledger.enabled(config) else -1
    if dledger_from >= 0 and to_offset is None:
        to_offset = dledger.committed_end(config)  # committed entries only, where `rebuild` stops
    if listing.segments and start < listing.min_offset:
        log.warning("offset_below_oldest_segment", requested=start, resumed_at=listing.min_offset)
        start = listing.min_offset
    names = [d.name for d in config.dispatchers]
    build_cq = ConsumeQueueDispatcher.name in names
    build_index = IndexDispatcher.name in names and config.store.message_index_enable
    others = [n for n in names if n not in (ConsumeQueueDispatcher.name, IndexDispatcher.name)]
    if others:
        log.warning("dispatchers_not_run", dispatchers=others, reason="backfill builds consumequeue and index only")
    tasks = plan_ranges(listing.segments, listing.segment_size, start, to_offset, config.backfill.range_bytes)
    owns_session = spark is None
    master = master or DEFAULT_MASTER
    summary = BackfillSummary(start_offset=start, end_offset=start, output_end=start, catalog=catalog,
                              ranges=len(tasks))
    started = time.perf_counter()
    say = progress or (lambda _text: None)
    archive = None
    check_output_below(out, start)
    catalog_covered = open_catalog(catalog, s3) if catalog is not None else ()
    interrupt = _Interrupt(own=owns_session)  # from here a signal ends the backfill as an interruption
    try:
        if spark is None:
            archive = choose_archive(config.backfill.jvm_class_archive, check_java(), archive_key(master))
            if archive is not None and archive.saving:
                kind = "local" if master.startswith("local") else "cluster-driver"
                say(f"this first {kind} backfill with this Java and Spark records the JVM's classes in "
                    f"{archive.path} as it ends, so that later ones start faster")
            with interrupt.launching():
                spark = create_session(master, spark_conf, archive)
            summary.phases["startup"] = time.perf_counter() - started
    except BaseException:
        interrupt.disarm()
        raise
    sc = spark.sparkContext
    job_id = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
    group = f"reputd-backfill-{job_id}"
    interrupt.arm(sc, group)
    job = None
    try:
        interrupt.check()
        summary.master = sc.master
        summary.partitions = partitions or max(1, sc.defaultParallelism)
        sc.setJobGroup(group, "reputd backfill")
        log.info("backfill_started", segments=len(listing.segments), ranges=len(tasks), from_offset=start,
                 to_offset=to_offset, output=out, master=summary.master, partitions=summary.partitions, job=job_id)
        store = config.store
        window = max(config.reput.batch_bytes, min(DECODE_WINDOW_BYTES, config.backfill.range_bytes))
        settings = DecodeSettings(store.mapped_file_size_commit_log, store.check_crc_on_recover,
                                  store.max_message_size, store.message_delay_level, window, config.backfill.read_bytes,
                                  build_index, catalog is not None, config.backfill.catalog_body, s3,
                                  multi_dispatch_flags(store.enable_multi_dispatch, store.enable_lmq),
                                  staging_root(out, job_id), dledger_from)
        job = _Job(config, spark, out, job_id, summary, settings, say, log, fault, s3)
        job.catalog_covered = catalog_covered
        if tasks:
            plan = job.decode(tasks, listing, start, to_offset, from_offset is not None)
            interrupt.check()
            job.write(plan, build_cq, build_index, catalog)
            interrupt.check()
    except Exception as e:
        if interrupt.signal is not None:
            raise KeyboardInterrupt from None  # the jobs failed because the signal cancelled them
        if isinstance(e, StoreError | ValueError | OSError):
            raise
        if type(e).__module__.startswith(("py4j", "pyspark")) or isinstance(e, ConnectionError):
            raise BackfillError(f"backfill failed in Spark: {spark_error_line(e)}") from None
        raise
    finally:
        interrupt.stopping()
        with contextlib.suppress(Exception):  # the context may be gone
            summary.spark_jobs = len(sc.statusTracker().getJobIdsForGroup(group))
        if job is not None:
            job.release()
        remove_tree(staging_root(out, job_id))
        if catalog is not None:
            remove_catalog_staging(catalog, s3, job_id)
        if owns_session:
            with contextlib.suppress(Exception):  # a JVM that died (out of memory, killed) cannot be stopped
                spark.stop()
            if archive is not None and archive.saving and interrupt.signal is None:
                t0 = time.perf_counter()
                if save_archive(archive):
                    summary.phases["saveClassArchive"] = time.perf_counter() - t0
                    summary.class_archive_saved = archive.path
                    log.info("jvm_class_archive_saved", path=archive.path,
                             seconds=round(summary.phases["saveClassArchive"], 3))
            end_driver_jvm()
            interrupt.disarm()
        # the backfill's own time: the one-off archive save is reported apart (11 s of a first 34.6 s run)
        summary.seconds = time.perf_counter() - started - summary.class_archive_seconds
    if summary.pending is not None:
        log.warning("incomplete_record_at_end", error=str(summary.pending))
    log.info("backfill_finished", **summary.as_dict())
    return summary


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GATEWAY_EXIT_TIMEOUT_S = 10.0


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (from /proc), children first."""
    parent: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        found.extend(frontier)
    return found


def kill_spark_processes() -> None:
    """Kill the processes this backfill started (the Spark launcher and gateway JVM, and under it the Python
    workers) at once: a JVM whose driver went away prints a Java stack trace, then lingers for minutes."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        from pyspark import SparkContext  # noqa: PLC0415

        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None:
            proc.wait(GATEWAY_EXIT_TIMEOUT_S)


def end_driver_jvm() -> None:
    """After the session has stopped: end the gateway JVM this process launched, killing it if it does not
    exit; the Python process may go on (a test, a caller)."""
    end_gateway(GATEWAY_EXIT_TIMEOUT_S)


class _Interrupt:
    """SIGINT or SIGTERM at any moment of a backfill that owns its session ends it as an interruption (the
    caller's KeyboardInterrupt: one line, exit 130), with nothing left running:

    * before Spark starts: at once;
    * while Spark starts (`launching`): the launcher and JVM are killed, so the start fails and is reported
      as the interruption (PySpark's own SIGINT handler, which SparkContext installs, is kept out: it raised
      from inside a call to the JVM and left the JVM running);
    * during the jobs (`arm`): they are cancelled from another thread and the job that fails of it ends the
      backfill (PySpark's handler called into the JVM from the thread the signal interrupts, which is inside a
      call to the JVM: py4j then printed three tracebacks); a second signal kills Spark's processes at once;
    * while the session stops (`stopping`): the stop goes on.

    For a caller's session, and off the main thread (where no handler can be set), it does nothing."""

    def __init__(self, own: bool):
        self.signal: int | None = None
        self._sc = self._group = None
        self._state = "before"
        self._kept = {}
        if own and threading.current_thread() is threading.main_thread():
            self._kept = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
            for sig in self._kept:
                signal.signal(sig, self._on_signal)

    @contextlib.contextmanager
    def launching(self):
        """Around the session's creation: a signal kills what is starting; PySpark's SIGINT handler is kept
        out; the start that fails of the kill, or succeeds before it, ends as the interruption."""
        try:
            import pyspark.core.context as pyspark_context  # noqa: PLC0415 - Spark 4
        except ImportError:
            import pyspark.context as pyspark_context  # noqa: PLC0415 - Spark 3.5

        real = pyspark_context.signal
        pyspark_context.signal = _SignalsKept(real, set(self._kept))
        self._state = "launching"
        try:
            yield
        except Exception:
            if self.signal is not None:
                raise KeyboardInterrupt from None
            raise
        finally:
            pyspark_context.signal = real
            self._state = "before"
        if self.signal is not None:
            kill_spark_processes()
            raise KeyboardInterrupt

    def arm(self, sc, group: str) -> None:
        self._sc, self._group = sc, group
        self._state = "running"

    def stopping(self) -> None:
        self._state = "stopping"

    def disarm(self) -> None:
        for sig, handler in self._kept.items():
            signal.signal(sig, handler)
        self._kept = {}

    def _on_signal(self, signum: int, _frame) -> None:
        first = self.signal is None
        if first:
            self.signal = signum
        if self._state == "before":
            raise KeyboardInterrupt
        if self._state == "launching":
            kill_spark_processes()
        elif self._state == "running":
            if not first:
                kill_spark_processes()
                raise KeyboardInterrupt
            threading.Thread(target=self._cancel, name="reputd-backfill-cancel", daemon=True).start()

    def _cancel(self) -> None:
        with contextlib.suppress(Exception):  # the context may be stopping already
            self._sc.cancelJobGroup(self._group)

    def check(self) -> None:
        """Raise the interruption if a signal came while the driver was not waiting for a job."""
        if self.signal is not None:
            raise KeyboardInterrupt


class _SignalsKept:
    """The `signal` module as PySpark's context sees it while it starts: handlers for the signals the backfill
    handles itself are not replaced."""

    def __init__(self, real, kept: set):
        self._real = real
        self._kept = kept

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def signal(self, signum, handler):
        if signum in self._kept:
            return self._real.getsignal(signum)
        return self._real.signal(signum, handler)


_SCAN_UNITS = 4096  # units read at a time looking for a queue's first real one


def first_real_unit(directory: str) -> tuple[str, int] | None:
    """The file and CommitLog offset of a queue's first unit that is neither pre-blank nor unwritten (read a
    few units at a time: a daemon's first file may hold a long blank head, or be all real units)."""
    for _, path in list_queue_files(directory):
        with open(path, "rb") as f:
            while chunk := f.read(_SCAN_UNITS * CQ_UNIT_SIZE):
                units = np.frombuffer(chunk, dtype=CQ_UNIT_DTYPE, count=len(chunk) // CQ_UNIT_SIZE)
                blank = ((units["commit_log_offset"] == 0) & (units["msg_size"] == BLANK_UNIT_MSG_SIZE)
                         & (units["tags_code"] == 0))
                real = np.flatnonzero(~blank & (units["msg_size"] > 0))
                if len(real):
                    return path, int(units["commit_log_offset"][real[0]])
    return None


def check_output_below(out: str, start: int) -> None:
    """Refuse, before Spark starts, an output that holds data below the backfill's first offset: an earlier
    backfill or run of a lower range (committing over it would be refused only after both Spark jobs)."""
    root = os.path.join(out, CONSUME_QUEUE_DIR)
    if os.path.isdir(root):
        for topic in sorted(os.listdir(root)):
            tdir = os.path.join(root, topic)
            if not os.path.isdir(tdir):
                continue
            for qid in sorted(os.listdir(tdir)):
                found = first_real_unit(os.path.join(tdir, qid)) if qid.isdigit() else None
                if found is not None and found[1] < start:
                    raise BackfillError(f"{found[0]}: the queue holds a unit for CommitLog offset {found[1]}, below "
                                        f"the backfill's first offset {start}: the output holds an earlier range; "
                                        f"backfill into an empty output, or continue this one with reputd rebuild")
    index_dir = os.path.join(out, INDEX_DIR)
    if os.path.isdir(index_dir):
        for name in sorted(os.listdir(index_dir)):
            path = os.path.join(index_dir, name)
            with open(path, "rb") as f:
                header = IndexHeader.decode(f.read(INDEX_HEADER_SIZE).ljust(INDEX_HEADER_SIZE, b"\0"))
            if header.index_count > FIRST_INDEX and header.begin_phy_offset < start:
                raise BackfillError(f"{path}: holds entries from CommitLog offset {header.begin_phy_offset}, below "
                                    f"the backfill's first offset {start}: the output holds an earlier range; "
                                    f"backfill into an empty output, or continue this one with reputd rebuild")


def open_catalog(catalog: str, s3: S3Options) -> tuple[tuple[int, int], ...]:
    """The CommitLog ranges a catalog holds already (none for a new one); a path that is not a catalog is
    refused before anything is written."""
    from daemon.backfill.catalog import MARKERS, catalog_filesystem, covered_ranges  # noqa: PLC0415

    filesystem, path = catalog_filesystem(catalog, s3)
    info = filesystem.get_file_info(path)
    if info.type == fs.FileType.NotFound:
        return ()
    if info.type != fs.FileType.Directory:
        raise BackfillError(f"--catalog {catalog}: is a file, not a catalog directory")
    covered = covered_ranges(filesystem, path)
    if not covered and filesystem.get_file_info(fs.FileSelector(path)):
        raise BackfillError(f"--catalog {catalog}: exists and is not a reputd catalog (it has no {MARKERS}/); "
                            f"give a new path or an earlier backfill's catalog")
    return tuple(covered)


def remove_catalog_staging(catalog: str, s3: S3Options, job_id: str) -> None:
    """The job's staged catalog files, and the staging directory when no other job stages there."""
    from daemon.backfill.catalog import STAGING, catalog_filesystem  # noqa: PLC0415

    with contextlib.suppress(Exception):
        filesystem, path = catalog_filesystem(catalog, s3)
        staging = f"{path.rstrip('/')}/{STAGING}"
        filesystem.delete_dir(f"{staging}/{job_id}")
        if not filesystem.get_file_info(fs.FileSelector(staging)):
            filesystem.delete_dir(staging)


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
    """Whole queues in `parts` groups of queue buckets balanced by units."""
    units: dict[int, int] = {}
    for o in ranges:
        for b, n in o.bucket_units.items():
            units[b] = units.get(b, 0) + n
    return [QueueWork(dirs, frozenset(g)) for g in balanced(units, parts)]


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


class _Job:
    """The phases of one backfill, sharing the config, the session and the summary."""

    def __init__(self, config: Config, spark, out: str, job_id: str, summary: BackfillSummary,
                 settings: DecodeSettings, say, log, fault: Fault | None, s3: S3Options):
        self.config = config
        self.spark = spark
        self.out = out
        self.job_id = job_id
        self.summary = summary
        self.settings = settings
        self.say = say
        self.log = log
        self.fault = fault
        self.s3 = s3
        self.broadcasts: list = []  # the work items of each job
        self.catalog_covered: tuple[tuple[int, int], ...] = ()
        self.index_plans: list = []
        self.outcomes: dict[int, RangeOutcome] = {}
        self.all_outcomes: list[RangeOutcome] = []  # every decode task's, re-reads included

    def _timed(self, phase: str, t0: float) -> None:
        self.summary.phases[phase] = self.summary.phases.get(phase, 0.0) + time.perf_counter() - t0

    def release(self) -> None:
        for items in self.broadcasts:
            with contextlib.suppress(Exception):
                items.destroy()

    def _decode_frame(self, work: Sequence) -> list[RangeOutcome]:
        # one partition per item, generated in the JVM: no Python RDD to convert (its own worker per task); each
        # task stages its range's output as files and hands back only the outcome (nothing is cached)
        items = self.spark.sparkContext.broadcast([pickle.dumps(w) for w in work])
        self.broadcasts.append(items)
        rows = (self.spark.range(0, len(work), 1, len(work))
                .mapInArrow(decode_rows(self.settings, items, self.fault), OUTCOME_DDL).collect())
        found = [pickle.loads(r.data) for r in rows]
        self.all_outcomes.extend(found)
        for o in found:
            self.outcomes[o.number] = o
        return found

    def decode(self, tasks: Sequence[RangeTask], listing: SegmentListing, start: int, to_offset: int | None,
               from_given: bool) -> ReadPlan:
        """Job 1: decode every range in parallel; re-read where the chain breaks; the read plan."""
        t0 = time.perf_counter()
        segments = len({t.segment for t in tasks})
        self.say(f"decoding {len(tasks)} ranges of {segments} segments")
        self._decode_frame(tasks)
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
            found = self._decode_frame(rereads)
            self.summary.reread_ranges += len(found)
        s = self.summary
        s.end_offset = plan.end_offset
        s.pending = plan.pending
        s.segments = plan.segments
        s.messages = s.new_messages = plan.messages  # every file is written anew from `start`
        s.bytes_read_remote = sum(o.bytes_read for o in self.all_outcomes)
        s.arrow_bytes_to_jvm = sum(o.arrow_bytes for o in self.all_outcomes)
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
        self.say(f"decoded {s.messages:,} messages in {s.segments} segments, [{s.start_offset}, {s.end_offset})")
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
        if ranges and build_cq:
            work.extend(queue_work(ranges, dirs, s.partitions))
        if ranges and catalog is not None:
            work.extend(catalog_work(ranges, dirs, s.partitions, file_name(s.start_offset, s.end_offset),
                                     self.catalog_covered))
        results: dict[str, list] = {QUEUES: [], INDEX_FILES: [], CATALOG_FILES: []}
        if work:
            store = self.config.store
            settings = WriterSettings(self.out, self.job_id, store.mapped_file_size_consume_queue,
                                      store.max_hash_slot_num, store.max_index_num, catalog, self.s3)
            items = self.spark.sparkContext.broadcast([pickle.dumps(w) for w in work])
            self.broadcasts.append(items)
            self.say(f"writing {len(work)} parts in one job")
            rows = (self.spark.range(0, len(work), 1, len(work))
                    .mapInArrow(write_rows(settings, items, self.fault), RESULT_DDL).collect())
            for row in rows:
                results[row.kind].append(pickle.loads(row.value))
        self._timed("write", t0)
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
        s.arrow_bytes_from_jvm = stats.arrow_bytes
        s.write_task_seconds = stats.seconds
        counts = file_counts()
        for q in queues:
            for k, v in commit_queue_dir(q.directory, os.path.join(self.out, CONSUME_QUEUE_DIR, q.topic,
                                                                   str(q.queue_id))).items():
                counts[k] += v
        if build_cq:
            s.files["consumequeue"] = sum(counts.values())
            self.log.info("consumequeues_written", queues=stats.queues, units=stats.units, **counts)
        index_counts = file_counts()
        for f, name in zip(staged_files, names, strict=True):
            index_counts[commit_index_file(f.path, os.path.join(index_dir, name))] += 1
        if build_index:
            s.files["index"] = len(names)
            self.log.info("index_files_written", files=len(names), keys=stats.keys, **index_counts)
        if catalog is not None:
            filesystem, base = catalog_filesystem(catalog, self.s3)
            rows = 0
            base = base.rstrip("/")
            for written in results[CATALOG_FILES]:
                for staged, relative, n in written:
                    final = f"{base}/{relative}"
                    filesystem.create_dir(final.rsplit("/", 1)[0], recursive=True)
                    if filesystem.get_file_info(final).type != fs.FileType.NotFound:
                        filesystem.delete_file(final)  # this range's own file, left by a commit a kill stopped
                    filesystem.move(staged, final)
                    rows += n
            filesystem.create_dir(base, recursive=True)
            write_marker(filesystem, base, s.start_offset, s.end_offset)
            s.files["catalog"] = sum(len(w) for w in results[CATALOG_FILES])
            self.log.info("catalog_written", path=catalog, files=s.files["catalog"], rows=rows)

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


