"""What runs in the Python workers: the functions Spark's `mapInArrow` calls, one per kind of task.

A worker unpickles these and imports what they name, and every worker of every run pays for it, so this
module and what it imports stay lean: the decode (`ranges`), the writers (`writers`), the staging helpers
(`commit`), numpy and pyarrow; not the driver's session and planning code (`job`), the config loader or the
daemon's dispatchers. The catalog writer imports `catalog` (pyarrow.compute, parquet) only when it runs.
"""

from __future__ import annotations

import contextlib
import pickle

from pyspark import TaskContext

from daemon.backfill.commit import attempt_dir, remove_tree
from daemon.backfill.plan import Reread
from daemon.backfill.ranges import LIMIT, DecodeSettings, decode_range
from daemon.backfill.writers import Attempt, Fault, result_rows, write_catalog, write_index_files, write_queues

QUEUES, INDEX_FILES, CATALOG_FILES = "queues", "index", "catalog"  # the kinds of result rows
CATALOG_STAGING = "_reputd-staging"


class BackfillTaskError(RuntimeError):
    """What a task died of, with the phase and partition: the one line the driver reports."""


def task_attempt() -> Attempt:
    ctx = TaskContext.get()
    return Attempt(ctx.partitionId(), ctx.taskAttemptId(), ctx.attemptNumber())


def reread(work: Reread, settings: DecodeSettings):
    """Decode consecutive ranges from a known boundary, until one's own first record is where the range
    before it stopped."""
    offset = work.start
    for i, t in enumerate(work.tasks):
        if i and work.claimed[i] == offset:
            return
        if offset >= t.seg_start + t.end:
            continue
        outcome = yield from decode_range(t, settings, start=offset)
        if outcome.status != LIMIT or t.to_limit:
            return
        offset = outcome.next_offset


def decode_rows(settings: DecodeSettings, work, fault: Fault | None):
    """The decode: each input row is the index (`id`) of a RangeTask or Reread in `work`, a broadcast list
    of them pickled (fetched once per worker, not shipped with every task)."""

    def run(batches):
        for rb in batches:
            for number in rb.column("id").to_pylist():
                item = pickle.loads(work.value[number])
                attempt = task_attempt()
                if fault is not None:
                    fault.check("decode", "started", attempt.attempt_number)
                try:
                    if isinstance(item, Reread):
                        yield from reread(item, settings)
                    else:
                        yield from decode_range(item, settings)
                except Exception as e:
                    name = item.tasks[0].location if isinstance(item, Reread) else item.location
                    raise BackfillTaskError(f"decode task for {name}: {e}") from e

    return run


def queue_writer(out: str, job_id: str, file_size: int, fault: Fault | None):
    """The ConsumeQueue writer of one partition of (topic, queue), staging its files."""

    def run(batches):
        attempt = task_attempt()
        stage = attempt_dir(out, job_id, "cq", attempt.partition, attempt.attempt_id)
        try:
            stats, staged = write_queues(batches, stage_dir=stage, file_size=file_size, attempt=attempt, fault=fault)
        except Exception as e:
            remove_tree(stage)
            raise BackfillTaskError(f"consumequeue task {attempt.partition}: {e}") from e
        yield from result_rows(QUEUES, (stats, staged))

    return run


def index_writer(out: str, job_id: str, hash_slot_num: int, index_num: int, fault: Fault | None):
    """The IndexFile writer of one partition of file numbers, staging each file under its number."""

    def run(batches):
        attempt = task_attempt()
        stage = attempt_dir(out, job_id, "index", attempt.partition, attempt.attempt_id)
        try:
            stats, staged = write_index_files(batches, stage_dir=stage, hash_slot_num=hash_slot_num,
                                              index_num=index_num, attempt=attempt, fault=fault)
        except Exception as e:
            remove_tree(stage)
            raise BackfillTaskError(f"index task {attempt.partition}: {e}") from e
        yield from result_rows(INDEX_FILES, (stats, staged))

    return run


def catalog_writer(catalog: str, s3, job_id: str):
    """The catalog writer of one partition of (topic, day), staging its Parquet files next to the catalog."""

    def run(batches):
        from daemon.backfill.catalog import catalog_filesystem  # noqa: PLC0415 - only a run with a catalog

        attempt = task_attempt()
        filesystem, base = catalog_filesystem(catalog, s3)
        stage = f"{base.rstrip('/')}/{CATALOG_STAGING}/{job_id}/a{attempt.attempt_id}"
        try:
            written = write_catalog(batches, stage=stage, filesystem=filesystem, attempt=attempt)
        except Exception as e:
            with contextlib.suppress(Exception):
                filesystem.delete_dir(stage)
            raise BackfillTaskError(f"catalog task {attempt.partition}: {e}") from e
        yield from result_rows(CATALOG_FILES, written)

    return run
