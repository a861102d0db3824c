"""Kills at the awkward moments of recovery itself, simulated in process (an exception where the kill
would land), then a real `reputd run --until-caught-up`: the files must still be a clean rebuild's."""

from __future__ import annotations

import os

import pytest
import structlog
import yaml

from daemon.config import load_config
from daemon.engine.recovery import write_replay_marker
from daemon.engine.session import open_session
from daemon.ops.metrics import ReputMetrics
from indexcore import _kernels
from indexcore.consumequeue import CQ_UNIT_SIZE as UNIT_SIZE
from tests.test_daemon import Store, assert_same_as_rebuild, events


class Killed(Exception):
    """Stands for SIGKILL: nothing after it runs, nothing is cleaned up."""


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.writer.close()


def config_of(store: Store):
    return load_config(store.config, env={})


def test_kill_after_a_consumequeue_quarantine_still_replays_the_queue(store):
    """The quarantine's decision (replay from the start) must survive a kill before the first checkpoint."""
    store.append(1200)
    assert store.run("--until-caught-up").returncode == 0
    store.append(300)
    cq_file = sorted((store.out / "consumequeue" / "TopicA" / "1").iterdir())[0]
    with open(cq_file, "r+b") as f:
        f.truncate(100)
    session = open_session(config_of(store), ReputMetrics(lambda: None))  # quarantines, then "killed"
    assert not cq_file.exists()
    del session
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert_same_as_rebuild(store)


def test_kill_in_the_middle_of_an_index_quarantine(store, monkeypatch):
    """Killed after moving one of the files from the damaged IndexFile on: the next start finishes the job
    and replays; no hole is left in the index."""
    store.append(1500)
    assert store.run("--until-caught-up").returncode == 0
    names = sorted(os.listdir(store.out / "index"))
    assert len(names) >= 3
    with open(store.out / "index" / names[-3], "r+b") as f:
        f.write(b"\xff" * 40)  # garbage header
    real_replace = os.replace
    calls = []

    def replace_then_die(src, dst):
        if os.path.dirname(src) == str(store.out / "index"):
            if calls:
                raise Killed
            calls.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_die)
    with pytest.raises(Killed):
        open_session(config_of(store), ReputMetrics(lambda: None))
    monkeypatch.undo()
    assert calls == [str(store.out / "index" / names[-1])], "newest first"
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert_same_as_rebuild(store)


@pytest.mark.parametrize("order", [["consumequeue"], ["index", "consumequeue"]])
def test_kill_in_the_middle_of_a_batch_before_the_first_checkpoint(store, monkeypatch, order):
    """A batch is written queue by queue: a kill between two queues, before any real checkpoint, leaves
    queues ahead of others. The start's replay marker makes the next start read that batch again."""
    cfg = yaml.safe_load(store.config.read_text())
    cfg["dispatchers"] = order
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    store.append(800)
    session = open_session(config_of(store), ReputMetrics(lambda: None))
    for d in session.dispatchers:
        if d.name == "consumequeue":
            d.gather_appends(0)  # each batch written at its end, queue after queue (a gathered one: none of it)
    real_writes = _kernels.pwrite_many

    def write_five_then_die(writes, *under):
        real_writes(writes[:5], *under)
        raise Killed

    monkeypatch.setattr(_kernels, "pwrite_many", write_five_then_die)
    result = session.reader.read(session.dispatched_offset)
    def dispatch_batch():
        for d in session.dispatchers:
            d.dispatch(result.batch)
        for d in session.dispatchers:  # `run` hands the writes to its writer thread: its failure comes back here
            if d.name == "consumequeue":
                d.queues.open_files.flush_writes()

    with pytest.raises((Killed, OSError)):
        dispatch_batch()
    monkeypatch.undo()
    for d in session.dispatchers:
        d.close()
    session.reader.close()
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    cfg["dispatchers"] = ["consumequeue", "index"]
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    expected = store.rebuild()
    for path in sorted(p for p in (expected / "consumequeue").rglob("*") if p.is_file()):
        rel = path.relative_to(expected)
        assert (store.out / rel).read_bytes() == path.read_bytes(), f"{rel} differs from a clean rebuild"


def test_checkpointed_index_file_deleted_is_rebuilt_not_duplicated(store):
    """The checkpoint names an IndexFile that is gone: recovery falls back to the files as they are and
    rebuilds the missing one under its own name, with no second chain of files after the others."""
    store.append(1500)
    assert store.run("--until-caught-up").returncode == 0
    names = sorted(os.listdir(store.out / "index"))
    os.unlink(store.out / "index" / names[-1])
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(store.out / "index")) == names
    assert_same_as_rebuild(store)


@pytest.mark.parametrize("cut", [4, 8, 12, 16])
def test_a_unit_a_kill_left_half_written_is_written_again_by_the_next_start(tmp_path, cut):
    """A kill can stop a write between two pages (the kernel copies it page by page), leaving the unit
    across the boundary half written: cut in its tags_code it looks whole, cut in its size or CommitLog
    offset it is invalid with written bytes. The next start, from the replay marker the interrupted run
    began with, writes it again: the files are a clean rebuild's (before, the tags_code stayed zero, or
    the queue was refused as damaged)."""
    store = Store(tmp_path, store={"mappedFileSizeConsumeQueue": 6000})
    try:
        store.append(12 * 205)  # 12 queues of 205 units: the last, unit 204 at byte 4080, crosses 4096
        assert store.run("--until-caught-up").returncode == 0
        path = store.out / "consumequeue" / "TopicA" / "0" / "00000000000000000000"
        units = path.read_bytes()
        last = 204 * UNIT_SIZE
        assert units[last + UNIT_SIZE : last + 2 * UNIT_SIZE] == bytes(UNIT_SIZE) != units[last : last + UNIT_SIZE]
        began = int.from_bytes(units[190 * UNIT_SIZE : 190 * UNIT_SIZE + 8], "big")
        write_replay_marker(str(store.out), began, "the interrupted run's start", structlog.get_logger())
        with open(path, "r+b") as f:  # what the kill left: the unit's bytes up to the page boundary
            f.seek(last + cut)
            f.write(bytes(UNIT_SIZE - cut))
        res = store.run("--until-caught-up")
        assert res.returncode == 0, res.stderr
        named = {kind: {p for e in events(res.stdout) if e["event"] == kind for p in e["paths"]}
                 for kind in ("torn_units_removed", "torn_units_zeroed")}
        # cut in its offset's high bytes, which are zeros here, the unit looks never written
        expect = "torn_units_removed" if cut >= 12 else "torn_units_zeroed" if cut == 8 else None
        assert {kind for kind, paths in named.items() if str(path) in paths} == ({expect} if expect else set())
        assert_same_as_rebuild(store)
    finally:
        store.writer.close()
