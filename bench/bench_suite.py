"""The benchmark suite behind `make bench`: every scenario of the performance issue, one table, one JSON file.

    .venv/bin/python bench/bench_suite.py [--workdir bench/results/suite] [--only rebuild,live,...] [--quick]

Scenarios (default store sizes unless said: 1 GiB CommitLog segments, 6,000,000-byte ConsumeQueue files,
5,000,000 slots and 20,000,000 entries per IndexFile):

    rebuild          2,000,000 messages, 256-byte bodies, UNIQ_KEY + 1 KEY, 8 topics x 8 queues
    rebuild-3keys    the same with 3 KEYS per message
    rebuild-4k       500,000 messages with 4 KiB bodies
    rebuild-noindex  the first data set with messageIndexEnable: false (ConsumeQueue only)
    rebuild-dledger  the first data set's messages as a DLedger CommitLog (enableDLegerCommitLog, one DLedger
                     entry each, bench/dledger_rebuild.py), rebuilt beside the plain one: msgs/s and the ratio
    verify           `reputd verify` of the first data set's rebuilt output, beside that rebuild's own time
    rebuild-lmq3     the first data set with every message also sent to 3 of 1,000 LMQ queues
                     (enableMultiDispatch, enableLmq); its msgs/s is compared with `rebuild`'s
    rebuild-lmq100k  the same with 100,000 LMQ queues (one run; also the most descriptors and mappings
                     the process held)
    live             a writer appends at 100,000 msgs/s while `reputd run` follows
    query            `reputd query key` against a full 20,000,000-entry IndexFile: the library call, and the
                     installed `reputd` command from process start to answer (300 runs; targets p50 80 ms,
                     p99 120 ms)
    backfill         `reputd backfill` on the rebuild data set: local[1], local[2], a standalone cluster of two
                     one-core workers, and local[2] reading the segments from an S3 server (moto)
    many-queues      production shapes (bench/many_queues.py): what each step of creating a ConsumeQueue file
                     costs; the rebuild of 2,000,000 messages over 8,000 queues and 1,000,000 over 100,000 beside
                     the first data set's 64 (CPU-seconds, wall, peak RSS, mappings, descriptors); the 4.9.3
                     store's own rebuild of the 64- and 8,000-queue CommitLogs, files compared; `run` at
                     100,000 msgs/s over 64 and over 10,000 queues
    timequery        `reputd query offset` and `query time` (a 1-second window of one topic's 8 queues) on the
                     backfill-cost store, process start to exit, and the CommitLog reads of their searches
                     against log2 of the queue's length (bench/timequery.py; targets 100 and 200 ms)
    backfill-cost    what a backfill message costs (bench/backfill_cost.py) on issue 29's store (16,000,000
                     messages, 7 segments of 1 GiB): CPU-seconds of the process tree for
                     the rebuild, a 10,000-message job and the whole data set on local[2], the marginal cost and
                     its parts, the serial fraction from Spark's event log and the projected speedup at 16/64,
                     what a catalog (`--catalog`) adds per message, and the marginal cost again on the same
                     messages over 2,000 topics x 8 queues (16,000 queues) against the 64 queues' (target 1.5x)
    retention-life   an accelerated life (bench/retention_life.py, 15 minutes): 4 MiB segments, 10,000 queues,
                     restarts across retention gaps; how long expired files wait, the output against what the
                     live window needs

Rebuilds are timed from process start to exit (`reputd rebuild` as an operator runs it, body CRCs
checked); peak RSS is the child's own (wait4). Each is compared with a plain sequential read of the same
CommitLog bytes in the same run, from the same page cache: the physical floor of this machine. Data sets
are generated once with `reputd produce` (the live and query ones with bench/paced_writer.py, which is
faster) and kept in the work directory.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.latency import LatencyHistogram  # noqa: E402
from bench.paced_writer import PacedWriter  # noqa: E402
from daemon.commands.query import query_key  # noqa: E402
from daemon.config import load_config  # noqa: E402
from daemon.engine.headwarm import read_ahead_bytes  # noqa: E402
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus  # noqa: E402

REPUTD = [sys.executable, "-m", "daemon.cli"]
# what an operator types: the installed console script (its process start is what the query figure counts)
REPUTD_SCRIPT = Path(sys.executable).with_name("reputd")
GIB = 1024**3
MIB = 1024**2
READ_CHUNK = 16 * MIB
CLK_TCK = os.sysconf("SC_CLK_TCK")

DATA_SETS = {
    # name: (messages, body size, KEYS per message, LMQ queues, LMQ queues per message)
    "256b-1key": (2_000_000, 256, 1, 0, 0),
    # issue 29's store: 7 segments of 1 GiB (the last part-filled), ~435-byte records (backfill-cost)
    "256b-1key-16m": (16_000_000, 256, 1, 0, 0),
    # the same messages over 2,000 topics x 8 queues (16,000 queues: backfill-cost's many-queue variant)
    "256b-1key-16m-16kq": (16_000_000, 256, 1, 0, 0),
    "256b-3keys": (2_000_000, 256, 3, 0, 0),
    "4k-1key": (500_000, 4096, 1, 0, 0),
    "256b-1key-lmq3": (2_000_000, 256, 1, 1_000, 3),
    "256b-1key-lmq100k": (2_000_000, 256, 1, 100_000, 3),
}
LMQ_ENV = {"REPUTD_STORE_ENABLE_MULTI_DISPATCH": "true", "REPUTD_STORE_ENABLE_LMQ": "true"}
REBUILDS = {
    # scenario: (data set, extra environment, runs (None: --repeat))
    "rebuild": ("256b-1key", {}, None),
    "rebuild-3keys": ("256b-3keys", {}, None),
    "rebuild-4k": ("4k-1key", {}, None),
    "rebuild-noindex": ("256b-1key", {"REPUTD_STORE_MESSAGE_INDEX_ENABLE": "false"}, None),
    "rebuild-lmq3": ("256b-1key-lmq3", LMQ_ENV, None),
    "rebuild-lmq100k": ("256b-1key-lmq100k", LMQ_ENV, 1),
}
COST_DATA_SET = "256b-1key-16m"  # backfill-cost runs on the 16M-message store of issue 29's figures
MANY_QUEUES_DATA_SET = "256b-1key-16m-16kq"  # and its many-queue variant on the same messages over 16,000 queues
LMQ_BASELINE = "rebuild"  # what rebuild-lmq3 is compared with (the same messages without LMQ)
TOPICS = ",".join(f"BenchTopic{i}" for i in range(8))
DATA_SET_TOPICS = {"256b-1key-16m-16kq": 2_000}  # topics (of 8 queues each) of a data set; 8 unless named here
QUERY_MESSAGES = 10_000_000  # UNIQ_KEY + 1 KEY each: 20,000,000 keys, one full IndexFile
CLI_QUERIES = 300  # `reputd query key` processes timed, process start to answer
CLI_P50_MS, CLI_P99_MS = 80, 120  # the targets operators were promised (issue 12)
LIVE_RATE = 100_000


# --- helpers ------------------------------------------------------------------------------------------

class Handles(threading.Thread):
    """Samples a process's open descriptors and memory mappings every few milliseconds; keeps the most."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.fds, self.maps = pid, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            try:
                self.fds = max(self.fds, len(os.listdir(f"/proc/{self.pid}/fd")))
                with open(f"/proc/{self.pid}/maps", "rb") as f:
                    self.maps = max(self.maps, sum(1 for _ in f))
            except OSError:
                return


def run_measured(cmd: list[str], env: dict | None = None, handles: dict | None = None) -> tuple[float, int, str]:
    """Run a command to completion; (wall seconds, its own peak RSS in bytes, stdout). With `handles`, the
    most descriptors and mappings it held go there."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env={**os.environ, **(env or {})})
        sampler = None
        if handles is not None:
            sampler = Handles(proc.pid)
            sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        if sampler is not None:
            sampler.done.set()
            sampler.join()
            handles.update(fds=sampler.fds, maps=sampler.maps)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.read()[-3000:]}")
        return wall, usage.ru_maxrss * 1024, out.read()


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def write_config(path: Path, store: Path, out: Path, **store_settings) -> Path:
    """A config for `store`; the bench's own settings come from the environment of each run."""
    path.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(store), **store_settings},
                                    "output": {"dir": str(out)}, "logging": {"level": "warning"}}))
    return path


def commitlog_bytes(store: Path) -> tuple[list[Path], int]:
    files = sorted((store / "commitlog").iterdir())
    return files, sum(f.stat().st_size for f in files)


def raw_read_seconds(store: Path, end_offset: int) -> float:
    """Read the CommitLog's written bytes front to back into one reused buffer: the floor."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    left = end_offset
    t0 = time.perf_counter()
    for path in sorted((store / "commitlog").iterdir()):
        with open(path, "rb", buffering=0) as f:
            while left > 0:
                n = f.readinto(view[: min(READ_CHUNK, left)])
                if not n:
                    break
                left -= n
    return time.perf_counter() - t0


def same_tree(a: Path, b: Path) -> bool:
    """Whether two outputs hold the same consumequeue/ and index/ files (a rebuild also leaves its checkpoint)."""
    return all(_same_files(a / d, b / d) for d in ("consumequeue", "index"))


def _same_files(a: Path, b: Path) -> bool:
    names_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    names_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    return names_a == names_b and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names_a)


PRODUCED = "produced.json"  # a data set's marker: {"messages": N, ...} once `reputd produce` made it whole


def produced_already(store: Path, messages: int) -> bool:
    """Whether `store` holds the `messages` a produce made whole (its marker says so); if not, it is emptied for
    a new produce, which writes the marker last."""
    marker = store / PRODUCED
    if marker.exists() and json.loads(marker.read_text()).get("messages") == messages:
        return True
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    return False


def ensure_data_set(work: Path, name: str, scale: float) -> tuple[Path, int]:
    """The store of a data set, produced once; (store root, messages)."""
    messages, body, keys, lmq_queues, lmq_per_message = DATA_SETS[name]
    messages = max(1000, int(messages * scale))
    store = work / "data" / name
    if produced_already(store, messages):
        return store, messages
    config = write_config(work / f"produce-{name}.yaml", store, work / "unused")
    print(f"producing {name}: {messages:,} messages ...", flush=True)
    lmq = ["--lmq-queues", str(lmq_queues), "--lmq-per-message", str(lmq_per_message)] if lmq_queues else []
    topics = ",".join(f"BenchTopic{i}" for i in range(DATA_SET_TOPICS[name])) if name in DATA_SET_TOPICS else TOPICS
    wall, _, _ = run_measured([*REPUTD, "produce", "--config", str(config), "--messages", str(messages),
                               "--body-size", str(body), "--keys", str(keys), "--topics", topics, "--queues", "8",
                               *lmq], LMQ_ENV if lmq_queues else None)
    (store / PRODUCED).write_text(json.dumps({"messages": messages, "seconds": round(wall, 1)}))
    return store, messages


# --- scenarios ----------------------------------------------------------------------------------------

def bench_rebuild(work: Path, scenario: str, scale: float, repeat: int) -> dict:
    data, env, runs_wanted = REBUILDS[scenario]
    store, messages = ensure_data_set(work, data, scale)
    outs = work / "out" / scenario
    shutil.rmtree(outs, ignore_errors=True)
    outs.mkdir(parents=True)  # a writing command creates its output directory only when its parent exists
    runs = []
    # Each run writes a directory of its own, all removed after the last: ext4 without a journal (this
    # machine's root) passes over inodes freed in the last minute when it allocates one, so the thousands of
    # queue directories an LMQ run creates right after deleting the previous run's cost seconds of scanning.
    for run in range(runs_wanted or repeat):
        config = write_config(work / f"{scenario}.yaml", store, outs / f"run-{run}")
        raw_read_seconds(store, commitlog_bytes(store)[1])  # the same warm page cache for both
        handles: dict = {}
        wall, rss, stdout = run_measured([*REPUTD, "rebuild", "--config", str(config), "--json"], env, handles)
        summary = last_json(stdout)
        floor = raw_read_seconds(store, summary["endOffset"])
        runs.append((wall, rss, summary, floor, handles))
    shutil.rmtree(outs, ignore_errors=True)
    wall, rss, summary, floor, handles = min(runs, key=lambda r: r[0])
    assert summary["messages"] == messages, summary
    size = summary["bytes"]
    lmq_queues = DATA_SETS[data][3]
    return {"scenario": scenario, "messages": messages, "bytes": size, "seconds": round(wall, 3),
            "msgs_per_s": round(messages / wall), "mb_per_s": round(size / MIB / wall, 1),
            "peak_rss_mb": round(rss / MIB, 1), "raw_read_seconds": round(floor, 3),
            "raw_read_mb_per_s": round(size / MIB / floor, 1), "ratio_to_raw_read": round(wall / floor, 2),
            "runs": [round(r[0], 3) for r in runs], "inner_seconds": summary["seconds"],
            "lmq_queues": lmq_queues, "consumequeue_files": summary["files"].get("consumequeue"),
            "max_open_fds": handles.get("fds"), "max_mappings": handles.get("maps")}


def bench_verify(work: Path, scale: float, repeat: int) -> dict:
    """`reputd verify` reads what a rebuild writes: timed against the rebuild of the same data, run just before
    it in the same way (process start to exit, fastest of `repeat`, the same warm page cache)."""
    store, messages = ensure_data_set(work, REBUILDS["rebuild"][0], scale)
    out = work / "out" / "verify"
    config = write_config(work / "verify.yaml", store, out)
    end = commitlog_bytes(store)[1]
    rebuilds, verifies = [], []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        raw_read_seconds(store, end)
        wall, rss, _ = run_measured([*REPUTD, "rebuild", "--config", str(config), "--json"])
        rebuilds.append((wall, rss))
    for _ in range(repeat):
        raw_read_seconds(store, end)
        wall, rss, stdout = run_measured([*REPUTD, "verify", "--config", str(config), "--json"])
        summary = last_json(stdout)
        if not summary["consistent"] or summary["messages"] != messages:
            sys.exit(f"verify of the rebuilt output: {summary}")
        verifies.append((wall, rss, summary))
    rb_wall, rb_rss = min(rebuilds)
    wall, rss, summary = min(verifies, key=lambda r: r[0])
    return {"scenario": "verify", "messages": messages, "bytes": summary["endOffset"] - summary["fromOffset"],
            "seconds": round(wall, 3), "msgs_per_s": round(messages / wall), "peak_rss_mb": round(rss / MIB, 1),
            "rebuild_seconds": round(rb_wall, 3), "rebuild_msgs_per_s": round(messages / rb_wall),
            "rebuild_peak_rss_mb": round(rb_rss / MIB, 1), "ratio_to_rebuild": round(rb_wall / wall, 2),
            "runs": [round(r[0], 3) for r in verifies], "rebuild_runs": [round(r[0], 3) for r in rebuilds],
            "inner_seconds": summary["seconds"]}


def _health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return json.loads(r.read())


def _wait_up(proc: subprocess.Popen, port: int, timeout: float = 60) -> None:
    """Until the daemon `proc` answers /healthz on `port`; its error once it has exited or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _health(port)
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.05)


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _proc_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def bench_live(work: Path, seconds: float, idle_seconds: float, rate: int = LIVE_RATE) -> dict:
    tmp = work / "live"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    latency_file = tmp / "latency.json"
    port = 19000 + random.randrange(900)
    cfg = {"store": {"storePathRootDir": str(tmp / "store")}, "output": {"dir": str(tmp / "out")},
           "metrics": {"port": port}, "logging": {"level": "warning", "format": "json"},
           "dispatchers": ["consumequeue", "index",
                           {"name": "bench.latency:LatencyDispatcher", "options": {"path": str(latency_file)}}]}
    (tmp / "reputd.yaml").write_text(yaml.safe_dump(cfg))
    writer = PacedWriter(str(tmp / "store" / "commitlog"), GIB, topics=("LiveTopicA", "LiveTopicB"), queues=8)
    proc = subprocess.Popen([*REPUTD, "run", "--config", str(tmp / "reputd.yaml")], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _wait_up(proc, port)
        cpu0, t0 = _proc_cpu(proc.pid), time.monotonic()
        wrote = writer.run(rate, seconds)
        writer.flush()
        while _health(port)["reputFromOffset"] < writer.max_offset:
            time.sleep(0.01)
        busy = (_proc_cpu(proc.pid) - cpu0) / (time.monotonic() - t0)
        time.sleep(3.0)  # past the daemon's switch to the idle probe interval
        cpu1, t1 = _proc_cpu(proc.pid), time.monotonic()
        time.sleep(idle_seconds)
        idle = (_proc_cpu(proc.pid) - cpu1) / (time.monotonic() - t1)
        peak_rss = _proc_rss(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        writer.close()
    lat = LatencyHistogram.load(str(latency_file)).summary()
    return {"scenario": "live", "rate_requested": rate, "rate_achieved": wrote["msgs_per_s"],
            "messages": wrote["messages"], "dispatched": lat["count"], "seconds": wrote["seconds"],
            "latency_ms_p50": lat["p50_ms"], "latency_ms_p99": lat["p99_ms"], "latency_ms_max": lat["max_ms"],
            "daemon_cpu_busy": round(busy, 3), "daemon_cpu_idle": round(idle, 4),
            "peak_rss_mb": round(peak_rss / MIB, 1), "writer_cpu": wrote["cpu_fraction"], "exit_code": code,
            "writer_stalls": wrote["stalls"], "writer_stalled_share": round(wrote["stalled_records"] /
                                                                             max(1, wrote["messages"]), 5),
            "writer_longest_write_ms": wrote["longest_write_ms"], "store_read_ahead_kb": read_ahead_kb(tmp)}


def read_ahead_kb(path: Path) -> int:
    """The kernel's readahead of the block device holding `path`: a writer's page fault past the head reads
    around that much (zero pages of a new segment), so it sets how long the writer's own stalls are."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_ahead_bytes(fd) >> 10
    finally:
        os.close(fd)


def ensure_query_store(work: Path, scale: float) -> tuple[Path, Path, int]:
    """10,000,000 messages (UNIQ_KEY + KEYS each) and the IndexFiles `reputd rebuild` builds for them."""
    messages = max(10_000, int(QUERY_MESSAGES * scale))
    base = work / "data" / "query"
    store, out = base / "store", base / "out"
    marker = base / "built.json"
    if marker.exists() and json.loads(marker.read_text()).get("messages") == messages:
        return store, out, messages
    shutil.rmtree(base, ignore_errors=True)
    print(f"writing the query data set: {messages:,} messages ...", flush=True)
    with PacedWriter(str(store / "commitlog"), GIB, topics=("QueryTopicA", "QueryTopicB"), queues=8,
                     body_size=64) as w:
        while w.count < messages:
            w.write(min(65536, messages - w.count))
        w.flush()
    config = write_config(base / "reputd.yaml", store, out)
    wall, _, stdout = run_measured([*REPUTD, "rebuild", "--config", str(config), "--json"])
    print(f"  indexed in {wall:.1f} s: {last_json(stdout)['files']}", flush=True)
    marker.write_text(json.dumps({"messages": messages}))
    return store, out, messages


def sample_keys(store: Path, count: int, seed: int = 7) -> list[tuple[str, str]]:
    """(topic, key) of records spread over the whole CommitLog: UNIQ_KEYs and KEYS alike."""
    log = CommitLog(str(store / "commitlog"), GIB)
    reader = CommitLogReader(log, batch_bytes=MIB)
    rng = random.Random(seed)
    picked: list[tuple[str, str]] = []
    starts = sorted(rng.randrange(len(log.segments)) for _ in range(count // 8))
    for seg in starts:
        seg_start, _ = log.segments[seg]
        result = reader.read(seg_start)
        b = result.batch
        for i in rng.sample(range(len(b)), min(8, len(b))):
            key = b.uniq_key[i] if rng.random() < 0.5 else b.keys[i].split(" ")[0]
            picked.append((b.topic_of(i), key))
        if result.status is not ReadStatus.OK:
            continue
    reader.close()
    return picked[:count]


def bench_query(work: Path, scale: float, library_queries: int, cli_queries: int) -> dict:
    store, out, messages = ensure_query_store(work, scale)
    config_path = write_config(work / "query.yaml", store, out)
    config = load_config(str(config_path), {})
    keys = sample_keys(store, library_queries)
    index_files = sorted((out / "index").iterdir())
    for topic, key in keys[:20]:  # warm the page cache for the files the queries touch
        query_key(config, topic, key)
    lib = []
    found = 0
    for topic, key in keys:
        t0 = time.perf_counter()
        got = query_key(config, topic, key)
        lib.append(time.perf_counter() - t0)
        found += bool(got)
    script = [str(REPUTD_SCRIPT)] if REPUTD_SCRIPT.exists() else REPUTD
    cli, answered = [], 0
    load_before = os.getloadavg()
    for i in range(cli_queries):
        topic, key = keys[i % len(keys)]
        wall, _, stdout = run_measured([*script, "query", "key", "--config", str(config_path), topic, key])
        cli.append(wall)
        answered += bool(stdout.strip())
    load_after = os.getloadavg()
    lib_ms, cli_ms = np.array(lib) * 1000, np.array(cli) * 1000
    return {"scenario": "query", "messages": messages, "index_files": [p.name for p in index_files],
            "index_entries": _index_entries(index_files), "queries": len(lib), "found": found,
            "library_ms_p50": round(float(np.percentile(lib_ms, 50)), 3),
            "library_ms_p99": round(float(np.percentile(lib_ms, 99)), 3),
            "cli_command": "reputd query key" if script != REPUTD else "python -m daemon.cli query key",
            "cli_queries": len(cli),
            "cli_answered": answered, "cli_ms_p50": round(float(np.percentile(cli_ms, 50)), 1),
            "cli_ms_p99": round(float(np.percentile(cli_ms, 99)), 1),
            "cli_ms_max": round(float(cli_ms.max()), 1), "cli_target_ms": {"p50": CLI_P50_MS, "p99": CLI_P99_MS},
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in load_after]}


def _index_entries(files: list[Path]) -> list[int]:
    counts = []
    for f in files:
        with open(f, "rb") as fh:
            header = fh.read(40)
        counts.append(int.from_bytes(header[36:40], "big", signed=True))
    return counts


class TreeSampler:
    """CPU seconds and peak RSS of a process and all its descendants (the Spark JVM, the Python workers),
    sampled from /proc ten times a second: a JVM that py4j leaves to init is not in the child's rusage."""

    def __init__(self, pid: int):
        self.pid = pid
        self.cpu: dict[int, float] = {}
        self.rss: dict[str, int] = {"driver": 0, "jvm": 0, "python_worker": 0}
        self._stop = False
        import threading  # noqa: PLC0415

        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tree(self) -> list[int]:
        parent: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    parent[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        tree, frontier = [self.pid], [self.pid]
        while frontier:
            frontier = [p for p, pp in parent.items() if pp in frontier]
            tree.extend(frontier)
        return tree

    def _run(self) -> None:
        while not self._stop:
            for pid in self._tree():
                try:
                    self.cpu[pid] = max(self.cpu.get(pid, 0.0), _proc_cpu(pid))
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    rss = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                   if line.startswith("VmRSS:"))) * 1024
                except (OSError, StopIteration, ValueError):
                    continue
                kind = ("driver" if pid == self.pid else "jvm" if b"java" in cmd.split(b"\0")[0]
                        else "python_worker" if b"pyspark" in cmd else None)
                if kind:
                    self.rss[kind] = max(self.rss[kind], rss)
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop = True
        self.thread.join()

    @property
    def cpu_seconds(self) -> float:
        return sum(self.cpu.values())


def run_sampled(cmd: list[str], env: dict | None = None) -> tuple[float, str, TreeSampler, float]:
    """Run a command to completion sampling its process tree; (wall, stdout, sampler, rusage CPU seconds)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env={**os.environ, **(env or {})})
        sampler = TreeSampler(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        sampler.stop()
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{err.read()[-3000:]}")
        return wall, out.read(), sampler, usage.ru_utime + usage.ru_stime


def _interrupted(signum, _frame) -> None:
    """SIGTERM as Ctrl-C: unwinds through the scenarios' cleanups (a moto server, a standalone cluster)
    instead of leaving them running without the benchmark."""
    raise KeyboardInterrupt(f"signal {signum}")


def _s3_source(store: Path, cleanup: list):
    """A moto S3 server (subprocess, free port; its stop appended to `cleanup`) holding the data set's
    segments; (environment for the backfill, URI)."""
    from pyarrow import fs  # noqa: PLC0415

    from bench.moto_server import start_moto_server  # noqa: PLC0415

    proc, endpoint = start_moto_server()
    cleanup.append(lambda: (proc.terminate(), proc.wait(30)))
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
    # moto assembles a multipart upload (and serves every ranged GET) from the whole object: allow it time
    s3 = fs.S3FileSystem(access_key="bench", secret_key="bench", region="us-east-1",
                         endpoint_override=endpoint.split("://")[1], scheme="http", allow_bucket_creation=True,
                         request_timeout=900, connect_timeout=30)
    s3.create_dir("bench")
    for path in sorted((store / "commitlog").iterdir()):
        with open(path, "rb") as src, s3.open_output_stream(f"bench/commitlog/{path.name}") as dst:
            while chunk := src.read(16 * MIB):
                dst.write(chunk)
    return env, "s3://bench/commitlog"


def _prime_class_archive(work: Path, config: Path) -> list[dict]:
    """The first local backfill with this Java and PySpark records the driver JVM's class archive as it ends
    (daemon/backfill/jvm.py): done here, untimed by the rows below, so that they all measure the steady case;
    its time is reported on its own."""
    from daemon.backfill.driver import LOCAL_DRIVER_JAVA_OPTIONS, check_java  # noqa: PLC0415
    from daemon.backfill.jvm import ARCHIVE_AUTO, choose_archive  # noqa: PLC0415

    archive = choose_archive(ARCHIVE_AUTO, check_java(), LOCAL_DRIVER_JAVA_OPTIONS)
    if archive is None or not archive.saving:
        return []
    out = work / "out" / "backfill-prime"
    shutil.rmtree(out, ignore_errors=True)
    wall, stdout, _, _ = run_sampled([*REPUTD, "backfill", "--config", str(config), "--out", str(out), "--json",
                                      "--master", "local[1]", "--conf", "spark.ui.enabled=false"])
    shutil.rmtree(out, ignore_errors=True)
    saved = last_json(stdout)["phaseSeconds"].get("saveClassArchive")
    print(f"jvm class archive: recorded by a first local[1] backfill in {wall:.1f} s ({saved} s of it saving "
          f"{archive.path})", flush=True)
    return [{"scenario": "jvm class archive (first local backfill, once)", "seconds": round(wall, 3),
             "save_seconds": saved, "path": archive.path}]


def bench_backfill(work: Path, scale: float, masters: list[str]) -> list[dict]:
    """`reputd backfill` on the rebuild's data set: local[1], local[2], a standalone cluster of two one-core
    workers, and local[2] reading the segments from an S3 server; beside the rebuild of the same data."""
    store, messages = ensure_data_set(work, "256b-1key", scale)
    reference = work / "out" / "backfill-reference"
    config = write_config(work / "backfill.yaml", store, reference)
    shutil.rmtree(reference, ignore_errors=True)
    raw_read_seconds(store, commitlog_bytes(store)[1])
    wall, stdout, sampler, cpu = run_sampled([*REPUTD, "rebuild", "--config", str(config), "--json"])
    rows = [{"scenario": "backfill-reference rebuild", "messages": messages, "seconds": round(wall, 3),
             "work_seconds": round(wall, 3), "msgs_per_s": round(messages / wall),
             "cpu_us_per_msg": round(1e6 * max(cpu, sampler.cpu_seconds) / messages, 3)}]
    rebuild_cpu = rows[0]["cpu_us_per_msg"]
    rows.extend(_prime_class_archive(work, config))
    for master in masters:
        name = master.replace("[", "").replace("]", "").replace(":", "-").replace("/", "")
        out = work / "out" / f"backfill-{name}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [*REPUTD, "backfill", "--config", str(config), "--out", str(out), "--json",
               "--conf", "spark.ui.enabled=false"]
        env, cleanup, label = {}, [], {"cluster": "standalone cluster, 2 one-core workers",
                                         "s3": "local[2], segments on S3 (moto)"}.get(master, master)
        try:
            if master == "cluster":
                from bench.spark_cluster import StandaloneCluster  # noqa: PLC0415

                cluster = StandaloneCluster(workers=2, work_dir=work / "spark-cluster", worker_memory="2g")
                cleanup.append(cluster.stop)
                cluster.start()
                cmd += ["--master", cluster.url]
                env = {"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
            elif master == "s3":
                env, uri = _s3_source(store, cleanup)
                cmd += ["--master", "local[2]", "--segments", uri]
            else:
                cmd += ["--master", master]
            wall, stdout, sampler, _ = run_sampled(cmd, env)
        except (OSError, SystemExit, RuntimeError) as e:
            print(f"backfill {label}: failed: {e}", flush=True)
            rows.append({"scenario": f"backfill {label}", "master": master, "error": str(e)[-500:]})
            continue
        finally:
            for stop in cleanup:
                stop()
        summary = last_json(stdout)
        startup = summary["phaseSeconds"].get("startup", 0.0)
        work_seconds = summary["seconds"] - startup
        task_seconds = summary["decodeTaskSeconds"] + summary["writeTaskSeconds"]
        rows.append({
            "scenario": f"backfill {label}", "master": master, "messages": messages, "seconds": round(wall, 3),
            "work_seconds": round(work_seconds, 3), "msgs_per_s": round(messages / wall),
            "msgs_per_s_after_startup": round(messages / work_seconds),
            "per_slot_decode_msgs_per_s": round(messages / summary["decodeTaskSeconds"]),
            "per_slot_msgs_per_s": round(messages / task_seconds),
            "cpu_us_per_msg": round(1e6 * sampler.cpu_seconds / messages, 3),
            "cpu_vs_rebuild": round(sampler.cpu_seconds / messages * 1e6 / rebuild_cpu, 2),
            "python_jvm_bytes_per_msg": round(summary["bytesToJvm"] / messages, 1),
            "peak_rss_mb": {k: round(v / MIB, 1) for k, v in sampler.rss.items()},
            "ratio_to_rebuild": round(wall / rows[0]["seconds"], 2), "spark_jobs": summary["sparkJobs"],
            "ranges": summary["ranges"], "identical_to_rebuild": same_tree(reference, out),
            "phases": summary["phaseSeconds"], "load": os.getloadavg()[0]})
        print(f"backfill {label}: {json.dumps(rows[-1])}", flush=True)
    locals_ = {r["master"]: r for r in rows[1:] if "master" in r and "error" not in r}
    if "local[1]" in locals_ and "local[2]" in locals_:
        locals_["local[2]"]["scaling_vs_local1"] = round(locals_["local[1]"]["work_seconds"]
                                                         / locals_["local[2]"]["work_seconds"], 2)
    return rows


# --- report -------------------------------------------------------------------------------------------

def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))) // 1024
    return {"cpu": model, "cores": os.cpu_count(), "memory_mb": mem, "python": platform.python_version(),
            "kernel": platform.release(), "load_at_start": os.getloadavg()[0]}


def lmq_ratio(results: list[dict]) -> None:
    """rebuild-lmq3 against the same messages without LMQ (the issue asks for at least 50%)."""
    by_name = {r["scenario"]: r for r in results}
    if "rebuild-lmq3" in by_name and LMQ_BASELINE in by_name:
        by_name["rebuild-lmq3"]["ratio_to_plain_msgs_per_s"] = round(
            by_name["rebuild-lmq3"]["msgs_per_s"] / by_name[LMQ_BASELINE]["msgs_per_s"], 3)


def print_table(results: list[dict]) -> None:
    print("\n| scenario | messages | seconds | msgs/s | MB/s | peak RSS MB | raw read s | ratio to raw read |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r["scenario"].startswith("rebuild") and "seconds" in r:  # rebuild-dledger has a line of its own
            print(f"| {r['scenario']} | {r['messages']:,} | {r['seconds']:.2f} | {r['msgs_per_s']:,} | "
                  f"{r['mb_per_s']:,.0f} | {r['peak_rss_mb']:.0f} | {r['raw_read_seconds']:.2f} | "
                  f"{r['ratio_to_raw_read']:.2f} |")
    backfills = [r for r in results if r["scenario"].startswith("backfill")]
    if backfills:
        print("\n| backfill (256-byte bodies, 1 KEY) | messages | s end to end | s after start-up | msgs/s | "
              "x rebuild time | per slot msgs/s (decode) | CPU us/msg (x rebuild) | Py<->JVM B/msg | "
              "peak RSS MB driver/JVM/worker | identical |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for r in backfills:
            if "error" in r:
                print(f"| {r['scenario']} | failed: {r['error'][:100]} |")
                continue
            if "master" not in r:
                print(f"| rebuild (same data) | {r['messages']:,} | {r['seconds']:.2f} | | {r['msgs_per_s']:,} | 1 | "
                      f"| {r['cpu_us_per_msg']} | | | |")
                continue
            extra = f" ({r['scaling_vs_local1']}x local[1] after start-up)" if "scaling_vs_local1" in r else ""
            rss = r["peak_rss_mb"]
            print(f"| {r['scenario']}{extra} | {r['messages']:,} | {r['seconds']:.2f} | {r['work_seconds']:.2f} | "
                  f"{r['msgs_per_s']:,} | {r['ratio_to_rebuild']} | {r['per_slot_msgs_per_s']:,} "
                  f"({r['per_slot_decode_msgs_per_s']:,}) | {r['cpu_us_per_msg']} ({r['cpu_vs_rebuild']}x) | "
                  f"{r['python_jvm_bytes_per_msg']} | "
                  f"{rss['driver']:.0f}/{rss['jvm']:.0f}/{rss['python_worker']:.0f} | "
                  f"{r['identical_to_rebuild']} |")
    for r in results:
        if r["scenario"] == "rebuild-dledger":
            from bench.dledger_rebuild import print_line  # noqa: PLC0415

            print_line(r)
        if r["scenario"] == "verify":
            print(f"\nverify: {r['messages']:,} messages in {r['seconds']:.2f} s ({r['msgs_per_s']:,} msgs/s, peak RSS "
                  f"{r['peak_rss_mb']:.0f} MB); the rebuild of the same data {r['rebuild_seconds']:.2f} s "
                  f"({r['rebuild_msgs_per_s']:,} msgs/s, peak RSS {r['rebuild_peak_rss_mb']:.0f} MB): "
                  f"{r['ratio_to_rebuild']:.2f}x the rebuild's msgs/s")
        if r["scenario"].startswith("rebuild-lmq"):
            ratio = (f", {r['ratio_to_plain_msgs_per_s']:.0%} of {LMQ_BASELINE}'s msgs/s"
                     if "ratio_to_plain_msgs_per_s" in r else "")
            print(f"\n{r['scenario']}: {r['lmq_queues']:,} LMQ queues, {r['consumequeue_files']:,} ConsumeQueue files, "
                  f"{r['msgs_per_s']:,} msgs/s{ratio}; peak RSS {r['peak_rss_mb']:.0f} MB, at most "
                  f"{r['max_open_fds']} descriptors and {r['max_mappings']} mappings open")
    for r in results:
        if r["scenario"] == "live":
            print(f"\nlive: {r['rate_achieved']:,} msgs/s for {r['seconds']:.0f} s ({r['dispatched']:,} of "
                  f"{r['messages']:,} dispatched); append-to-dispatch latency ms p50 {r['latency_ms_p50']} "
                  f"p99 {r['latency_ms_p99']} max {r['latency_ms_max']}; daemon CPU {r['daemon_cpu_busy']:.1%} "
                  f"of a core busy, {r['daemon_cpu_idle']:.2%} idle; peak RSS {r['peak_rss_mb']:.0f} MB")
            print(f"live: the writer's own stalls (a write over 5 ms: its page faults, each reading around "
                  f"read_ahead_kb {r['store_read_ahead_kb']} of the store's disk): {r['writer_stalls']}, longest "
                  f"{r['writer_longest_write_ms']} ms, holding {r['writer_stalled_share']:.2%} of the records late "
                  f"before reputd can see them")
        if r["scenario"] == "retention-life":
            from bench.retention_life import print_line  # noqa: PLC0415

            print_line(r)
        if r["scenario"] == "query":
            print(f"query: {r['queries']:,} keys against IndexFiles with {r['index_entries']} entries: library "
                  f"p50 {r['library_ms_p50']} ms p99 {r['library_ms_p99']} ms; CLI `{r['cli_command']}` "
                  f"({r['cli_queries']} runs, {r['cli_answered']} answered, process start to answer) p50 "
                  f"{r['cli_ms_p50']} ms p99 {r['cli_ms_p99']} ms max {r['cli_ms_max']} ms (target p50 <= "
                  f"{CLI_P50_MS} ms, p99 <= {CLI_P99_MS} ms; load {r['load_before']} -> {r['load_after']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "suite")
    ap.add_argument("--only", default="rebuild,rebuild-3keys,rebuild-4k,rebuild-noindex,rebuild-dledger,verify,"
                                      "rebuild-lmq3,"
                                      "rebuild-lmq100k,live,query,timequery,backfill,many-queues,backfill-cost,retention-life")
    ap.add_argument("--quick", action="store_true", help="a tenth of every data set and short runs (a smoke test)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per rebuild scenario; the fastest is reported")
    ap.add_argument("--live-seconds", type=float, default=20.0)
    ap.add_argument("--masters", default="local[1],local[2],cluster,s3",
                    help="backfill runs: local[N], cluster (a standalone master and 2 workers), s3 (moto source)")
    ap.add_argument("--cli-queries", type=int, default=CLI_QUERIES, help="`reputd query key` processes to time")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)  # so each scenario's `finally` stops its servers and cluster
    work = args.workdir.resolve()
    (work / "out").mkdir(parents=True, exist_ok=True)  # the parent of every scenario's output
    scale = 0.1 if args.quick else 1.0
    wanted = args.only.split(",")
    results: list[dict] = []
    info = machine()
    print(f"machine: {info}", flush=True)
    for scenario in REBUILDS:
        if scenario in wanted:
            results.append(bench_rebuild(work, scenario, scale, 1 if args.quick else args.repeat))
            print(f"{scenario}: {results[-1]['msgs_per_s']:,} msgs/s", flush=True)
    if "rebuild-dledger" in wanted:
        from bench.dledger_rebuild import bench_rebuild_dledger  # noqa: PLC0415

        results.append(bench_rebuild_dledger(work, scale, 1 if args.quick else args.repeat, sys.modules[__name__]))
        print(f"rebuild-dledger: {results[-1]['dledger']['msgs_per_s']:,} msgs/s "
              f"({results[-1]['ratio_to_plain_msgs_per_s']:.0%} of the plain CommitLog's)", flush=True)
    if "verify" in wanted:
        results.append(bench_verify(work, scale, 1 if args.quick else args.repeat))
        print(f"verify: {results[-1]['msgs_per_s']:,} msgs/s ({results[-1]['ratio_to_rebuild']}x rebuild)", flush=True)
    if "live" in wanted:
        results.append(bench_live(work, 5.0 if args.quick else args.live_seconds, 3.0 if args.quick else 10.0))
        print(f"live: p99 {results[-1]['latency_ms_p99']} ms", flush=True)
    if "query" in wanted:
        results.append(bench_query(work, 0.01 if args.quick else 1.0, 200 if args.quick else 2000,
                                   20 if args.quick else args.cli_queries))
        print(f"query: library p99 {results[-1]['library_ms_p99']} ms, CLI p50 {results[-1]['cli_ms_p50']} ms "
              f"p99 {results[-1]['cli_ms_p99']} ms", flush=True)
    timequery = None
    if "timequery" in wanted:
        from bench.timequery import bench_timequery, report  # noqa: PLC0415

        timequery = bench_timequery(work, scale, 5 if args.quick else 30)
        print("\n".join(report(timequery)), flush=True)
    if "backfill" in wanted:
        results.extend(bench_backfill(work, scale, args.masters.split(",")))
    many = None
    if "many-queues" in wanted:
        from bench.many_queues import measure as measure_many_queues  # noqa: PLC0415

        many = measure_many_queues(work, scale, 1 if args.quick else args.repeat,
                                   live_seconds=5.0 if args.quick else args.live_seconds)
    cost = None
    if "backfill-cost" in wanted:
        from bench.backfill_cost import DEFAULT_ROUNDS, measure  # noqa: PLC0415

        cost = measure(work, COST_DATA_SET, scale, "local[2]", catalog=True,
                       rounds=1 if args.quick else DEFAULT_ROUNDS, many_queues=MANY_QUEUES_DATA_SET)
    if "retention-life" in wanted:
        from bench.retention_life import bench_retention_life  # noqa: PLC0415

        results.append(bench_retention_life(work, args.quick))
    lmq_ratio(results)
    print_table(results)
    if many is not None:
        print("\nmany queues (bench/many_queues.py):" + "\n".join(many.pop("table")))
        results.append(many)
    if cost is not None:
        print("\nbackfill cost (bench/backfill_cost.py):\n" + "\n".join(cost.pop("table")))
        results.append(cost)
    if timequery is not None:
        print("\n" + "\n".join(report(timequery)))
        results.append(timequery)
    out = work / "results.json"
    out.write_text(json.dumps({"machine": info, "results": results}, indent=2))
    print(f"\nfigures: {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:
        print(f"bench_suite: interrupted ({e or 'Ctrl-C'}); servers and clusters it started are stopped",
              file=sys.stderr)
        sys.exit(130)
