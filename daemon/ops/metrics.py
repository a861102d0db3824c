"""Prometheus metrics and the health endpoint of `reputd run`.

Everything lives in one registry of the daemon's own (nothing from the process-global default), served
with `/healthz` on one port. Units are base units (bytes, seconds); the two gauges RocketMQ 5.x's store
also exports keep its names, so one dashboard reads both. Lag is computed when Prometheus scrapes, from
the loop's last published progress and a look at the CommitLog's head, never on the dispatch path.
"""

from __future__ import annotations

import errno
import json
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from daemon import __version__
from daemon.config import ConfigError, env_var_name
from daemon.ops.logs import get_logger
from daemon.ops.metriclabels import (
    ErrorKind,
    FileKind,
    OutputStage,
    RecoveryDecision,
    RetentionBehind,
    SkipReason,
)
from indexcore.errors import CORRUPT_RECORD_FIELDS

HEALTHY, DEGRADED, DOWN = "healthy", "degraded", "down"
HEALTH_STATES = (HEALTHY, DEGRADED, DOWN)

HTTP_OK, HTTP_UNAVAILABLE, HTTP_NOT_FOUND = 200, 503, 404
METRICS_PATH, HEALTH_PATH = "/metrics", "/healthz"
MS_PER_SECOND = 1000
FLUSH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


# A client that went away before its answer was written (a scrape that timed out while the daemon was stopped or
# slow, a `curl` interrupted): nothing to report, the next scrape asks again.
CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)

LAYOUT_REASON = "layout"  # a CommitLog directory the broker would refuse (StoreLayoutError), not one record
CORRUPT_REASONS = (*CORRUPT_RECORD_FIELDS, LAYOUT_REASON)


@dataclass(frozen=True, slots=True)
class Lag:
    """What the scrape-time collector needs, taken from the loop's published progress."""

    reput_offset: int
    commit_log_max_offset: int
    flushed_offset: int
    checkpoint_offset: int
    checkpoint_written_at: float  # time.time() of the last checkpoint write, 0 before the first
    behind_seconds: float
    consume_queue_files: int
    index_files: int
    retention: RetentionBehind | None = None  # None before the clean-up's first look


class _LagCollector:
    """Gauges computed at scrape time, so a stalled loop still shows a growing lag."""

    def __init__(self, source: Callable[[], Lag | None]):
        self._source = source

    def collect(self):
        lag = self._source()
        if lag is None:
            return
        behind = max(0, lag.commit_log_max_offset - lag.reput_offset)
        yield _gauge("rocketmq_storage_dispatch_behind_bytes",
                     "CommitLog bytes written but not yet dispatched (RocketMQ 5.x name).", behind)
        yield _gauge("rocketmq_storage_flush_behind_bytes",
                     "Dispatched CommitLog bytes whose output is not yet flushed (RocketMQ 5.x name).",
                     max(0, lag.reput_offset - lag.flushed_offset))
        yield _gauge("reputd_dispatch_behind_seconds",
                     "Age by store timestamp of the oldest message the CommitLog still holds that is not yet "
                     "dispatched (at most what the broker keeps); 0 when caught up.",
                     lag.behind_seconds if behind else 0.0)
        yield _gauge("reputd_reput_offset_bytes", "CommitLog offset the reput loop reads next (reputFromOffset).",
                     lag.reput_offset)
        yield _gauge("reputd_commitlog_max_offset_bytes", "End of the written CommitLog data.",
                     lag.commit_log_max_offset)
        yield _gauge("reputd_checkpoint_offset_bytes", "CommitLog offset covered by the checkpoint.",
                     lag.checkpoint_offset)
        age = 0.0
        if lag.checkpoint_offset < lag.reput_offset and lag.checkpoint_written_at:
            age = max(0.0, time.time() - lag.checkpoint_written_at)
        yield _gauge("reputd_checkpoint_age_seconds",
                     "Seconds since the checkpoint was last written, 0 while it covers everything dispatched.", age)
        files = GaugeMetricFamily("reputd_files", "Output files by kind.", labels=["kind"])
        files.add_metric([FileKind.CONSUME_QUEUE], lag.consume_queue_files)
        files.add_metric([FileKind.INDEX], lag.index_files)
        yield files
        behind = lag.retention or RetentionBehind()
        behind_files = GaugeMetricFamily("reputd_retention_behind_files", "Output files the CommitLog no longer "
                                         "needs that are still on disk (retention not done yet), by kind.",
                                         labels=["kind"])
        behind_files.add_metric([FileKind.CONSUME_QUEUE], behind.files)
        behind_files.add_metric([FileKind.INDEX], behind.index_files)
        yield behind_files
        behind_bytes = GaugeMetricFamily("reputd_retention_behind_bytes", "Allocated bytes of those files, by kind.",
                                         labels=["kind"])
        behind_bytes.add_metric([FileKind.CONSUME_QUEUE], behind.bytes)
        behind_bytes.add_metric([FileKind.INDEX], behind.index_bytes)
        yield behind_bytes
        yield _gauge("reputd_retention_behind_seconds", "How long the longest-waiting of those files has been "
                     "found expired; 0 when none is left.", behind.seconds(time.monotonic()))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class ReputMetrics:
    """The daemon's instruments; the loop and the flusher update them, Prometheus reads them."""

    def __init__(self, lag_source: Callable[[], Lag | None]):
        # No `*_created` series: one more series per counter and histogram that no alert or panel reads
        # (a restart shows as a counter reset, which rate() and increase() handle).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.dispatched = Counter("reputd_dispatched_messages", "Messages handed to each dispatcher.",
                                  ["dispatcher"], registry=r)
        self.errors = _known(Counter("reputd_errors", "Errors by kind (dispatch, flush, checkpoint, commitlog, "
                                     "recovery, loop, retention).", ["kind"], registry=r), ErrorKind)
        self.corrupt = _known(Counter("reputd_corrupt_records", "Corrupt CommitLog records met, by field at fault.",
                                      ["reason"], registry=r), CORRUPT_REASONS)
        self.skipped = _known(Counter("reputd_skipped_bytes", "CommitLog bytes not dispatched, by reason.",
                                      ["reason"], registry=r), SkipReason)
        self.deleted_files = _known(Counter("reputd_deleted_files", "Output files deleted because the CommitLog no "
                                            "longer holds their records (the broker's CleanConsumeQueueService), "
                                            "by kind.", ["kind"], registry=r), FileKind)
        self.deleted_bytes = _known(Counter("reputd_deleted_bytes", "Disk space (allocated bytes) freed by deleting "
                                            "expired output files, by kind.", ["kind"], registry=r), FileKind)
        self.flush_duration = Histogram("reputd_flush_duration_seconds", "Duration of one flush cycle.",
                                        buckets=FLUSH_BUCKETS, registry=r)
        self.batch_messages = Histogram("reputd_batch_messages", "Messages per dispatched batch.",
                                        buckets=BATCH_BUCKETS, registry=r)
        self.checkpoints = Counter("reputd_checkpoints_written", "Checkpoint files written.", registry=r)
        self.reads = Counter("reputd_commitlog_reads", "Reads of the CommitLog by the reput loop (each may find "
                             "nothing new): a few per poll interval when idle.", registry=r)
        self.no_space = _known(Counter("reputd_output_space_exhausted",
                                       "Output writes refused for lack of room (ENOSPC, EDQUOT, EFBIG), by stage.",
                                       ["stage"], registry=r), OutputStage)
        self.recoveries = _known(Counter("reputd_recoveries", "Start-up recoveries, by decision.", ["decision"],
                                         registry=r), RecoveryDecision)
        self.dledger_truncations = Counter("reputd_dledger_truncations", "Starts that found entries already "
                                           "dispatched cut from the DLedger log (a new leader's) and cut the output "
                                           "back to the last entry both logs hold.", registry=r)
        self.dledger_truncated_bytes = Counter("reputd_dledger_truncated_bytes", "DLedger log bytes dispatched "
                                               "again after such a cut (from the cut to the old checkpoint).",
                                               registry=r)
        self.broker_lock_taken = Counter("reputd_broker_lock_taken", "A broker took its lock in the output "
                                         "directory (its store root) while reputd wrote there: reputd stopped "
                                         "writing, checkpointed and exited 2.", registry=r)
        self.up = Gauge("reputd_health", "1 for the current health state.", ["state"], registry=r)
        self.set_health(DOWN)  # Health's state until the daemon has recovered
        info = Info("reputd_build", "Build information.", registry=r)
        info.info({"version": __version__, "python": platform.python_version()})
        r.register(_LagCollector(lag_source))

    def set_health(self, state: str) -> None:
        for s in HEALTH_STATES:
            self.up.labels(state=s).set(1 if s == state else 0)


class KnownLabels:
    """A counter with one label that takes only its declared values, each exposed at 0 from the start. An
    undeclared value is a programming error (it would be a series no alert knew at start), refused here
    rather than exported."""

    def __init__(self, counter: Counter, values):
        self._children = {str(v): counter.labels(str(v)) for v in values}

    def labels(self, *values, **labelled):
        (value,) = (*values, *labelled.values())
        try:
            return self._children[str(value)]
        except KeyError:
            raise ValueError(f"{value!r} is not a declared label value: {', '.join(self._children)}") from None


def _known(counter: Counter, values) -> KnownLabels:
    return KnownLabels(counter, values)


class Health:
    """Healthy, degraded (running but stuck: corruption, a failing dispatcher or flush) or down."""

    def __init__(self):
        self._lock = threading.Lock()
        self.state = DOWN
        self.reason = "starting"
        self.since = time.time()

    def set(self, state: str, reason: str = "") -> bool:
        """Record the state; True when it changed (worth a log event)."""
        with self._lock:
            changed = (state, reason) != (self.state, self.reason)
            if changed:
                self.state, self.reason, self.since = state, reason, time.time()
            return changed

    def snapshot(self) -> dict:
        with self._lock:
            return {"status": self.state, "reason": self.reason, "sinceMs": int(self.since * MS_PER_SECOND)}


class MetricsServer:
    """`/metrics` and `/healthz` over HTTP on a background thread."""

    def __init__(self, host: str, port: int, metrics: ReputMetrics, health: Health,
                 progress: Callable[[], dict] | None = None):
        registry = metrics.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == METRICS_PATH:
                    self._send(HTTP_OK, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == HEALTH_PATH:
                    body = health.snapshot()
                    if progress is not None:
                        body.update(progress())
                    code = HTTP_UNAVAILABLE if body["status"] == DOWN else HTTP_OK
                    self._send(code, json.dumps(body).encode() + b"\n", "application/json")
                else:
                    self._send(HTTP_NOT_FOUND, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        try:
            self._server = _Server((host, port), Handler)
        except OSError as e:
            raise _bind_error(host, port, e) from e
        self._server.daemon_threads = True
        self.address = self._server.server_address
        self._thread = threading.Thread(target=self._server.serve_forever, name="reputd-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    """socketserver prints a traceback to stderr for any request that raises, a client's disconnect included;
    the daemon's stderr is for one-line errors. A client gone is passed over, anything else is one event."""

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, CLIENT_GONE):
            return
        get_logger().error("metrics_request_failed", client=str(client_address[0]) if client_address else "",
                           error=f"{type(error).__name__}: {error}")


def _bind_error(host: str, port: int, error: OSError) -> ConfigError:
    """A metrics endpoint that cannot listen is a configuration problem: say which key to change."""
    fix = f"set {_key('port')} or {_key('enabled')}: false"
    if error.errno == errno.EADDRINUSE:
        return ConfigError("metrics.port", f"{port} on {host} is in use; {fix}")
    if error.errno == errno.EACCES:
        return ConfigError("metrics.port", f"{port} on {host} needs privileges this process lacks; {fix}")
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return ConfigError("metrics.host", f"{host!r} is not an address of this machine ({error.strerror or error}); "
                                           f"set {_key('host')}")
    return ConfigError("metrics.port", f"cannot listen on {host}:{port}: {error.strerror or error}; {fix}")


def _key(name: str) -> str:
    return f"metrics.{name} ({env_var_name('metrics', name)})"

