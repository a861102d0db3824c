"""Splitting segments into byte ranges: whatever the range size, the ranges' output, chained and re-read by
the driver's rules, is exactly what one sequential read of every segment gives (no Spark here: the decode
tasks and the driver's walk are plain functions; tests/test_backfill.py runs them under Spark)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import pytest

from daemon.backfill import ranges as ranges_module
from daemon.backfill import stage as stage_module
from daemon.backfill.plan import BackfillFailed, Reread, walk_ranges
from daemon.backfill.ranges import DecodeSettings, decode_range, plan_ranges
from daemon.backfill.source import LOCAL, S3Options, SegmentDir, SegmentListing, open_image
from daemon.backfill.stage import StagedRange
from daemon.backfill.tasks import reread as _reread
from daemon.config import ON_CORRUPTION_SKIP_SEGMENT, ON_CORRUPTION_STOP
from indexcore.dispatch import DEFAULT_MESSAGE_DELAY_LEVEL
from indexcore.errors import StoreLayoutError
from indexcore.queuestore import consume_queue_units, consume_queue_units_flat
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus
from tests.backfill_stores import corrupt_record, tear_tail, write_forged_store

SEGMENT = 256 * 1024
MIB = 1024 * 1024


_STAGE: dict[str, str | None] = {"root": None}


@pytest.fixture(autouse=True, scope="module")
def _stage_root(tmp_path_factory):
    """Where the decode tasks of this module stage their files (under pytest's own temporary directory)."""
    _STAGE["root"] = str(tmp_path_factory.mktemp("stage"))


def stage_root() -> str:
    return tempfile.mkdtemp(prefix="ranges-", dir=_STAGE["root"])


def settings(index: bool = True) -> DecodeSettings:
    return DecodeSettings(SEGMENT, True, 4 * MIB, DEFAULT_MESSAGE_DELAY_LEVEL, 8192, MIB, index, False, False,
                          stage_root=stage_root())


def outcomes_of(gen) -> list:
    """The outcomes a decode generator yields."""
    return list(gen)


def staged_rows(outcome) -> tuple[dict, list]:
    """A range's staged units (by queue: (queue offset, unit)) and keys (hash, phy, store time)."""
    staged = StagedRange(outcome.stage_dir)
    queues = {}
    for q, units, queue_offset in staged.queue_units():
        queues.setdefault(q, []).extend(zip(queue_offset.tolist(), units.astype(">i8,>i4,>i8").tolist(), strict=True))
    k = staged.keys(0, outcome.keys)
    keys = list(zip(k["hash"].tolist(), k["phy"].tolist(), k["ts"].tolist(), strict=True))
    staged.close()
    return queues, keys


def ranged(commitlog: Path | list[SegmentDir], range_bytes: int, on_corruption: str = ON_CORRUPTION_STOP,
           segment: int = SEGMENT, s: DecodeSettings | None = None, start: int | None = None, to: int | None = None):
    """Run the decode tasks and the driver's walk as the job does, over one CommitLog directory or a list of
    segment directories; (plan, units by queue, keys, rereads)."""
    s = s or settings()
    dirs = commitlog if isinstance(commitlog, list) else [SegmentDir(LOCAL, str(commitlog))]
    listing = SegmentListing(dirs, segment)
    start = listing.min_offset if start is None else start
    tasks = plan_ranges(listing.segments, segment, start, to, range_bytes)
    outcomes = {}
    rereads = 0

    def run(work) -> None:
        gen = _reread(work, s) if isinstance(work, Reread) else decode_range(work, s)
        for o in outcomes_of(gen):
            outcomes[o.number] = o

    for t in tasks:
        run(t)
    while True:
        plan, again = walk_ranges(tasks, outcomes, segment, listing.missing, start, to, on_corruption, False)
        if plan is not None:
            break
        for r in again:
            rereads += 1
            run(r)
    queues: dict[tuple[str, int], list] = {}
    keys = []
    for n in plan.ranges:
        range_queues, range_keys = staged_rows(outcomes[n])
        for q, units in range_queues.items():
            queues.setdefault(q, []).extend(units)
        keys.extend(range_keys)
    shutil.rmtree(s.stage_root, ignore_errors=True)
    return plan, queues, keys, rereads


def sequential(commitlog: Path, on_corruption: str = ON_CORRUPTION_STOP, segment: int = SEGMENT,
               start: int | None = None):
    """One read from the first segment's start, as `reputd rebuild` (and `run` with skip-segment) reads."""
    log = CommitLog(str(commitlog), segment)
    reader = CommitLogReader(log, batch_bytes=8192)
    offset = log.min_offset if start is None else start
    queues: dict[tuple[str, int], list] = {}
    keys = []
    error = None
    while True:
        res = reader.read(offset)
        b = res.batch
        for q in consume_queue_units(b):
            queues.setdefault((q.topic, q.queue_id), []).extend(
                zip(q.queue_offset.tolist(), q.units.tolist(), strict=True))
        hashes, owners = b.index_keys(b.index_mask())
        keys.extend(zip(hashes.tolist(), b.phy_offset[owners].tolist(), b.store_timestamp[owners].tolist(),
                        strict=True))
        offset = res.next_offset
        if res.status is ReadStatus.END:
            break
        if res.status is ReadStatus.CORRUPT:
            error = res.error
            if on_corruption != ON_CORRUPTION_SKIP_SEGMENT or not log.has_segment_after(offset):
                break
            offset = log.segment_start(offset) + segment
    reader.close()
    for q in queues.values():  # a queue keeps a unit once: the broker skips repeats
        q.sort(key=lambda u: u[1][0])
    return offset, queues, keys, error


@pytest.fixture(scope="module")
def forged(tmp_path_factory):
    root = tmp_path_factory.mktemp("forged")
    results = write_forged_store(root / "commitlog", SEGMENT, 1500)
    return root / "commitlog", results


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k, units in a.items():
        assert sorted(units, key=lambda u: u[1][0]) == b[k], k


@pytest.mark.parametrize("range_bytes", [997, 4099, 20_000, 65_537, SEGMENT, 4 * SEGMENT])
def test_ranges_chain_to_one_sequential_read(forged, range_bytes):
    """Forged headers and whole forged records in bodies, BLANKs, v2 records: the same units and keys."""
    commitlog, results = forged
    plan, queues, keys, rereads = ranged(commitlog, range_bytes)
    end, ref_queues, ref_keys, error = sequential(commitlog)
    assert error is None
    assert plan.end_offset == end == results[-1].phy_offset + results[-1].msg_size
    assert plan.messages == len(results)
    same(queues, ref_queues)
    assert keys == ref_keys
    if range_bytes == 997:
        assert rereads > 0  # forgeries were found first, and the chain check caught them


def test_forgeries_are_found_first(forged):
    """Without the chain check the forged records would be taken: some range starts at one."""
    commitlog, _ = forged
    listing = SegmentListing([SegmentDir(LOCAL, str(commitlog))], SEGMENT)
    tasks = plan_ranges(listing.segments, SEGMENT, 0, None, 997)
    starts: set[int] = set()
    log = CommitLog(str(commitlog), SEGMENT)
    reader = CommitLogReader(log, batch_bytes=1 << 30)
    offset = 0
    while True:
        res = reader.read(offset)
        starts.update(res.batch.phy_offset.tolist())
        offset = res.next_offset
        if res.status is not ReadStatus.OK:
            break
    forged_firsts = 0
    for t in tasks[:200]:
        (o,) = outcomes_of(decode_range(t, settings()))
        if o.first is not None and o.first not in starts:
            forged_firsts += 1
    assert forged_firsts > 3


@pytest.mark.parametrize("policy", [ON_CORRUPTION_STOP, ON_CORRUPTION_SKIP_SEGMENT])
@pytest.mark.parametrize("range_bytes", [1500, 30_000, SEGMENT])
def test_corrupt_record_mid_segment(tmp_path, policy, range_bytes):
    """`stop`: the walk fails at the record the sequential reader fails at; `skip-segment`: the same records
    are dispatched and the same range skipped."""
    results = write_forged_store(tmp_path / "commitlog", SEGMENT, 900, seed=5)
    victim = next(r for r in results if r.phy_offset // SEGMENT == 1 and r.phy_offset % SEGMENT > SEGMENT // 3)
    corrupt_record(tmp_path / "commitlog", SEGMENT, victim)
    _, ref_queues, ref_keys, error = sequential(tmp_path / "commitlog", policy)
    assert error is not None
    assert error.offset == victim.phy_offset
    if policy == ON_CORRUPTION_STOP:
        with pytest.raises(BackfillFailed) as failed:
            ranged(tmp_path / "commitlog", range_bytes, policy)
        assert str(failed.value) == str(error)
        return
    plan, queues, keys, _ = ranged(tmp_path / "commitlog", range_bytes, policy)
    assert [(a, b) for a, b, _ in plan.skipped] == [(victim.phy_offset, 2 * SEGMENT)]
    same(queues, ref_queues)
    assert keys == ref_keys


@pytest.mark.parametrize("range_bytes", [1500, 30_000, SEGMENT])
def test_incomplete_tail_is_the_end_of_the_data(tmp_path, range_bytes):
    results = write_forged_store(tmp_path / "commitlog", SEGMENT, 700, seed=9)
    tear_tail(tmp_path / "commitlog", SEGMENT, results[-1])
    plan, queues, keys, _ = ranged(tmp_path / "commitlog", range_bytes)
    end, ref_queues, ref_keys, error = sequential(tmp_path / "commitlog")
    assert error is None
    assert plan.end_offset == end == results[-1].phy_offset
    assert plan.pending is not None
    same(queues, ref_queues)
    assert keys == ref_keys


def test_from_and_to_cut_ranges_at_record_boundaries(forged):
    commitlog, results = forged
    start, to = results[200].phy_offset, results[1200].phy_offset
    plan, _, _, _ = ranged(commitlog, 3001, start=start, to=to)
    assert (plan.start_offset, plan.end_offset) == (start, to)
    assert plan.messages == 1000
    with pytest.raises(BackfillFailed, match="not a record boundary"):
        ranged(commitlog, 3001, start=start, to=to + 5)


@pytest.mark.parametrize("range_bytes", [MIB, 7 * MIB, 64 * MIB, 128 * MIB])
def test_large_segments_at_the_range_sizes_of_a_deployment(tmp_path_factory, range_bytes):
    """128 MiB segments holding 70 MB of messages (forgeries in the bodies): 1, 7 and 64 MiB ranges and
    whole segments read what one sequential read does."""
    root = tmp_path_factory.getbasetemp() / "large-forged"
    segment = 128 * MIB
    if not (root / "done").exists():
        write_forged_store(root / "commitlog", segment, 1400, big_every=2, big_body=160_000)
        (root / "done").touch()
    s = DecodeSettings(segment, True, 4 * MIB, DEFAULT_MESSAGE_DELAY_LEVEL, 4 * MIB, 16 * MIB, True, False, False,
                       stage_root=stage_root())
    plan, queues, keys, _ = ranged(root / "commitlog", range_bytes, segment=segment, s=s)
    end, ref_queues, ref_keys, _ = sequential(root / "commitlog", segment=segment)
    assert end > 64 * MIB
    assert plan.end_offset == end
    same(queues, ref_queues)
    assert keys == ref_keys


def _first_of(task, s: DecodeSettings | None = None):
    (o,) = outcomes_of(decode_range(task, s or settings()))
    return o.first


def test_a_record_starting_in_a_ranges_last_bytes_is_its_first(forged):
    """A range owns the records whose first byte lies in it, up to its last byte: one that starts 1-3 bytes
    before the end (its MAGICCODE past the end) is found there, not left for the chain check to re-read."""
    commitlog, results = forged
    listing = SegmentListing([SegmentDir(LOCAL, str(commitlog))], SEGMENT)
    template = plan_ranges(listing.segments, SEGMENT, 0, None, SEGMENT)[0]
    starts = [r.phy_offset for r in results if 0 < r.phy_offset < SEGMENT - 64][:40]
    assert len(starts) == 40
    for p in starts:
        for after in (1, 2, 3, 4):
            task = dataclasses.replace(template, begin=p - 1, end=p + after, known=False)
            assert _first_of(task) == p, (p, after)


@pytest.mark.parametrize("step", [5, 4099])
def test_the_search_step_does_not_change_the_ranges(forged, monkeypatch, step):
    """The first record is searched for a step at a time: with tiny or odd steps the ranges still chain to
    the sequential read, a record straddling a step's end included."""
    monkeypatch.setattr(ranges_module, "_FIND_STEP", step)
    commitlog, _ = forged
    plan, queues, keys, _ = ranged(commitlog, 4099)
    end, ref_queues, ref_keys, _ = sequential(commitlog)
    assert plan.end_offset == end
    same(queues, ref_queues)
    assert keys == ref_keys


def test_a_decoded_range_keeps_none_of_its_unit_arrays(forged, monkeypatch):
    """A worker decodes range after range: once a range's batches are gone, so is every unit array it
    grouped. pyarrow holds on to buffer-protocol objects handed to `pa.array`; the rows' unit slices
    went that way, and a worker grew by a window's units with every range (175 MiB after 16 ranges)."""
    import gc
    import weakref

    commitlog, _ = forged
    grouped = []

    def watched(batch):
        flat = consume_queue_units_flat(batch)
        grouped.append(weakref.ref(flat.units))
        return flat

    monkeypatch.setattr(stage_module, "consume_queue_units_flat", watched)
    listing = SegmentListing([SegmentDir(LOCAL, str(commitlog))], SEGMENT)
    units = 0
    for task in plan_ranges(listing.segments, SEGMENT, 0, None, 30_000)[:20]:
        for o in outcomes_of(decode_range(task, settings())):
            units += sum(o.bucket_units.values())
    gc.collect()
    assert units > 0
    assert grouped
    assert [r for r in grouped if r() is not None] == []


def test_a_python_worker_imports_only_what_its_tasks_need():
    """Every Python worker of every backfill imports the task functions (`tasks`): neither the driver's
    Spark and planning code (`job`), the catalog's Parquet stack, the daemon's dispatchers, metrics and
    logging, nor pandas (which `pa.array` imports) come with them: 0.34 s of imports here, against 0.65 s
    and then 0.26 s for pandas in a worker's first task."""
    import subprocess
    import sys

    code = ("import sys, daemon.backfill.tasks, daemon.backfill.writers as w\n"
            "list(daemon.backfill.tasks._to_jvm(iter([('queues', 1)])))\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('daemon', 'prometheus_client', 'structlog', 'watchdog', 'pandas') or m.startswith('pyarrow.parquet'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parent.parent).stdout.split())
    assert "daemon.backfill.tasks" in loaded
    assert {"daemon.backfill.ranges", "daemon.backfill.writers"} <= loaded
    assert loaded.isdisjoint({"daemon.backfill.job", "daemon.backfill.driver", "daemon.backfill.phases",
                              "daemon.backfill.outputs", "daemon.backfill.interrupt", "daemon.backfill.catalog",
                              "daemon.engine.dispatchers",
                              "daemon.engine.recovery", "daemon.ops.metrics", "daemon.ops.logs", "prometheus_client",
                              "structlog", "watchdog", "pyarrow.parquet", "pandas"}), sorted(loaded)


def test_the_python_daemon_ends_a_worker_whose_socket_closed_quietly():
    """A worker whose task Spark cancelled finds its socket closed: it exits 1, as PySpark's daemon has it
    exit, without the BrokenPipeError traceback PySpark prints (it reached the terminal on every Ctrl-C)."""
    import subprocess
    import sys

    code = ("import daemon.backfill.pydaemon as d\n"
            "def closed(sock, authenticated):\n"
            "    raise BrokenPipeError(32, 'Broken pipe')\n"
            "d._pyspark_worker = closed\n"
            "import pyspark.daemon\n"
            "assert pyspark.daemon.worker is d.worker\n"
            "pyspark.daemon.worker(None, False)\n"
            "print('not reached')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parent.parent, timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stdout == ""
    assert res.stderr == ""


def test_python_workers_start_with_the_daemons_imports_frozen(spark):
    """PySpark's daemon freezes what it imported (PySpark, numpy, pyarrow, the task modules) before it forks the
    workers, so a worker's full collections do not walk those objects again and again (2 of the workers' 12
    CPU-s on the 16M store): every worker sees them in the permanent generation."""

    def frozen(numbers):
        import gc

        for _ in numbers:
            yield gc.get_freeze_count()

    counts = spark.parallelize(range(2), 2).mapPartitions(frozen).collect()
    assert len(counts) == 2
    assert min(counts) > 10_000, counts


def test_python_workers_run_the_installed_pyspark_not_its_zip(spark):
    """Spark puts its zipped PySpark first on the workers' path, and Python compiles a zip's sources again in
    every process (1.4-1.6 CPU-s of each backfill's start); the daemon imports the installed PySpark, the same
    code, instead."""
    import pyspark

    def origin(numbers):
        import py4j
        import pyspark as worker_pyspark

        for _ in numbers:
            yield worker_pyspark.__file__, py4j.__file__

    rows = spark.parallelize(range(2), 2).mapPartitions(origin).collect()
    assert {p for p, _ in rows} == {pyspark.__file__}
    assert all(".zip" not in j for _, j in rows), rows


def _spark_home(root: Path, py4j: str) -> Path:
    lib = root / "pyspark" / "python" / "lib"
    lib.mkdir(parents=True)
    (root / "pyspark" / "__init__.py").write_text("")
    for name in ("pyspark.zip", f"py4j-{py4j}-src.zip"):
        (lib / name).write_bytes(b"")
    (root / "py4j").mkdir()
    (root / "py4j" / "__init__.py").write_text("")
    (root / "py4j" / "version.py").write_text('__version__ = "0.10.9.9"\n')
    return lib


@pytest.mark.parametrize(("py4j", "moved"), [("0.10.9.9", 2), ("0.10.9.7", 1)])
def test_the_workers_path_keeps_zips_the_install_does_not_match(tmp_path, py4j, moved):
    """Only a pip-installed PySpark's own pyspark.zip, and its py4j zip when that py4j version is installed,
    go last; a Spark installation's zips elsewhere (a cluster's SPARK_HOME) keep their place."""
    from daemon.backfill.pydaemon import prefer_installed_pyspark

    lib = _spark_home(tmp_path / "site", py4j)
    other = tmp_path / "spark-home" / "python" / "lib" / "pyspark.zip"
    zips = [str(lib / "pyspark.zip"), str(lib / f"py4j-{py4j}-src.zip")]
    path = [str(other), *zips, "/usr/lib/python311.zip", str(tmp_path / "site")]
    out = prefer_installed_pyspark(path)
    assert sorted(out) == sorted(path)
    assert out[0] == str(other)
    assert out[-moved:] == zips[:moved]
    if moved == 1:
        assert out.index(zips[1]) < out.index(str(tmp_path / "site"))
    assert prefer_installed_pyspark([str(other), str(tmp_path / "nothing")]) == [str(other), str(tmp_path / "nothing")]


@pytest.mark.parametrize("length", [0, 4096])
def test_a_local_segment_of_the_wrong_size_is_named_with_its_size(tmp_path, length):
    """The operator sees the size against mappedFileSizeCommitLog, not "mmap closed" (nor, for an empty file,
    "cannot mmap an empty file")."""
    path = tmp_path / "00000000000000000000"
    path.write_bytes(b"\x00" * length)
    with pytest.raises(StoreLayoutError) as e:
        open_image(str(path), 65536, 1 << 20, S3Options())
    assert e.value.path == str(path)
    assert f"segment is {length} bytes, mappedFileSizeCommitLog is 65536" in str(e.value)


def test_a_released_staged_file_leaves_the_rss_and_reads_the_same(tmp_path):
    """`StagedRange.release` unmaps what a writer read (its RSS counted every staged page it had touched: 2 GB
    for the 16M store's catalog); a view still held reads the same bytes, faulted in again from the page cache."""
    import numpy as np

    from daemon.backfill.stage import UNITS_DATA

    def rss_file() -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("RssFile:"))
        return int(line.split()[1]) * 1024

    data = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
    (tmp_path / UNITS_DATA).write_bytes(data.tobytes())
    staged = StagedRange(str(tmp_path))
    try:
        view = np.frombuffer(staged._data(UNITS_DATA), dtype=np.uint8)
        before = rss_file()
        assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page touched
        touched = rss_file()
        assert touched > before + (48 << 20)  # the 64 MiB file mapped
        staged.release()
        assert rss_file() < touched - (48 << 20)
        assert np.array_equal(view, data)
        del view
    finally:
        staged.close()
