"""`reputd backfill`: Spark builds the same consumequeue/ and index/ bytes as `reputd rebuild`."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog
import yaml

from daemon.backfill import (
    BackfillError,
    BackfillFailed,
    Fault,
    backfill,
    check_java,
    commit_log_dirs,
)
from daemon.backfill.catalog import CATALOG_QUERIES, GROUP_FIELDS, SCHEMA, file_name
from daemon.backfill.commit import STAGING_DIR
from daemon.backfill.driver import quiet_pyspark_servers, spark_error_line
from daemon.commands.query import query_key
from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from daemon.ops.outlock import LOCK_FILE
from indexcore.commitlog import MAGIC_CODE_OFFSET, TRANSACTION_COMMIT_TYPE, TRANSACTION_PREPARED_TYPE
from indexcore.commitlog import TRANSACTION_ROLLBACK_TYPE as ROLLBACK
from indexcore.errors import StoreError
from indexcore.writer import CommitLogWriter, Message
from tests.backfill_stores import write_forged_store
from tests.conformance import discover, files_under
from tests.tools import catches

SEGMENT = 64 * 1024
STORE = {"mappedFileSizeCommitLog": SEGMENT, "mappedFileSizeConsumeQueue": 400, "maxHashSlotNum": 31,
         "maxIndexNum": 50}
REPUTD = [sys.executable, "-m", "daemon.cli"]
CHECKPOINT = "reputd.checkpoint"
CONFORMANCE = discover()


def write_store(root: Path, n: int = 1200, seed: int = 7) -> list:
    """A multi-segment CommitLog exercising the dispatch rules: transactions, delays, records without keys,
    a record whose keys straddle IndexFiles, a topic that starts late, equal store times (name clashes)."""
    ticks = iter(range(n))

    def clock() -> int:
        return 1_700_000_000_000 + next(ticks) // 2 * 3  # two records per millisecond, 3 ms apart

    results = []
    with CommitLogWriter(str(root / "commitlog"), SEGMENT, clock=clock) as w:
        for i in range(n):
            topic = ("TopicA", "TopicB", "Late" if i > n // 2 else "TopicA")[i % 3]
            props = {"TAGS": ("TagA", "标签", "")[i % 3]}
            if i % 5:
                props["KEYS"] = " ".join(f"k{i}-{j}😀" for j in range(i % 4)) + (" dup dup" if i % 13 == 0 else "")
            if i % 7:
                props["UNIQ_KEY"] = f"{seed:08X}{i:024X}"
            if i % 17 == 0:
                props["DELAY"] = str(i % 20)
            if i == n // 3:
                props["KEYS"] = " ".join(f"many{j}" for j in range(120))  # spans three IndexFiles
            sys_flag = (0, TRANSACTION_PREPARED_TYPE, TRANSACTION_COMMIT_TYPE, ROLLBACK)[i % 4] if i % 9 == 0 else 0
            results.append(w.append(Message(topic, i % 3, bytes([i % 251]) * (i * 37 % 400), props,
                                            sys_flag=sys_flag)))
    return results


def make_config(tmp: Path, out: str, store_root: Path, **extra):
    cfg = {"store": {"storePathRootDir": str(store_root), **STORE}, "output": {"dir": str(tmp / out)},
           "metrics": {"enabled": False}, "logging": {"level": "warning"}}
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path, env={})


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """A generated store and its rebuild from offset 0 (the reference)."""
    tmp = tmp_path_factory.mktemp("generated")
    results = write_store(tmp / "store")
    reference = make_config(tmp, "reference", tmp / "store")
    rebuild(reference)
    return tmp, results, outputs(tmp / "reference")


def outputs(path: Path) -> dict[str, bytes]:
    """The output files, without the checkpoint and the writers' lock file of the commands that ran there."""
    return {k: v for k, v in files_under(path).items() if k not in (CHECKPOINT, LOCK_FILE)}


def assert_same_files(actual: dict[str, bytes], expected: dict[str, bytes]) -> None:
    assert sorted(actual) == sorted(expected)
    assert [name for name in expected if actual[name] != expected[name]] == []


def assert_no_staging(out: Path) -> None:
    assert not (out / STAGING_DIR).exists()


def test_backfill_is_byte_identical_to_rebuild(spark, generated):
    """Every ConsumeQueue and IndexFile (names included), with segments cut into many small ranges and small
    read windows, in at most 3 Spark jobs; a rerun finds its files in place and leaves them so."""
    tmp, results, expected = generated
    config = make_config(tmp, "bf", tmp / "store", reput={"batchBytes": 4096}, backfill={"rangeBytes": 5000})
    summary = backfill(config, spark=spark, partitions=3)
    assert summary.messages == len(results)
    assert summary.end_offset == results[-1].phy_offset + results[-1].msg_size
    assert summary.segments == len(os.listdir(tmp / "store" / "commitlog")) > 3
    assert summary.ranges > 5 * summary.segments
    assert summary.files["index"] > 3
    assert summary.spark_jobs <= 3
    assert_same_files(files_under(tmp / "bf"), expected)
    assert_no_staging(tmp / "bf")
    backfill(config, spark=spark, partitions=2)
    assert_same_files(files_under(tmp / "bf"), expected)


@pytest.mark.parametrize("chunk_keys", [1, 7, 30, 40])
def test_indexfiles_put_in_chunks_by_several_tasks_are_the_rebuilds(spark, generated, tmp_path, monkeypatch,
                                                                     chunk_keys):
    """An IndexFile larger than a chunk is put by one task per chunk, each with slots of its own, and its slot
    chains linked by the driver: byte for byte the file of one sequential put (49 keys a file here; 40 keys
    a chunk are more than its 31 slots, which bound the chains the chunk starts)."""
    from daemon.backfill import phases

    tmp, _, expected = generated
    monkeypatch.setattr(phases, "INDEX_CHUNK_KEYS", chunk_keys)
    config = make_config(tmp_path, "bf", tmp / "store", backfill={"rangeBytes": 30_000})
    backfill(config, spark=spark, partitions=2)
    assert_same_files(files_under(tmp_path / "bf"), expected)
    assert_no_staging(tmp_path / "bf")


def test_forged_records_in_bodies_are_re_read(spark, tmp_path):
    """Ranges that start inside bodies holding self-validating forged records: the driver's chain check
    has them re-read, and the files are the rebuild's."""
    results = write_forged_store(tmp_path / "store" / "commitlog", SEGMENT, 400)
    rebuild(make_config(tmp_path, "reference", tmp_path / "store"))
    config = make_config(tmp_path, "bf", tmp_path / "store", backfill={"rangeBytes": 6007})
    summary = backfill(config, spark=spark, partitions=2)
    assert summary.messages == len(results)
    assert summary.reread_ranges > 0
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))


def test_backfill_from_an_offset_matches_rebuild_from_it(spark, generated, tmp_path):
    """Queues that start past queue offset 0 get the broker's pre-blank units; IndexFiles start fresh there."""
    tmp, results, _ = generated
    start = results[len(results) // 3 + 5].phy_offset
    rebuild(make_config(tmp_path, "reference", tmp / "store"), from_offset=start)
    summary = backfill(make_config(tmp_path, "bf", tmp / "store"), spark=spark, from_offset=start)
    assert summary.start_offset == start
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))


@pytest.mark.parametrize("store", CONFORMANCE, ids=[s.name for s in CONFORMANCE])
def test_conformance_stores_backfill_like_rebuild(spark, store, tmp_path):
    """The broker-written stores: backfill writes exactly what rebuild writes (which is what the broker wrote),
    the DLedger one included (daemon/backfill/dledger.py)."""
    config_path = store.make_workspace(tmp_path)
    reference = load_config(config_path, env={}, overrides={"output.dir": str(tmp_path / "reference")})
    rebuild(reference)
    config = load_config(config_path, env={}, overrides={"output.dir": str(tmp_path / "bf")})
    summary = backfill(config, spark=spark, partitions=3)
    assert summary.messages == len(store.manifest["messages"])
    assert_same_files(outputs(tmp_path / "bf"), outputs(tmp_path / "reference"))
    assert sorted(files_under(tmp_path / "bf" / "consumequeue")) == sorted(files_under(store.store / "consumequeue"))


@pytest.mark.parametrize("fault", [Fault("decode", "started"), Fault("index", "staged")],
                         ids=lambda f: f"{f.phase}-{f.point}")
def test_task_retry_leaves_no_partial_file(spark, generated, tmp_path, fault):
    """A task attempt that dies (before decoding, or after staging its files) is retried: the output is the
    same as without the failure and no staged file is left behind."""
    tmp, _, expected = generated
    marker = tmp_path / "fault-fired"
    config = make_config(tmp_path, "bf", tmp / "store")
    backfill(config, spark=spark, partitions=2, fault=Fault(fault.phase, fault.point, marker=str(marker)))
    assert marker.exists()
    assert_same_files(files_under(tmp_path / "bf"), expected)
    assert_no_staging(tmp_path / "bf")


def run_cli(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    full_env.update(env or {})
    return subprocess.run([*REPUTD, *args], capture_output=True, text=True, env=full_env, timeout=timeout,
                          check=False)


def config_file(tmp: Path, out: str, store_root: Path, **extra) -> Path:
    make_config(tmp, out, store_root, **extra)
    return tmp / f"{out}.yaml"


def test_handoff_backfill_below_then_daemon_continues(spark, generated, tmp_path):
    """Backfill [first, X), then `reputd run` resumes where it ended: one store, identical to one rebuild."""
    tmp, results, expected = generated
    handoff = results[2 * len(results) // 3].phy_offset
    config = make_config(tmp_path, "out", tmp / "store")
    summary = backfill(config, spark=spark, to_offset=handoff)
    assert summary.end_offset == handoff
    res = run_cli("run", "--config", str(tmp_path / "out.yaml"), "--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / CHECKPOINT).exists()
    assert_same_files(outputs(tmp_path / "out"), expected)


def test_handoff_daemon_first_then_backfill_below_it(spark, generated, tmp_path):
    """A daemon that started at X (`rebuild --from X` standing in for its start) follows a broker that
    appends; it is stopped (one writer per output), backfill writes [first, X) into the same output, and
    the daemon is started again: the ConsumeQueues end up those of one rebuild (the daemon's pre-blank
    heads filled in), the backfilled IndexFiles sort before the daemon's, every key is found, and the
    daemon carries on with the store."""
    tmp, results, _ = generated
    shutil.copytree(tmp / "store" / "commitlog", tmp_path / "store" / "commitlog")
    handoff = results[len(results) // 2 + 1].phy_offset
    config = make_config(tmp_path, "out", tmp_path / "store")
    rebuild(config, from_offset=handoff)
    daemon_index = sorted(os.listdir(tmp_path / "out" / "index"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    daemon = subprocess.Popen([*REPUTD, "run", "--config", str(tmp_path / "out.yaml")], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    appended = []

    def broker() -> None:
        ticks = iter(range(1_700_000_100_000, 1_800_000_000_000, 2))
        with CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT, clock=lambda: next(ticks)) as w:
            for i in range(300):
                appended.append(w.append(Message(("TopicA", "Late")[i % 2], i % 3, b"y" * 90, {"KEYS": f"new{i}"})))
                w.flush()
                time.sleep(0.005)

    try:
        writer = threading.Thread(target=broker)
        writer.start()
        writer.join()
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    summary = backfill(config, spark=spark, to_offset=handoff)
    assert summary.new_messages == summary.messages > 0  # merged into the daemon's queues, all new to them
    res = run_cli("run", "--config", str(tmp_path / "out.yaml"), "--until-caught-up")  # started again
    assert res.returncode == 0, res.stderr
    reference = make_config(tmp_path, "reference", tmp_path / "store")
    rebuild(reference)

    def queues(path: Path) -> dict[str, bytes]:
        return {k: v for k, v in files_under(path).items() if k.startswith("consumequeue/")}

    assert_same_files(queues(tmp_path / "out"), queues(tmp_path / "reference"))
    names = sorted(os.listdir(tmp_path / "out" / "index"))
    below = [n for n in names if n < daemon_index[0]]
    assert len(below) == summary.files["index"] > 0  # the backfilled files all sort before the daemon's
    assert set(daemon_index) <= set(names)
    found = 0
    keys = [(r.topic, f"{7:08X}{i:024X}") for i, r in enumerate(results)] + [
        (r.topic, f"k{i}-0😀") for i, r in enumerate(results)] + [(r.topic, f"new{i}") for i, r in enumerate(appended)]
    for topic, key in keys[::7]:
        got = [m.physical_offset for m in query_key(config, topic, key, 64, 0, 2**63 - 1)]
        assert got == [m.physical_offset for m in query_key(reference, topic, key, 64, 0, 2**63 - 1)]
        found += len(got)
    assert found > 100


@pytest.mark.parametrize("index", [True], ids=["with-index"])
def test_older_files_in_the_output_are_refused(spark, generated, tmp_path, index):
    """Backfilling above files written for an earlier range is refused before anything is written."""
    tmp, results, _ = generated
    handoff = results[len(results) // 2].phy_offset
    config = make_config(tmp_path, "out", tmp / "store", store={"messageIndexEnable": index})
    backfill(config, spark=spark, to_offset=handoff)
    before = files_under(tmp_path / "out")
    with pytest.raises(BackfillError, match=r"first offset \d+: the output holds an earlier range"):
        backfill(config, spark=spark, from_offset=handoff)
    assert files_under(tmp_path / "out") == before
    assert ("index" in {p.name for p in (tmp_path / "out").iterdir()}) is index


def test_an_output_holding_an_earlier_range_is_refused_before_spark_starts(spark, generated, tmp_path):
    """`reputd backfill --from X` into an output holding [first, X): exit 1 with one line naming the file,
    and no Spark started (the refusal used to come at the commit, after both Spark jobs)."""
    tmp, results, _ = generated
    handoff = results[len(results) // 2].phy_offset
    config = config_file(tmp_path, "out", tmp / "store")
    backfill(load_config(config, env={}), spark=spark, to_offset=handoff)
    before = outputs(tmp_path / "out")
    res = run_cli("backfill", "--config", str(config), "--master", "local[1]", "--from", str(handoff),
                  "--conf", "spark.ui.enabled=false", env={"JAVA_HOME": str(tmp_path / "no-java")})
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("reputd: error: ")
    assert "the output holds an earlier range" in res.stderr
    assert "JAVA_HOME" not in res.stderr  # refused before Java was even looked for
    assert len(res.stderr.strip().splitlines()) == 1
    assert outputs(tmp_path / "out") == before


def corrupt_store(tmp: Path) -> tuple[Path, list, int]:
    """A store with a bad magic code in a record of its third segment."""
    store = tmp / "store"
    results = write_store(store, n=600)
    victim = next(r for r in results if r.phy_offset // SEGMENT == 2 and r.phy_offset % SEGMENT > 0)
    path = store / "commitlog" / f"{2 * SEGMENT:020d}"
    with open(path, "r+b") as f:
        f.seek(victim.phy_offset % SEGMENT + MAGIC_CODE_OFFSET)
        f.write(b"\x00\x00\x00\x01")
    return path, results, victim.phy_offset


def test_corrupt_record_fails_naming_file_and_offset(spark, tmp_path):
    """A corrupt record fails the job with the segment file and the offset named; nothing is written."""
    path, _, offset = corrupt_store(tmp_path)
    with pytest.raises(BackfillFailed) as err:
        backfill(make_config(tmp_path, "out", tmp_path / "store"), spark=spark)
    assert str(path) in str(err.value)
    assert f"offset {offset}" in str(err.value)
    assert not (tmp_path / "out" / "consumequeue").exists()
    assert not (tmp_path / "out" / "index").exists()
    assert_no_staging(tmp_path / "out")


def test_skip_segment_skips_the_rest_of_the_segment_like_the_daemon(spark, tmp_path):
    """onCorruption: skip-segment dispatches up to the bad record, skips to the next segment (logged in the
    summary) and goes on; the files are those `reputd run` writes with the same policy."""
    path, results, offset = corrupt_store(tmp_path)
    config = make_config(tmp_path, "bf", tmp_path / "store", reput={"onCorruption": "skip-segment"})
    summary = backfill(config, spark=spark)
    assert [(a, b) for a, b, _ in summary.skipped] == [(offset, 3 * SEGMENT)]
    assert str(path) in summary.skipped[0][2]
    skipped = sum(1 for r in results if offset <= r.phy_offset < 3 * SEGMENT)
    assert summary.messages == len(results) - skipped
    config_file(tmp_path, "daemon", tmp_path / "store", reput={"onCorruption": "skip-segment"})
    res = run_cli("run", "--config", str(tmp_path / "daemon.yaml"), "--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert_same_files(files_under(tmp_path / "bf"), outputs(tmp_path / "daemon"))


def test_to_inside_a_record_is_refused(spark, generated, tmp_path):
    """--to must be a record boundary (where a daemon can have started)."""
    tmp, results, _ = generated
    with pytest.raises(BackfillFailed, match="not a record boundary"):
        backfill(make_config(tmp_path, "out", tmp / "store"), spark=spark, to_offset=results[100].phy_offset + 3)
    assert not (tmp_path / "out" / "consumequeue").exists()


def test_write_task_seconds_count_the_catalog_writers(spark, generated, tmp_path):
    """The summary's writeTaskSeconds is every writer task's time: with no ConsumeQueue and no IndexFile to
    build (the index off, only the index dispatcher named), the catalog's writers are all the write tasks,
    and their time is counted (it was 0: the bench's catalog row showed less write time than without)."""
    tmp, _, _ = generated
    config = make_config(tmp_path, "out", tmp / "store", store={"messageIndexEnable": False})
    path = tmp_path / "out.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "dispatchers": ["index"]}))
    summary = backfill(load_config(path, env={}), spark=spark, catalog=str(tmp_path / "catalog"))
    assert summary.files["catalog"] > 0
    assert not summary.files.get("consumequeue")
    assert not summary.files.get("index")
    assert summary.write_task_seconds > 0
    assert config.store.message_index_enable is False


def test_catalog_is_typed_one_file_per_topic_and_day_and_answers_the_documented_queries(spark, spark_sql, generated,
                                                                                           tmp_path):
    """--catalog: one Parquet row per dispatched message with typed camelCase columns, one file per (topic,
    day), and docs/backfill.md's two Spark SQL queries give the answers the store holds."""
    tmp, results, _ = generated
    catalog = tmp_path / "catalog"
    summary = backfill(make_config(tmp_path, "out", tmp / "store", backfill={"rangeBytes": 20_000}), spark=spark,
                       catalog=str(catalog))
    files = sorted(str(p.relative_to(catalog)) for p in catalog.rglob("*.parquet"))
    name = file_name(0, summary.end_offset)
    assert files == [f"{t}/2023-11-14/{name}" for t in ("Late", "SCHEDULE_TOPIC_XXXX", "TopicA", "TopicB")]
    assert len(files) == 4 == summary.files["catalog"]
    assert sorted(p.name for p in (catalog / "_reputd-backfills").iterdir()) == [f"{0:020d}-{summary.end_offset:020d}"]
    assert not (catalog / "_reputd-staging").exists()
    rows = read_catalog(spark_sql, catalog)
    types = dict(rows.dtypes)
    assert types["storeTime"] == types["bornTime"] == "timestamp"
    assert types["keys"] == "array<string>"
    assert types["date"] == "date"
    assert types["topic"] == "string"
    assert rows.count() == len(results)
    first = rows.orderBy("commitLogOffset").first()
    assert (first.commitLogOffset, first.topic, str(first.date), first.tags) == (0, "TopicA", "2023-11-14", "TagA")
    assert first.uniqKey is None  # message 0: no UNIQ_KEY (0 % 7)
    assert first.keys is None  # nor KEYS (0 % 5)
    assert first.msgId == results[0].msg_id
    delayed = rows.filter("topic = 'SCHEDULE_TOPIC_XXXX'").orderBy("commitLogOffset").first()
    assert delayed.commitLogOffset == results[17].phy_offset  # DELAY 17: sent to TopicA, queue 2
    assert (delayed.realTopic, delayed.realQueueId) == ("TopicA", 2)
    assert rows.filter("realTopic IS NOT NULL AND topic != 'SCHEDULE_TOPIC_XXXX'").count() == 0
    rows.createOrReplaceTempView("catalog")
    key_hits = spark_sql.sql(CATALOG_QUERIES["key"].format(topic="TopicB", key="k7-2😀", start="2023-11-01",
                                                       end="2023-12-01")).collect()
    assert [r.commitLogOffset for r in key_hits] == [results[7].phy_offset]
    per_day = {(r.topic, str(r.date)): r.messages for r in spark_sql.sql(CATALOG_QUERIES["per_day"]).collect()}
    assert per_day == {(t, "2023-11-14"): sum(1 for r in results if r.topic == t) for t in {r.topic for r in results}}
    readme = (Path(__file__).resolve().parents[1] / "docs" / "backfill.md").read_text()
    for query in CATALOG_QUERIES.values():
        assert " ".join(query.split()) in " ".join(readme.split())


def read_catalog(spark_sql, catalog: Path):
    """docs/backfill.md's reading: the directories are not `key=value`, so Spark reads below PATH only
    with recursiveFileLookup (without it: UNABLE_TO_INFER_SCHEMA)."""
    return spark_sql.read.option("recursiveFileLookup", "true").parquet(str(catalog))


# each reader's type names, as Spark's
ARROW_TYPES = {"int64": "bigint", "int32": "int", "timestamp[ms, tz=UTC]": "timestamp", "string": "string",
               "date32[day]": "date", "list<element: string>": "array<string>", "list<item: string>": "array<string>",
               "binary": "binary"}
DUCKDB_TYPES = {"BIGINT": "bigint", "INTEGER": "int", "TIMESTAMP WITH TIME ZONE": "timestamp", "VARCHAR": "string",
                "DATE": "date", "VARCHAR[]": "array<string>", "BLOB": "binary"}


def catalog_by_reader(spark_sql, catalog: Path) -> dict[str, tuple[list[tuple[str, str]], list[tuple[int, str, str]]]]:
    """What each reader, opening a catalog as docs/backfill.md says, makes of it: its columns in order with
    their types (as Spark names them), and (commitLogOffset, topic, date) of every row."""
    import datetime

    import duckdb
    import pandas
    import pyarrow.dataset as ds

    def triples(offsets, topics, dates) -> list[tuple[int, str, str]]:
        return sorted(zip((int(o) for o in offsets), topics, (d.isoformat() for d in dates), strict=True))

    seen = {}
    frame = pandas.read_parquet(catalog)  # as an operator reads it, then with the Arrow types pandas keeps
    assert frame.topic.dtype == object  # was a category
    assert {type(t) for t in frame.topic} == {str}
    assert frame.date.dtype == object  # was a category
    assert {type(d) for d in frame.date} == {datetime.date}
    typed = pandas.read_parquet(catalog, dtype_backend="pyarrow")
    seen["pandas"] = ([(c, ARROW_TYPES[str(t.pyarrow_dtype)]) for c, t in typed.dtypes.items()],
                      triples(frame.commitLogOffset, frame.topic, frame.date))
    table = ds.dataset(catalog, partitioning="hive").to_table()
    seen["pyarrow"] = ([(f.name, ARROW_TYPES[str(f.type)]) for f in table.schema],
                       triples(table["commitLogOffset"].to_pylist(), table["topic"].to_pylist(),
                               table["date"].to_pylist()))
    with duckdb.connect() as db:
        result = db.execute(f"SELECT * FROM read_parquet('{catalog}/**/*.parquet')")
        names = [d[0] for d in result.description]
        types = [str(d[1]) for d in result.description]
        got = result.fetchall()
    at = {n: i for i, n in enumerate(names)}
    seen["duckdb"] = ([(n, DUCKDB_TYPES[t]) for n, t in zip(names, types, strict=True)],
                      triples((r[at["commitLogOffset"]] for r in got), (r[at["topic"]] for r in got),
                              (r[at["date"]] for r in got)))
    frame_ = read_catalog(spark_sql, catalog)
    rows = frame_.collect()
    seen["spark"] = (frame_.dtypes, triples((r.commitLogOffset for r in rows), (r.topic for r in rows),
                                            (r.date for r in rows)))
    return seen


def test_a_catalog_with_bodies_holds_each_messages_body(spark, generated, tmp_path):
    """`backfill.catalogBody: true`: the writers read the staged rows with the body column and every row's
    `body` is its message's."""
    import pyarrow.parquet as pq

    tmp, results, _ = generated
    catalog = tmp_path / "catalog"
    config = make_config(tmp_path, "out", tmp / "store", backfill={"rangeBytes": 20_000, "catalogBody": True})
    summary = backfill(config, spark=spark, catalog=str(catalog))
    assert summary.files["catalog"] == 4
    table = pq.ParquetDataset(sorted(str(p) for p in catalog.rglob("*.parquet"))).read()
    assert table.column_names[-3:] == ["body", "topic", "date"]
    number = {r.phy_offset: i for i, r in enumerate(results)}
    rows = table.select(["commitLogOffset", "body"]).to_pylist()
    assert len(rows) > len(results) // 2
    assert [r["body"] for r in rows] == [bytes([number[r["commitLogOffset"]] % 251])
                                         * (number[r["commitLogOffset"]] * 37 % 400) for r in rows]


def test_the_catalog_opens_in_pandas_pyarrow_duckdb_and_spark_alike(spark, spark_sql, generated, tmp_path):
    """The same 17 columns, in the same order with the same types, and the same rows in all four readers:
    `topic` and `date` are stored in the files only, under directories that are not `key=value` (inferred
    from `topic=T/date=D/` names, `date` was a string in pyarrow and `topic` a category in pandas)."""
    tmp, results, _ = generated
    catalog = tmp_path / "catalog"
    backfill(make_config(tmp_path, "out", tmp / "store"), spark=spark, catalog=str(catalog))
    seen = catalog_by_reader(spark_sql, catalog)
    expected = sorted((r.phy_offset, r.topic, "2023-11-14") for r in results)
    columns = [(f.name, ARROW_TYPES[str(f.type)]) for f in [*SCHEMA, *GROUP_FIELDS]]
    assert len(columns) == 17
    assert columns[-2:] == [("topic", "string"), ("date", "date")]
    for reader, (types, rows) in seen.items():
        assert types == columns, reader
        assert rows == expected, reader
    # without recursiveFileLookup Spark finds no file to infer a schema from (no partition directories)
    with pytest.raises(Exception, match="UNABLE_TO_INFER_SCHEMA"):
        spark_sql.read.parquet(str(catalog))


def test_topic_directories_are_path_safe_and_distinct(spark, spark_sql, tmp_path):
    """A topic's directory escapes what would make readers skip it (a leading "." or "_"), read it as a
    partition column ("=") or as a path or glob ("/", "%", "*"); the `topic` column keeps the real name,
    so every reader gives each row its topic."""
    import pyarrow as pa
    from pyarrow import fs

    from daemon.backfill.catalog import ParquetOut, partition_dir

    topics = ["%RETRY%group", "_hidden", ".dot", "a=b", "a/b", "x*?", "标签", "", "%", "%25",
              # over 255 bytes once escaped (ENAMETOOLONG as they are): shortened, each still its own
              "%" * 127, "%" * 126 + "a", "订" * 90 + "a", "订" * 90 + "b", "a" * 200 + "/" * 27]
    day = 19675  # 2023-11-14
    catalog = tmp_path / "catalog"
    for i, topic in enumerate(topics):
        rows = pa.table({"commitLogOffset": pa.array([i], pa.int64())})
        out = ParquetOut(fs.LocalFileSystem(), f"{catalog}/{partition_dir(topic, day)}/{file_name(0, 1)}", topic, day)
        out.write(rows, rows.nbytes)
        out.close()
        os.rename(out.path, out.path.removesuffix(".staged"))
    dirs = [partition_dir(t, day).split("/")[0] for t in topics]
    assert len(set(dirs)) == len(topics)
    assert not any(d[0] in "._" or "=" in d or "/" in d or "*" in d for d in dirs)
    assert max(len(d.encode()) for d in dirs) <= 255
    assert sorted(p.parent.parent.name for p in catalog.rglob("*.parquet")) == sorted(dirs)
    seen = catalog_by_reader(spark_sql, catalog)
    for reader, (types, rows) in seen.items():
        assert types == [("commitLogOffset", "bigint"), ("topic", "string"), ("date", "date")], reader
        assert rows == [(i, t, "2023-11-14") for i, t in enumerate(topics)], reader


def test_catalog_files_hold_whole_row_groups(tmp_path, monkeypatch):
    """A partition's rows go out in row groups of ROW_GROUP_ROWS, the rows past the last whole one held for
    the next (written at once, they made a small row group after each: 131072, 201, 131072, 2304, ...)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyarrow import fs

    from daemon.backfill import catalog
    from daemon.backfill.catalog import ParquetOut

    monkeypatch.setattr(catalog, "ROW_GROUP_ROWS", 100)
    out = ParquetOut(fs.LocalFileSystem(), f"{tmp_path}/T/2023-11-14/{file_name(0, 1)}", "T", 19675)
    for at in range(0, 1020, 30):  # a window's group at a time, as write_catalog gives them
        rows = pa.table({"commitLogOffset": pa.array(range(at, at + 30), pa.int64())})
        out.write(rows, rows.nbytes)
    out.close()
    meta = pq.ParquetFile(out.path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [100] * 10 + [20]
    table = pq.read_table(out.path)
    assert table.column("commitLogOffset").to_pylist() == list(range(1020))
    assert set(table.column("topic").to_pylist()) == {"T"}


def test_a_catalog_is_extended_exactly_by_later_backfills(spark, spark_sql, generated, tmp_path):
    """A second backfill over later segments appends to the catalog's day partitions; one over a range it
    holds in part adds only the rest; a rerun of the same range adds nothing."""
    tmp, results, _ = generated
    catalog = tmp_path / "catalog"
    third, two_thirds = results[len(results) // 3].phy_offset, results[2 * len(results) // 3].phy_offset
    backfill(make_config(tmp_path, "a", tmp / "store"), spark=spark, catalog=str(catalog), to_offset=third)
    backfill(make_config(tmp_path, "b", tmp / "store"), spark=spark, catalog=str(catalog), from_offset=third,
             to_offset=two_thirds)
    before = sorted(p.relative_to(catalog) for p in catalog.rglob("*.parquet"))
    again = backfill(make_config(tmp_path, "c", tmp / "store"), spark=spark, catalog=str(catalog), to_offset=two_thirds)
    assert again.files["catalog"] == 0
    assert sorted(p.relative_to(catalog) for p in catalog.rglob("*.parquet")) == before
    backfill(make_config(tmp_path, "d", tmp / "store"), spark=spark, catalog=str(catalog))  # overlaps [0, 2/3)
    rows = read_catalog(spark_sql, catalog).select("commitLogOffset").collect()
    assert sorted(r.commitLogOffset for r in rows) == [r.phy_offset for r in results]
    assert not (catalog / "_reputd-staging").exists()


def as_written_before_required_columns(catalog: Path) -> None:
    """Rewrite a catalog's files as reputd wrote them before its never-null columns were `required`: every
    column `optional` (with definition levels), data pages v1, the other options the same."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from daemon.backfill.catalog import DELTA_COLUMNS, DICTIONARY_COLUMNS, NO_STATISTICS

    for path in catalog.rglob("*.parquet"):
        table = pq.read_table(path)
        assert not table.schema.field("msgId").nullable  # as this reputd writes it
        table = table.cast(pa.schema([f.with_nullable(True) for f in table.schema]))
        pq.write_table(table, path, compression="zstd", use_dictionary=DICTIONARY_COLUMNS,
                       column_encoding=DELTA_COLUMNS, data_page_version="1.0",
                       write_statistics=[n for n in table.schema.names if n not in NO_STATISTICS])


@pytest.mark.parametrize("earlier_first", [True, False])
def test_a_catalog_written_before_required_columns_reads_alike_once_extended(spark, spark_sql, generated, tmp_path,
                                                                            earlier_first):
    """A catalog whose files hold every column `optional` (reputd before the never-null columns were
    `required`, data pages v1), extended by this reputd (`required` columns, data pages v2): all four
    readers give the same 17 columns and every row, whether the earlier file of a day sorts first (the
    earlier backfill was of the earlier range) or last, and the documented Spark queries still answer."""
    import pyarrow.parquet as pq

    tmp, results, _ = generated
    catalog = tmp_path / "catalog"
    third = results[len(results) // 3].phy_offset
    earlier, later = ({"to_offset": third}, {"from_offset": third}) if earlier_first else \
        ({"from_offset": third}, {"to_offset": third})
    backfill(make_config(tmp_path, "a", tmp / "store"), spark=spark, catalog=str(catalog), **earlier)
    as_written_before_required_columns(catalog)
    old = set(catalog.rglob("*.parquet"))
    backfill(make_config(tmp_path, "b", tmp / "store"), spark=spark, catalog=str(catalog), **later)
    new = set(catalog.rglob("*.parquet")) - old
    assert len(old | new) == 7  # `Late` is in the last third only
    assert len({p.parent for p in old} & {p.parent for p in new}) == 3  # three topics' days hold both kinds
    for path in old | new:
        assert pq.ParquetFile(path).schema_arrow.field("msgId").nullable == (path in old)
    for day in {p.parent for p in old} & {p.parent for p in new}:  # the file a reader lists first there
        assert (min(day.glob("*.parquet")) in old) == earlier_first
    seen = catalog_by_reader(spark_sql, catalog)
    expected = sorted((r.phy_offset, r.topic, "2023-11-14") for r in results)
    columns = [(f.name, ARROW_TYPES[str(f.type)]) for f in [*SCHEMA, *GROUP_FIELDS]]
    for reader, (types, rows) in seen.items():
        assert types == columns, reader
        assert rows == expected, reader
    read_catalog(spark_sql, catalog).createOrReplaceTempView("catalog")
    key_hits = spark_sql.sql(CATALOG_QUERIES["key"].format(topic="TopicB", key="k7-2😀", start="2023-11-01",
                                                       end="2023-12-01")).collect()
    assert [r.commitLogOffset for r in key_hits] == [results[7].phy_offset]
    per_day = {(r.topic, str(r.date)): r.messages for r in spark_sql.sql(CATALOG_QUERIES["per_day"]).collect()}
    assert per_day == {(t, "2023-11-14"): sum(1 for r in results if r.topic == t) for t in {r.topic for r in results}}


def test_a_catalog_in_the_earlier_layout_is_refused_before_spark_runs(spark, generated, tmp_path):
    """A catalog of the `topic=T/date=D/` layout (from the library, as an s3:// catalog reaches it; the CLI
    refuses a local one with exit 2): refused before any job, naming the path, and nothing is written."""
    tmp, _, _ = generated
    legacy = tmp_path / "legacy"
    (legacy / "topic=TopicA" / "date=2023-11-14").mkdir(parents=True)
    (legacy / "_reputd-backfills").mkdir()
    (legacy / "_reputd-backfills" / f"{0:020d}-{100:020d}").touch()
    before = sorted(legacy.rglob("*"))
    with pytest.raises(BackfillError, match=f"--catalog {legacy}: is in the topic=T/date=D/ layout of an earlier"):
        backfill(make_config(tmp_path, "out", tmp / "store"), spark=spark, catalog=str(legacy))
    assert sorted(legacy.rglob("*")) == before
    assert not (tmp_path / "out" / "consumequeue").exists()


def test_a_failed_backfill_leaves_no_staged_catalog_file(spark, spark_sql, generated, tmp_path, monkeypatch):
    """The catalog writers stage under CATALOG/_reputd-staging/JOB/ with names no `*.parquet` glob takes;
    a backfill that fails after them removes that directory, and the rerun writes the catalog."""
    from daemon.backfill import phases

    tmp, results, _ = generated
    catalog = tmp_path / "catalog"
    staged: list[str] = []

    def fail(self, results_, *args):
        staged.extend(str(p) for p in catalog.rglob("*") if p.is_file())
        raise BackfillError("injected failure at commit")

    monkeypatch.setattr(phases.Phases, "_commit", fail)
    with pytest.raises(BackfillError, match="injected"):
        backfill(make_config(tmp_path, "out", tmp / "store"), spark=spark, catalog=str(catalog))
    assert staged
    assert all("/_reputd-staging/" in p and not p.endswith(".parquet") for p in staged)
    assert not catalog.exists() or not list(catalog.rglob("*"))
    monkeypatch.undo()
    backfill(make_config(tmp_path, "again", tmp / "store"), spark=spark, catalog=str(catalog))
    assert read_catalog(spark_sql, catalog).count() == len(results)


def test_cli_backfill_prints_a_summary_and_matches_rebuild(generated, tmp_path):
    """`reputd backfill --master local[1]` exits 0 with messages, bytes, segments, seconds and msgs/s. The
    first run records the driver JVM's class archive as it ends, a one-off its summary line leaves out of
    the time and the rate and states on a note of its own (issue 33.9); the second maps it and, into the same
    output, finds the same files there: all its messages read, none new (as `rebuild` counts them, issue
    44.12); the JVM's messages about the archive stay off standard output, which holds the JSON summary."""
    tmp, results, expected = generated
    cache = tmp_path / "cache"
    out = tmp_path / "out"
    config = config_file(tmp_path, out.name, tmp / "store")
    for run in ("records the archive", "maps it"):
        first = run == "records the archive"  # the human summary, with the summary as a log event too
        res = run_cli("backfill", "--config", str(config), "--master", "local[1]", "--conf", "spark.ui.enabled=false",
                      *([] if first else ["--json"]),
                      env={"XDG_CACHE_HOME": str(cache), **({"REPUTD_LOGGING_LEVEL": "info"} if first else {})},
                      timeout=300)
        assert res.returncode == 0, res.stderr
        assert "Traceback" not in res.stderr
        assert "[Stage" not in res.stderr  # Spark's progress bar is for a terminal, not a captured stderr
        # nor Spark's start-up chatter: its default logging profile, host name and Hadoop warnings, levels
        for chatter in ("log4j profile", " WARN ", "Setting default log level", "Setting Spark log level",
                        "NativeCodeLoader", "WARNING: Using incubator modules", "\r"):
            assert chatter not in res.stderr, res.stderr
        if first:
            events = [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
            (summary,) = [e for e in events if e["event"] == "backfill_finished"]
            line, note = res.stdout.splitlines()
            m = re.fullmatch(rf"backfilled {len(results):,} messages, .* in ([\d.]+) s \(([\d,]+) msgs/s\); .*", line)
            assert m, line
            assert float(m[1]) == pytest.approx(summary["seconds"], abs=0.01)
            assert int(m[2].replace(",", "")) == round(len(results) / summary["seconds"])
            m = re.fullmatch(r"note: then ([\d.]+) s once, not in the time and rate above, to save the driver "
                             r"JVM's classes in (\S+), which later local backfills start from", note)
            assert m, note
            assert float(m[1]) == pytest.approx(summary["phaseSeconds"]["saveClassArchive"], abs=0.01)
            assert m[2] == summary["classArchiveSaved"]
            assert Path(m[2]).parent == cache / "reputd"
        else:
            summary = json.loads(res.stdout)
            assert summary["classArchiveSaved"] is None
        assert summary["messages"] == len(results)
        assert summary["newMessages"] == (len(results) if first else 0)
        assert summary["segments"] > 3
        assert summary["msgsPerSecond"] > 0
        assert summary["master"] == "local[1]"
        assert_same_files(outputs(out), expected)
        archives = list((cache / "reputd").glob("spark-driver-*.jsa"))
        assert len(archives) == 1, run
        assert archives[0].stat().st_size > 0, run
        assert ("saveClassArchive" in summary["phaseSeconds"]) == (run == "records the archive")
    assert not list((cache / "reputd").glob("*.tmp"))


def test_the_driver_jvms_stderr_is_passed_on_without_javas_incubator_warning():
    """Every line the driver JVM writes to standard error reaches the backfill's, in order, but Java's
    incubator-module warning; a closed standard error (`2>&1 | true`) does not stop the reading, which would
    leave the JVM blocked on a full pipe."""
    from daemon.backfill.driver import JVM_INCUBATOR_WARNING, forward_jvm_stderr

    lines = [b"first\n", JVM_INCUBATOR_WARNING + b"\n", b"Exception in thread \"main\"\n", b"x" * 100_000 + b"\n",
             b"no newline at the end"]
    for reader_open in (True, False):
        source_r, source_w = os.pipe()
        out_r, out_w = os.pipe()
        if not reader_open:
            os.close(out_r)
        thread = forward_jvm_stderr(os.fdopen(source_r, "rb"), fd=out_w)
        received = []
        if reader_open:  # the far end reads as the JVM's stderr would be read, while the JVM writes
            reader = threading.Thread(target=lambda r=out_r, into=received: into.append(os.fdopen(r, "rb").read()))
            reader.start()
        with os.fdopen(source_w, "wb") as source:
            for _ in range(20):
                source.write(b"".join(lines[:-1]))
            source.write(lines[-1])
        thread.join(60)
        assert not thread.is_alive()
        os.close(out_w)
        if reader_open:
            reader.join(60)
            assert received == [b"".join(line for line in lines[:-1] if JVM_INCUBATOR_WARNING not in line) * 20
                                + lines[-1]]


def test_a_python_workers_stderr_reaches_the_backfills_through_the_jvm(spark, capfd):
    """A task's words on standard error (a worker's traceback) go through the driver JVM's standard error,
    which the backfill now reads itself: they still reach its own."""

    def speak(numbers):
        import sys

        for n in numbers:
            print(f"worker-stderr-marker-{n}", file=sys.stderr, flush=True)
            yield n

    assert sorted(spark.parallelize(range(2), 2).mapPartitions(speak).collect()) == [0, 1]
    seen = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(f"worker-stderr-marker-{n}" in seen for n in (0, 1)):
        time.sleep(0.1)
        seen += capfd.readouterr().err
    assert "worker-stderr-marker-0" in seen
    assert "worker-stderr-marker-1" in seen


def test_cli_corrupt_store_exits_1_with_one_line(tmp_path):
    """A corrupt record: exit 1, one line naming file and offset, no traceback, nothing written."""
    path, _, offset = corrupt_store(tmp_path)
    config = config_file(tmp_path, "out", tmp_path / "store")
    res = run_cli("backfill", "--config", str(config), "--master", "local[1]", "--conf", "spark.ui.enabled=false",
                  timeout=300)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert f"reputd: error: corrupt record in {path} @ offset {offset}" in res.stderr
    assert not (tmp_path / "out" / "consumequeue").exists()


def test_cli_backfill_with_its_output_pipe_closed_runs_to_the_end(generated, tmp_path):
    """`reputd backfill ... 2>&1 | head -5`: stdout and stderr one pipe whose reader is gone at once. Exit 0 and
    the same files as the rebuild (it exited 1 halfway: consumequeue/ written, no index/)."""
    tmp, _, expected = generated
    config = config_file(tmp_path, "out", tmp / "store")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([*REPUTD, "backfill", "--config", str(config), "--master", "local[1]", "--conf",
                              "spark.ui.enabled=false"], stdout=write, stderr=write,
                             env={**env, "REPUTD_LOGGING_LEVEL": "info"}, timeout=300, check=False)
    finally:
        os.close(write)
    assert res.returncode == 0
    assert_same_files(outputs(tmp_path / "out"), expected)


def test_missing_java_is_a_clear_error(tmp_path):
    """Without JAVA_HOME or `java` on PATH: exit 1 and a message saying to install Java 17."""
    write_store(tmp_path / "store", n=10)
    config = config_file(tmp_path, "out", tmp_path / "store")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME" and not k.startswith("REPUTD_")}
    env["PATH"] = str(tmp_path / "no-java-here")
    res = subprocess.run([*REPUTD, "backfill", "--config", str(config)], capture_output=True, text=True, env=env,
                         timeout=60, check=False)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert "install" in res.stderr
    assert "Java 17" in res.stderr
    with pytest.raises(BackfillError, match="JAVA_HOME"):
        check_java({"JAVA_HOME": str(tmp_path), "PATH": ""})


@pytest.mark.parametrize(("conf", "ui"), [({}, False), ({"spark.ui.enabled": "true"}, True)])
def test_a_local_context_has_no_web_ui_unless_asked(conf, ui):
    """A local backfill starts no web UI (about 1 CPU-s of a short job's driver JVM); `--conf
    spark.ui.enabled=true` brings it back. A fresh interpreter: the tests' shared context is made already."""
    code = ("import sys, json; from daemon.backfill.driver import create_context; "
            f"s = create_context('local[1]', json.loads({json.dumps(json.dumps(conf))})); "
            "print(s.uiWebUrl); s.stop()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    url = res.stdout.strip().splitlines()[-1]
    assert (url != "None") is ui, url
    if ui:
        assert url.startswith("http://")


def test_workers_keep_freed_memory_where_the_c_library_is_glibc():
    """The Python daemon sets the workers' allocator thresholds where the C library is glibc (mallopt says it
    took both) and leaves any other alone; in a fresh interpreter, as the daemon does."""
    code = "from daemon.backfill.pydaemon import keep_freed_memory; print(keep_freed_memory())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(platform.libc_ver()[0] == "glibc")


def test_segments_take_paths_and_file_s3_hdfs_uris(tmp_path):
    """--segments: plain paths and file://, s3:// and hdfs:// URIs; other schemes are refused (exit 2)."""
    config = make_config(tmp_path, "out", tmp_path / "store")
    assert commit_log_dirs(config, None) == config.store.commit_log_dirs
    assert commit_log_dirs(config, f"file://{tmp_path}/a,{tmp_path}/b") == (f"{tmp_path}/a", f"{tmp_path}/b")
    assert commit_log_dirs(config, "s3://bucket/rocketmq/commitlog/") == ("s3://bucket/rocketmq/commitlog",)
    assert commit_log_dirs(config, "hdfs://nn:8020/rmq/commitlog") == ("hdfs://nn:8020/rmq/commitlog",)
    for uri in ("s3a://bucket/commitlog", "gs://bucket/commitlog", "s3:///no-bucket"):
        with pytest.raises(ValueError, match="--segments"):
            commit_log_dirs(config, uri)
    res = run_cli("backfill", "--config", str(tmp_path / "out.yaml"), "--segments", "ftp://host/commitlog")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("master", ["local1", "local[x]", "spark:/host:7077", "127.0.0.1:7077", "", "spark://host",
                                    "spark://h1:7077,h2", "spark://host:port"])
def test_a_master_spark_cannot_parse_is_refused_before_spark_starts(tmp_path, master):
    """A master URL Spark would reject once its JVM is up is a usage error at once, naming the accepted forms."""
    config = make_config(tmp_path, "out", tmp_path / "store")
    res = run_cli("backfill", "--config", str(tmp_path / "out.yaml"), "--master", master)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert f"--master {master} is not a Spark master URL: local, local[N]" in res.stderr
    assert not os.path.exists(config.output.dir)


def test_the_master_urls_spark_accepts_pass():
    from daemon.cli.backfill import SPARK_MASTER_URL

    for master in ("local", "local[1]", "local[*]", "local[4, 2]", "local-cluster[2, 1, 1024]", "yarn",
                   "spark://127.0.0.1:7077", "spark://h1:7077,h2:7077", "spark://[::1]:7077", "k8s://https://api:6443",
                   "mesos://zk://h:2181"):
        assert SPARK_MASTER_URL.fullmatch(master), master


def test_a_standalone_master_nothing_answers_at_fails_at_once_naming_it(generated, tmp_path):
    """`--master spark://HOST:PORT` with nothing listening there: exit 1 with one line naming the address,
    before Spark starts (Spark retried for over a minute, then said only "Cannot call methods on a stopped
    SparkContext"), and nothing left: the output directory it created is gone again, lock file and all."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    config = config_file(tmp_path, "out", generated[0] / "store")
    res = run_cli("backfill", "--config", str(config), "--master", f"spark://127.0.0.1:{port}")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert f"reputd: error: no Spark master answers at 127.0.0.1:{port} (Connection refused)" in res.stderr
    assert "stopped SparkContext" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_one_standalone_master_that_answers_is_enough():
    """A master with standbys (`spark://h1:p1,h2:p2`): one address accepting connections passes the check;
    local and cluster-manager masters are Spark's business."""
    from daemon.backfill.driver import check_master_answers

    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
    with socket.create_server(("127.0.0.1", 0)) as live:
        live_port = live.getsockname()[1]
        check_master_answers(f"spark://127.0.0.1:{dead_port},127.0.0.1:{live_port}")
        check_master_answers(f"spark://127.0.0.1:{live_port}")
    with pytest.raises(BackfillError, match=rf"127.0.0.1:{dead_port} \(Connection refused\)"):
        check_master_answers(f"spark://127.0.0.1:{dead_port}")
    for master in ("local[2]", "yarn", "k8s://https://api:6443"):
        check_master_answers(master)


def test_hdfs_reaches_the_filesystem_call(tmp_path, monkeypatch):
    """hdfs:// goes to pyarrow's HadoopFileSystem with the namenode of the URI; without libhdfs (as here) the
    error names the URI and what HDFS needs."""
    from pyarrow import fs

    calls = []

    def fake_hdfs(host, port):
        calls.append((host, port))
        raise OSError("Unable to load libhdfs")

    monkeypatch.setattr(fs, "HadoopFileSystem", fake_hdfs)
    config = make_config(tmp_path, "out", tmp_path / "store")
    with pytest.raises(StoreError, match=r"hdfs://nn:8020/rmq/commitlog.*libhdfs"):
        backfill(config, segments="hdfs://nn:8020/rmq/commitlog", spark=object())
    assert calls == [("nn", 8020)]


def test_a_jvm_out_of_memory_says_which_setting_to_raise():
    """The JVM's OutOfMemoryError, or the JVM gone (the py4j connection refused), is one line naming the
    setting to raise, never py4j's or the JVM's traces."""
    from py4j.protocol import Py4JNetworkError

    oom = Exception("An error occurred while calling o123.collectToPython.\n: java.lang.OutOfMemoryError: Java heap "
                    "space\n\tat java.base/java.util.Arrays.copyOf(Arrays.java:3541)\n")
    assert spark_error_line(oom) == ("Spark's JVM ran out of memory (java.lang.OutOfMemoryError: Java heap space): "
                                     "raise spark.driver.memory (a local master runs the tasks in the driver JVM) "
                                     "or, on a cluster, spark.executor.memory, e.g. --conf spark.driver.memory=4g")
    for gone in (ConnectionRefusedError(111, "Connection refused"), Py4JNetworkError("Answer from Java side is empty")):
        line = spark_error_line(gone)
        assert line.startswith("Spark's JVM ended during the backfill (")
        assert line.endswith("e.g. --conf spark.driver.memory=4g")
        assert "\n" not in line


def test_spark_errors_become_the_task_error_line():
    """A Py4JJavaError's text (Java stack, Python traceback inside) reduces to the task's own error line."""
    text = ("An error occurred while calling o12.collectAndServe.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 failed 3 "
            "times, most recent failure: Lost task 0.2 (TID 9): org.apache.spark.api.python.PythonException: "
            "Traceback (most recent call last):\n  File \"/x/worker.py\", line 1, in main\n"
            "OSError: [Errno 28] No space left on device: '/out/index/20231114221623169'\n\n"
            "The above exception was the direct cause of the following exception:\n\n"
            "daemon.backfill.tasks.BackfillTaskError: index task 0: [Errno 28] No space left on device: "
            "'/out/index/20231114221623169'\n\n\tat org.apache.spark.api.python.BasePythonRunner.handle(x.scala:1)\n")
    assert spark_error_line(RuntimeError(text)) == (
        "BackfillTaskError: index task 0: [Errno 28] No space left on device: '/out/index/20231114221623169'")


def test_py4j_tracebacks_on_the_root_logger_are_kept_out(caplog):
    """py4j's gateway logs "Exception while sending command." with its traceback through the root logger
    (`logging.exception`) when the JVM goes away mid-call, as when a signal kills it during Spark's start:
    the operator saw it after `reputd: interrupted`. Other root-logger records still pass."""
    import logging

    quiet_pyspark_servers()
    code = ("try:\n    raise OSError('gone')\n"
            "except OSError:\n    logging.exception('Exception while sending command.')\n")
    with caplog.at_level(logging.INFO):
        exec(compile(code, os.path.join("site-packages", "py4j", "java_gateway.py"), "exec"), {"logging": logging})
        logging.getLogger().error("reputd's own")
    assert [r.getMessage() for r in caplog.records] == ["reputd's own"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_backfill_interrupted_mid_job_exits_130_cleanly(generated, tmp_path, sig):
    """Ctrl-C (or a service manager's SIGTERM) while a Spark job runs: the jobs are cancelled, the staging
    directory removed, nothing written, exit 130 with one line. PySpark's own SIGINT handler called into
    the JVM from inside a JVM call: py4j printed three tracebacks; SIGTERM killed the command outright.
    The signal goes while the decode job's first task runs, its tree held until then (it cannot end first)."""
    proc, marker = _marked_backfill(generated, tmp_path, "BACKFILL_MID_JOB", sig, None)
    err = _interrupted_leaving_nothing(proc, marker, sig, None, ("Traceback",),
                                       task=tmp_path / "out" / STAGING_DIR / "*" / "r*-a*")  # a range's decode
    assert err.rstrip().endswith("reputd: interrupted"), err[-2000:]
    out = tmp_path / "out"
    assert not (out / STAGING_DIR).exists()
    assert not (out / "consumequeue").exists()
    assert not (out / "index").exists()


def test_cli_backfill_interrupted_during_the_commit_exits_130_saying_what_the_output_holds(generated, tmp_path,
                                                                                          monkeypatch, capsys):
    """A signal during the commit stops it between two files (CommitInterrupted): the command exits 130 with the
    one line that says how far the commit got and how to complete it."""
    from daemon.backfill import job
    from daemon.backfill.interrupt import CommitInterrupted
    from daemon.cli import main

    tmp, _, _ = generated
    config = config_file(tmp_path, "out", tmp / "store")
    out = tmp_path / "out"

    def interrupted(config, **_kwargs):
        raise CommitInterrupted(config.output.dir, (3, 7, 0, 1), catalog=True)

    monkeypatch.setattr(job, "backfill", interrupted)
    sigterm = signal.getsignal(signal.SIGTERM)
    logging = structlog.get_config()  # the command points the log at this test's captured stderr
    try:
        assert main(["backfill", "--config", str(config)]) == 130
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        structlog.configure(**logging)
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"reputd: interrupted: the backfill's commit stopped after putting the files of 3 of 7 queues and 0 of 1 "
        f"IndexFile in place (each whole) and put nothing more in {out}, and the catalog was not extended; the "
        "same backfill run again puts the rest (what is in place is checked and kept)")


def _marked_processes(marker: str) -> list[int]:
    """Processes whose environment holds `marker` (everything a command started inherits it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _marked_backfill(generated, tmp_path, tag: str, sig, after: float) -> tuple[subprocess.Popen, str]:
    """`reputd backfill` of the generated store into tmp_path/out on local[1], its process tree marked by an
    environment variable named after `tag` (`_marked_processes` finds what is left of it)."""
    tmp, _, _ = generated
    config = config_file(tmp_path, "out", tmp / "store")
    marker = f"{tag}_{os.getpid()}_{sig}_{after}".replace(".", "_")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    env[marker] = "1"
    proc = subprocess.Popen([*REPUTD, "backfill", "--config", str(config), "--master", "local[1]", "--conf",
                             "spark.ui.enabled=false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    return proc, marker


def _hold_tree(proc: subprocess.Popen, marker: str) -> list[int]:
    """SIGSTOP the backfill, then every process of its tree (the Spark launcher, the JVM, its Python workers):
    nothing of it runs until `_release`. The backfill first, at once: stopped, it can neither start a job
    nor take a finished one's result."""
    os.kill(proc.pid, signal.SIGSTOP)
    held = [proc.pid]
    for pid in _marked_processes(marker):
        if pid != proc.pid:
            try:
                os.kill(pid, signal.SIGSTOP)
                held.append(pid)
            except ProcessLookupError:
                continue
    return held


def _release(held: list[int]) -> None:
    for pid in reversed(held):  # the backfill last, its pending signal then handled at once
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue


def _interrupted_leaving_nothing(proc: subprocess.Popen, marker: str, sig, after: float | None, traces,
                                 task: Path | None = None) -> str:
    """`sig` to the backfill `after` seconds from now, or (`after` None) the moment a task of a Spark job runs,
    the first path matching the glob `task` (a task's staging directory): exit 130, none of `traces` in
    stderr, which ends with the one line, and no process of its tree left. Returns stderr.

    The backfill cannot end before its signal, however fast the machine: at the moment `after` None waits
    for, or else as it prints "decoding" (before its first job) with its signal not yet sent, its whole tree
    is stopped (SIGSTOP) until the signal is sent, then continued (SIGCONT): a signal late for start-up lands
    during the jobs, never after the end. (A fixed delay let a faster backfill exit 0 first.)"""
    lines: list[str] = []
    lock = threading.Lock()
    held: list[int] = []
    holding = threading.Event()
    sent = False

    def hold() -> None:
        with lock:
            if not sent and not holding.is_set():
                held.extend(_hold_tree(proc, marker))
                holding.set()

    def read_stderr() -> None:
        for line in proc.stderr:
            lines.append(line)
            if task is None and "decoding " in line:
                hold()

    def watch_tasks() -> None:
        while not holding.is_set() and proc.poll() is None:
            if glob.glob(str(task)):
                hold()
            time.sleep(0.002)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    if task is not None:
        threading.Thread(target=watch_tasks, daemon=True).start()
    drain = threading.Thread(target=proc.stdout.read, daemon=True)  # a full pipe must not stall the backfill
    drain.start()
    try:
        if after is None:
            deadline = time.monotonic() + 120
            while not holding.wait(0.01) and proc.poll() is None and time.monotonic() < deadline:
                pass
            assert holding.is_set(), f"no task {task} seen before the backfill ended ({proc.poll()}): {''.join(lines)}"
        else:
            time.sleep(after)
        with lock:
            ended = proc.poll()
            assert ended is None, f"the backfill ended (exit {ended}) before its signal: {''.join(lines)}"
            proc.send_signal(sig)
            sent = True
            _release(held)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # a failed assertion: nothing of it is left stopped or running
            _release(held)
            for pid in [proc.pid, *_marked_processes(marker)]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=30)
        reader.join(timeout=10)
        drain.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode == 130, err
    for trace in traces:
        assert trace not in err, err
    assert err.rstrip().endswith("reputd: interrupted"), err
    deadline = time.monotonic() + 30
    while _marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked_processes(marker) == []
    return err


@pytest.mark.parametrize(("sig", "after"), [(signal.SIGTERM, 0.0), (signal.SIGINT, 0.05), (signal.SIGTERM, 0.1),
                                            (signal.SIGINT, 0.2), (signal.SIGTERM, 0.5), (signal.SIGINT, 1.0),
                                            (signal.SIGTERM, 2.0), (signal.SIGINT, None)],
                         ids=["term-0s", "int-0.05s", "term-0.1s", "int-0.2s", "term-0.5s", "int-1s", "term-2s",
                              "int-writing"])
def test_cli_backfill_signal_from_its_first_instant_is_one_line(generated, tmp_path, sig, after):
    """A signal `after` seconds from the moment the command first handles signals (its first lines of
    Python, while it still imports its modules): one line, exit 130, nothing left running or staged. A
    SIGINT in the first ~0.2 s printed a KeyboardInterrupt traceback (the imports ran before any handling)
    and a SIGTERM ended it with 143, silent. The interpreter's own start, before reputd runs a line, stays
    the signal's: the process ends of it (a shell shows 130 for SIGINT). `after` None: while a task of its
    last job, the writers', runs (a fixed 5 s let a faster backfill end first)."""
    proc, marker = _marked_backfill(generated, tmp_path, "BACKFILL_EARLY_SIGNAL", sig, after)
    writing = tmp_path / "out" / STAGING_DIR / "*" / "index-p*"  # a task of the write job (its IndexFiles first)
    deadline = time.monotonic() + 60
    while proc.poll() is None and not catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.001)
    err = _interrupted_leaving_nothing(proc, marker, sig, after,
                                       ("Traceback", "KeyboardInterrupt", "Exception", "\tat ", "py4j", "ERROR"),
                                       task=None if after is not None else writing)
    assert err.count("reputd: interrupted") == 1, err
    out = tmp_path / "out"
    assert not (out / STAGING_DIR).exists()
    assert not (out / "consumequeue").exists()
    assert not (out / "index").exists()


@pytest.mark.parametrize(("sig", "after"), [(signal.SIGINT, 0.0), (signal.SIGINT, 0.5), (signal.SIGTERM, 0.2),
                                            (signal.SIGINT, 2.0), (signal.SIGTERM, 4.0)],
                         ids=["int-0s", "int-0.5s", "term-0.2s", "int-2s", "term-4s"])
def test_cli_backfill_interrupted_during_start_up_leaves_nothing_running(generated, tmp_path, sig, after):
    """A signal at any moment of Spark's start-up (`after` seconds once its launcher runs): one line, exit
    130, and no process left (the gateway JVM outlived reputd for minutes and printed a Java stack trace;
    SIGTERM exited 143 saying nothing; later, py4j printed its tracebacks)."""
    proc, marker = _marked_backfill(generated, tmp_path, "BACKFILL_SIGNAL_TEST", sig, after)
    deadline = time.monotonic() + 120
    while proc.poll() is None and len(_marked_processes(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # until Spark's launcher has started (a process below reputd)
    _interrupted_leaving_nothing(proc, marker, sig, after, ("Traceback", "Exception", "\tat ", "py4j", "ERROR"))
    assert not (tmp_path / "out" / STAGING_DIR).exists()


class _CancelRecorder:
    """A SparkContext as the signal handling sees it: the job groups it was asked to cancel."""

    def __init__(self):
        self.cancelled: list[str] = []

    def cancelJobGroup(self, group):  # PySpark's name
        self.cancelled.append(group)


def test_a_signal_during_the_write_job_stops_the_commit_and_one_during_the_commit_is_kept_for_it():
    """The cancel can reach Spark before the write job starts, which then runs whole: the signal is checked
    again as the commit begins (it had linked the files into place, then said "reputd: interrupted" with
    exit 130). A signal once the commit began raises nothing there: it is kept (`signal`) for the commit to
    stop between two files (tests/test_backfill_queuewriter.py's
    test_a_signal_during_the_commit_stops_it_between_two_queues)."""
    from daemon.backfill.interrupt import Interrupt

    context = _CancelRecorder()
    cancelled = context.cancelled
    for committing_first in (False, True):
        interrupt = Interrupt(own=True)
        try:
            interrupt.arm(context, "g")
            if committing_first:
                interrupt.committing()
                os.kill(os.getpid(), signal.SIGINT)
                assert interrupt.commit_began()
                assert interrupt.signal == signal.SIGINT
            else:
                os.kill(os.getpid(), signal.SIGINT)
                deadline = time.monotonic() + 10
                while not cancelled and time.monotonic() < deadline:
                    time.sleep(0.01)
                with pytest.raises(KeyboardInterrupt):
                    interrupt.committing()
                assert not interrupt.commit_began()
        finally:
            interrupt.stopping()
            interrupt.disarm()
    assert cancelled
    assert set(cancelled) == {"g"}


def test_a_signal_cancels_the_jobs_again_until_the_driver_leaves_them():
    """Spark cancels only a group's running jobs, so a job submitted just after the cancel (the write job as the
    decode ends) ran whole: the cancel is repeated while the driver runs the jobs, and ends when it stops."""
    from daemon.backfill import interrupt as interrupt_module

    context = _CancelRecorder()
    cancelled = context.cancelled
    interrupt = interrupt_module.Interrupt(own=True)
    try:
        interrupt.arm(context, "g")
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 30
        while len(cancelled) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cancelled == ["g"] * len(cancelled)
        assert len(cancelled) >= 3
    finally:
        interrupt.stopping()
        interrupt.disarm()
    time.sleep(2 * interrupt_module.CANCEL_REPEAT_S)  # a cancel under way when it stopped ends
    after = len(cancelled)
    time.sleep(5 * interrupt_module.CANCEL_REPEAT_S)
    assert len(cancelled) == after
