"""`reputd run` end to end: the real CLI as a subprocess, following a CommitLog this test writes.

Every scenario ends by comparing the daemon's output with a clean `reputd rebuild` of the same
CommitLog: ConsumeQueue and IndexFile bytes identical, names included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from daemon.engine.checkpoint import CHECKPOINT_FILE
from indexcore.commitlog import MessageRecord
from indexcore.consumequeue import BLANK_UNIT as BLANK_CQ_UNIT
from indexcore.writer import CommitLogWriter, Message
from tests.conformance import discover, files_under

SEGMENT = 256 * 1024
REPUTD = [sys.executable, "-m", "daemon.cli"]
TOPICS = ("TopicA", "TopicB", "订单Topic")
START_MS = 1_700_000_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Store:
    """A CommitLog this test appends to, plus the daemon's config and a rebuild to compare with."""

    def __init__(self, tmp: Path, **overrides):
        self.tmp = tmp
        self.out = tmp / "out"
        self.port = free_port()
        self._clock = iter(range(START_MS, START_MS + 10**12, 137))
        self.writer = CommitLogWriter(str(tmp / "store" / "commitlog"), SEGMENT, clock=lambda: next(self._clock))
        self.count = 0
        reput = {"pollIntervalMs": 50, "shutdownTimeoutMs": 10000, **overrides.pop("reput", {})}
        cfg = {"store": {"storePathRootDir": str(tmp / "store"), "mappedFileSizeCommitLog": SEGMENT,
                         "mappedFileSizeConsumeQueue": 2000, "maxHashSlotNum": 97, "maxIndexNum": 400,
                         "flushIntervalConsumeQueue": 50, "flushConsumeQueueThoroughInterval": 300,
                         **overrides.pop("store", {})},
               "output": {"dir": str(self.out)}, "reput": reput,
               "metrics": {"port": self.port}, "logging": {"level": "info", "format": "json"}, **overrides}
        self.config = tmp / "reputd.yaml"
        self.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))

    def append(self, n: int, body_size: int = 200) -> None:
        for _ in range(n):
            i = self.count
            props = {"TAGS": f"Tag{i % 3}", "KEYS": f"order-{i} 订单😀{i % 11}", "UNIQ_KEY": f"{i:032X}"}
            self.writer.append(Message(TOPICS[i % len(TOPICS)], i % 4, bytes([i % 251]) * (body_size + i % 50), props))
            self.count += 1

    @property
    def end(self) -> int:
        return self.writer.max_offset

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([*REPUTD, "run", "--config", str(self.config), *args], env=clean_env(env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*REPUTD, "run", "--config", str(self.config), *args], env=clean_env(env),
                              capture_output=True, text=True, timeout=timeout, check=False)

    def rebuild(self) -> Path:
        ref = self.tmp / "reference"
        res = subprocess.run([*REPUTD, "rebuild", "--config", str(self.config), "--out", str(ref)],
                             env=clean_env(), capture_output=True, text=True, timeout=120, check=False)
        assert res.returncode == 0, res.stderr
        return ref

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def health(self) -> dict:
        return json.loads(self.get("/healthz")[1])

    def metrics(self) -> dict[str, float]:
        out = {}
        for family in text_string_to_metric_families(self.get("/metrics")[1].decode()):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPUTD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(extra or {})
    return env


def output_files(root: Path) -> dict[str, bytes]:
    """The broker-format files of an output directory (not reputd's checkpoint or quarantine)."""
    return {str(p.relative_to(root)): p.read_bytes() for sub in ("consumequeue", "index")
            for p in sorted((root / sub).rglob("*")) if p.is_file()}


def assert_same_as_rebuild(store: Store) -> None:
    expected = output_files(store.rebuild())
    actual = output_files(store.out)
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name] == expected[name], f"{name} differs from a clean rebuild"


def wait_for(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except (OSError, ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 20) -> tuple[int, str, str]:
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.writer.close()


def test_until_caught_up_matches_rebuild_and_checkpoints(store):
    """--until-caught-up dispatches everything, flushes, writes the checkpoint at the end, exits 0."""
    store.append(1500)
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert_same_as_rebuild(store)
    ckpt = json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]
    assert ckpt["reputFromOffset"] == store.end
    assert ckpt["dispatchers"]["index"]["name"] == sorted(os.listdir(store.out / "index"))[-1]
    names = [e["event"] for e in events(res.stdout)]
    assert names[0] == "reputd_started"
    assert "recovered" in names
    assert "final_flush" in names
    # a second run finds nothing to do and changes nothing
    before = output_files(store.out)
    assert store.run("--until-caught-up").returncode == 0
    assert output_files(store.out) == before


def test_follows_a_growing_commitlog_then_stops_on_sigterm(store):
    """Appends in bursts across segment rolls are dispatched as they come; metrics and /healthz tell
    the truth; SIGTERM flushes, checkpoints and exits 0."""
    store.append(300)
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="first catch-up")
        for _ in range(4):
            store.append(700)
            wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="catch-up after a burst")
        assert store.health()["status"] == "healthy"
        wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="checkpoint at the head")
        m = store.metrics()
        assert m["reputd_reput_offset_bytes"] == store.end
        assert m["reputd_commitlog_max_offset_bytes"] == store.end
        assert m["rocketmq_storage_dispatch_behind_bytes"] == 0
        assert m["rocketmq_storage_flush_behind_bytes"] == 0
        assert m["reputd_checkpoint_age_seconds"] == 0
        assert m["reputd_dispatched_messages_total{dispatcher=consumequeue}"] == store.count
        assert m["reputd_dispatched_messages_total{dispatcher=index}"] == store.count
        assert m["reputd_health{state=healthy}"] == 1
        assert m["reputd_files{kind=index}"] == len(os.listdir(store.out / "index"))
        assert m["reputd_batch_messages_count"] >= 5
        assert m["reputd_flush_duration_seconds_count"] >= 1
        assert any(k.startswith("reputd_build_info{") for k in m)
        assert store.get("/nope")[0] == 404
        # idle, the loop reads the CommitLog a few times per poll interval (500 ms), never in a busy loop: its
        # own opens and reads of a segment raise inotify events, which must not wake it
        reads = store.metrics()["reputd_commitlog_reads_total"]
        time.sleep(2.0)
        assert store.metrics()["reputd_commitlog_reads_total"] - reads <= 40
    finally:
        code, out, err = stop(proc)
    assert code == 0, err
    names = [e["event"] for e in events(out)]
    assert "shutdown_requested" in names
    assert "segment_rolled" in names
    assert names[-1] == "reputd_stopped"
    assert json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]["reputFromOffset"] == store.end
    assert_same_as_rebuild(store)


def test_metrics_show_lag_while_behind(store):
    """With the daemon stuck (a corrupt record), appends past it show as bytes and seconds behind."""
    store.append(200)
    bad = store.end
    store.append(300)
    corrupt_body_byte(store, bad)
    proc = store.start()
    try:
        wait_for(lambda: store.health()["status"] == "degraded", what="degraded")
        m = store.metrics()
        assert m["reputd_reput_offset_bytes"] == bad
        assert m["rocketmq_storage_dispatch_behind_bytes"] == store.end - bad
        assert m["reputd_dispatch_behind_seconds"] > 0
        assert m["reputd_corrupt_records_total{reason=body_crc}"] == 1
        health = store.health()
        assert health["reputFromOffset"] == bad
        assert "corrupt" in health["reason"]
    finally:
        code, out, err = stop(proc)
    assert code == 0, err
    corrupt = [e for e in events(out) if e["event"] == "corrupt_commitlog"]
    assert len(corrupt) == 1, "reported once, however long it stays stuck"
    assert corrupt[0]["offset"] == bad
    assert corrupt[0]["file"].endswith("00000000000000000000")


def corrupt_body_byte(store: Store, offset: int) -> None:
    """Flip the first body byte of the record at `offset`, so its body CRC no longer matches."""
    seg = store.tmp / "store" / "commitlog" / f"{offset - offset % SEGMENT:020d}"
    data = bytearray(seg.read_bytes())
    msg = MessageRecord.decode(bytes(data), offset % SEGMENT)
    body_at = bytes(data).index(msg.body, offset % SEGMENT)
    data[body_at] ^= 0xFF
    seg.write_bytes(bytes(data))


def test_corruption_until_caught_up_exits_1_and_checkpoints_before_it(store):
    store.append(200)
    bad = store.end
    store.append(50)
    corrupt_body_byte(store, bad)
    res = store.run("--until-caught-up")
    assert res.returncode == 1
    assert json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]["reputFromOffset"] == bad
    assert any(e["event"] == "corrupt_commitlog" and e["offset"] == bad for e in events(res.stdout))


def test_skip_segment_logs_counts_and_goes_on(tmp_path):
    store = Store(tmp_path, reput={"onCorruption": "skip-segment"})
    store.append(200)
    bad = store.end
    while store.end // SEGMENT == bad // SEGMENT:
        store.append(50)
    corrupt_body_byte(store, bad)
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="skip past the bad segment")
        m = store.metrics()
        next_segment = bad - bad % SEGMENT + SEGMENT
        assert m["reputd_skipped_bytes_total{reason=corruption}"] == next_segment - bad
        assert m["reputd_corrupt_records_total{reason=body_crc}"] == 1
    finally:
        code, out, _ = stop(proc)
        store.writer.close()
    assert code == 0
    skipped = [e for e in events(out) if e["event"] == "segment_skipped"]
    assert skipped
    assert skipped[0]["skipped_from"] == bad
    assert skipped[0]["skipped_to"] == next_segment
    units = list((store.out / "consumequeue").rglob("0*"))
    assert units


def test_corrupt_checkpoint_is_reported_and_recovered_from_the_commitlog(store):
    store.append(600)
    assert store.run("--until-caught-up").returncode == 0
    store.append(400)
    (store.out / CHECKPOINT_FILE).write_text('{"payload": {"reputFromOffset": 5}, "crc32": 1}')
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    bad = [e for e in events(res.stdout) if e["event"] == "checkpoint_corrupt"]
    assert bad
    assert bad[0]["path"] == str(store.out / CHECKPOINT_FILE)
    assert_same_as_rebuild(store)


def test_wrong_size_output_files_are_quarantined_and_rebuilt(store):
    store.append(1200)
    assert store.run("--until-caught-up").returncode == 0
    cq_file = sorted((store.out / "consumequeue" / "TopicA" / "1").iterdir())[0]
    with open(cq_file, "r+b") as f:
        f.truncate(100)
    index_file = sorted((store.out / "index").iterdir())[-1]
    with open(index_file, "r+b") as f:
        f.truncate(1000)
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    moved = [e for e in events(res.stdout) if e["event"] == "output_file_quarantined"]
    assert {Path(e["path"]) for e in moved} == {cq_file, index_file}
    assert (store.out / "quarantine").is_dir()
    assert_same_as_rebuild(store)


def test_failing_dispatcher_never_lets_the_checkpoint_pass_it(store, tmp_path):
    """A plug-in that fails (a full disk, say): the checkpoint stays before the batch it did not take;
    the daemon stays up, degraded, retries from the checkpoint, and recovers once the cause is gone."""
    marker = tmp_path / "disk-full"
    cfg = yaml.safe_load(store.config.read_text())
    cfg["dispatchers"] = ["consumequeue", "index",
                          {"name": "tests.plugins.failing:FailingDispatcher", "options": {"fail_if": str(marker)}}]
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    store.append(500)
    assert store.run("--until-caught-up").returncode == 0
    first = store.end
    marker.touch()
    store.append(500)
    res = store.run("--until-caught-up")
    assert res.returncode == 1
    assert json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]["reputFromOffset"] == first
    assert any(e["event"] == "dispatch_failed" and e["dispatcher"] == "failing" for e in events(res.stdout))
    proc = store.start()
    try:
        wait_for(lambda: store.health()["status"] == "degraded", what="degraded while failing")
        assert store.metrics()["reputd_errors_total{kind=dispatch}"] >= 1
        marker.unlink()
        wait_for(lambda: store.health().get("checkpointOffset") == store.end, timeout=30, what="recovery")
        assert store.health()["status"] == "healthy"
    finally:
        code, _, err = stop(proc)
    assert code == 0, err
    assert_same_as_rebuild(store)


def test_missing_commitlog_is_a_clear_error_not_a_crash_loop(tmp_path):
    store = Store(tmp_path)
    store.writer.close()
    os.rename(tmp_path / "store" / "commitlog", tmp_path / "elsewhere")
    res = store.run("--until-caught-up")
    assert res.returncode == 1
    assert any(e["event"] == "recovery_failed" and "commitlog" in e["error"] for e in events(res.stdout))
    assert "Traceback" not in res.stderr
    proc = store.start()
    try:
        status = wait_for(lambda: store.get("/healthz")[0] == 503 and store.health()["reason"] != "starting"
                          and store.health(), what="health down")
        assert status["status"] == "down"
        assert "commitlog" in status["reason"]
        os.rename(tmp_path / "elsewhere", tmp_path / "store" / "commitlog")
        wait_for(lambda: store.health()["status"] == "healthy", timeout=30, what="up once the CommitLog is back")
    finally:
        code, _, err = stop(proc)
    assert code == 0, err


def test_sd_notify_ready_watchdog_status_stopping(store, tmp_path):
    store.append(300)
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(10)
    proc = store.start(env={"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "200000"})
    messages: list[str] = []
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (
                any("READY=1" in m for m in messages) and sum("WATCHDOG=1" in m for m in messages) >= 3
                and any(m.startswith("STATUS=") for m in messages)):
            messages.append(sock.recv(4096).decode())
    finally:
        code, _, err = stop(proc)
        sock.settimeout(2)
        try:
            while True:
                messages.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
        sock.close()
    assert code == 0, err
    ready = next(m for m in messages if "READY=1" in m)
    assert messages.index(ready) == 0 or all("READY" not in m for m in messages[: messages.index(ready)])
    status = [m for m in messages if m.startswith("STATUS=") and "reput offset" in m]
    assert status, messages
    assert sum("WATCHDOG=1" in m for m in messages) >= 3
    assert "STOPPING=1" in messages[-1]


def test_torn_record_at_the_head_is_waited_for(store):
    """A record whose bytes are only partly written is not dispatched until it is complete."""
    store.append(100)
    head = store.end
    # the bytes the next append would write, made on a copy of the CommitLog
    shutil.copytree(store.tmp / "store" / "commitlog", store.tmp / "scratch")
    scratch = CommitLogWriter(str(store.tmp / "scratch"), SEGMENT, clock=lambda: START_MS + 10**9)
    scratch.append(Message("TopicA", 1, b"late" * 100, {"KEYS": "torn-key", "UNIQ_KEY": "F" * 32}))
    record = (store.tmp / "scratch" / f"{0:020d}").read_bytes()[head:scratch.max_offset]
    scratch.close()
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == head, what="catch-up")
        seg = store.tmp / "store" / "commitlog" / f"{0:020d}"
        with open(seg, "r+b") as f:
            f.seek(head)
            f.write(record[: len(record) // 2])
            f.flush()
            time.sleep(0.5)
            assert store.health()["reputFromOffset"] == head, "half a record was dispatched"
            f.seek(head + len(record) // 2)
            f.write(record[len(record) // 2:])
        wait_for(lambda: store.health().get("reputFromOffset") == head + len(record), what="the completed record")
    finally:
        code, _, err = stop(proc)
    assert code == 0, err
    assert_same_as_rebuild(store)


def test_sigint_stops_cleanly_like_sigterm(store):
    store.append(200)
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="catch-up")
    finally:
        code, out, err = stop(proc, signal.SIGINT)
    assert code == 0, err
    assert any(e["event"] == "shutdown_requested" and e["reason"] == "SIGINT" for e in events(out))
    assert json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]["reputFromOffset"] == store.end


def test_shutdown_timeout_exits_1_and_the_next_start_recovers(store):
    """A final flush that outlasts shutdownTimeoutMs: exit 1 without a final checkpoint, nothing lost."""
    cfg = yaml.safe_load(store.config.read_text())
    cfg["reput"]["shutdownTimeoutMs"] = 300
    cfg["store"]["flushIntervalConsumeQueue"] = 3_600_000
    cfg["dispatchers"] = ["consumequeue", "index",
                          {"name": "tests.plugins.slow:SlowFlushDispatcher", "options": {"flush_seconds": 5}}]
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    store.append(300)
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="catch-up")
        started = time.monotonic()
    finally:
        code, out, _ = stop(proc)
    assert code == 1
    assert time.monotonic() - started < 4
    assert any(e["event"] == "shutdown_timeout" for e in events(out))
    ckpt = json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]
    assert (ckpt["reputFromOffset"], ckpt["dispatchers"]) == (0, {}), "only the start's replay marker"
    cfg["dispatchers"] = ["consumequeue", "index"]
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    assert store.run("--until-caught-up").returncode == 0
    assert_same_as_rebuild(store)


def retention_gap(store, read_up_to: int) -> int:
    """Delete every segment up to the one after the one holding `read_up_to`, as the broker's retention does
    while reputd is away; the first unread segment's offset."""
    log_dir = store.tmp / "store" / "commitlog"
    first_unread = read_up_to - read_up_to % SEGMENT
    for name in sorted(os.listdir(log_dir)):
        if int(name) <= first_unread + SEGMENT:
            os.unlink(log_dir / name)
    return first_unread


def test_segments_deleted_by_retention(store):
    """Segments deleted below the read offset change nothing; segments deleted before they were read are
    skipped with a warning and counted, and dispatch goes on from the oldest segment left."""
    store.append(1000)
    assert store.run("--until-caught-up").returncode == 0
    read_up_to = store.end
    while store.end // SEGMENT < read_up_to // SEGMENT + 3:
        store.append(500)
    first_unread = retention_gap(store, read_up_to)
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    skipped = [e for e in events(res.stdout) if e["event"] == "offset_below_oldest_segment"]
    assert len(skipped) == 1
    assert skipped[0]["requested"] == read_up_to
    assert skipped[0]["resumed_at"] == first_unread + 2 * SEGMENT
    ckpt = json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]
    assert ckpt["reputFromOffset"] == store.end


def test_blanked_units_are_counted_as_the_files_hold_them(tmp_path):
    """`queue_offsets_blanked` counts every blank unit a restart across a retention gap writes: the gaps inside
    the queues the output held and the pre-blank units of a queue first met after the gap (its earliest records
    deleted unread), which it used to leave out (a life: 885,424 reported, 912,968 in the files)."""
    store = Store(tmp_path, store={"mappedFileSizeConsumeQueue": 20 * 2000})  # one file a queue: none expires
    try:
        store.append(600)
        assert store.run("--until-caught-up").returncode == 0
        read_up_to = store.end
        late = 0
        while store.end // SEGMENT < read_up_to // SEGMENT + 3:  # a queue born while reputd is away
            store.append(60)
            for _ in range(20):
                store.writer.append(Message("LateTopic", 1, bytes(300), {"KEYS": f"late-{late}"}))
                late += 1
        retention_gap(store, read_up_to)
        res = store.run("--until-caught-up")
        assert res.returncode == 0, res.stderr
    finally:
        store.writer.close()
    reported = sum(e["blanks"] for e in events(res.stdout) if e["event"] == "queue_offsets_blanked")
    in_files = {}
    for path in sorted(p for p in (store.out / "consumequeue").rglob("*") if p.is_file()):
        data = path.read_bytes()
        units = [data[i:i + 20] for i in range(0, len(data), 20)]
        in_files[str(path.relative_to(store.out))] = units.count(BLANK_CQ_UNIT)
    late_blanks = sum(n for name, n in in_files.items() if "LateTopic" in name)
    assert late_blanks > 0
    assert sum(in_files.values()) > late_blanks  # the queues the output held got gaps too
    assert reported == sum(in_files.values())


def test_an_output_and_checkpoint_of_0_1_0_carry_over(store):
    """docs/upgrading.md: a newer reputd goes on from a 0.1.0 output and checkpoint. 0.1.0 wrote the same
    checkpoint format (version 1) with no state for the ConsumeQueue dispatcher (`null`; the queue count came
    later): the start cuts back to it (`decision: checkpoint`) and the files end as a clean rebuild's."""
    from daemon.engine.checkpoint import Checkpoint, read_checkpoint, write_checkpoint

    store.append(500)
    assert store.run("--until-caught-up").returncode == 0
    now = read_checkpoint(str(store.out))
    assert now.dispatchers["consumequeue"] == {"queues": 12}
    write_checkpoint(str(store.out), Checkpoint(now.reput_from_offset, {**now.dispatchers, "consumequeue": None},
                                                now.written_at_ms))
    store.append(300)
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert [e["decision"] for e in events(res.stdout) if e["event"] == "recovered"] == ["checkpoint"]
    assert_same_as_rebuild(store)


def test_enabling_the_index_later_builds_it_from_the_start(store):
    """A dispatcher the checkpoint does not cover gets every record; the others skip what they hold."""
    cfg = yaml.safe_load(store.config.read_text())
    cfg["store"]["messageIndexEnable"] = False
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    store.append(800)
    assert store.run("--until-caught-up").returncode == 0
    assert not (store.out / "index").exists()
    store.append(300)
    cfg["store"]["messageIndexEnable"] = True
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert any(e["event"] == "dispatcher_not_in_checkpoint" and e["dispatcher"] == "index" for e in events(res.stdout))
    assert_same_as_rebuild(store)


def fail_flushes_while(store: Store, marker: Path) -> Path:
    """Add the failing test dispatcher to the store's config: its flush fails while `marker` exists."""
    cfg = yaml.safe_load(store.config.read_text())
    cfg["dispatchers"] = ["consumequeue", "index", {"name": "tests.plugins.failing:FailingDispatcher",
                                                    "options": {"fail_flush_if": str(marker)}}]
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return marker


def test_flush_errors_degrade_and_hold_the_checkpoint_until_they_stop(store, tmp_path):
    marker = fail_flushes_while(store, tmp_path / "io-error")
    store.append(300)
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="first checkpoint")
        marker.touch()
        held = store.end
        store.append(300)
        wait_for(lambda: store.health()["status"] == "degraded", what="degraded on flush errors")
        assert store.health()["reason"].startswith("flush failed")
        assert store.health()["checkpointOffset"] == held
        assert store.metrics()["reputd_errors_total{kind=flush}"] >= 1
        marker.unlink()
        wait_for(lambda: store.health()["status"] == "healthy", what="healthy once flushes succeed")
        wait_for(lambda: store.health()["checkpointOffset"] == store.end, what="checkpoint moves on")
    finally:
        code, out, err = stop(proc)
    assert code == 0, err
    assert any(e["event"] == "flush_failed" for e in events(out))


def test_commitlog_directory_vanishing_mid_run_is_reported_and_waited_out(store):
    store.append(200)
    proc = store.start()
    log_dir = store.tmp / "store" / "commitlog"
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="catch-up")
        os.rename(log_dir, store.tmp / "moved")
        wait_for(lambda: store.get("/healthz")[0] == 503, what="down while the CommitLog is gone")
        assert store.metrics()["reputd_errors_total{kind=commitlog}"] == 1
        os.rename(store.tmp / "moved", log_dir)
        store.append(100)
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="catch-up after it is back")
        assert store.health()["status"] == "healthy"
    finally:
        code, out, err = stop(proc)
    assert code == 0, err
    assert "Traceback" not in out + err
    gone = [e for e in events(out) if e["event"] == "commitlog_unavailable"]
    assert len(gone) == 1
    assert gone[0]["path"] == str(log_dir)
    assert_same_as_rebuild(store)


@pytest.mark.parametrize("conformance", discover(), ids=lambda s: s.name)
def test_the_daemon_writes_the_brokers_bytes(tmp_path, conformance):
    """`reputd run --until-caught-up` on a broker-written store: ConsumeQueue files byte-identical to the
    broker's, IndexFiles identical in name order (the daemon's path: flusher, checkpoint, final flush)."""
    config = conformance.make_workspace(tmp_path)
    res = subprocess.run([*REPUTD, "run", "--config", str(config), "--until-caught-up"], capture_output=True,
                         text=True, timeout=300, check=False, env=clean_env({"REPUTD_METRICS_ENABLED": "false"}))
    assert res.returncode == 0, res.stderr
    out = tmp_path / "store"
    assert files_under(out / "consumequeue") == files_under(conformance.store / "consumequeue")
    assert list(files_under(out / "index").values()) == list(files_under(conformance.store / "index").values())


SIGNAL_INSIDE_WAKE_LOCK = """
import os, signal, sys, time
from daemon.engine import reput
from daemon.config import load_config

def run(self):
    with self._wake._cond:  # the loop clearing its wake event when SIGTERM arrives
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the Python handler runs here, inside the lock
    return 0 if self.stopping.wait(10) else 3

reput.ReputService.run = run
sys.exit(reput.run_daemon(load_config(sys.argv[1], {})))
"""


def test_sigterm_while_the_loop_holds_its_wake_lock_stops_cleanly(tmp_path):
    """A SIGTERM that lands while the loop holds the wake event's lock (it clears the event after every file
    event) stops the daemon: the handler takes no lock (it once set that event from the handler and hung
    until the shutdown timeout, exit 1, no final checkpoint)."""
    (tmp_path / "store" / "commitlog").mkdir(parents=True)
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(tmp_path / "store")},
                                      "output": {"dir": str(tmp_path / "out")}, "metrics": {"enabled": False}}))
    proc = subprocess.run([sys.executable, "-c", SIGNAL_INSIDE_WAKE_LOCK, str(config)],
                          cwd=Path(__file__).parent.parent, env=clean_env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "shutdown_timeout" not in proc.stdout
