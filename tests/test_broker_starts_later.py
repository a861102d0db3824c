"""A broker that starts on the store root `reputd run` writes into (issue 44 §1.1): `run` watches the broker's
`lock` for as long as it writes, not only at its start. Once a broker takes it, `run` dispatches nothing
more, flushes and checkpoints what it dispatched, reports health `down`, logs `broker_lock_taken`, counts
it, and exits 2 (systemd's RestartPreventExitStatus=2) with one line on stderr.

The broker is a process holding `lock` as 4.9.3's DefaultMessageStore.start() does (FileChannel.tryLock(0, 1,
false): a POSIX record lock on its first byte), and, under `make stress`, the real 4.9.3 store
(../shared/realbroker/ LiveWriter) started on the root while `run` follows it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog
import yaml

from daemon.engine.brokerlock import BROKER_RUNNING, EXIT_BROKER_RUNNING, BrokerLockGuard
from daemon.engine.checkpoint import read_checkpoint
from daemon.ops.metrics import DOWN, ReputMetrics
from indexcore.writer import CommitLogWriter, Message
from tests import stress
from tests.test_cli import REPUTD, SEGMENT, make_store, run, write_config
from tests.test_cli_papercuts import hold_broker_lock
from tests.test_daemon import clean_env, output_files

WAIT_S = 60


def _root_config(tmp: Path) -> Path:
    """write_config's store, with the output in the store root (`output.dir` unset: a broker's own store)."""
    config = write_config(tmp)
    cfg = yaml.safe_load(config.read_text())
    del cfg["output"]
    cfg["logging"] = {"level": "info", "format": "json"}
    config.write_text(yaml.safe_dump(cfg))
    return config


def _start_run(config: Path) -> tuple[subprocess.Popen, list[str]]:
    """`reputd run` (no metrics port) once it has caught up; its stdout lines collect in the list."""
    proc = subprocess.Popen([*REPUTD, "run", "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_env({"REPUTD_METRICS_ENABLED": "false"}))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + WAIT_S
    while not any('"caught_up"' in line for line in list(lines)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "run did not catch up"
        time.sleep(0.02)
    return proc, lines


def _events(lines: list[str], name: str) -> list[dict]:
    return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e.get("event") == name]


def test_run_stops_writing_when_a_broker_takes_the_lock_of_the_root_it_writes(tmp_path):
    """`run` follows a store root (the output is the root); a broker takes `lock`, then writes 50 messages:
    `run` dispatches none of them, checkpoints what it had, exits 2 with one line naming the root, the PID and
    the offset, health down and `broker_lock_taken` in the log. With the broker stopped again, `run` catches
    up and the root verifies clean: the stop left nothing half done."""
    results = make_store(tmp_path, n=200)
    root = tmp_path / "store"
    end = results[-1].phy_offset + results[-1].msg_size
    config = _root_config(tmp_path)
    proc, lines = _start_run(config)
    broker = None
    try:
        before = output_files(root)
        broker = hold_broker_lock(root / "lock")  # DefaultMessageStore.start(): the lock, then its reput and puts
        clock = iter(range(1_900_000_000_000, 2_000_000_000_000, 250))
        with CommitLogWriter(str(root / "commitlog"), SEGMENT, clock=lambda: next(clock)) as w:
            for i in range(50):
                w.append(Message("TopicA", i % 3, b"after the broker started", {"KEYS": f"late-{i}"}))
        code = proc.wait(WAIT_S)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        if broker is not None:
            broker.stdin.close()
            broker.wait(10)
    assert code == EXIT_BROKER_RUNNING, err
    assert err.splitlines() == [
        f"reputd: error: output directory {root} became the store root of a running broker (PID {broker.pid} took "
        f"{root / 'lock'}), which writes consumequeue/ and index/ there itself: reputd stopped writing, checkpoint at "
        f"CommitLog offset {end}; write elsewhere with --out DIR, or run reputd there only while the broker is "
        "stopped"]
    taken = _events(lines, "broker_lock_taken")
    assert [(e["level"], e["pid"], e["lock"], e["reput_from_offset"]) for e in taken] == [
        ("error", broker.pid, str(root / "lock"), end)]
    assert _events(lines, "health_changed")[-1]["state"] == DOWN
    assert _events(lines, "health_changed")[-1]["reason"].startswith(f"{BROKER_RUNNING}: PID {broker.pid} took ")
    assert [e["reason"] for e in _events(lines, "shutdown_requested")] == ["broker_lock_taken"]
    assert _events(lines, "final_flush")[-1]["checkpoint_offset"] == end
    assert read_checkpoint(str(root)).reput_from_offset == end
    assert output_files(root) == before  # not one unit or key of the broker's messages
    # the broker stopped: reputd may write its root again, and the files end as they should
    res = run("run", "--config", str(config), "--until-caught-up", env={"REPUTD_METRICS_ENABLED": "false"})
    assert res.returncode == 0, res.stderr
    res = run("verify", "--config", str(config))
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_rebuild_into_the_root_stops_when_a_broker_takes_the_lock(tmp_path):
    """`rebuild` into a store root (a slow plug-in keeps it in the middle of the CommitLog) while a broker
    takes `lock`: it stops after the batch in hand with what it wrote flushed and checkpointed, its summary
    line says `interrupted:`, one line says why and where, exit 2."""
    results = make_store(tmp_path, n=2000)
    root = tmp_path / "store"
    started = tmp_path / "started"
    config = _root_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["logging"] = {"level": "warning"}
    cfg["dispatchers"] = ["consumequeue", "index", {"name": "tests.plugins.slow:SlowDispatchDispatcher",
                                                    "options": {"dispatch_seconds": 0.1, "started": str(started)}}]
    config.write_text(yaml.safe_dump(cfg))
    (root / "lock").write_bytes(b"lock")
    proc = subprocess.Popen([*REPUTD, "rebuild", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env())
    broker = None
    try:
        deadline = time.monotonic() + WAIT_S
        while not (started.exists() and len(started.read_text().split()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        broker = hold_broker_lock(root / "lock")
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        if broker is not None:
            broker.stdin.close()
            broker.wait(10)
    assert proc.returncode == EXIT_BROKER_RUNNING, err
    stopped = read_checkpoint(str(root)).reput_from_offset
    assert 0 < stopped < results[-1].phy_offset
    assert out.startswith("interrupted: rebuilt ")
    assert f"[0, {stopped})" in out
    assert err.splitlines()[-1] == (
        f"reputd: error: output directory {root} became the store root of a running broker (PID {broker.pid} took "
        f"{root / 'lock'}), which writes consumequeue/ and index/ there itself: the rebuild stopped at CommitLog "
        f"offset {stopped} (a record boundary; everything before it is written and flushed) and the broker's reput "
        "dispatches the rest; rebuild elsewhere with --out DIR")


def test_the_guard_reports_once_counts_and_stops(tmp_path):
    """BrokerLockGuard: nothing while the lock is free (or absent); once a process holds it, health down with
    the reason, the counter at 1, the stop asked for once, and `taken` stays true (also with the lock freed
    again: the service has stopped writing for good)."""
    lock = tmp_path / "lock"
    metrics = ReputMetrics(lambda: None)
    health, stops, events = [], [], []

    class Log:
        def error(self, event, **fields):
            events.append((event, fields))

    class Notifier:
        def status(self, text):
            pass

    guard = BrokerLockGuard(str(tmp_path), metrics, Log(), lambda s, r: health.append((s, r)), Notifier(),
                            stops.append, lambda: 4096)
    assert not guard.taken(now=True)
    lock.write_bytes(b"lock")
    assert not guard.taken(now=True)
    holder = hold_broker_lock(lock)
    try:
        assert guard.taken(now=True)
        assert guard.taken()
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert guard.taken(now=True)
    assert guard.holder == holder.pid
    assert metrics.registry.get_sample_value("reputd_broker_lock_taken_total") == 1
    assert stops == ["broker_lock_taken"]
    assert [e for e, _ in events] == ["broker_lock_taken"]
    assert events[0][1]["pid"] == holder.pid
    assert events[0][1]["reput_from_offset"] == 4096
    assert health == [(DOWN, f"{BROKER_RUNNING}: PID {holder.pid} took {lock}; reputd stopped writing there")]


@pytest.mark.stress_only
def test_the_real_broker_started_on_the_root_run_writes(tmp_path):
    """The real 4.9.3 store: a broker wrote and stopped; its ConsumeQueues and IndexFiles were deleted and
    `reputd run` rebuilds them in its root and follows it; the broker starts again on the root (load(), then
    start() takes `lock`) and writes more: `run` exits 2 with its line, and once the broker has stopped, the
    root verifies clean against the whole CommitLog (the broker took reputd's files and went on from them)."""
    from tests.test_realbroker_live import java_build, java_command

    build = java_build()
    root = tmp_path / "broker"
    sizes = {"mappedFileSizeCommitLog": 1 << 20, "mappedFileSizeConsumeQueue": 6000, "maxHashSlotNum": 97,
             "maxIndexNum": 400}
    messages = stress.scale(300, 3000)

    def writer(seed: int) -> subprocess.Popen:
        return subprocess.Popen([*java_command(build), "LiveWriter", "--store", str(root), "--messages",
                                 str(messages), "--rate", "1000", "--seed", str(seed), "--linger-ms", "0",
                                 "--ha-port", "0", "--commitlog-size", str(1 << 20), "--cq-size", "6000",
                                 "--hash-slots", "97", "--index-num", "400"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    first = writer(7)
    assert first.wait(300) == 0, "the first LiveWriter failed"
    for sub in ("consumequeue", "index"):
        shutil.rmtree(root / sub)
    config = write_config(tmp_path, storePathRootDir=str(root), **sizes)
    cfg = yaml.safe_load(config.read_text())
    del cfg["output"]
    cfg["logging"] = {"level": "info", "format": "json"}
    config.write_text(yaml.safe_dump(cfg))
    proc, lines = _start_run(config)
    second = writer(8)
    try:
        assert second.stdout.readline().startswith("STARTED"), "the second LiveWriter did not start"
        started = time.monotonic()
        code = proc.wait(WAIT_S)
        stopped_after = time.monotonic() - started
        err = proc.stderr.read()
        assert second.wait(300) == 0, "the second LiveWriter failed"
    finally:
        for p in (proc, second):
            if p.poll() is None:
                p.kill()
    assert code == EXIT_BROKER_RUNNING, err
    assert err.startswith(f"reputd: error: output directory {root} became the store root of a running broker (PID "
                          f"{second.pid} took {root / 'lock'})"), err
    assert len(err.splitlines()) == 1, err
    assert [e["pid"] for e in _events(lines, "broker_lock_taken")] == [second.pid]
    res = run("verify", "--config", str(config))
    stress.report("broker-starts-later", messages=2 * messages, stopped_after_s=round(stopped_after, 3),
                  verify_exit=res.returncode)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "consistent" in res.stdout
    assert os.path.exists(root / "lock")
    assert sys.platform.startswith("linux")


def test_a_backfill_into_the_root_puts_nothing_more_in_place_once_a_broker_takes_the_lock(spark, tmp_path,
                                                                                         monkeypatch):
    """`backfill` into a store root (one small Spark job): a broker takes `lock` just after the commit put the
    first queue's files in place. The backfill puts nothing more there (no other queue, no IndexFile), logs
    `broker_lock_taken` once, leaves no staging behind, and ends with the line `reputd backfill` prints."""
    from structlog.testing import capture_logs

    from daemon.backfill import BrokerLockTaken, backfill, commit
    from daemon.backfill.commit import STAGING_DIR
    from daemon.config import load_config

    make_store(tmp_path, n=200)
    root = tmp_path / "store"
    (root / "lock").write_bytes(b"lock")
    config = load_config(_root_config(tmp_path), env={})
    holders = []
    commit_queue_dir = commit.commit_queue_dir

    def then_a_broker_starts(*args, **kwargs):
        counts = commit_queue_dir(*args, **kwargs)
        if not holders:
            holders.append(hold_broker_lock(root / "lock"))
        return counts

    monkeypatch.setattr(commit, "commit_queue_dir", then_a_broker_starts)
    try:
        with capture_logs() as logs, pytest.raises(BrokerLockTaken) as caught:
            backfill(config, spark=spark, partitions=2)
    finally:
        for h in holders:
            h.stdin.close()
            h.wait(10)
    queues = sorted(p.parent.relative_to(root / "consumequeue") for p in (root / "consumequeue").glob("*/*/0*"))
    assert len(set(queues)) == 1  # the first queue's files, nothing after the lock was seen
    assert not (root / "index").exists()
    assert not (root / STAGING_DIR).exists()
    taken = [e for e in logs if e["event"] == "broker_lock_taken"]
    assert [(e["log_level"], e["pid"], e["lock"]) for e in taken] == [("error", holders[0].pid, str(root / "lock"))]
    assert re.fullmatch(
        re.escape(f"output directory {root} became the store root of a running broker (PID {holders[0].pid} took "
                  f"{root / 'lock'}), which writes consumequeue/ and index/ there itself: the backfill stopped after "
                  "putting the files of 1 of 6 queues and 0 of ") + r"(1 IndexFile|\d+ IndexFiles)" + re.escape(
            " in place, and put nothing more; backfill elsewhere with --out DIR, or into "
            f"{root} only while the broker is stopped"), str(caught.value)), str(caught.value)


def test_the_backfills_watch_cancels_its_spark_jobs_when_a_broker_takes_the_lock(tmp_path):
    """While Spark runs the backfill's jobs (the driver waits in them), the watch's thread sees the lock taken
    within BROKER_LOCK_CHECK_S and cancels the job group until the driver leaves the jobs; the event once."""
    from daemon.backfill.brokerwatch import BrokerWatch

    (tmp_path / "lock").write_bytes(b"lock")
    cancelled, events = [], []

    class Context:
        def cancelJobGroup(self, group):  # SparkContext.cancelJobGroup
            cancelled.append(group)

    class Log:
        def error(self, event, **fields):
            events.append((event, fields))

    watch = BrokerWatch(str(tmp_path), Log())
    watch.arm(Context(), "reputd-backfill-job")
    holder = None
    try:
        watch.check()  # free: the jobs go on
        holder = hold_broker_lock(tmp_path / "lock")
        deadline = time.monotonic() + WAIT_S
        while not cancelled:
            assert time.monotonic() < deadline, "the jobs were not cancelled"
            time.sleep(0.01)
        with pytest.raises(Exception, match=f"PID {holder.pid} took {tmp_path / 'lock'}"):
            watch.check()
    finally:
        watch.close()
        if holder is not None:
            holder.stdin.close()
            holder.wait(10)
    assert set(cancelled) == {"reputd-backfill-job"}
    assert [(e, f["pid"]) for e, f in events] == [("broker_lock_taken", holder.pid)]


def test_backfill_stopped_by_a_broker_exits_2_with_its_line(tmp_path, monkeypatch, capsys):
    """The command line: the backfill's BrokerLockTaken is one `reputd: error:` line on stderr and exit 2, as
    `run` and `rebuild` exit for the same reason (systemd's RestartPreventExitStatus=2)."""
    import signal

    from daemon.backfill import BrokerLockTaken, job
    from daemon.cli import main

    make_store(tmp_path, n=20)
    config = _root_config(tmp_path)
    root = tmp_path / "store"
    stopped = BrokerLockTaken(str(root), str(root / "lock"), 4321, "before putting any file in place")

    def broker_started(*_args, **_kwargs):
        raise stopped

    monkeypatch.setattr(job, "backfill", broker_started)
    sigterm = signal.getsignal(signal.SIGTERM)
    logging = structlog.get_config()  # the command points the log at this test's captured stderr
    try:
        code = main(["backfill", "--config", str(config), "--master", "local[1]"])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        structlog.configure(**logging)
    assert code == EXIT_BROKER_RUNNING
    assert capsys.readouterr().err.splitlines()[-1] == f"reputd: error: {stopped}"
