"""The flusher's rules, in process: flushConsumeQueueLeastPages holds the checkpoint back until a
thorough flush, the checkpoint never covers what is not flushed, and a poisoned session never
checkpoints. Also recovery's decisions on a checkpoint that cannot be trusted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from daemon.config import load_config
from daemon.engine.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from daemon.engine.flusher import Flusher
from daemon.engine.session import open_session
from daemon.ops.metrics import ReputMetrics
from indexcore.reader import ReadStatus
from indexcore.writer import CommitLogWriter, Message

SEGMENT = 1 << 20


def is_replay_marker_at_0(checkpoint: Checkpoint | None) -> bool:
    """The checkpoint a start without a trusted one writes first: offset 0, no dispatcher state."""
    return checkpoint is not None and (checkpoint.reput_from_offset, checkpoint.dispatchers) == (0, {})


def make_config(tmp: Path, **store):
    cfg = {"store": {"storePathRootDir": str(tmp / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 400_000, "maxHashSlotNum": 101, "maxIndexNum": 1000,
                     "flushConsumeQueueLeastPages": 2, "flushConsumeQueueThoroughInterval": 3_600_000, **store},
           "output": {"dir": str(tmp / "out")}}
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    return load_config(tmp / "c.yaml", env={})


def append(tmp: Path, n: int, queues: int = 1) -> int:
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 10))
    with CommitLogWriter(str(tmp / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock)) as w:
        for i in range(n):
            w.append(Message("T", i % queues, b"b" * 100, {"KEYS": f"k{i}", "UNIQ_KEY": f"{i:032X}"}))
        return w.max_offset


def dispatch_all(session) -> None:
    offset = session.dispatched_offset
    while True:
        result = session.reader.read(offset)
        with session.lock:
            for d in session.dispatchers:
                if len(result.batch):
                    d.dispatch(result.batch)
            session.dispatched_offset = offset = result.next_offset
        if result.status is ReadStatus.END:
            return


@pytest.fixture
def metrics():
    return ReputMetrics(lambda: None)


def close(session):
    for d in session.dispatchers:
        d.close()
    session.reader.close()


def test_least_pages_defers_the_checkpoint_until_a_thorough_flush(tmp_path, metrics):
    """10 units (200 bytes) are fewer than 2 dirty pages: not synced, so not checkpointed."""
    config = make_config(tmp_path)
    end = append(tmp_path, 10)
    session = open_session(config, metrics)
    dispatch_all(session)
    flusher = Flusher(session, on_error=pytest.fail)
    assert flusher.flush_once() is False
    assert is_replay_marker_at_0(read_checkpoint(str(tmp_path / "out")))
    assert flusher.flush_once(thorough=True) is True
    ckpt = read_checkpoint(str(tmp_path / "out"))
    assert ckpt.reput_from_offset == end
    assert ckpt.dispatchers["index"]["index_count"] == 21  # 10 messages x (UNIQ_KEY + KEY), numbered from 1
    assert flusher.flush_once(thorough=True) is False, "nothing new: no rewrite"
    close(session)


def test_a_checkpoint_the_clean_up_asks_for_comes_at_the_next_cycle(tmp_path, metrics):
    """Too few dirty pages defer the checkpoint, unless the clean-up waits for one (`checkpoint_wanted`,
    daemon/engine/cleaner.py): that cycle is thorough, and the request is spent."""
    config = make_config(tmp_path)
    end = append(tmp_path, 10)
    session = open_session(config, metrics)
    dispatch_all(session)
    flusher = Flusher(session, on_error=pytest.fail)
    assert flusher.flush_once() is False
    session.checkpoint_wanted.set()
    assert flusher.flush_once() is True
    assert read_checkpoint(str(tmp_path / "out")).reput_from_offset == end
    assert not session.checkpoint_wanted.is_set()
    close(session)


def test_enough_dirty_pages_checkpoint_without_a_thorough_flush(tmp_path, metrics):
    config = make_config(tmp_path)
    end = append(tmp_path, 2000)  # 40,000 bytes of units in one queue: 9+ pages
    session = open_session(config, metrics)
    dispatch_all(session)
    assert Flusher(session, on_error=pytest.fail).flush_once() is True
    assert read_checkpoint(str(tmp_path / "out")).reput_from_offset == end
    close(session)


def test_one_lagging_queue_holds_the_checkpoint_back(tmp_path, metrics):
    """Queue 0 gets enough pages, queue 1 does not: no checkpoint may claim queue 1's units."""
    config = make_config(tmp_path)
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 10))
    with CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock)) as w:
        for i in range(2000):
            w.append(Message("T", 1 if i % 500 == 0 else 0, b"b" * 100, {}))
    session = open_session(config, metrics)
    dispatch_all(session)
    assert Flusher(session, on_error=pytest.fail).flush_once() is False
    assert is_replay_marker_at_0(read_checkpoint(str(tmp_path / "out")))
    close(session)


def test_a_poisoned_session_never_checkpoints(tmp_path, metrics):
    config = make_config(tmp_path)
    append(tmp_path, 50)
    session = open_session(config, metrics)
    dispatch_all(session)
    session.poisoned = True
    assert Flusher(session, on_error=pytest.fail).flush_once(thorough=True) is False
    assert is_replay_marker_at_0(read_checkpoint(str(tmp_path / "out")))
    close(session)


def test_checkpoint_past_the_commitlog_is_not_trusted(tmp_path, metrics):
    config = make_config(tmp_path)
    append(tmp_path, 50)
    (tmp_path / "out").mkdir()
    write_checkpoint(str(tmp_path / "out"), Checkpoint(10 * SEGMENT, {}))
    session = open_session(config, metrics)
    assert session.dispatched_offset == 0
    assert is_replay_marker_at_0(read_checkpoint(str(tmp_path / "out"))), "replaced by a replay marker"
    close(session)


def test_checkpoint_naming_a_missing_index_file_falls_back_to_derivation(tmp_path, metrics):
    """The checkpoint's IndexFile is gone: recovery does not trust it and starts from the files."""
    config = make_config(tmp_path)
    append(tmp_path, 50)
    session = open_session(config, metrics)
    dispatch_all(session)
    Flusher(session, on_error=pytest.fail).flush_once(thorough=True)
    close(session)
    ckpt = read_checkpoint(str(tmp_path / "out"))
    index_dir = tmp_path / "out" / "index"
    for f in index_dir.iterdir():
        f.unlink()
    session = open_session(config, metrics)
    assert is_replay_marker_at_0(read_checkpoint(str(tmp_path / "out")))
    assert session.dispatched_offset == 0, "the index must be rebuilt from the start"
    assert ckpt.reput_from_offset > 0
    close(session)


def _plans(tmp_path: Path, files: int):
    from daemon.engine.dispatchers import FlushPlan

    paths = []
    for i in range(files):
        d = tmp_path / "consumequeue" / f"%LMQ%r{i}" / "0"
        d.mkdir(parents=True)
        (d / "00000000000000000000").write_bytes(b"unit")
        paths.append(str(d / "00000000000000000000"))
    done = []
    return [FlushPlan(paths=paths, done=lambda: done.append(True))], done


@pytest.mark.parametrize("files", [3, 300])
def test_a_rebuilds_last_flush_of_many_files_syncs_the_file_system_once(tmp_path, monkeypatch, files):
    """From SYNCFS_MIN_FILES files, one syncfs per file system instead of an fdatasync per file and an fsync
    per new directory; the periodic flush of `run` always keeps to its own files."""
    from daemon.engine import flusher

    calls = {"syncfs": 0, "fdatasync": 0}
    real_syncfs, real_sync_paths = flusher._kernels.syncfs, flusher.sync_paths
    monkeypatch.setattr(flusher._kernels, "syncfs", lambda fd: (calls.__setitem__("syncfs", calls["syncfs"] + 1),
                                                              real_syncfs(fd)))
    monkeypatch.setattr(flusher, "sync_paths", lambda paths: (calls.__setitem__("fdatasync", len(paths)),
                                                              real_sync_paths(paths)))
    plans, done = _plans(tmp_path, files)
    flusher.sync_plans(plans, str(tmp_path), set(), whole_fs=True)
    whole = files >= flusher.SYNCFS_MIN_FILES
    assert calls == ({"syncfs": 1, "fdatasync": 0} if whole else {"syncfs": 0, "fdatasync": files})
    assert done == [True]
    calls.update(syncfs=0, fdatasync=0)
    plans, _ = _plans(tmp_path / "again", files)
    flusher.sync_plans(plans, str(tmp_path / "again"), set())
    assert calls == {"syncfs": 0, "fdatasync": files}


def test_sync_file_systems_syncs_each_file_system_once(tmp_path, monkeypatch):
    from daemon.engine import flusher

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a second file system")
    synced = []
    monkeypatch.setattr(flusher._kernels, "syncfs", lambda fd: synced.append(os.fstat(fd).st_dev))
    other = shm / f"reputd-test-{os.getpid()}"
    other.write_bytes(b"x")
    try:
        flusher.sync_file_systems([str(tmp_path), str(tmp_path / "."), str(other)])
    finally:
        other.unlink()
    assert sorted(synced) == sorted({tmp_path.stat().st_dev, shm.stat().st_dev})


def test_a_whole_file_system_sync_stats_the_outputs_own_entries_not_every_file(tmp_path, monkeypatch):
    """The last flush of a rebuild of 8,000 queues synced 8,000 files and 10,000 directories with one syncfs,
    and stat'ed each of them to find its file system; it stats the output directory's own entries now."""
    from daemon.engine import flusher

    paths = []
    for t in range(20):
        for q in range(4):
            path = tmp_path / "consumequeue" / f"T{t}" / str(q) / f"{0:020d}"
            path.parent.mkdir(parents=True)
            path.write_bytes(b"x")
            paths.append(str(path))
    (tmp_path / "index").mkdir()
    paths.append(str(tmp_path / "index" / "20261129000000000"))
    Path(paths[-1]).write_bytes(b"x")
    stats, synced = [], []
    real_stat = os.stat
    monkeypatch.setattr(flusher.os, "stat", lambda p, *a, **k: (stats.append(str(p)), real_stat(p, *a, **k))[1])
    monkeypatch.setattr(flusher._kernels, "syncfs", synced.append)
    flusher.sync_file_systems({*paths, *flusher.new_entries(paths, str(tmp_path), set())}, str(tmp_path))
    assert sorted(stats) == sorted([str(tmp_path), str(tmp_path / "consumequeue"), str(tmp_path / "index")])
    assert len(synced) == 1
