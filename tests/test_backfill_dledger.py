"""The backfill on a DLedger CommitLog (daemon/backfill/dledger.py): whatever the range size, ranges cut inside
DLedger data files find their first entry and chain into exactly what one sequential read of the log gives
(no Spark: the decode tasks and the driver's walk as plain functions); and `reputd backfill` writes the files
`reputd rebuild` writes, on the real 4.9.3 DLedger store in shared/ and on a store upgraded from the plain
CommitLog (old commitlog/ below dividedCommitlogOffset, DLedger entries after it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from bench.spark_cluster import StandaloneCluster
from daemon.backfill import backfill
from daemon.backfill.boundaries import entry_at
from daemon.backfill.ranges import DecodeSettings
from daemon.backfill.source import LOCAL, SegmentDir, SegmentListing
from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from indexcore.commitlog import encode_blank
from indexcore.dispatch import DEFAULT_MESSAGE_DELAY_LEVEL
from indexcore.dledger import DLEDGER_ENTRIES, ENTRY_HEADER_SIZE
from indexcore.dledgerlog import DLedgerLog
from indexcore.dledgerwriter import DLedgerLogWriter, commitlog_records, write_checkpoint
from indexcore.queuestore import consume_queue_units
from indexcore.reader import CommitLogReader, ReadStatus
from indexcore.writer import CommitLogWriter, Message
from tests import stress
from tests.conformance import conformance_roots
from tests.test_backfill_ranges import ranged as run_ranges
from tests.test_backfill_s3 import BUCKET, KEYS
from tests.test_backfill_s3 import s3_server as s3_server  # noqa: PLC0414 - the fixture, used by name
from tests.test_daemon import clean_env

SEGMENT = 65536
DLEDGER = {"enableDLegerCommitLog": True, "dLegerSelfId": "n0", "dLegerGroup": "broker-a",
           "dLegerPeers": "n0-127.0.0.1:40911"}


def _store() -> Path | None:
    for root in conformance_roots():
        if (root / "dledger" / "store" / "dledger-n0" / "data").is_dir():
            return root / "dledger" / "store"
    return None


STORE = _store()
needs_store = pytest.mark.skipif(STORE is None, reason="the shared dledger conformance store is not on this machine")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """A store upgraded from the plain CommitLog: 2 plain segments (the last closed by a BLANK, as
    DLedgerCommitLog.recover closes it), then DLedger data files from dividedCommitlogOffset = 131072."""
    root = tmp_path_factory.mktemp("mixed") / "store"
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 13))
    plain = CommitLogWriter(str(root / "commitlog"), SEGMENT, clock=lambda: next(clock))
    for i in range(400):
        plain.append(Message(("A", "B")[i % 2], i % 4, bytes([i % 9]) * (80 + i % 120),
                             {"KEYS": f"p{i} k{i % 7}", "UNIQ_KEY": f"P{i:031X}", "TAGS": "x"}))
    assert SEGMENT < plain.max_offset < 2 * SEGMENT
    end = plain.max_offset
    plain.close()
    with open(root / "commitlog" / f"{end - end % SEGMENT:020d}", "r+b") as f:  # DLedgerCommitLog.recover's BLANK
        f.seek(end % SEGMENT)
        f.write(encode_blank(SEGMENT - end % SEGMENT))
    scratch = root.parent / "scratch"
    more = CommitLogWriter(str(scratch), SEGMENT, clock=lambda: next(clock))
    more.queue_offsets.update(plain.queue_offsets)
    for i in range(900):
        more.append(Message(("A", "B", "C")[i % 3], i % 4, bytes([i % 5]) * (60 + i % 300),
                            {"KEYS": f"d{i}", "UNIQ_KEY": f"D{i:031X}"}))
    more.close()
    writer = DLedgerLogWriter(str(root / "dledger-n0"), SEGMENT, first_offset=2 * SEGMENT)
    for record in commitlog_records(str(scratch), SEGMENT):
        writer.append(record, 0)
    write_checkpoint(str(root / "dledger-n0"), writer.next_index - 1, writer.next_index - 1)
    shutil.rmtree(scratch)
    return root


def dirs_of(root: Path) -> list[SegmentDir]:
    old = [SegmentDir(LOCAL, str(root / "commitlog"))] if (root / "commitlog").is_dir() else []
    return [*old, SegmentDir(LOCAL, str(root / "dledger-n0" / "data"))]


def ranged(root: Path, range_bytes: int, start: int | None = None, to: int | None = None):
    """The decode tasks and the driver's walk, as the job runs them: (units by queue, keys, rereads)."""
    listing = SegmentListing(dirs_of(root), SEGMENT)
    dledger_from = min(seg.start for seg in listing.segments if "/dledger-n0/" in seg.location)
    s = DecodeSettings(SEGMENT, True, 4 * 1024 * 1024, DEFAULT_MESSAGE_DELAY_LEVEL, 8192, 1024 * 1024, True, False,
                       False, stage_root=tempfile.mkdtemp(prefix="ranges-"), dledger_from=dledger_from)
    _, queues, keys, rereads = run_ranges(dirs_of(root), range_bytes, segment=SEGMENT, s=s, start=start, to=to)
    return queues, keys, rereads


def sequential(root: Path, start: int | None = None, to: int | None = None):
    """One read of the log through the reader `reputd rebuild` uses; with `to`, the entries before it."""
    log = DLedgerLog(str(root), "n0", SEGMENT, commit_log_dirs=[str(root / "commitlog")])
    reader = CommitLogReader(log, batch_bytes=8192)
    offset = log.min_offset if start is None else start
    below = (lambda phy: phy - ENTRY_HEADER_SIZE < to) if to is not None else (lambda phy: True)
    queues: dict = {}
    keys = []
    while True:
        res = reader.read(offset)
        b = res.batch
        for q in consume_queue_units(b):
            queues.setdefault((q.topic, q.queue_id), []).extend(
                (qo, u) for qo, u in zip(q.queue_offset.tolist(), q.units.tolist(), strict=True) if below(u[0]))
        hashes, owners = b.index_keys(b.index_mask())
        keys.extend(k for k in zip(hashes.tolist(), b.phy_offset[owners].tolist(),
                                   b.store_timestamp[owners].tolist(), strict=True) if below(k[1]))
        offset = res.next_offset
        assert res.status is not ReadStatus.CORRUPT, res.error
        if res.status is ReadStatus.END or (to is not None and offset >= to):
            break
    reader.close()
    return {k: v for k, v in queues.items() if v}, keys


def as_sequential(queues: dict) -> dict:
    """Staged units are keyed by queue bucket; the sequential read by (topic, queue): compare the unit lists."""
    return sorted(sorted((qo, tuple(u)) for qo, u in units) for units in queues.values())


def test_an_entry_validates_itself_and_a_message_header_is_not_one(mixed):
    data = (mixed / "dledger-n0" / "data" / f"{2 * SEGMENT:020d}").read_bytes()
    assert entry_at(data, 0, 2 * SEGMENT, SEGMENT, 4 << 20)
    assert not entry_at(data, 48, 2 * SEGMENT, SEGMENT, 4 << 20)  # the message inside: no entry
    plain = DecodeSettings(SEGMENT, True, 4 << 20, DEFAULT_MESSAGE_DELAY_LEVEL, 8192, 1 << 20, True, False, False)
    assert plain.flags(0) & DLEDGER_ENTRIES == 0
    dledger = DecodeSettings(SEGMENT, True, 4 << 20, DEFAULT_MESSAGE_DELAY_LEVEL, 8192, 1 << 20, True, False, False,
                             dledger_from=2 * SEGMENT)
    assert dledger.flags(SEGMENT) & DLEDGER_ENTRIES == 0
    assert dledger.flags(2 * SEGMENT) & DLEDGER_ENTRIES


@pytest.mark.parametrize("range_bytes", [4096, 20_000, 65536])
def test_ranges_over_a_mixed_store_chain_into_one_sequential_read(mixed, range_bytes):
    queues, keys, _ = ranged(mixed, range_bytes)
    seq_queues, seq_keys = sequential(mixed)
    assert keys == seq_keys
    assert as_sequential(queues) == as_sequential(seq_queues)
    assert len(keys) > 2000


@needs_store
@pytest.mark.parametrize("range_bytes", [8192, 65536])
def test_ranges_over_the_real_dledger_store_chain_into_one_sequential_read(range_bytes):
    queues, keys, _ = ranged(STORE, range_bytes)
    seq_queues, seq_keys = sequential(STORE)
    assert keys == seq_keys
    assert as_sequential(queues) == as_sequential(seq_queues)


@needs_store
def test_from_and_to_are_entry_positions(tmp_path):
    """[--from, --to) between two entries of the real store: the same records as the sequential read."""
    start, to = 131072 + 2 * 65536, 1_000_000  # a data file's start, then an entry position found below
    data = (STORE / "dledger-n0" / "data" / f"{to - to % SEGMENT:020d}").read_bytes()
    p = to % SEGMENT
    while not entry_at(data, p, to - to % SEGMENT, SEGMENT, 4 << 20):
        p += 1
    to = to - to % SEGMENT + p
    queues, keys, _ = ranged(STORE, 10_000, start, to)
    seq_queues, seq_keys = sequential(STORE, start, to)
    assert keys == seq_keys
    assert as_sequential(queues) == as_sequential(seq_queues)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True, text=True,
                          env=clean_env(), timeout=600, check=False)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for sub in ("consumequeue", "index")
            for p in sorted((root / sub).rglob("*")) if p.is_file()}


def test_backfill_writes_what_rebuild_writes_on_a_mixed_store(tmp_path, mixed):
    """Through the CLI, local[2], ranges of 20,000 bytes: byte-identical to `reputd rebuild`."""
    cfg = {"store": {"storePathRootDir": str(mixed), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 1280, "maxHashSlotNum": 97, "maxIndexNum": 400, **DLEDGER},
           "backfill": {"rangeBytes": 20_000}, "logging": {"level": "warning"}}
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    rebuilt = run_cli("rebuild", "--config", str(config), "--out", str(tmp_path / "rebuild"), "--json")
    assert rebuilt.returncode == 0, rebuilt.stderr
    filled = run_cli("backfill", "--config", str(config), "--out", str(tmp_path / "backfill"), "--master",
                     "local[2]", "--json")
    assert filled.returncode == 0, filled.stderr[-3000:]
    summary = json.loads(filled.stdout.strip().splitlines()[-1])
    assert summary["messages"] == json.loads(rebuilt.stdout.strip().splitlines()[-1])["messages"] == 1300
    assert files(tmp_path / "backfill") == files(tmp_path / "rebuild")


def test_backfill_from_s3_writes_what_rebuild_writes_on_a_mixed_store(spark, s3_server, mixed, tmp_path,
                                                                         monkeypatch):
    """The mixed store's old commitlog/ and dledger-n0/data archived on S3 and named by `--segments` (the DLedger
    data last): the files `reputd rebuild` writes from the local store."""
    fs = pytest.importorskip("pyarrow.fs")
    s3 = fs.S3FileSystem(access_key=KEYS["AWS_ACCESS_KEY_ID"], secret_key=KEYS["AWS_SECRET_ACCESS_KEY"],
                         region=KEYS["AWS_REGION"], endpoint_override=s3_server.split("://")[1], scheme="http",
                         allow_bucket_creation=True)
    s3.create_dir(BUCKET)
    for sub in ("commitlog", "dledger-n0/data"):
        for path in sorted((mixed / sub).iterdir()):
            with s3.open_output_stream(f"{BUCKET}/dledger-a/{sub}/{path.name}") as out:
                out.write(path.read_bytes())
    store = {"mappedFileSizeCommitLog": SEGMENT, "mappedFileSizeConsumeQueue": 1280, "maxHashSlotNum": 97,
             "maxIndexNum": 400, **DLEDGER}

    def config(name: str, root: Path):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **store},
                                        "output": {"dir": str(tmp_path / name)}, "metrics": {"enabled": False},
                                        "backfill": {"rangeBytes": 30_000, "readBytes": 1 << 20},
                                        "logging": {"level": "warning"}}))
        return load_config(path, env={})

    rebuild(config("reference", mixed))
    for k, v in {**KEYS, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(k, v)
    summary = backfill(config("bf", tmp_path / "nonexistent"), spark=spark, partitions=2,
                       segments=f"s3://{BUCKET}/dledger-a/commitlog,s3://{BUCKET}/dledger-a/dledger-n0/data")
    assert summary.messages == 1300
    assert files(tmp_path / "bf") == files(tmp_path / "reference")


@pytest.mark.stress_only
def test_standalone_cluster_backfill_equals_rebuild_on_a_mixed_store(tmp_path, mixed):
    """`--master spark://...` on a Spark standalone cluster (a master and two one-core workers, started here;
    long mode only, as tests/test_backfill_cluster.py): the files of `reputd rebuild`."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime: a Spark cluster needs one")
    cfg = {"store": {"storePathRootDir": str(mixed), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 1280, "maxHashSlotNum": 97, "maxIndexNum": 400, **DLEDGER},
           "backfill": {"rangeBytes": 25_000}, "logging": {"level": "warning"}}
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    rebuilt = run_cli("rebuild", "--config", str(config), "--out", str(tmp_path / "rebuild"))
    assert rebuilt.returncode == 0, rebuilt.stderr
    with StandaloneCluster(workers=2, work_dir=tmp_path / "cluster") as cluster:
        env = {k: v for k, v in cluster.env().items() if not k.startswith("REPUTD_")}
        env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
        res = subprocess.run([sys.executable, "-m", "daemon.cli", "backfill", "--config", str(config), "--out",
                              str(tmp_path / "backfill"), "--master", cluster.url, "--json", "--conf",
                              "spark.ui.enabled=false"], capture_output=True, text=True, env=env, timeout=900,
                             check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    stress.report("backfill-dledger-cluster", master=cluster.url, messages=summary["messages"])
    assert summary["messages"] == 1300
    assert files(tmp_path / "backfill") == files(tmp_path / "rebuild")
