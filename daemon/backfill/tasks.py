"""What runs in the Python workers: the functions Spark's `mapPartitions` calls, one per job.

A worker unpickles these and imports what they name, and every worker of every run pays for it, so this
module and what it imports stay lean: the decode (`ranges`, `stage`), the writers (`writers`), the staging
helpers (`commit`), numpy and pyarrow; not the driver's Spark and planning code (`job`), the config loader
or the daemon's dispatchers. The catalog writer imports `catalog` (pyarrow.compute, parquet) only when it
runs.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from pyspark import TaskContext

from daemon.backfill.commit import attempt_dir, remove_tree
from daemon.backfill.plan import Reread
from daemon.backfill.queuewriter import QueueWork, write_queues
from daemon.backfill.ranges import LIMIT, DecodeSettings, decode_range
from daemon.backfill.writers import (
    Attempt,
    CatalogWork,
    Fault,
    write_catalog,
    write_index_chunk,
    write_index_files,
)

QUEUES, INDEX_FILES, CATALOG_FILES = "queues", "index", "catalog"  # the kinds of result rows


class WorkFile:
    """A job's work items (each pickled), in a file under the job's staging root, which every executor sees:
    `value` is the list, read once per worker process. A broadcast of the list cost the driver 45 ms between
    the two jobs, when no task runs (the serial part of the job)."""

    _loaded: ClassVar[dict[str, list]] = {}  # path -> items, in this worker: the latest job's only

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def write(cls, path: str, items) -> WorkFile:
        with open(path, "wb") as f:
            pickle.dump([pickle.dumps(w) for w in items], f, protocol=pickle.HIGHEST_PROTOCOL)
        return cls(path)

    @property
    def value(self) -> list:
        items = WorkFile._loaded.get(self.path)
        if items is None:
            with open(self.path, "rb") as f:
                items = pickle.load(f)
            WorkFile._loaded.clear()
            WorkFile._loaded[self.path] = items
        return items


class BackfillTaskError(RuntimeError):
    """What a task died of, with the phase and partition: the one line the driver reports."""


def task_attempt() -> Attempt:
    ctx = TaskContext.get()
    return Attempt(ctx.partitionId(), ctx.taskAttemptId(), ctx.attemptNumber())


def reread(work: Reread, settings: DecodeSettings, attempt_id: int = 0):
    """Decode consecutive ranges from a known boundary, until one's own first record is where the range
    before it stopped."""
    offset = work.start
    for i, t in enumerate(work.tasks):
        if i and work.claimed[i] == offset:
            return
        if offset >= t.seg_start + t.end:
            continue
        outcome = yield from decode_range(t, settings, start=offset, attempt_id=attempt_id)
        if outcome.status != LIMIT or t.to_limit:
            return
        offset = outcome.next_offset


def decode_partition(settings: DecodeSettings, work, fault: Fault | None):
    """The decode: each input is the index of a RangeTask or Reread in `work` (a WorkFile: read once per
    worker, not shipped with every task). Each range stages its output (`stage.py`) and hands back its
    outcome."""

    def run(numbers):
        for number in numbers:
            item = pickle.loads(work.value[number])
            attempt = task_attempt()
            if fault is not None:
                fault.check("decode", "started", attempt.attempt_number)
            try:
                if isinstance(item, Reread):
                    yield from reread(item, settings, attempt.attempt_id)
                else:
                    yield from decode_range(item, settings, attempt_id=attempt.attempt_id)
            except Exception as e:
                name = item.tasks[0].location if isinstance(item, Reread) else item.location
                raise BackfillTaskError(f"decode task for {name}: {e}") from e

    return lambda numbers: _to_jvm(run(numbers))


@dataclass(frozen=True, slots=True)
class WriterSettings:
    out: str
    job_id: str
    cq_file_size: int
    hash_slot_num: int
    index_num: int
    catalog: str | None = None
    s3: object = None
    catalog_body: bool = False  # the catalog's rows carry the body column (`backfill.catalogBody`)


def write_partition(settings: WriterSettings, work, fault: Fault | None):
    """The writers: each input is the index of a QueueWork, IndexWork or CatalogWork in `work` (a WorkFile);
    each task stages its files and hands back (kind, result)."""

    def run(numbers):
        for number in numbers:
            yield from _write(settings, pickle.loads(work.value[number]), fault)

    return lambda numbers: _to_jvm(run(numbers))


def _to_jvm(results: Iterator) -> Iterator[bytes]:
    """What a task hands the JVM: each result pickled here rather than by PySpark's serializer, so that the
    driver counts the bytes that crossed (`bytesToJvm`) as it unpickles them."""
    for value in results:
        yield pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _write(settings: WriterSettings, item, fault: Fault | None):
    attempt = task_attempt()
    if isinstance(item, CatalogWork):
        yield from _write_catalog(settings, item, attempt)
        return
    phase = "cq" if isinstance(item, QueueWork) else "index"
    stage = attempt_dir(settings.out, settings.job_id, phase, attempt.partition, attempt.attempt_id)
    try:
        if isinstance(item, QueueWork):
            kind = QUEUES
            result = write_queues(item, stage_dir=stage, file_size=settings.cq_file_size, attempt=attempt, fault=fault)
        else:
            kind = INDEX_FILES
            write = write_index_files if item.chunk is None else write_index_chunk
            result = write(item, stage_dir=stage, hash_slot_num=settings.hash_slot_num,
                           index_num=settings.index_num, attempt=attempt, fault=fault)
    except Exception as e:
        remove_tree(stage)
        name = "consumequeue" if phase == "cq" else "index"
        raise BackfillTaskError(f"{name} task {attempt.partition}: {e}") from e
    yield kind, result


def _write_catalog(settings: WriterSettings, item: CatalogWork, attempt: Attempt):
    """A catalog writer stages its Parquet files next to the catalog (under a name no reader takes)."""
    from daemon.backfill.catalog import STAGING, catalog_filesystem  # noqa: PLC0415 - only a run with a catalog

    filesystem, base = catalog_filesystem(settings.catalog, settings.s3)
    stage = f"{base.rstrip('/')}/{STAGING}/{settings.job_id}/a{attempt.attempt_id}"
    started = time.perf_counter()
    try:
        written = write_catalog(item, stage=stage, filesystem=filesystem, attempt=attempt,
                                with_body=settings.catalog_body)
    except Exception as e:
        with contextlib.suppress(Exception):
            filesystem.delete_dir(stage)
        raise BackfillTaskError(f"catalog task {attempt.partition}: {e}") from e
    # the task time too, so that the summary's writeTaskSeconds counts the catalog's writers with the others
    yield CATALOG_FILES, (written, time.perf_counter() - started)
