"""`backfill()`: the driver's run, from the config to the summary. It checks the output and the catalog
(`outputs.py`), starts the Spark context (`driver.py`) under the signal handling (`interrupt.py`), runs
the phases (`phases.py`) and turns Spark's failures into one-line errors:

    job 1  decode   one task per byte range (`ranges.py`), staging its output as files (`stage.py`) and
                    returning its outcome; the driver checks the chain (`plan.walk_ranges`) and has a
                    broken link re-read from the right boundary (a small extra job, rarely needed)
    job 2  write    every writer over the staged runs: ConsumeQueue runs by queue bucket, IndexFile keys
                    by file (or chunk), catalog groups by (topic, day); each task stages its files
                    (`writers.py`)
           commit   the driver names the IndexFiles, checks the output and links everything into place

Local segments are mapped, so with a cluster they must be on a mount every executor sees at the same
path; s3:// and hdfs:// segments are read by each task from the store. The output directory must be
shared by the driver and the executors (the staged files are linked into place).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Mapping

from daemon.backfill import dledger
from daemon.backfill.brokerwatch import BrokerLockTaken, BrokerWatch
from daemon.backfill.commit import remove_tree, staging_root
from daemon.backfill.driver import DEFAULT_MASTER, archive_key, check_java, create_context, spark_error_line
from daemon.backfill.interrupt import Interrupt, end_driver_jvm
from daemon.backfill.jvm import choose_archive, save_archive
from daemon.backfill.outputs import check_output_below, open_catalog, remove_catalog_staging
from daemon.backfill.phases import Phases
from daemon.backfill.plan import BackfillError
from daemon.backfill.ranges import DecodeSettings, plan_ranges
from daemon.backfill.source import LOCAL, S3Options, SegmentDir, SegmentListing, parse_segment_dirs
from daemon.backfill.summary import BackfillSummary
from daemon.backfill.writers import Fault
from daemon.config import Config
from daemon.engine.dispatchers import ConsumeQueueDispatcher, IndexDispatcher
from daemon.ops.logs import get_logger
from indexcore.errors import StoreError
from indexcore.multidispatch import multi_dispatch_flags

# --- the job -----------------------------------------------------------------------------------------

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
    SparkContext (or a SparkSession, whose context runs the jobs), kept open; otherwise a context is created
    with `master` and stopped at the end."""
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
    owns_context = spark is None
    master = master or DEFAULT_MASTER
    summary = BackfillSummary(start_offset=start, end_offset=start, output_end=start, catalog=catalog,
                              ranges=len(tasks))
    started = time.perf_counter()
    say = progress or (lambda _text: None)
    archive = None
    check_output_below(out, start)
    catalog_covered = open_catalog(catalog, s3) if catalog is not None else ()
    broker = BrokerWatch(out, log)  # from here a broker that takes `lock` in the output stops the backfill
    interrupt = Interrupt(own=owns_context)  # from here a signal ends the backfill as an interruption
    try:
        if spark is None:
            archive = choose_archive(config.backfill.jvm_class_archive, check_java(), archive_key(master),
                                     lambda directory, why: log.warning(
                                         "jvm_class_archive_unavailable", directory=directory, error=why,
                                         setting=config.backfill.jvm_class_archive,
                                         detail="the driver JVM starts without a class archive (about twice as "
                                                "long); set XDG_CACHE_HOME to a writable directory, or "
                                                "backfill.jvmClassArchive to a writable path or off"))
            if archive is not None and archive.saving:
                kind = "local" if master.startswith("local") else "cluster-driver"
                say(f"this first {kind} backfill with this Java and Spark records the JVM's classes in "
                    f"{archive.path} as it ends, so that later ones start faster")
            with interrupt.launching():
                spark = create_context(master, spark_conf, archive)
            summary.phases["startup"] = time.perf_counter() - started
    except BaseException:
        interrupt.disarm()
        broker.close()
        raise
    sc = getattr(spark, "sparkContext", spark)  # a SparkSession's context
    job_id = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
    group = f"reputd-backfill-{job_id}"
    interrupt.arm(sc, group)
    broker.arm(sc, group)
    job = None
    try:
        interrupt.check()
        broker.check()
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
        job = Phases(config, sc, out, job_id, summary, settings, say, log, fault, s3)
        job.catalog_covered = catalog_covered
        job.before_commit = interrupt.committing
        job.stop_requested = lambda: interrupt.signal is not None
        job.broker = broker
        if tasks:
            plan = job.decode(tasks, listing, start, to_offset, from_offset is not None)
            interrupt.check()
            broker.check()
            job.write(plan, build_cq, build_index, catalog)
    except Exception as e:
        if broker.holder is not None and not isinstance(e, BrokerLockTaken):  # the watch cancelled the jobs
            broker.taken()
            raise broker.error() from None
        if interrupt.signal is not None and not interrupt.commit_began():
            raise KeyboardInterrupt from None  # the jobs failed because the signal cancelled them
        if isinstance(e, StoreError | ValueError | OSError):
            raise
        if type(e).__module__.startswith(("py4j", "pyspark")) or isinstance(e, ConnectionError):
            raise BackfillError(f"backfill failed in Spark: {spark_error_line(e)}") from None
        raise
    finally:
        broker.close()
        interrupt.stopping()
        with contextlib.suppress(Exception):  # the context may be gone
            summary.spark_jobs = len(sc.statusTracker().getJobIdsForGroup(group))
        remove_tree(staging_root(out, job_id))
        if catalog is not None:
            remove_catalog_staging(catalog, s3, job_id)
        if owns_context:
            with contextlib.suppress(Exception):  # a JVM that died (out of memory, killed) cannot be stopped
                sc.stop()
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
