"""`reputd rebuild` into an output that already holds files continues it exactly where it ends, by the resume
rules `reputd run` uses (daemon/engine/recovery.py): run twice, or stopped anywhere and run again, it ends with the
files of one rebuild, with no (hash, offset) pair indexed twice, and says how many messages were new.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import structlog
import yaml

from daemon.cli.common import program
from daemon.config import load_config
from daemon.engine.checkpoint import CHECKPOINT_FILE
from daemon.engine.dispatchers import ConsumeQueueDispatcher, IndexDispatcher
from daemon.engine.rebuild import dispatch_batch
from daemon.engine.rebuild import rebuild as daemon_rebuild
from indexcore.indexfile import INDEX_ENTRY_DTYPE, INDEX_HEADER, INDEX_HEADER_SIZE
from indexcore.reader import ReadResult, ReadStatus
from indexcore.writer import CommitLogWriter
from tests.conformance import discover
from tests.conftest import DispatchRec, make_dispatch_batch
from tests.test_crash_matrix import PHASE_1, PHASE_2, append
from tests.test_daemon import clean_env, events, output_files

REPUTD = [sys.executable, "-m", "daemon.cli"]
SEGMENT = 256 * 1024
SLOTS, ENTRIES = 97, 400


def reputd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, *args], env=clean_env(env), capture_output=True, text=True, timeout=120,
                          check=False)


def index_pairs(root: Path, slots: int = SLOTS) -> Counter:
    """(key hash, CommitLog offset) of every entry the IndexFiles record, counted."""
    pairs: Counter = Counter()
    directory = root / "index"
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        data = path.read_bytes()
        count = max(INDEX_HEADER.unpack_from(data)[5], 1)
        entries = np.frombuffer(data, dtype=INDEX_ENTRY_DTYPE, count=count, offset=INDEX_HEADER_SIZE + 4 * slots)[1:]
        pairs.update(zip(entries["key_hash"].tolist(), entries["phy_offset"].tolist(), strict=True))
    return pairs


@pytest.fixture
def store(tmp_path):
    """A CommitLog (phase 1 of the crash matrix: records whose keys straddle IndexFile rolls) and a config."""
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 211))
    writer = CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock))
    append(writer, 0, PHASE_1)
    cfg = {"store": {"storePathRootDir": str(tmp_path / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 800, "maxHashSlotNum": SLOTS, "maxIndexNum": ENTRIES},
           "output": {"dir": str(tmp_path / "out")}, "logging": {"level": "info", "format": "json"}}
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    yield tmp_path, config, writer
    writer.close()


def rebuild(config: Path, *args: str, env: dict | None = None) -> dict:
    res = reputd("rebuild", "--config", str(config), "--json", *args, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def reference(tmp: Path, config: Path) -> tuple[dict, Counter]:
    ref = tmp / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    rebuild(config, "--out", str(ref))
    return output_files(ref), index_pairs(ref)


def test_rebuild_twice_is_one_rebuild(store):
    tmp, config, writer = store
    first = rebuild(config)
    assert first["newMessages"] == first["messages"] == PHASE_1
    before = output_files(tmp / "out")
    again = rebuild(config)
    assert (again["messages"], again["newMessages"]) == (0, 0)
    assert again["startOffset"] == first["endOffset"]
    assert output_files(tmp / "out") == before
    append(writer, PHASE_1, PHASE_2)
    writer.flush()
    more = rebuild(config)
    assert more["newMessages"] == more["messages"] == PHASE_2 - PHASE_1
    expected, pairs = reference(tmp, config)
    assert output_files(tmp / "out") == expected
    assert index_pairs(tmp / "out") == pairs


@pytest.mark.parametrize("point", ["index.after_straddling_key", "index.after_allocate", "consumequeue.after_header@3",
                                   "consumequeue.before_create"])
@pytest.mark.parametrize("earlier", ["empty output", "earlier rebuild"])
def test_interrupted_rebuild_run_again_is_one_rebuild(store, point, earlier):
    """Killed mid-batch (a batch is written queue by queue, and an IndexFile roll mid-record), then run again:
    the files of one rebuild, each (hash, offset) pair once."""
    tmp, config, writer = store
    if earlier == "earlier rebuild":
        rebuild(config)
    append(writer, PHASE_1, PHASE_2)
    writer.flush()
    killed = reputd("rebuild", "--config", str(config), env={"REPUTD_FAILPOINT": point})
    assert killed.returncode == -9, killed.stderr[-500:]
    again = rebuild(config)
    assert again["newMessages"] <= again["messages"]
    expected, pairs = reference(tmp, config)
    assert output_files(tmp / "out") == expected
    assert index_pairs(tmp / "out") == pairs


def test_run_after_rebuild_goes_on_from_its_checkpoint(store):
    tmp, config, writer = store
    rebuild(config)
    ckpt = json.loads((tmp / "out" / CHECKPOINT_FILE).read_text())["payload"]
    assert ckpt["dispatchers"]["index"] is not None
    append(writer, PHASE_1, PHASE_2)
    writer.flush()
    res = reputd("run", "--config", str(config), "--until-caught-up", env={"REPUTD_METRICS_ENABLED": "false"})
    assert res.returncode == 0, res.stderr
    recovered = [e for e in events(res.stdout) if e["event"] == "recovered"]
    assert [(e["decision"], e["reput_from_offset"]) for e in recovered] == [("checkpoint", ckpt["reputFromOffset"])]
    expected, _ = reference(tmp, config)
    assert output_files(tmp / "out") == expected


def writable_copy(conformance, tmp_path: Path) -> tuple[Path, Path]:
    """A writable copy of a conformance store (the real broker's files) under tmp/store, and a config
    rebuilding into it."""
    root = tmp_path / "store"
    shutil.copytree(conformance.store, root)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **conformance.store_settings()},
                                      "logging": {"level": "warning"}}))
    return root, config


@pytest.mark.parametrize("conformance", discover()[:1], ids=lambda s: s.name)
def test_rebuild_into_a_brokers_store_adds_nothing(tmp_path, conformance):
    """The broker's own files, rebuilt into three times: nothing is new, no file changes, and a key's
    offset is returned once (before, each run added the newest IndexFile's last record's keys again)."""
    root, config = writable_copy(conformance, tmp_path)
    before = output_files(root)
    newest = sorted((root / "index").iterdir())[-1]
    for _ in range(3):
        summary = rebuild(config)
        assert summary["newMessages"] == 0
    assert output_files(root) == before, f"{newest.name} and the queues are the broker's still"


class _Recorder:
    """A dispatcher that notes where and when it took each batch, and fails when told to."""

    def __init__(self, name: str, alongside: bool, log: list, fail: Exception | None = None, pause: float = 0.0):
        self.name, self.dispatch_alongside, self.log, self.fail, self.pause = name, alongside, log, fail, pause

    def dispatch(self, batch) -> None:
        self.log.append((self.name, "start", threading.current_thread().name, time.monotonic()))
        time.sleep(self.pause)
        self.log.append((self.name, "end", threading.current_thread().name, time.monotonic()))
        if self.fail is not None:
            raise self.fail


def test_the_index_takes_a_batch_alongside_the_queues_and_errors_come_out_after_both():
    """A rebuild hands a batch to the dispatchers that say `dispatch_alongside` (the IndexFile's) on a
    thread of their own while the others take it, returns once all are done, and raises a failure of
    this thread's dispatchers first, else one of those alongside."""
    batch = make_dispatch_batch([DispatchRec(phy_offset=0)])
    result = ReadResult(batch, 100, ReadStatus.OK)
    assert IndexDispatcher.dispatch_alongside
    assert not getattr(ConsumeQueueDispatcher, "dispatch_alongside", False)
    with ThreadPoolExecutor(1, thread_name_prefix="aside") as pool:
        log: list = []
        dispatch_batch([_Recorder("cq", False, log, pause=0.2), _Recorder("index", True, log, pause=0.2)], result,
                       pool)
        started = {name: t for name, what, _, t in log if what == "start"}
        ended = {name: t for name, what, _, t in log if what == "end"}
        assert {name: thread.startswith("aside") for name, _, thread, _ in log} == {"cq": False, "index": True}
        assert started["index"] < ended["cq"]  # at the same time
        assert started["cq"] < ended["index"]

        log.clear()
        with pytest.raises(ValueError, match="index broke"):
            dispatch_batch([_Recorder("cq", False, log), _Recorder("index", True, log, ValueError("index broke"),
                                                                    pause=0.2)], result, pool)
        assert [(n, w) for n, w, _, _ in log if w == "end"] == [("cq", "end"), ("index", "end")]

        log.clear()
        with pytest.raises(KeyError, match="cq broke"):
            dispatch_batch([_Recorder("cq", False, log, KeyError("cq broke")),
                            _Recorder("index", True, log, ValueError("index broke"), pause=0.2)], result, pool)
        assert ("index", "end") in [(n, w) for n, w, _, _ in log]  # waited for, though its error is not raised


def test_an_index_failure_mid_rebuild_stops_it_and_the_next_rebuild_writes_the_files(store, monkeypatch):
    """The IndexFile's dispatch failing on a batch (alongside the queues') stops the rebuild with that error
    and no checkpoint past what was flushed before; the next rebuild ends with the files of a clean one."""
    tmp, config, _ = store
    calls = {"n": 0}
    real = IndexDispatcher.dispatch

    def failing(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device", "index/x")
        real(self, batch)

    monkeypatch.setattr(IndexDispatcher, "dispatch", failing)
    monkeypatch.setattr("daemon.engine.rebuild.REBUILD_BATCH_BYTES", 4096)
    cfg = load_config(config)
    cfg = dataclasses.replace(cfg, reput=dataclasses.replace(cfg.reput, batch_bytes=4096))
    with structlog.testing.capture_logs(), pytest.raises(OSError, match="No space left"):
        daemon_rebuild(cfg)
    assert calls["n"] == 3
    monkeypatch.setattr(IndexDispatcher, "dispatch", real)
    summary = rebuild(config)
    assert summary["endOffset"] > 0
    expected, pairs = reference(tmp, config)
    assert output_files(tmp / "out") == expected
    assert index_pairs(tmp / "out") == pairs


# --- the operator's repair: output files deleted from a broker store, then `rebuild` into it ------------------

def _broker_store_copy(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A copy of the conformance store (the real 4.9.3 broker's files) and a config rebuilding into it."""
    stores = [s for s in discover() if s.name == "visible"]
    if not stores:
        pytest.skip("the conformance store is not found (set REPUTD_CONFORMANCE_DIR)")
    conformance = stores[0]
    root, config = writable_copy(conformance, tmp_path)
    return root, config, output_files(root)


def _index_contents(files: dict) -> list[bytes]:
    return [files[n] for n in sorted(n for n in files if n.startswith("index/"))]


@pytest.mark.parametrize("deleted", ["consumequeue/TopicTest", "newest files of a queue", "newest IndexFiles"])
def test_rebuild_into_a_broker_store_restores_deleted_files_exactly(tmp_path, deleted):
    """Issue 27 §2.7: the files the broker wrote, some deleted, rebuilt in place: the broker's bytes again."""
    root, config, broker = _broker_store_copy(tmp_path)
    if deleted == "consumequeue/TopicTest":
        shutil.rmtree(root / "consumequeue" / "TopicTest")
    elif deleted == "newest files of a queue":
        queue = max((root / "consumequeue").glob("*/*"), key=lambda q: len(list(q.iterdir())))
        for path in sorted(queue.iterdir())[-2:]:
            path.unlink()
    else:
        for path in sorted((root / "index").iterdir())[-2:]:
            path.unlink()
    res = reputd("rebuild", "--config", str(config))
    assert res.returncode == 0, res.stderr
    if deleted != "newest IndexFiles":
        assert re.search(r"note: restored [1-9][\d,]* ConsumeQueue units below the output's end", res.stdout)
    actual = output_files(root)
    assert {n: b for n, b in actual.items() if n.startswith("consumequeue/")} == \
        {n: b for n, b in broker.items() if n.startswith("consumequeue/")}
    assert _index_contents(actual) == _index_contents(broker)  # names are wall-clock times: compared in order
    again = reputd("rebuild", "--config", str(config), "--json")
    assert json.loads(again.stdout)["newMessages"] == 0


def test_rebuild_names_an_indexfile_missing_from_the_middle_and_the_command_that_rebuilds_it(tmp_path):
    """An IndexFile cannot be put back between two others: exit 1 naming them, nothing written, and the
    printed command rebuilds an index equal to the broker's."""
    root, config, broker = _broker_store_copy(tmp_path)
    names = sorted((root / "index").iterdir())
    names[7].unlink()
    res = reputd("rebuild", "--config", str(config))
    assert res.returncode == 1
    assert f"{names[8]}: an IndexFile is missing before it (after {names[6].name})" in res.stderr
    assert not (root / CHECKPOINT_FILE).exists()
    command = shlex.split(res.stderr.rsplit(": ", 1)[1])  # run as printed, from another directory
    assert command[:len(program()) + 1] == [*program(), "rebuild"]
    fresh = Path(command[command.index("--out") + 1])
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
                          env={k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")})
    assert done.returncode == 0, done.stderr
    assert _index_contents(output_files(fresh)) == _index_contents(broker)


@pytest.mark.parametrize("command", ["rebuild", "run"])
def test_a_queue_deleted_from_reputds_own_output_is_rebuilt_from_the_checkpoints_count(store, command):
    """The checkpoint counts the queues: one deleted since makes the next start read from the CommitLog's
    first offset (`queues_missing`), each queue skipping what it holds, and the files are one rebuild's."""
    tmp, config, writer = store
    rebuild(config)
    assert json.loads((tmp / "out" / CHECKPOINT_FILE).read_text())["payload"]["dispatchers"]["consumequeue"] == \
        {"queues": len(list((tmp / "out" / "consumequeue").glob("*/*")))}
    shutil.rmtree(tmp / "out" / "consumequeue" / "TopicA" / "2")
    append(writer, PHASE_1, PHASE_2)
    writer.flush()
    res = reputd(command, "--config", str(config), *(["--until-caught-up"] if command == "run" else []),
                 env={"REPUTD_METRICS_ENABLED": "false"})
    assert res.returncode == 0, res.stderr
    [missing] = [e for e in events(res.stdout + res.stderr) if e["event"] == "queues_missing"]
    assert (missing["queues"], missing["reput_from_offset"]) == (1, 0)
    expected, pairs = reference(tmp, config)
    assert output_files(tmp / "out") == expected
    assert index_pairs(tmp / "out") == pairs
