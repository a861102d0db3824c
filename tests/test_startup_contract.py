"""What `reputd run` tells systemd while it starts and stops (issue 15 item 2), heard on a notification
socket standing in for systemd's.

The contract (docs/systemd.md): READY=1 once start-up is over, either following the CommitLog or waiting
for something only the outside can fix (the CommitLog directory missing, a damaged segment, no room for the
output); STATUS= and /healthz say which. Segments that all have another size than mappedFileSizeCommitLog
(the setting is not the broker's) are exit 1 without READY=1, so Restart= and the start limit end the
retries. A long recovery pushes the start timeout
back with EXTEND_TIMEOUT_USEC while it works, and stops doing so if it hangs. STOPPING=1 goes out when the
stop begins, before the final flush.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import yaml

from daemon.engine import reput
from tests.test_daemon import SEGMENT, Store, clean_env, events, stop, wait_for


class Listener:
    """A bound datagram socket collecting every notification, with its arrival time."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="sdn-")  # AF_UNIX paths are short; tmp_path can be long
        self.path = os.path.join(self.dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic() - self.started, data.decode()))

    def fields(self) -> list[str]:
        return [m for _, m in self.messages]

    def first(self, prefix: str) -> str | None:
        return next((m for m in self.fields() if any(line.startswith(prefix) for line in m.split("\n"))), None)

    def close(self) -> None:
        time.sleep(0.3)  # what the process sent just before it exited
        self._stop.set()
        self._thread.join()
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def timeline(self) -> str:
        return "\n".join(f"{t:7.3f}s {m!r}" for t, m in self.messages)


@pytest.fixture
def listener():
    sd = Listener()
    yield sd
    sd.close()


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.writer.close()


def test_missing_commitlog_directory_is_ready_and_down_then_follows(store, listener):
    """READY=1 comes at once, its STATUS= and /healthz saying what is awaited; once the directory is there
    the daemon recovers and follows, and a stop sends STOPPING=1."""
    store.append(300)
    log_dir = store.tmp / "store" / "commitlog"
    os.rename(log_dir, store.tmp / "elsewhere")
    proc = store.start(env={"NOTIFY_SOCKET": listener.path})
    try:
        wait_for(lambda: listener.first("READY=1"), timeout=30, what="READY=1")
        ready = listener.first("READY=1")
        assert "STATUS=down: " in ready, ready
        assert str(log_dir) in ready
        assert "does not exist" in ready
        health = store.health()
        assert health["status"] == "down"
        assert str(log_dir) in health["reason"]
        assert store.get("/healthz")[0] == 503
        os.rename(store.tmp / "elsewhere", log_dir)
        wait_for(lambda: listener.first("STATUS=recovered"), timeout=30, what="recovered once the directory is back")
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="caught up")
        assert store.health()["status"] == "healthy"
    finally:
        code, out, err = stop(proc)
    assert code == 0, err
    assert sum("READY=1" in m for m in listener.fields()) == 1, listener.timeline()
    assert any("STOPPING=1" in m for m in listener.fields()), listener.timeline()
    assert any(e["event"] == "recovery_failed" and e["retry_in_s"] for e in events(out))


def test_segment_size_setting_mismatch_exits_2_without_ready(store, listener):
    """Every segment is 256 KiB, the config says 128 KiB: only a config change fixes that, so exit 2 at
    once, the configuration error every command gives (systemd's RestartPreventExitStatus=2 does not
    restart it), with STATUS= and one line on stderr saying why and never READY=1 (a unit that never
    becomes ready and never exits would loop on TimeoutStartSec= forever)."""
    while store.end < SEGMENT:
        store.append(200)
    store.writer.close()
    cfg = yaml.safe_load(store.config.read_text())
    cfg["store"]["mappedFileSizeCommitLog"] = SEGMENT // 2
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    proc = store.start(env={"NOTIFY_SOCKET": listener.path})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Traceback" not in out + err
    assert err.splitlines()[-1].startswith("reputd: config error: "), err
    assert "set store.mappedFileSizeCommitLog to the broker's value" in err
    assert listener.first("READY=1") is None, listener.timeline()
    assert listener.fields()[-1].startswith("STATUS=failed"), "the last word systemd shows is why"
    status = listener.first("STATUS=failed")
    assert status is not None, listener.timeline()
    assert f"the segments here are {SEGMENT} bytes" in status
    assert "mappedFileSizeCommitLog is 131072" in status
    mismatch = [e for e in events(out) if e["event"] == "config_mismatch"]
    assert mismatch
    assert mismatch[0]["exit_code"] == 2


def test_one_segment_of_another_size_is_ready_and_down_until_repaired(store, listener):
    """A single segment of the wrong size (a copy cut short) is damage an operator can repair: READY=1 with
    STATUS= and /healthz down naming the file, and the daemon goes on by itself once it is repaired."""
    while store.end < SEGMENT:
        store.append(200)
    store.append(100)
    store.writer.close()
    first = store.tmp / "store" / "commitlog" / f"{0:020d}"
    data = first.read_bytes()
    with open(first, "r+b") as f:
        f.truncate(SEGMENT // 2)
    proc = store.start(env={"NOTIFY_SOCKET": listener.path})
    try:
        wait_for(lambda: listener.first("READY=1"), timeout=30, what="READY=1")
        ready = listener.first("READY=1")
        assert "STATUS=down: " in ready, ready
        assert str(first) in ready
        assert f"segment is {SEGMENT // 2} bytes" in ready
        assert store.get("/healthz")[0] == 503
        assert str(first) in store.health()["reason"]
        repaired = store.tmp / "repaired"
        repaired.write_bytes(data)
        os.replace(repaired, first)
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, timeout=60, what="caught up after repair")
    finally:
        code, _, err = stop(proc)
    assert code == 0, err


def test_stopping_is_sent_when_stopping_starts(store, listener, tmp_path):
    """STOPPING=1 goes out as soon as SIGTERM arrives, while the final flush is still running."""
    hold = tmp_path / "hold-flush"
    cfg = yaml.safe_load(store.config.read_text())
    cfg["dispatchers"] = ["consumequeue", "index",
                          {"name": "tests.plugins.gated:GatedDispatcher", "options": {"hold_flush_while": str(hold)}}]
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    store.append(200)
    proc = store.start(env={"NOTIFY_SOCKET": listener.path})
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="caught up")
        hold.touch()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: listener.first("STOPPING=1"), timeout=5, what="STOPPING=1 while the flush is held")
        assert proc.poll() is None, "still flushing"
    finally:
        hold.unlink(missing_ok=True)
        code, _, err = stop(proc)
    assert code == 0, err
    assert sum("STOPPING=1" in m for m in listener.fields()) == 1, listener.timeline()


@pytest.mark.parametrize(("option", "extended"), [("startup_cpu_seconds", True), ("startup_sleep_seconds", False)],
                         ids=["working", "hanging"])
def test_long_recovery_extends_the_start_timeout_only_while_it_works(store, listener, option, extended):
    """EXTEND_TIMEOUT_USEC before READY=1 while recovery uses CPU (here a plug-in's construction); a
    recovery that hangs sends none, so TimeoutStartSec= still ends it. The daemon runs in its own process
    (beats every 0.2 s), as under systemd: the beats measure that process's work."""
    beat = 0.2
    times = store.tmp / "gated-startup"
    cfg = yaml.safe_load(store.config.read_text())
    cfg["dispatchers"] = ["consumequeue", "index",
                          {"name": "tests.plugins.gated:GatedDispatcher",
                           "options": {option: 2.0, "startup_times_file": str(times)}}]
    cfg["metrics"] = {"enabled": False}
    store.config.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    store.append(100)
    # a loaded test machine gives the working recovery little CPU per (shortened) beat
    progress_cpu = 0.002 if extended else reput.STARTUP_PROGRESS_CPU_S
    res = subprocess.run([sys.executable, "-m", "tests.plugins.beats", str(beat), str(progress_cpu),
                          "run", "--config", str(store.config), "--until-caught-up"],
                         env=clean_env({"NOTIFY_SOCKET": listener.path}), capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    began, ended = (float(t) - listener.started for t in times.read_text().split())
    # beats inside the plug-in's construction, after the first one (which may still count the work before it)
    extends = [t for t, m in listener.messages
               if m.startswith("EXTEND_TIMEOUT_USEC=") and began + beat * 1.5 <= t <= ended]
    if extended:
        assert len(extends) >= 2, listener.timeline()
        assert all(m.split("\n")[0] == f"EXTEND_TIMEOUT_USEC={int(reput.STARTUP_EXTEND_S * 1_000_000)}"
                   for _, m in listener.messages if m.startswith("EXTEND_TIMEOUT_USEC="))
    else:
        assert extends == [], listener.timeline()
    ready_at = next(t for t, m in listener.messages if "READY=1" in m)
    assert not [t for t, m in listener.messages if m.startswith("EXTEND_TIMEOUT_USEC=") and t > ready_at]
