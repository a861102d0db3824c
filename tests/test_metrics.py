"""The daemon's metrics as an alert sees them: every known label value of a labelled counter exists at 0
from the start (so `increase(...) > 0` fires on the first event), no `*_created` series, and label values
that come only from the sets daemon/ops/metrics.py declares."""

from __future__ import annotations

import ast
import http.client
import importlib
import socket
import struct
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import structlog
from prometheus_client import generate_latest

from daemon.ops.metrics import (
    CLIENT_GONE,
    CORRUPT_REASONS,
    DEGRADED,
    DOWN,
    HEALTH_STATES,
    HEALTHY,
    ErrorKind,
    Health,
    Lag,
    MetricsServer,
    OutputStage,
    RecoveryDecision,
    ReputMetrics,
    SkipReason,
)
from indexcore.commitlog import RECORD_ERRORS
from indexcore.dledger import ENTRY_ERRORS
from indexcore.errors import CORRUPT_RECORD_FIELDS, CorruptRecordError

ROOT = Path(__file__).resolve().parent.parent

# metric family -> (label, the values it must have from the start)
KNOWN_LABELS = {
    "reputd_errors": ("kind", [k.value for k in ErrorKind]),
    "reputd_corrupt_records": ("reason", list(CORRUPT_REASONS)),
    "reputd_skipped_bytes": ("reason", [r.value for r in SkipReason]),
    "reputd_output_space_exhausted": ("stage", [s.value for s in OutputStage]),
    "reputd_recoveries": ("decision", [d.value for d in RecoveryDecision]),
}


@pytest.fixture
def metrics() -> ReputMetrics:
    return ReputMetrics(lambda: None)


@pytest.mark.parametrize("family", sorted(KNOWN_LABELS))
def test_every_known_label_value_starts_at_zero(metrics, family):
    label, values = KNOWN_LABELS[family]
    assert values
    for value in values:
        assert metrics.registry.get_sample_value(f"{family}_total", {label: value}) == 0.0, (family, value)
    # and no other value: the set is exactly the declared one
    exposed = {s.labels[label] for m in metrics.registry.collect() if m.name == family for s in m.samples}
    assert exposed == set(values)


def test_the_first_event_moves_a_series_that_was_already_there(metrics):
    """What `increase()` needs: a sample at 0 before the first error, then 1."""
    before = metrics.registry.get_sample_value("reputd_errors_total", {"kind": "flush"})
    metrics.errors.labels(kind=ErrorKind.FLUSH).inc()
    metrics.corrupt.labels(reason="body_crc").inc()
    assert (before, metrics.registry.get_sample_value("reputd_errors_total", {"kind": "flush"})) == (0.0, 1.0)
    assert metrics.registry.get_sample_value("reputd_corrupt_records_total", {"reason": "body_crc"}) == 1.0
    assert metrics.registry.get_sample_value("reputd_errors_total", {"kind": "dispatch"}) == 0.0


def test_an_undeclared_label_value_is_refused(metrics):
    with pytest.raises(ValueError, match="'bogus' is not a declared label value: dispatch, flush"):
        metrics.errors.labels(kind="bogus")
    with pytest.raises(ValueError, match="not a declared label value"):
        metrics.corrupt.labels("no_such_field")
    assert metrics.errors.labels("flush") is metrics.errors.labels(kind=ErrorKind.FLUSH)
    exposed = {s.labels["kind"] for m in metrics.registry.collect() if m.name == "reputd_errors" for s in m.samples}
    assert "bogus" not in exposed


def test_health_has_one_series_per_state_from_the_start(metrics):
    get = metrics.registry.get_sample_value
    assert {s: get("reputd_health", {"state": s}) for s in HEALTH_STATES} == {HEALTHY: 0.0, DEGRADED: 0.0, DOWN: 1.0}
    metrics.set_health(HEALTHY)
    assert {s: get("reputd_health", {"state": s}) for s in HEALTH_STATES} == {HEALTHY: 1.0, DEGRADED: 0.0, DOWN: 0.0}


def test_no_created_series(metrics):
    metrics.errors.labels(kind=ErrorKind.LOOP).inc()
    metrics.flush_duration.observe(0.01)
    assert metrics.registry.get_sample_value("reputd_errors_created", {"kind": "loop"}) is None
    assert metrics.registry.get_sample_value("reputd_flush_duration_seconds_created") is None
    text = generate_latest(metrics.registry).decode()
    assert "_created" not in text
    assert 'reputd_errors_total{kind="loop"} 1.0' in text


def test_files_gauge_has_both_kinds_whenever_lag_is_known():
    lag = Lag(reput_offset=10, commit_log_max_offset=20, flushed_offset=10, checkpoint_offset=10,
              checkpoint_written_at=0.0, behind_seconds=1.5, consume_queue_files=3, index_files=1)
    registry = ReputMetrics(lambda: lag).registry
    assert registry.get_sample_value("reputd_files", {"kind": "consumequeue"}) == 3
    assert registry.get_sample_value("reputd_files", {"kind": "index"}) == 1
    assert registry.get_sample_value("rocketmq_storage_dispatch_behind_bytes") == 10


def test_a_scrape_whose_client_left_mid_response_prints_nothing(capsys):
    """A scrape that timed out while the daemon was stopped (SIGSTOP) or slow is answered when it resumes, to a
    client that is gone: the write fails with a broken pipe or a reset, which socketserver printed as a raw
    traceback on stderr. Here the collector holds the answer until the client has reset the connection."""
    armed, asked, answer = threading.Event(), threading.Event(), threading.Event()

    def lag():  # also called once as the registry describes its collectors
        if armed.is_set():
            asked.set()
            answer.wait(10)

    server = MetricsServer("127.0.0.1", 0, ReputMetrics(lag), Health())
    failures, handle_error = [], server._server.handle_error

    def recording(request, client_address):
        failures.append(sys.exc_info()[1])
        handle_error(request, client_address)

    server._server.handle_error = recording
    server.start()
    armed.set()
    try:
        client = socket.create_connection(server.address[:2], timeout=5)
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert asked.wait(5)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        client.close()
        answer.set()
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [type(e) for e in failures if not isinstance(e, CLIENT_GONE)] == []
        assert failures  # the write did meet the client's reset
        # the endpoint still answers the next scrape, and nothing reached stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{server.address[1]}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        answer.set()
        server.stop()
    assert capsys.readouterr().err == ""


def test_a_request_that_fails_otherwise_is_one_event_not_a_traceback(capsys):
    """Anything else a request raises (here a collector) is the `metrics_request_failed` event, one line."""
    armed = threading.Event()

    def lag():
        if armed.is_set():
            raise RuntimeError("collector broke")

    server = MetricsServer("127.0.0.1", 0, ReputMetrics(lag), Health())
    server.start()
    armed.set()
    try:
        with structlog.testing.capture_logs() as logs:
            with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
                urllib.request.urlopen(f"http://127.0.0.1:{server.address[1]}/metrics", timeout=5)
            deadline = time.monotonic() + 5
            while not logs and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        server.stop()
    assert [(e["event"], e["log_level"], e["error"]) for e in logs] == [
        ("metrics_request_failed", "error", "RuntimeError: collector broke")]
    assert "Traceback" not in capsys.readouterr().err


# --- label values come from the declared sets only ----------------------------------------------------------

def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _calls(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                yield node


LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "msg", "bind"}


def test_no_label_value_is_a_string_literal_at_a_call_site():
    """The daemon names a label value by a member of its declared set, never by a string of its own: no
    `.labels(...)` with a literal, and no literal equal to a known label value passed as that label's
    keyword to any call but a log event (`_count(metrics, "errors", kind="flush")` is caught too)."""
    known = {label: set(values) for label, values in KNOWN_LABELS.values()}
    known["state"] = set(HEALTH_STATES)
    literals = []
    for path in _python_files("daemon"):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for call in _calls(tree, "labels"):
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                if isinstance(arg, ast.Constant | ast.JoinedStr):
                    literals.append(f"{where}:{call.lineno}")
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
            if name in LOG_METHODS:
                continue
            literals += [f"{where}:{call.lineno} {k.arg}={k.value.value!r}" for k in call.keywords
                         if isinstance(k.value, ast.Constant) and k.value.value in known.get(k.arg, ())]
            literals += [f"{where}:{call.lineno} {a.value!r}" for a in call.args
                         if name == "_report_no_space" and isinstance(a, ast.Constant)]
    assert literals == []


def test_every_corrupt_record_field_raised_is_declared():
    """`reputd_corrupt_records_total{reason}` is the error's field: each field a CorruptRecordError is made
    with anywhere (literal or from the record error table) is in CORRUPT_RECORD_FIELDS, and no other."""
    raised = {field for field, _ in (*RECORD_ERRORS.values(), *ENTRY_ERRORS.values())}
    for path in _python_files("indexcore", "daemon"):
        tree = ast.parse(path.read_text(), str(path))
        for call in [*_calls(tree, "CorruptRecordError"), *_calls(tree, "CorruptEntryHeaderError")]:
            if call.args and isinstance(call.args[0], ast.Constant):
                raised.add(call.args[0].value)
            elif call.args and isinstance(call.args[0], ast.Name):  # a module constant naming the field
                module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
                value = getattr(module, call.args[0].id, None)  # a local variable is the table's field
                if isinstance(value, str):
                    raised.add(value)
    assert len(raised) >= 8
    assert raised == set(CORRUPT_RECORD_FIELDS), raised ^ set(CORRUPT_RECORD_FIELDS)
    assert set(CORRUPT_REASONS) >= set(CORRUPT_RECORD_FIELDS)
    assert CorruptRecordError("body_crc", "x").field in CORRUPT_REASONS
