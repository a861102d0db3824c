"""Ctrl-C or SIGTERM in a command's first fraction of a second, and in commands that had no handling of their
own (issue 44 §2.9), through the real CLI: from reputd's first line on, every command answers a signal with
one line and its exit code for it (130; 0 for `run`, whose normal stop SIGTERM is), never a traceback and
never a death by the signal. The signals are sent at several instants counted from the moment the process
handles SIGTERM (its first line has run: /proc's SigCgt), while the command's modules still import, and
later; the interpreter's own start before that line is Python's (docs/commands.md says so)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from indexcore.checkpoint import CHECKPOINT_FILE
from tests.test_cli import REPUTD, make_store, run, write_config
from tests.tools import catches

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60
RUN_STOPPED = re.compile(r"reputd: stopped by SIG(INT|TERM) while starting: nothing was read or written")


def _spawn(args: list[str], env: dict | None = None) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    full.update({"REPUTD_METRICS_ENABLED": "false", **(env or {})})
    return subprocess.Popen([*REPUTD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=full)


def _signal_after_first_line(proc: subprocess.Popen, sig: int, after: float) -> tuple[str, str]:
    """Send `sig` `after` seconds past the instant the process handles SIGTERM; its output."""
    deadline = time.monotonic() + WAIT_S
    while proc.poll() is None and not catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.0005)
    time.sleep(after)
    proc.send_signal(sig)
    return proc.communicate(timeout=WAIT_S)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store of 2,000 messages and a config writing elsewhere; each test writes under its own directory."""
    base = tmp_path_factory.mktemp("early-signals")
    make_store(base, n=2000)
    return base, write_config(base)


def _args(command: str, base: Path, config: Path, tmp: Path) -> list[str]:
    return {"run": ["run", "--config", str(config), "--out", str(tmp / "out")],
            "inspect": ["inspect", str(base / "store" / "commitlog" / "00000000000000000000")],
            "produce": ["produce", "--config", str(config), "--store", str(tmp / "produced"), "--messages", "100000"],
            "handoff": ["handoff", "--config", str(config), "--out", str(tmp / "out"), "--dry-run"]}[command]


@pytest.mark.parametrize("command", ["run", "inspect", "produce", "handoff"])
@pytest.mark.parametrize(("sig", "after"), [(signal.SIGINT, 0.0), (signal.SIGTERM, 0.0), (signal.SIGTERM, 0.03)],
                         ids=["int-0s", "term-0s", "term-0.03s"])
def test_a_signal_while_any_command_starts_is_one_line(store, tmp_path, command, sig, after):
    """The commands that had no start-up handling (`run`, `produce`, `handoff`; `inspect` alongside): one line,
    exit 130 (`run`: 0, its documented stop), nothing left behind (a SIGINT printed a KeyboardInterrupt
    traceback; a SIGTERM ended `run` at 0.3 s with status 143)."""
    base, config = store
    proc = _spawn(_args(command, base, config, tmp_path))
    _out, err = _signal_after_first_line(proc, sig, after)
    assert "Traceback" not in err
    if command == "run":
        assert proc.returncode == 0, err
        assert RUN_STOPPED.fullmatch(err.strip()), err
    else:
        assert proc.returncode == 130, err
        assert err == "reputd: interrupted\n", err
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "produced").exists()


@pytest.mark.parametrize("command", ["run", "rebuild"])
def test_signals_at_several_early_instants_never_kill_or_trace(store, tmp_path, command):
    """SIGTERM or SIGINT at 0, 20, 50, 100, 200 and 400 ms past reputd's first line, whatever the command is
    doing then (importing, recovering, reading): the command's exit code for a stop (run 0, rebuild 130, or
    0 for a rebuild already done), at most the lines of its documented stop, never a traceback, never a death
    by the signal."""
    _base, config = store
    seen = []
    for i, after in enumerate((0.0, 0.02, 0.05, 0.1, 0.2, 0.4)):
        sig = (signal.SIGTERM, signal.SIGINT)[i % 2]
        out_dir = tmp_path / f"out-{i}"
        out_dir.mkdir()  # an output that exists: no note that the command created it
        proc = _spawn([command, "--config", str(config), "--out", str(out_dir)])
        _out, err = _signal_after_first_line(proc, sig, after)
        seen.append((after, proc.returncode, err))
        assert "Traceback" not in err, (after, err)
        lines = err.splitlines()
        if command == "run":  # before its service runs: the start-up line; after: a normal stop, silent
            assert proc.returncode == 0, (after, err)
            assert lines == [] or (len(lines) == 1 and RUN_STOPPED.fullmatch(lines[0])), (after, err)
        elif proc.returncode == 0:  # a rebuild done before the signal (a fast host): it says nothing of one
            assert after > 0.1, (after, err)
            assert lines == [], (after, err)
        else:  # before it reads: the start-up line; after: where it stopped and how to continue
            assert proc.returncode == 130, (after, err)
            assert lines == ["reputd: interrupted"] or lines[-1].startswith(
                f"reputd: interrupted by {signal.Signals(sig).name}: stopped at CommitLog offset"), (after, err)
    assert len(seen) == 6


def test_produce_stops_at_a_message_boundary(store, tmp_path):
    """SIGTERM while `produce` writes: it ends after the message in hand, says how many of how many and where
    the CommitLog ends, exit 130; the CommitLog holds exactly those messages (a rebuild reads them all)."""
    _base, config = store
    produced = tmp_path / "produced"
    proc = _spawn(["produce", "--config", str(config), "--store", str(produced), "--messages", "2000000"])
    deadline = time.monotonic() + WAIT_S
    while not list((produced / "commitlog").glob("0*"))[1:]:  # a second segment: well into the writing
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, err
    m = re.fullmatch(r"interrupted: produced ([\d,]+) messages, [\d,]+ bytes at CommitLog offsets \[0, (\d+)\)\n", out)
    assert m, out
    messages, end = int(m[1].replace(",", "")), int(m[2])
    assert err == (f"reputd: interrupted by SIGTERM: stopped after {messages:,} of 2,000,000 messages; the CommitLog "
                   f"ends at offset {end}, a message boundary\n")
    res = run("rebuild", "--config", str(config), "--store", str(produced), "--out", str(tmp_path / "out"), "--json")
    assert res.returncode == 0, res.stderr
    assert '"pendingTail": null' in res.stdout
    assert f'"messages": {messages},' in res.stdout
    assert f'"endOffset": {end},' in res.stdout


def test_handoff_stopped_while_completing_changes_nothing_of_the_brokers(tmp_path):
    """SIGTERM while the hand-off completes the output (a slow plug-in dispatcher keeps it there): exit 130, one
    line saying where it stopped and that nothing of the broker's changed (its checkpoint absent, `abort`
    kept); run again, it hands off."""
    make_store(tmp_path, n=2000)
    root = tmp_path / "store"
    started = tmp_path / "started"
    cfg = yaml.safe_load(write_config(tmp_path).read_text())
    del cfg["output"]
    cfg["dispatchers"] = ["consumequeue", "index", {"name": "tests.plugins.slow:SlowDispatchDispatcher",
                                                    "options": {"dispatch_seconds": 0.1, "started": str(started)}}]
    config = tmp_path / "slow.yaml"
    config.write_text(yaml.safe_dump(cfg))
    (root / "abort").write_bytes(b"")
    (root / "lock").write_bytes(b"lock")
    proc = _spawn(["handoff", "--config", str(config)])
    deadline = time.monotonic() + WAIT_S
    while not (started.exists() and len(started.read_text().split()) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, err
    *events, last = err.splitlines()  # the rebuild's own `rebuild_interrupted` warning, as `rebuild` logs it
    assert [json.loads(e)["event"] for e in events] == ["rebuild_interrupted"]
    assert re.fullmatch(rf"reputd: interrupted by SIGTERM: handoff stopped completing the output {root} at "
                        r"CommitLog offset \d+ \(everything before it written, flushed and checkpointed\); nothing "
                        r"of the broker's was changed; run it again to hand off", last), err
    assert (root / "abort").exists()
    assert not (root / CHECKPOINT_FILE).exists()
    del cfg["dispatchers"]
    config.write_text(yaml.safe_dump(cfg))
    res = run("handoff", "--config", str(config))
    assert res.returncode == 0, res.stderr
    assert not (root / "abort").exists()


def test_the_exit_code_holds_while_the_interpreter_exits():
    """Once `main` has the command's result, both signals are ignored: Python resets a handler of its own to
    the default as it exits, and a signal then ended a finished command by the signal (143)."""
    code = ("import signal, sys\n"
            "sys.argv = ['reputd', 'inspect', '/nonexistent']\n"
            "from daemon.cli import main\n"
            "code = main()\n"
            "print(code, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, "
            "signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         check=False)
    assert res.stdout.split() == ["2", "True", "True"], res.stdout + res.stderr


def test_the_start_up_handler_imports_nothing():
    """The handler may run in the middle of any import of the start-up: one of its own (`import contextlib`)
    met `types` half imported and turned a SIGTERM at 20 ms into an ImportError traceback, exit 1."""
    import ast
    import inspect
    import textwrap

    from daemon.cli import startsignals

    tree = ast.parse(textwrap.dedent(inspect.getsource(startsignals._interrupted_while_starting)))
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
