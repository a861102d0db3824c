"""The table of log events in docs/events.md lists exactly the events the code logs (issue 12, item 16)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from tests.test_cli import make_store, run, write_config

ROOT = Path(__file__).resolve().parents[1]
LEVELS = frozenset({"debug", "info", "warning", "error", "exception", "critical"})
EVENT_NAME = re.compile(r"[a-z][a-z0-9_]*")
TABLE_HEADER = "| event | level | by |"


def logged_events() -> dict[str, set[str]]:
    """Event name -> the levels it is logged at, from every `<logger>.<level>("event", ...)` call and every
    hand-written `{"event": "...", "level": "..."}` line in daemon/."""
    events: dict[str, set[str]] = {}
    for path in sorted((ROOT / "daemon").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and EVENT_NAME.fullmatch(node.args[0].value)):
                level = "error" if node.func.attr == "exception" else node.func.attr
                events.setdefault(node.args[0].value, set()).add(level)
            if isinstance(node, ast.Dict):
                fields = {k.value: v.value for k, v in zip(node.keys, node.values, strict=True)
                          if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
                if isinstance(fields.get("event"), str) and "level" in fields:
                    events.setdefault(fields["event"], set()).add(fields["level"])
    return events


def readme_events() -> dict[str, set[str]]:
    """Event name -> levels, from the table of events in docs/events.md."""
    lines = (ROOT / "docs" / "events.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(TABLE_HEADER))
    events: dict[str, set[str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        name, levels = (cell.strip() for cell in line.strip("|").split("|")[:2])
        assert re.fullmatch(r"`[a-z][a-z0-9_]*`", name), line
        assert name[1:-1] not in events, f"{name} is listed twice"
        events[name[1:-1]] = {level.strip() for level in levels.split(",")}
    return events


def test_the_readme_lists_every_logged_event_at_its_levels():
    code, documented = logged_events(), readme_events()
    assert len(code) > 30
    assert sorted(set(code) - set(documented)) == [], "logged but not in docs/events.md's table"
    assert sorted(set(documented) - set(code)) == [], "in docs/events.md's table but never logged"
    assert {name: levels for name, levels in code.items() if documented[name] != levels} == {}


def test_events_a_run_logs_are_in_the_table(tmp_path):
    """What `reputd run --until-caught-up` and `reputd rebuild` print as JSON lines names only events of
    the table, the ones of a clean run among them."""
    make_store(tmp_path, n=120)
    config = write_config(tmp_path)
    env = {"REPUTD_LOGGING_LEVEL": "info", "REPUTD_LOGGING_FORMAT": "json"}
    res = run("run", "--config", str(config), "--until-caught-up", env=env)
    assert res.returncode == 0, res.stderr
    seen = {json.loads(line)["event"] for line in res.stdout.splitlines()}
    res = run("rebuild", "--config", str(config), "--out", str(tmp_path / "again"), env=env)
    assert res.returncode == 0, res.stderr
    # stderr: the log's JSON lines, and the note that the new output directory was created
    note = f"reputd: note: created the output directory {tmp_path / 'again'} (it did not exist)"
    assert res.stderr.splitlines()[-1] == note
    seen |= {json.loads(line)["event"] for line in res.stderr.splitlines()[:-1]}
    assert {"reputd_started", "recovered", "caught_up", "final_flush", "session_closed", "reputd_stopped",
            "rebuild_started", "rebuild_finished"} <= seen
    assert sorted(seen - set(readme_events())) == []
