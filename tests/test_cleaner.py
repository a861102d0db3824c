"""The clean-up pass that keeps up (issue 46): IndexFiles first and at once, ConsumeQueue files oldest first over
all queues and paced by what deleting costs, a pass stopped in one life finished from where it stopped in the
next, the CommitLog's first offset as the bound whatever the checkpoint, and what is left expired published.

The rule itself (which files are expired) is tests/test_retention.py's, against the broker's code."""

from __future__ import annotations

import dataclasses
import random
import shutil
import struct
import time
import types
from pathlib import Path

import pytest
import structlog
import yaml

from daemon.config import OutputConfig, load_config
from daemon.engine import cleaner as cleaner_module
from daemon.engine.brokerlock import BrokerLockGuard
from daemon.engine.cleaner import Cleaner, clean_output, commit_log_min_offset
from daemon.engine.cleanplan import PACE_BURST_SECONDS, Expired, FileFacts, Pace, QueueFiles, expired_queue_plan
from daemon.engine.dispatchers import ConsumeQueueDispatcher
from daemon.engine.flusher import Flusher
from daemon.engine.session import open_session
from daemon.ops.metrics import Lag, ReputMetrics, RetentionBehind
from indexcore.mappedfile import offset_to_file_name
from indexcore.queuestore import ConsumeQueueStore
from indexcore.writer import CommitLogWriter, Message
from tests.test_cli_papercuts import hold_broker_lock
from tests.test_daemon import output_files
from tests.test_retention import close, model_kept_queue_files, write_queue
from tests.test_retention import dispatch_all as dispatch

UNIT = struct.Struct(">qiq")
UNIT_SIZE = 20
SEGMENT = 64 * 1024
CQ_FILE = 60 * UNIT_SIZE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the pace ----------------------------------------------------------------------------------------------------

def test_the_pace_spreads_deletions_over_both_budgets():
    """Files and bytes each have a budget a second; a burst of PACE_BURST_SECONDS goes at once, the rest waits
    for the budget that binds; time passing pays it back; 0 is no limit."""
    clock = Clock()
    pace = Pace(100, 1_000_000, clock)
    assert pace.book(5, 1000) == 0  # 5 files: 0.05 s of the files budget, the burst
    assert pace.book(10, 1000) == pytest.approx(0.10)  # 0.15 s booked, 0.05 s of burst
    clock.now += 0.10
    assert pace.book(1, 500_000) == pytest.approx(0.5 - PACE_BURST_SECONDS)  # the bytes bind now
    clock.now += 10  # idle: a budget never saves up more than its burst
    assert pace.book(5, 0) == 0
    assert pace.book(1, 0) == pytest.approx(0.01)
    unlimited = Pace(0, 0, clock)
    assert unlimited.book(10**6, 10**12) == 0


def test_a_group_is_a_bursts_worth_of_the_plan():
    plan = [Expired(i, ("T", 0), i, f"p{i}", 4096) for i in range(500)]
    assert Pace(1000, 0, Clock()).group(plan, 0) == int(1000 * PACE_BURST_SECONDS)
    assert Pace(1000, 4096 * 100, Clock()).group(plan, 0) == 5  # 0.05 s of 409,600 bytes a second
    assert Pace(1, 0, Clock()).group(plan, 0) == 1
    assert Pace(1000, 0, Clock()).group(plan, 495) == 5


# --- the plan ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_the_plan_takes_each_queues_expired_prefix_oldest_first_over_all_queues(tmp_path, seed):
    """Random queues and offsets: each queue's planned files are the broker's expired prefix (without a
    checkpoint to keep files for), and the plan's order never deletes a queue's file before an older one of
    it, nor a younger file (by its queue's highest last unit so far) before an older one of any queue."""
    rng = random.Random(seed)
    size = UNIT_SIZE * rng.choice((3, 5))
    root = tmp_path / "consumequeue"
    layouts = {q: write_queue(root / "T" / str(q), size, rng) for q in range(4)}
    store = ConsumeQueueStore(str(tmp_path), size)
    store.load()
    offset = rng.randrange(0, 8000)
    plan, held = expired_queue_plan([QueueFiles(("T", q), store.queue("T", q), store.queue("T", q).file_starts)
                                     for q in layouts], offset, FileFacts())
    assert held == []
    for q, files in layouts.items():
        mine = [e.start for e in plan if e.key == ("T", q)]
        assert mine == store.queue("T", q).file_starts[: model_kept_queue_files(files, offset)], f"seed {seed}"
    assert [e.age for e in plan] == sorted(e.age for e in plan)
    store.close()


def test_a_queue_keeps_the_file_a_recovery_to_the_checkpoint_leaves_newest(tmp_path):
    """Files 0-4 expired, the newest is 5; the checkpoint's offset lies inside file 2: a recovery there deletes
    files 3-5 (all their units past it) and leaves file 2 the newest, so files 2-4 stay (a queue loses a
    prefix only) and are kept as expired, not deleted."""
    d = tmp_path / "consumequeue" / "T" / "0"
    d.mkdir(parents=True)
    for i in range(6):
        (d / offset_to_file_name(i * 3 * UNIT_SIZE)).write_bytes(b"".join(UNIT.pack(100 * (3 * i + u), 50, 0)
                                                                          for u in range(3)))
    store = ConsumeQueueStore(str(tmp_path), 3 * UNIT_SIZE)
    store.load()
    cq = store.queue("T", 0)
    queues = [QueueFiles(("T", 0), cq, cq.file_starts)]
    plan, held = expired_queue_plan(queues, 10_000, FileFacts(), recover_to=700)  # unit 7: file 2
    assert [e.start // (3 * UNIT_SIZE) for e in plan] == [0, 1]
    assert [e.start // (3 * UNIT_SIZE) for e in held] == [2, 3, 4]
    plan, held = expired_queue_plan(queues, 10_000, FileFacts(), recover_to=1500)  # unit 15: the newest's first
    assert [e.start // (3 * UNIT_SIZE) for e in held] == [4]
    plan, held = expired_queue_plan(queues, 10_000, FileFacts(), recover_to=1600)  # inside the newest
    assert ([e.start // (3 * UNIT_SIZE) for e in plan], held) == ([0, 1, 2, 3, 4], [])
    store.close()


def test_the_facts_of_a_file_are_read_once(tmp_path):
    rng = random.Random(3)
    size = 5 * UNIT_SIZE
    files = write_queue(tmp_path / "consumequeue" / "T" / "0", size, rng)
    while len(files) < 4:
        files = write_queue(tmp_path / "consumequeue" / "T" / "0", size, rng)
    store = ConsumeQueueStore(str(tmp_path), size)
    store.load()
    cq = store.queue("T", 0)
    facts = FileFacts()
    queues = [QueueFiles(("T", 0), cq, cq.file_starts)]
    first, _ = expired_queue_plan(queues, 10**9, facts)
    read = facts.reads
    assert read == len(files) - 1  # the newest is never read
    again, _ = expired_queue_plan(queues, 10**9, facts)
    assert (again, facts.reads) == (first, read)
    store.close()


# --- a session ----------------------------------------------------------------------------------------------------

def write_store(tmp_path: Path, messages: int, idle: range = range(0)) -> tuple[object, list[int]]:
    """Two busy queues, and an `Idle` queue written only by the messages in `idle`; small batches, so that
    a session can be dispatched part-way. The config and every record's offset."""
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 97))
    writer = CommitLogWriter(str(tmp_path / "store" / "commitlog"), SEGMENT, clock=clock.__next__)
    offsets = []
    for i in range(messages):
        topic, queue = ("Idle", 0) if i in idle and i % 3 == 0 else (f"T{i % 2}", i % 2)
        offsets.append(writer.append(Message(topic, queue, b"x" * 300, {"KEYS": f"k{i}", "UNIQ_KEY": f"{i:032X}"}))
                       .phy_offset)
    writer.close()
    cfg = {"store": {"storePathRootDir": str(tmp_path / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": CQ_FILE, "maxHashSlotNum": 17, "maxIndexNum": 240},
           "reput": {"batchBytes": 8192}, "output": {"dir": str(tmp_path / "out")}, "metrics": {"enabled": False},
           "retention": {"deleteFilesPerSecond": 0, "deleteBytesPerSecond": 0}}
    path = tmp_path / "reputd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(str(path), env={}), offsets


def finish(config) -> None:
    """A restart: recovery, dispatch to the end, a checkpoint, one pass."""
    s = open_session(config, ReputMetrics(lambda: None))
    dispatch(s)
    assert Flusher(s, pytest.fail).flush_once(thorough=True)
    Cleaner(s).clean_once(paced=False)
    close(s)


def test_a_kill_after_cleaning_past_the_checkpoint_recovers_to_the_files_of_a_life_that_did_not(tmp_path):
    """The checkpoint trails the CommitLog's first offset (reputd killed with dispatched records unflushed, the
    broker deleting segments meanwhile: a restart across a retention gap), and the pass deletes for the first
    offset. A kill then, and a restart from that checkpoint, end in the files of a life that deleted nothing
    before the kill: nothing deleted held a unit a recovery or a retained record needs. The `Idle` queue,
    whose units past the checkpoint all point at deleted records, keeps the file the recovery cuts it back to;
    a pass that deleted that file too would leave the queue no file at all."""
    config, offsets = write_store(tmp_path, 3000, idle=range(900, 1300))
    s = open_session(config, ReputMetrics(lambda: None))
    dispatch(s, until=offsets[1000])
    assert Flusher(s, pytest.fail).flush_once(thorough=True)
    checkpoint = s.checkpoint_offset
    dispatch(s)  # dispatched, not checkpointed
    log_dir = tmp_path / "store" / "commitlog"
    segments = sorted(log_dir.iterdir())
    for path in segments:
        if int(path.name) + SEGMENT <= offsets[1400]:
            path.unlink()
    first = commit_log_min_offset((str(log_dir),))
    assert checkpoint < first
    control = tmp_path / "control"
    shutil.copytree(tmp_path / "out", control)  # what a kill leaves of a life that deleted nothing
    unprotected = tmp_path / "unprotected"
    shutil.copytree(tmp_path / "out", unprotected)
    result = Cleaner(s).clean_once(paced=False)
    assert result.files["consumequeue"] > 0
    assert s.retention_behind.files > 0  # the Idle queue's files kept for the recovery
    close(s)  # the kill: nothing flushed or checkpointed since
    finish(config)
    finish(dataclasses.replace(config, output=OutputConfig(str(control))))
    assert output_files(tmp_path / "out") == output_files(control)
    idle = [n for n in output_files(control) if n.startswith("consumequeue/Idle/")]
    assert idle

    # without keeping it (the ConsumeQueue files alone, by the broker's rule): the queue is cut back to nothing
    queues = ConsumeQueueDispatcher(config.store, str(unprotected))
    clean_output([queues], config.store.commit_log_dirs)
    queues.close()
    finish(dataclasses.replace(config, output=OutputConfig(str(unprotected))))
    assert not [n for n in output_files(unprotected) if n.startswith("consumequeue/Idle/")]


def deletions(monkeypatch) -> list[str]:
    """The paths the cleaner unlinks, in order."""
    seen: list[str] = []
    real = cleaner_module.remove_files

    def recording(paths: list[str]) -> None:
        seen.extend(paths)
        real(paths)

    monkeypatch.setattr(cleaner_module, "remove_files", recording)
    return seen


def cleaned_store(tmp_path: Path, messages: int = 3000, delete_segments: int = 8):
    config, _ = write_store(tmp_path, messages)
    s = open_session(config, ReputMetrics(lambda: None))
    dispatch(s)
    assert Flusher(s, pytest.fail).flush_once(thorough=True)
    close(s)
    for path in sorted((tmp_path / "store" / "commitlog").iterdir())[:delete_segments]:
        path.unlink()
    return config


def test_index_files_go_first_and_a_stopped_pass_goes_on_in_the_next_life(tmp_path, monkeypatch):
    """A paced pass deletes every expired IndexFile before any ConsumeQueue file; stopped part-way, the next
    life's first pass deletes the rest, in the order one pass would have: the two lives' deletions are one
    unstopped pass's."""
    config = cleaned_store(tmp_path)
    whole = tmp_path / "whole"
    shutil.copytree(tmp_path / "out", whole)
    seen = deletions(monkeypatch)
    s = open_session(dataclasses.replace(config, output=OutputConfig(str(whole))), ReputMetrics(lambda: None))
    clean_output(s.dispatchers, config.store.commit_log_dirs)
    close(s)
    one_pass = [Path(p).relative_to(whole).as_posix() for p in seen]
    assert one_pass[0].startswith("index/")
    assert one_pass[-1].startswith("consumequeue/")
    index = sum(1 for p in one_pass if p.startswith("index/"))
    assert 1 < index < len(one_pass) - 12
    seen.clear()

    slow = dataclasses.replace(config, retention=dataclasses.replace(config.retention, delete_files_per_second=40))
    s = open_session(slow, ReputMetrics(lambda: None))
    c = Cleaner(s)
    c.start()
    try:
        while len(seen) < index + 8:
            c._stop.wait(0.01)
    finally:
        c.stop()
    close(s)
    first_life = list(seen)
    assert index + 8 <= len(first_life) < len(one_pass)
    seen.clear()
    s = open_session(config, ReputMetrics(lambda: None))
    result = Cleaner(s).clean_once()
    close(s)
    assert not result.interrupted
    out = tmp_path / "out"
    assert [Path(p).relative_to(out).as_posix() for p in first_life + seen] == one_pass
    assert output_files(out) == output_files(whole)


def test_a_started_clean_up_looks_at_once_and_a_pass_with_nothing_to_delete_says_nothing(tmp_path, monkeypatch):
    """A start meets what expired while reputd was stopped: the thread's first pass runs as it starts, not
    cleanResourceInterval later, and logs `expired_files_deleted`; a pass that finds nothing to delete logs
    nothing (the clean-up looks every interval: one line each time would bury the ones that matter)."""
    config = cleaned_store(tmp_path)
    seen = deletions(monkeypatch)
    s = open_session(config, ReputMetrics(lambda: None))
    with structlog.testing.capture_logs() as logs:
        c = Cleaner(s, interval_ms=3_600_000)
        c.start()
        try:
            deadline = time.monotonic() + 10
            while not [e for e in logs if e["event"] == "expired_files_deleted"] and time.monotonic() < deadline:
                c._stop.wait(0.01)
        finally:
            c.stop()
        assert seen, "the first pass waited for the interval"
        again = Cleaner(s).clean_once(paced=False)
    close(s)
    assert (again.deleted, again.interrupted) == (0, False)
    assert [e["event"] for e in logs if e["event"] == "expired_files_deleted"] == ["expired_files_deleted"]

def test_a_queue_whose_files_changed_since_the_plan_keeps_them(tmp_path):
    """A group deletes a queue's planned files only while they are still its oldest: a file list that moved
    since the plan (its oldest gone by other means) leaves the queue's files alone until the next pass plans
    again, never a file the plan did not name."""
    config = cleaned_store(tmp_path)
    s = open_session(config, ReputMetrics(lambda: None))
    c = Cleaner(s)
    plan, _, queues = c._plan(commit_log_min_offset(s.commit_log.dirs))
    key = plan[0].key
    queues[key].forget_oldest(1)
    before = list(queues[key].file_starts)
    assert c._delete_group([e for e in plan if e.key == key], queues) == []
    assert queues[key].file_starts == before
    close(s)

def test_a_broker_that_takes_the_outputs_lock_stops_the_pass(tmp_path, monkeypatch):
    """Deleting is writing: a broker started on the output directory (reputd's store root) takes `lock`
    after the pass's IndexFiles and first group of ConsumeQueue files went; the pass deletes nothing more
    (the broker's own retention cleans there now), says it was cut short, and the service is told once. A
    pass that starts with the lock taken deletes nothing at all."""
    config = cleaned_store(tmp_path)
    out = tmp_path / "out"
    stops: list[str] = []
    metrics = ReputMetrics(lambda: None)
    guard = BrokerLockGuard(str(out), metrics, structlog.get_logger(), lambda *_: None,
                            types.SimpleNamespace(status=lambda _: None), stops.append, lambda: 0)
    seen = deletions(monkeypatch)
    holders = []

    def after_delete() -> None:
        if not holders and any("/consumequeue/" in p for p in seen):
            holders.append(hold_broker_lock(out / "lock"))

    monkeypatch.setattr(cleaner_module, "report", lambda *_: None)
    slow = dataclasses.replace(config, retention=dataclasses.replace(config.retention, delete_files_per_second=40))
    s = open_session(slow, metrics)
    real = cleaner_module.remove_files
    monkeypatch.setattr(cleaner_module, "remove_files", lambda paths: (real(paths), after_delete()))
    try:
        result = Cleaner(s, broker_lock=guard).clean_once()
        assert holders, "no ConsumeQueue file was deleted"
        group = max(1, int(40 * PACE_BURST_SECONDS))  # the files of one group at 40 a second
        assert result.files["index"] > 0
        assert result.files["consumequeue"] == group
        assert result.interrupted
        assert stops == ["broker_lock_taken"]
        again = Cleaner(s, broker_lock=guard).clean_once()
        assert (again.deleted, again.interrupted) == (0, True)
    finally:
        close(s)
        for h in holders:
            h.stdin.close()
            h.wait()
    assert stops == ["broker_lock_taken"]
    assert metrics.registry.get_sample_value("reputd_broker_lock_taken_total") == 1


# --- what it tells -------------------------------------------------------------------------------------------------

def test_the_expired_output_left_on_disk_is_exposed_at_scrape_time():
    clock_now = __import__("time").monotonic()
    behind = RetentionBehind(files=3, bytes=12288, index_files=1, index_bytes=4_000_040, oldest_since=clock_now - 42)
    metrics = ReputMetrics(lambda: Lag(0, 0, 0, 0, 0.0, 0.0, 9, 2, behind))
    get = metrics.registry.get_sample_value
    assert get("reputd_retention_behind_files", {"kind": "consumequeue"}) == 3
    assert get("reputd_retention_behind_files", {"kind": "index"}) == 1
    assert get("reputd_retention_behind_bytes", {"kind": "consumequeue"}) == 12288
    assert get("reputd_retention_behind_bytes", {"kind": "index"}) == 4_000_040
    assert 42 <= get("reputd_retention_behind_seconds") < 60
    empty = ReputMetrics(lambda: Lag(0, 0, 0, 0, 0.0, 0.0, 9, 2))  # before the first look: every series at 0
    assert empty.registry.get_sample_value("reputd_retention_behind_files", {"kind": "index"}) == 0
    assert empty.registry.get_sample_value("reputd_retention_behind_seconds") == 0


def test_files_kept_for_the_checkpoint_ask_for_a_new_one_and_go_at_the_next_pass(tmp_path):
    """IndexFiles kept because the checkpoint names an older one: the pass asks the flusher for a checkpoint
    (its next cycle is thorough whatever the dirty pages), and the pass after it deletes them."""
    config = cleaned_store(tmp_path)
    s = open_session(config, ReputMetrics(lambda: None))
    names = list(s.dispatchers[1].service.names)
    s.checkpoint_states = {**s.checkpoint_states, "index": {"name": names[1]}}  # as a trailing checkpoint has it
    first = Cleaner(s).clean_once(paced=False)
    assert first.index_files_kept > 0
    assert s.checkpoint_wanted.is_set()
    assert Flusher(s, pytest.fail).flush_once() is True  # not thorough by the clock, by the request
    assert s.checkpoint_states["index"]["name"] == names[-1]
    second = Cleaner(s).clean_once(paced=False)
    assert (second.files["index"], second.index_files_kept) == (first.index_files_kept, 0)
    assert s.retention_behind == RetentionBehind()
    assert not s.checkpoint_wanted.is_set()
    close(s)


def test_expired_files_kept_too_long_are_logged_and_so_is_the_end_of_it(tmp_path):
    """IndexFiles the checkpoint keeps stay expired: once they have waited past the threshold, one
    `retention_behind` warning (not one per pass); once they are gone, one `retention_caught_up`."""
    config = cleaned_store(tmp_path)
    s = open_session(config, ReputMetrics(lambda: None))
    names = list(s.dispatchers[1].service.names)
    s.checkpoint_states = {"index": {"name": names[1]}}
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        c = Cleaner(s, clock=clock)
        first = c.clean_once(paced=False)
        assert first.index_files_kept > 0
        clock.now += c.warn_after - 1
        c.clean_once(paced=False)
        assert not [e for e in logs if e["event"] == "retention_behind"]
        clock.now += 2
        c.clean_once(paced=False)
        clock.now += 10
        c.clean_once(paced=False)
        [warning] = [e for e in logs if e["event"] == "retention_behind"]
        assert warning["log_level"] == "warning"
        assert warning["index_files"] == first.index_files_kept
        assert warning["behind_s"] == round(c.warn_after + 1)
        s.checkpoint_states = {"index": {"name": names[-1]}}  # a new checkpoint names the newest
        c.clean_once(paced=False)
    assert s.retention_behind == RetentionBehind()
    assert [e["event"] for e in logs if e["event"].startswith("retention_")] == ["retention_behind",
                                                                                  "retention_caught_up"]
    close(s)
