"""The operations kit: Prometheus alert rules (config/prometheus/), the Grafana dashboard (config/grafana/)
and the log recipe of docs/systemd.md, each held to what a real `reputd run` exposes and writes.

One daemon runs through a whole life as a subprocess — started before its CommitLog directory exists,
then following it across a corrupt record (skip-segment) and segment rolls, losing the directory mid-run,
getting it back, and stopped with SIGTERM — and its /metrics scrape and stdout are what the rules, the
dashboard and the log recipe are checked against. `promtool` runs the rules' unit tests when installed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from daemon.ops.metrics import HEALTH_STATES, ErrorKind, SkipReason
from tests.test_daemon import REPUTD, SEGMENT, Store, clean_env, corrupt_body_byte, stop, wait_for
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "config" / "prometheus" / "reputd-rules.yml"
RULE_TESTS = ROOT / "config" / "prometheus" / "reputd-rules.test.yml"
DASHBOARD = ROOT / "config" / "grafana" / "reputd-dashboard.json"
SYSTEMD_README = ROOT / "docs" / "systemd.md"
README = ROOT / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"

PROMETHEUS_SERIES = {"up"}  # made by Prometheus itself, not by the daemon
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
# A Grafana variable as a query sees it, replaced by a value PromQL accepts.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$instance": ".*",
                     "$job": "reputd"}
RENDER_RULES = ROOT / "config" / "prometheus" / "render_rules.py"
SHIPPED_SELECTOR = ("job", "=", "reputd")  # what the shipped rules carry (render_rules.DEFAULT_SELECTOR)


# --- PromQL: the series selectors of an expression --------------------------------------------------------

IDENTIFIER = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]


def grafana_to_promql(expr: str) -> str:
    for variable, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def selectors(expr: str) -> list[Selector]:
    """Every `metric{matchers}` and bare `metric` an expression reads (not functions, keywords, labels)."""
    found = []
    rest = re.sub(r"\[[^\]]*\]", " ", expr)  # range and subquery durations
    rest = GROUPING.sub(" ", rest)

    def take(m: re.Match) -> str:
        assert m.group(1), f"selector without a metric name in {expr!r}: {m.group(0)}"
        found.append(Selector(m.group(1), tuple(MATCHER.findall(m.group(2)))))
        return " "

    rest = re.sub(rf"({IDENTIFIER})?\s*\{{([^}}]*)\}}", take, rest)
    rest = re.sub(r'"(?:[^"\\]|\\.)*"', " ", rest)
    for m in re.finditer(rf"(?<![\w.]){IDENTIFIER}(?![\w(]|\s*\()", rest):
        if m.group(0) not in KEYWORDS:
            found.append(Selector(m.group(0), ()))
    return found


def test_selector_parsing():
    expr = ('histogram_quantile(0.99, sum by (instance, le) (rate(reputd_flush_duration_seconds_bucket'
            '{instance=~".*"}[1m]))) / up{job="reputd"} > 128 * 1024 or reputd_health == bool 1')
    assert selectors(expr) == [
        Selector("reputd_flush_duration_seconds_bucket", (("instance", "=~", ".*"),)),
        Selector("up", (("job", "=", "reputd"),)),
        Selector("reputd_health", ()),
    ]


# --- one daemon's life ------------------------------------------------------------------------------------

@dataclass
class Life:
    scrape: str  # /metrics while following, after the corrupt record was skipped
    stdout: str
    stderr: str
    exit_code: int
    corrupt_offset: int


@pytest.fixture(scope="module")
def life(tmp_path_factory) -> Life:
    tmp = tmp_path_factory.mktemp("life")
    store = Store(tmp, reput={"onCorruption": "skip-segment"})
    log_dir = tmp / "store" / "commitlog"
    away = tmp / "commitlog.away"
    store.append(200)
    bad = store.end
    while store.end // SEGMENT == bad // SEGMENT:
        store.append(50)
    corrupt_body_byte(store, bad)
    os.rename(log_dir, away)
    proc = store.start()
    try:
        wait_for(lambda: store.health()["status"] == "down", what="down while the CommitLog is missing")
        os.rename(away, log_dir)
        wait_for(lambda: store.health().get("reputFromOffset") == store.end, what="past the corrupt record")
        for _ in range(3):
            store.append(400)
            wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="checkpoint at the head")
        scrape = store.get("/metrics")[1].decode()
        os.rename(log_dir, away)
        wait_for(lambda: store.get("/healthz")[0] == 503, what="down while the CommitLog is gone")
        os.rename(away, log_dir)
        store.append(100)
        wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="follows again")
    finally:
        code, out, err = stop(proc, signal.SIGTERM)
        store.writer.close()
    return Life(scrape, out, err, code, bad)


@pytest.fixture(scope="module")
def exposed(life) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets the daemon exposed for it."""
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(life.scrape):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(dict(sample.labels))
    return samples


def test_the_life_went_as_planned(life, exposed):
    assert life.exit_code == 0, life.stderr
    assert exposed["reputd_corrupt_records_total"]
    assert {"kind": ErrorKind.COMMITLOG.value} in exposed["reputd_errors_total"]
    assert {s["state"] for s in exposed["reputd_health"]} == set(HEALTH_STATES)
    assert {s["reason"] for s in exposed["reputd_skipped_bytes_total"]} == {r.value for r in SkipReason}


def check_selectors(where: str, expr: str, exposed: dict[str, list[dict[str, str]]]) -> list[str]:
    """What in `expr` the daemon does not expose: unknown series, labels, or label values."""
    problems = []
    found = selectors(expr)
    if not found:
        problems.append(f"{where}: reads no series: {expr}")
    for s in found:
        if s.metric in PROMETHEUS_SERIES:
            continue
        if s.metric not in exposed:
            problems.append(f"{where}: {s.metric} is not exposed by reputd")
            continue
        for label, op, value in s.matchers:
            if label in TARGET_LABELS:
                continue
            values = {labels.get(label) for labels in exposed[s.metric]} - {None}
            if not values:
                problems.append(f"{where}: {s.metric} has no label {label}")
            elif op == "=" and value not in values:
                problems.append(f"{where}: {s.metric}{{{label}={value!r}}} never exposed (has {sorted(values)})")
    return problems


# --- alert rules ------------------------------------------------------------------------------------------

def load_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_rule_reads_series_the_daemon_exposes(exposed):
    problems = []
    for rule in load_rules():
        problems += check_selectors(rule["alert"], rule["expr"], exposed)
    assert problems == []


def test_the_rules_cover_what_operators_alert_on():
    """Lag in bytes and seconds, checkpoint age, health, corruption, skipped bytes, a full output and a daemon
    that is not there; each with a severity and a summary naming the instance."""
    rules = load_rules()
    read = {s.metric for rule in rules for s in selectors(rule["expr"])}
    assert {"rocketmq_storage_dispatch_behind_bytes", "reputd_dispatch_behind_seconds",
            "reputd_checkpoint_age_seconds", "reputd_health", "reputd_corrupt_records_total",
            "reputd_skipped_bytes_total", "reputd_output_space_exhausted_total", "reputd_errors_total",
            "up"} <= read
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        if not rule["expr"].startswith("absent("):  # absent() has no instance: there is none
            assert "{{ $labels.instance }}" in rule["annotations"]["summary"], rule["alert"]
        if "increase(" in rule["expr"]:
            # a counter alert fires on the first event only because its series already exist at 0
            assert "for" not in rule, rule["alert"]
        else:
            assert "for" in rule, f"{rule['alert']}: a gauge alert needs a duration, or it flaps"


def test_every_rule_is_scoped_to_reputds_scrape_job():
    """A RocketMQ 5.x broker exports rocketmq_storage_dispatch_behind_bytes under the same name: every series
    selector of every rule carries reputd's scrape selector, so a broker's lag never fires reputd's alerts;
    and a missing target is an alert of its own (absent), since ReputdDown needs a target to be 0."""
    rules = load_rules()
    for rule in rules:
        for s in selectors(rule["expr"]):
            assert SHIPPED_SELECTOR in s.matchers, f"{rule['alert']}: {s.metric} is not scoped: {rule['expr']}"
    assert 'absent(up{job="reputd"})' in {r["expr"] for r in rules}


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_every_rule_links_a_runbook_that_exists_and_lag_alerts_keep_firing():
    """runbook_url: the section of docs/operations.md that says what to do for that alert, by name (the anchor
    GitHub and mkdocs both give its heading); the lag alerts keep firing a while after dropping below the
    threshold, so a lag hovering there does not flap."""
    anchors = github_anchors(OPERATIONS.read_text())
    for rule in load_rules():
        base, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert base == "docs/operations.md", rule["alert"]
        assert anchor == rule["alert"].lower(), rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: docs/operations.md has no heading #{anchor}"
        if rule["alert"].startswith("ReputdDispatchLag"):
            assert rule["keep_firing_for"] == "5m", rule["alert"]


def render_rules(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RENDER_RULES), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_the_selector_and_runbook_base_are_settings(tmp_path):
    """render_rules.py with the defaults writes the shipped file; with another selector and runbook base every
    expression carries the new selector and no longer the shipped one, every link the new base, and promtool
    loads it. A selector that is not label matchers is refused (exit 2, one line)."""
    assert render_rules().stdout == RULES.read_text()
    done = render_rules("--selector", 'job="reputd-prod", env="eu"', "--runbook-base", "https://wiki.example/README.md")
    assert done.returncode == 0, done.stderr
    rendered = [rule for group in yaml.safe_load(done.stdout)["groups"] for rule in group["rules"]]
    assert [r["alert"] for r in rendered] == [r["alert"] for r in load_rules()]
    for rule in rendered:
        for s in selectors(rule["expr"]):
            assert ("job", "=", "reputd-prod") in s.matchers, rule["expr"]
            assert ("env", "=", "eu") in s.matchers, rule["expr"]
            assert SHIPPED_SELECTOR not in s.matchers, rule["expr"]
        assert rule["annotations"]["runbook_url"] == f"https://wiki.example/README.md#{rule['alert'].lower()}"
    header = done.stdout.split("\ngroups:", 1)[0]  # it named the shipped selector whatever was rendered
    assert 'job="reputd"' not in header.replace('job="reputd-prod"', "")
    assert 'job="reputd-prod", env="eu"' in header
    assert header.startswith("# Rendered by render_rules.py --selector 'job=\"reputd-prod\", env=\"eu\"'")
    bad = render_rules("--selector", "job=reputd")
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("render_rules: not a list of label matchers")
    path = tmp_path / "rendered.yml"
    path.write_text(done.stdout)
    check = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120,
                           check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_alert_has_a_unit_test_where_it_fires():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for t in tests for case in t["alert_rule_test"] if not case["exp_alerts"]}
    names = {rule["alert"] for rule in load_rules()}
    assert fired == names
    assert quiet == names


def promtool() -> str:
    return require_tool("promtool", "prometheus",
                        "the rules' unit tests in config/prometheus/reputd-rules.test.yml were not run")


def test_promtool_checks_the_rules():
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in result.stdout


def test_promtool_runs_the_rule_unit_tests():
    result = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                            capture_output=True, text=True, timeout=120, check=False)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# --- the dashboard ----------------------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def queries(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = [(f"panel {p['title']!r} {t['refId']}", grafana_to_promql(t["expr"]))
             for p in panels(board) for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            m = re.fullmatch(r"label_values\((\w+(?:\{[^}]*\})?),\s*(\w+)\)", query)
            assert m, f"variable {variable['name']}: {query}"
            found.append((f"variable {variable['name']}", grafana_to_promql(m.group(1))))
    return found


def test_every_dashboard_query_reads_series_the_daemon_exposes(exposed):
    problems = []
    board = dashboard()
    for where, expr in queries(board):
        problems += check_selectors(where, expr, exposed)
    assert problems == []
    assert len(queries(board)) >= 10


def test_the_dashboard_shows_what_operators_watch():
    board = dashboard()
    read = {}
    for _, expr in queries(board):
        for s in selectors(expr):
            read.setdefault(s.metric, []).append(expr)
    for metric in ("rocketmq_storage_dispatch_behind_bytes", "reputd_dispatch_behind_seconds",
                   "reputd_flush_duration_seconds_bucket", "reputd_checkpoint_age_seconds", "reputd_health"):
        assert metric in read, metric
    assert any("by (instance, dispatcher)" in e for e in read["reputd_dispatched_messages_total"])
    # scoped to reputd's jobs, as the rules are: a broker's own rocketmq_storage_* series never show here
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["job"]["query"]["query"] == "label_values(reputd_build_info, job)"
    for p in panels(board):
        for t in p.get("targets", []):
            for s in selectors(t["expr"]):
                assert ("job", "=~", "$job") in s.matchers, f"panel {p['title']!r}: {t['expr']}"
    assert any("by (instance, kind)" in e for e in read["reputd_errors_total"])


def test_the_dashboard_is_importable_grafana_json():
    board = dashboard()
    assert board["uid"] == "reputd"
    assert isinstance(board["schemaVersion"], int)
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in panels(board):
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys(), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each query, its Grafana variables filled in, as a recording rule: promtool parses the PromQL."""
    tool = promtool()
    exprs = [expr for _, expr in queries(dashboard()) if "(" in expr or "{" in expr]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": e}
                                                        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_links_the_kit():
    """The README links the rules, their tests and the dashboard; docs/operations.md names each."""
    text, operations = README.read_text(), OPERATIONS.read_text()
    for path in (RULES, RULE_TESTS, DASHBOARD):
        assert f"({path.relative_to(ROOT)})" in text, path
        assert f"`{path.relative_to(ROOT)}`" in operations, path


# --- logs: every line reputd writes to stdout is JSON -----------------------------------------------------

def json_lines(stdout: str) -> list[dict]:
    out = []
    for number, line in enumerate(stdout.splitlines(), 1):
        event = json.loads(line)  # fails, naming the line, on anything that is not JSON
        assert isinstance(event, dict), f"line {number}: {line}"
        assert {"event", "level", "timestamp"} <= event.keys(), f"line {number}: {line}"
        out.append(event)
    return out


def test_every_stdout_line_of_a_daemons_life_is_json(life):
    events = json_lines(life.stdout)
    names = [e["event"] for e in events]
    for expected in ("reputd_started", "recovered", "corrupt_commitlog", "segment_skipped", "commitlog_unavailable",
                     "shutdown_requested", "final_flush", "reputd_stopped"):
        assert expected in names, expected
    assert names[0] == "reputd_started"
    assert names[-1] == "reputd_stopped"
    # the wait for the missing CommitLog directory was said, before recovery
    waited = events[1:names.index("recovered")]
    assert any(e["level"] in {"warning", "error"} and "commitlog" in json.dumps(e).lower() for e in waited), waited
    corrupt = [e for e in events if e["event"] == "corrupt_commitlog"]
    assert corrupt[0]["offset"] == life.corrupt_offset
    assert corrupt[0]["level"] == "error"
    assert "Traceback" not in life.stderr


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*REPUTD, *args], cwd=cwd, env=clean_env(env), capture_output=True, text=True,
                          timeout=120, check=False)


def test_stdout_is_json_on_the_error_exits(tmp_path):
    """A configuration error (exit 2) writes nothing to stdout; a corrupt record under onCorruption: stop
    with --until-caught-up (exit 1) writes only JSON events; the one-line error goes to stderr."""
    store = Store(tmp_path)
    store.append(200)
    bad = store.end
    store.append(20)
    store.writer.close()
    corrupt_body_byte(store, bad)

    typo = run_cli("run", "--config", str(store.config), cwd=tmp_path, env={"REPUTD_STORE_MAX_HASH_SLOT_NUMS": "9"})
    assert typo.returncode == 2
    assert typo.stdout == ""
    assert typo.stderr.startswith("reputd: config error: REPUTD_STORE_MAX_HASH_SLOT_NUMS")
    assert typo.stderr.count("\n") == 1

    corrupt = run_cli("run", "--config", str(store.config), "--until-caught-up", cwd=tmp_path)
    assert corrupt.returncode == 1
    events = json_lines(corrupt.stdout)
    assert [e["offset"] for e in events if e["event"] == "corrupt_commitlog"] == [bad]
    assert "Traceback" not in corrupt.stderr

    missing = run_cli("run", "--config", str(store.config), "--until-caught-up", cwd=tmp_path,
                      env={"REPUTD_STORE_STORE_PATH_ROOT_DIR": str(tmp_path / "nowhere")})
    assert missing.returncode == 2  # a configured path that does not exist: a configuration error
    assert missing.stdout == ""
    assert missing.stderr.count("\n") == 1
    assert ("no such store root directory (store.storePathRootDir, from REPUTD_STORE_STORE_PATH_ROOT_DIR)"
            in missing.stderr)
    (tmp_path / "empty-root").mkdir()
    no_data = run_cli("run", "--config", str(store.config), "--until-caught-up", cwd=tmp_path,
                      env={"REPUTD_STORE_STORE_PATH_ROOT_DIR": str(tmp_path / "empty-root")})
    assert no_data.returncode == 1  # a store root without its commitlog/: data missing, logged as JSON
    assert any(e["level"] == "error" for e in json_lines(no_data.stdout))


SYSTEMD_LINES = (
    "Starting reputd.service - reputd - RocketMQ ConsumeQueue/IndexFile builder following the CommitLog...",
    "reputd.service: Watchdog timeout (limit 30s)!",
    "reputd.service: Main process exited, code=killed, status=6/ABRT",
    "reputd.service: Failed with result 'watchdog'.",
)


def readme_recipes() -> list[tuple[str, str]]:
    """(jq flags, jq program) of docs/systemd.md's `journalctl ... SYSLOG_IDENTIFIER=reputd | jq -R` lines."""
    recipes = re.findall(r"^journalctl [^|\n]*SYSLOG_IDENTIFIER=reputd[^|\n]*\| jq (-\w*R\w*) '([^']+)'",
                         SYSTEMD_README.read_text(), re.MULTILINE)
    assert len(recipes) >= 2, "docs/systemd.md gives the journalctl | jq -R 'fromjson? | ...' recipe"
    return recipes


def json_stream(text: str) -> list:
    decoder, values, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        value, at = decoder.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
        values.append(value)
    return values


def test_the_readme_recipe_reads_the_journal_of_a_daemons_life(life):
    """The recipes over what the journal holds for reputd — its JSON lines, its stderr, and systemd's own
    plain-text lines, which `-o cat` prints the same way — run without error, and the error filter returns
    exactly the daemon's error events."""
    jq = require_tool("jq", "jq", "the recipes' jq programs were not run")
    journal = "\n".join([*SYSTEMD_LINES[:1], *life.stdout.splitlines(), *life.stderr.splitlines(),
                         *SYSTEMD_LINES[1:]]) + "\n"
    errors = [e for e in json_lines(life.stdout) if e["level"] == "error"]
    assert errors
    checked = 0
    for flags, program in readme_recipes():
        assert program.startswith("fromjson? | "), program
        result = subprocess.run([jq, flags, program], input=journal, capture_output=True, text=True, timeout=60,
                                check=False)
        assert result.returncode == 0, f"jq {flags} {program!r}: {result.stderr}"
        assert result.stdout.strip(), program
        if program == 'fromjson? | select(.level == "error")':
            assert json_stream(result.stdout) == errors
            checked += 1
    assert checked == 1
    # and the recipe the README used to give fails on the very first systemd line
    plain = subprocess.run([jq, 'select(.level == "error")'], input=journal, capture_output=True, text=True,
                           timeout=60, check=False)
    assert plain.returncode != 0
