"""One writer per output directory, and a rebuild stopped by a signal (issue 11, items 2 and 4), through the
real CLI: a second writer is refused at once naming the directory and the holder's PID, readers never wait,
and SIGTERM stops a rebuild at a batch boundary with everything before it written and a command that
continues it to the files one uninterrupted rebuild writes."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from daemon.cli.common import program
from tests.conformance import files_under
from tests.test_cli import REPUTD, make_store, run, write_config

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    env.update(extra)
    return env


def _start_daemon(config: Path) -> tuple[subprocess.Popen, list[str]]:
    """`reputd run` (no metrics port), once it has reached the head of the CommitLog."""
    proc = subprocess.Popen([*REPUTD, "run", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=_env(REPUTD_METRICS_ENABLED="false", REPUTD_LOGGING_LEVEL="info"))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + WAIT_S
    while not any('"caught_up"' in line for line in list(lines)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the daemon did not catch up"
        time.sleep(0.05)
    return proc, lines


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT_S) == 0


def _one_line_refusal(res, out: Path, pid: int) -> None:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"reputd: error: output directory {out} is in use by another reputd writer "
                               f"(PID {pid}, reputd run)")
    assert "Traceback" not in res.stderr


def test_a_second_writer_is_refused_and_readers_are_not(tmp_path):
    """While `run` holds the output: a second `run`, a `rebuild` and a `backfill` exit 2 at once with one
    line naming the directory and the daemon's PID (backfill before Spark starts: no Java here), nothing
    of theirs is written; `query` and `inspect` answer; after the daemon stops, the rebuild runs."""
    results = make_store(tmp_path, n=200)
    config = write_config(tmp_path)
    out = tmp_path / "out"
    daemon, _ = _start_daemon(config)
    try:
        before = files_under(out)
        _one_line_refusal(run("run", "--config", str(config), "--until-caught-up"), out, daemon.pid)
        _one_line_refusal(run("run", "--config", str(config), env={"REPUTD_METRICS_ENABLED": "false"}), out,
                          daemon.pid)
        _one_line_refusal(run("rebuild", "--config", str(config)), out, daemon.pid)
        no_java = {"JAVA_HOME": str(tmp_path / "no-java"), "PATH": os.path.dirname(sys.executable)}
        _one_line_refusal(run("backfill", "--config", str(config), "--master", "local[1]", env=no_java), out,
                          daemon.pid)
        assert files_under(out).keys() == before.keys()
        res = run("query", "msgid", results[9].msg_id, "--config", str(config), "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["commitLogOffset"] == results[9].phy_offset
        queue_file = out / "consumequeue" / "TopicA" / "0" / f"{0:020d}"
        res = run("inspect", str(queue_file), "--json", "--config", str(config))
        assert res.returncode == 0, res.stderr
    finally:
        _stop(daemon)
    res = run("rebuild", "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    assert (out / "reputd.lock").read_text().split()[1] == "rebuild"


def test_the_lock_dies_with_its_holder(tmp_path):
    """A writer killed with SIGKILL leaves the lock file, not the lock: the next writer starts."""
    make_store(tmp_path, n=50)
    config = write_config(tmp_path)
    daemon, _ = _start_daemon(config)
    daemon.kill()
    daemon.wait(WAIT_S)
    res = run("run", "--config", str(config), "--until-caught-up")
    assert res.returncode == 0, res.stderr


def _slow_config(tmp: Path, out: str, started: Path) -> Path:
    cfg = yaml.safe_load(write_config(tmp).read_text())
    cfg["output"]["dir"] = str(tmp / out)
    cfg["dispatchers"] = ["consumequeue", "index", {"name": "tests.plugins.slow:SlowDispatchDispatcher",
                                                    "options": {"dispatch_seconds": 0.1, "started": str(started)}}]
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_sigterm_stops_a_rebuild_at_a_batch_boundary_and_says_how_to_continue(tmp_path):
    """SIGTERM in the middle of a rebuild: exit 130, the summary of what was written, then where it stopped
    and the command that continues it; that command ends with the files of one uninterrupted rebuild."""
    results = make_store(tmp_path, n=2000)  # 64 KiB segments: one batch each, a dozen of them
    started = tmp_path / "started"
    config = _slow_config(tmp_path, "out", started)
    proc = subprocess.Popen([*REPUTD, "rebuild", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    deadline = time.monotonic() + WAIT_S
    while not (started.exists() and len(started.read_text().split()) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    m = re.search(r"reputd: interrupted by SIGTERM: stopped at CommitLog offset (\d+) .*; continue with: (.+)$", err,
                  re.MULTILINE)
    assert m, err
    stopped = int(m[1])
    assert 0 < stopped < results[-1].phy_offset
    assert stopped in {r.phy_offset for r in results}  # a record boundary
    assert re.match(rf"interrupted: rebuilt [\d,]+ messages, {stopped:,} bytes \[0, {stopped}\)", out)
    command = shlex.split(m[2])  # run as printed, from another directory
    assert command == [*program(), "rebuild", "--from", str(stopped), "--config", str(config)]
    res = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=_env(REPUTD_DISPATCHERS="consumequeue,index"), check=False)
    assert res.returncode == 0, res.stderr
    assert re.match(rf"rebuilt [\d,]+ messages, [\d,]+ bytes \[{stopped}, ", res.stdout)
    reference = write_config(tmp_path)
    assert run("rebuild", "--config", str(reference), "--out", str(tmp_path / "reference")).returncode == 0

    def outputs(root: Path) -> dict[str, bytes]:
        return {k: v for k, v in files_under(root).items() if k.startswith(("consumequeue/", "index/"))}

    continued, clean = outputs(tmp_path / "out"), outputs(tmp_path / "reference")
    assert sorted(k for k in continued if k.startswith("consumequeue/")) == sorted(
        k for k in clean if k.startswith("consumequeue/"))
    assert [v for k, v in sorted(continued.items())] == [v for k, v in sorted(clean.items())]
