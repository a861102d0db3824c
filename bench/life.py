"""Accelerated life: `reputd run` beside a broker-like CommitLog for minutes that stand in for months.

A writer process appends record by record as a broker does (`tests/record_writer.py`: each record its own
write, small segments, the next segment pre-created full size and zero-filled), over topics that grow in
number; a retention loop deletes the oldest segments, keeping the newest `--keep-segments`, as the
broker's CleanCommitLogService does; the daemon is restarted across the run: SIGTERM at once, `kill -9`
followed by a pause long enough for retention to delete segments it had not read, and SIGTERM followed by
such a pause. After the writer stops, the daemon catches up and stops, and `reputd verify` must exit 0.

It prints, every `--interval` seconds: output size against CommitLog size, files, the daemon's RSS,
descriptors and mappings, and how far behind it is; and at the end: output bytes/hour with retention, the
files kept against the broker's rule (`indexcore.retention` applied to the final output: what it would
still delete), corrupt records met (from the daemon's log, all lives), dispatch latency p50/p99 from the
bounded histogram of `bench/latency.py` (the first life, which never restarts, and every life), and the lag
gauges sampled while far behind beside the truth at that moment.

    python bench/life.py [--seconds 240] [--rate 5000] [--json FILE]

`REPUTD_LIFE_SECONDS` sets the default duration (`make stress` runs it with REPUTD_STRESS=1). Exit 0 when
verify exited 0, no corrupt record was met, no daemon life ended badly and nothing expired was kept.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.latency import LatencyHistogram  # noqa: E402
from bench.retention_watch import OutputWatch, lines, pass_rates, verdict  # noqa: E402
from indexcore.indexservice import IndexService  # noqa: E402
from indexcore.queuestore import ConsumeQueueStore  # noqa: E402
from indexcore.reader import CommitLog  # noqa: E402
from indexcore.retention import expired_index_files, expired_queue_files  # noqa: E402
from indexcore.writer import Message  # noqa: E402
from tests.record_writer import RecordWriter  # noqa: E402

try:
    from tests.stress import report
except ImportError:
    report = None

MIB = 1024 * 1024
QUEUES = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the writer (a process of its own, as a broker is) -------------------------------------------------

def topic_count(elapsed: float, seconds: float, first: int, last: int) -> int:
    return first + int((last - first) * min(1.0, elapsed / seconds))


def write(directory: str, segment_size: int, rate: float, seconds: float, topics: tuple[int, int],
          end, count, stop, keys_path: str, units_per_file: int) -> None:
    """Record by record at `rate`/s for `seconds`, topics growing from topics[0] to topics[1]; the end
    offset and count are published in the shared values. Each record whose unit is the last of a
    ConsumeQueue file is noted in `keys_path` (bench/retention_watch.py: when that file expires)."""
    w = RecordWriter(directory, segment_size)  # the wall clock: latency is measured from STORETIMESTAMP
    n = 0
    begin = time.monotonic()
    try:
        with open(keys_path, "w") as keys:
            while not stop.is_set():
                elapsed = time.monotonic() - begin
                if elapsed >= seconds:
                    break
                if n >= elapsed * rate:
                    time.sleep(0.0005)
                    continue
                t = n % topic_count(elapsed, seconds, *topics)
                r = w.append(Message(f"LifeTopic{t}", n % QUEUES, bytes([n % 251 + 1]) * (100 + n % 60),
                                     {"TAGS": f"Tag{n % 5}", "KEYS": f"order-{n} k{n % 13}", "UNIQ_KEY": f"{n:032X}"}))
                if (r.queue_offset + 1) % units_per_file == 0:
                    keys.write(f"LifeTopic{t} {n % QUEUES} {r.queue_offset} {r.phy_offset}\n")
                n += 1
                if n % 64 == 0:
                    end.value, count.value = w.max_offset, n
                    if n % 4096 == 0:
                        keys.flush()
            end.value, count.value = w.max_offset, n
    finally:
        w.close()


def retain(directory: str, keep: int, stop: threading.Event, deleted: list[int], watch: OutputWatch) -> None:
    """CleanCommitLogService, reduced: every 0.5 s, delete the oldest segments beyond the newest `keep`; each
    new first offset is told to `watch` with the time just before the unlink that made it."""
    while not stop.wait(0.5):
        names = sorted(n for n in os.listdir(directory) if n.isdigit())
        gone = names[: max(0, len(names) - keep)]
        if gone:
            watch.first_moved(int(names[len(gone)]), at=watch.now())
        for name in gone:
            try:
                os.unlink(os.path.join(directory, name))
                deleted.append(int(name))
            except FileNotFoundError:
                pass


# --- the daemon ----------------------------------------------------------------------------------------

class Daemon:
    def __init__(self, work: Path, config: Path, port: int, log, root: Path, watch: OutputWatch):
        self.work, self.config, self.port, self.log, self.root, self.watch = work, config, port, log, root, watch
        self.proc: subprocess.Popen | None = None
        self.lives = 0

    def start(self) -> None:
        self.lives += 1
        self.watch.life_started()
        cfg = yaml.safe_load(self.config.read_text())
        cfg["dispatchers"][-1]["options"]["path"] = str(self.work / f"latency-{self.lives}.json")
        self.config.write_text(yaml.safe_dump(cfg))
        env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
        env["PYTHONPATH"] = str(self.root)
        env["PYTHONFAULTHANDLER"] = "1"
        self.proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "run", "--config", str(self.config)],
                                     env=env, cwd=self.root, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                health(self.port)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit(f"reputd did not start; see {self.work / 'reputd.log'}") from None
                time.sleep(0.05)

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=8)  # before the daemon's own shutdown timeout (10 s) gives up
        except subprocess.TimeoutExpired:  # stuck: every thread's stack into the log (PYTHONFAULTHANDLER)
            self.proc.send_signal(signal.SIGABRT)
            code = self.proc.wait(timeout=120)
        self.proc = None
        self.watch.life_stopped()
        return code


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return json.loads(r.read())


def scrape(port: int, names: tuple[str, ...]) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out


def proc_figures(pid: int) -> dict:
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for _ in f)
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "maps": maps}


def tree_bytes(path: Path) -> tuple[int, int, int]:
    """(allocated bytes, ConsumeQueue files, IndexFiles) under an output directory."""
    total = cq = index = 0
    for d, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(d, name)).st_blocks * 512
            except FileNotFoundError:
                continue
            if f"{os.sep}consumequeue{os.sep}" in d + os.sep:
                cq += 1
            elif d.endswith(f"{os.sep}index"):
                index += 1
    return total, cq, index


LAG_GAUGES = ("rocketmq_storage_dispatch_behind_bytes", "reputd_dispatch_behind_seconds")


def true_lag(commitlog: str, segment_size: int, reput: int, end: int) -> tuple[int, float | None]:
    """What the gauges should say: bytes from the oldest undispatched retained record to the written end, and
    that record's age (decoded here with the library's reader)."""
    log = CommitLog(commitlog, segment_size, follow=True)
    start = max(reput, log.min_offset)
    age = None
    if start < end:
        try:
            rec = log.read_record(start, check_crc=False)
            age = time.time() - rec.store_timestamp / 1000
        except Exception:  # a BLANK or a segment deleted this instant: age unknown
            age = None
    return max(0, end - start), age


def slope(samples: list[dict], key: str) -> float | None:
    """Least-squares trend of samples[key] in units per hour."""
    if len(samples) < 3:
        return None
    ts, ys = [s["t"] for s in samples], [s[key] for s in samples]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var * 3600 if var else None


# --- the run -------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("REPUTD_LIFE_SECONDS", "240")))
    ap.add_argument("--rate", type=float, default=5000, help="records/s (default 5,000)")
    ap.add_argument("--segment-size", type=int, default=1 * MIB)
    ap.add_argument("--keep-segments", type=int, default=16)
    ap.add_argument("--topics", default="20,400", help="topics at the start and at the end")
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--cq-units", type=int, default=300, help="units per ConsumeQueue file (default 300)")
    ap.add_argument("--index-num", type=int, default=20_000, help="maxIndexNum (default 20,000)")
    ap.add_argument("--hash-slots", type=int, default=5_000, help="maxHashSlotNum (default 5,000)")
    ap.add_argument("--clean-interval", type=int, default=2000, help="cleanResourceInterval ms (default 2,000)")
    ap.add_argument("--delete-interval", type=int, default=1,
                    help="deleteConsumeQueueFilesInterval ms (the broker's pause after each queue; default 1)")
    ap.add_argument("--watch-interval", type=float, default=5.0, help="seconds between listings of the output")
    ap.add_argument("--sample-every", type=float, default=30.0,
                    help="seconds between weighings of the output against the live window")
    ap.add_argument("--reputd-root", type=Path, default=ROOT,
                    help="the checkout whose daemon runs (another worktree: a before/after pair)")
    ap.add_argument("--dir")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "life.json"))
    args = ap.parse_args()
    cq_file_size = args.cq_units * 20
    first_topics, last_topics = (int(x) for x in args.topics.split(","))
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="reputd-life-"))
    work.mkdir(parents=True, exist_ok=True)
    commitlog = work / "store" / "commitlog"
    commitlog.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    port = free_port()
    config = work / "reputd.yaml"
    config.write_text(yaml.safe_dump({
        "store": {"storePathRootDir": str(work / "store"), "mappedFileSizeCommitLog": args.segment_size,
                  "mappedFileSizeConsumeQueue": cq_file_size, "maxHashSlotNum": args.hash_slots,
                  "maxIndexNum": args.index_num, "cleanResourceInterval": args.clean_interval,
                  "deleteConsumeQueueFilesInterval": args.delete_interval},
        "output": {"dir": str(out)}, "metrics": {"port": port}, "logging": {"level": "info", "format": "json"},
        "dispatchers": ["consumequeue", "index",
                        {"name": "bench.latency:LatencyDispatcher", "options": {"path": ""}}]}))
    # how long retention takes to delete what is retained now: a pause longer than this crosses a gap
    probe = RecordWriter(str(work / "probe"), args.segment_size)
    record = probe.append(Message("LifeTopic0", 0, b"x" * 130, {"TAGS": "Tag0", "KEYS": "order-0 k0",
                                                                "UNIQ_KEY": "0" * 32})).msg_size
    probe.close()
    shutil.rmtree(work / "probe")
    gap_pause = args.keep_segments * args.segment_size / (record * args.rate) * 1.5 + 2
    print(f"life: {args.seconds:.0f} s, {args.rate:,.0f} records/s record by record ({record}-byte records), "
          f"{args.segment_size // 1024} KiB segments, retention keeps {args.keep_segments} "
          f"(~{args.keep_segments * args.segment_size / (record * args.rate):.0f} s of data), topics "
          f"{first_topics} -> {last_topics} x {QUEUES} queues; restarts: SIGTERM, kill -9 + {gap_pause:.0f} s, "
          f"SIGTERM + {gap_pause:.0f} s; dir {work}", flush=True)

    ctx = multiprocessing.get_context("fork")
    end, count, stop_writer = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Event()
    watch = OutputWatch(out, cq_file_size, work / "file-ends.txt", args.watch_interval, args.sample_every)
    writer = ctx.Process(target=write, args=(str(commitlog), args.segment_size, args.rate, args.seconds,
                                             (first_topics, last_topics), end, count, stop_writer,
                                             str(work / "file-ends.txt"), args.cq_units), daemon=True)
    stop_retention, deleted_segments = threading.Event(), []
    retention = threading.Thread(target=retain, args=(str(commitlog), args.keep_segments, stop_retention,
                                                      deleted_segments, watch), daemon=True)
    log = open(work / "reputd.log", "a")  # noqa: SIM115 - every life of the daemon writes here
    daemon = Daemon(work, config, port, log, args.reputd_root, watch)
    samples: list[dict] = []
    lag_samples: list[dict] = []
    exits: list[tuple[str, int]] = []
    t0 = time.monotonic()

    def sample(note: str = "") -> dict:
        now = time.monotonic() - t0
        cl = sum(os.stat(commitlog / n).st_blocks * 512 for n in os.listdir(commitlog) if n.isdigit()
                 and (commitlog / n).exists())
        o, cq, index = tree_bytes(out)
        s = {"t": round(now, 1), "written": count.value, "commitlog_bytes": cl, "output_bytes": o,
             "cq_files": cq, "index_files": index, "note": note}
        if daemon.proc is not None:
            try:
                s.update(proc_figures(daemon.proc.pid))
                h = health(port)
                s["behind_bytes"] = max(0, end.value - h["reputFromOffset"])
                s["status"] = h["status"]
            except (OSError, ValueError):
                pass
        samples.append(s)
        print(f"{s['t']:>6.0f} {s['written']:>10,} {cl / MIB:>9.1f} {o / MIB:>9.1f} {cq:>7,} {index:>6,} "
              f"{s.get('rss', 0) / MIB:>7.1f} {s.get('fds', '-'):>5} {s.get('maps', '-'):>5} "
              f"{s.get('behind_bytes', 0) / MIB:>9.2f}  {s.get('status', 'stopped')} {note}", flush=True)
        return s

    def sample_lag(life: int) -> None:
        """The gauges at three scrapes right after a start behind the writer, beside the truth."""
        for _ in range(3):
            h = health(port)
            g = scrape(port, LAG_GAUGES)
            truth_bytes, truth_age = true_lag(str(commitlog), args.segment_size, h["reputFromOffset"], end.value)
            lag_samples.append({"life": life, "t": round(time.monotonic() - t0, 1),
                                "behind_bytes_gauge": g.get(LAG_GAUGES[0]), "behind_bytes_true": truth_bytes,
                                "behind_seconds_gauge": g.get(LAG_GAUGES[1]),
                                "behind_seconds_true": None if truth_age is None else round(truth_age, 2)})
            time.sleep(0.3)

    def wait_until(t: float) -> None:
        next_sample = samples[-1]["t"] + args.interval if samples else 0
        while time.monotonic() - t0 < t:
            if time.monotonic() - t0 >= next_sample:
                sample()
                next_sample += args.interval
            time.sleep(0.2)

    print(f"{'t s':>6} {'written':>10} {'CL MiB':>9} {'out MiB':>9} {'CQ fls':>7} {'idx':>6} {'RSS MiB':>7} "
          f"{'fds':>5} {'maps':>5} {'behind MiB':>9}  status", flush=True)
    ok = True
    verify_code = None
    try:
        watch.start()
        daemon.start()
        writer.start()
        retention.start()
        d = args.seconds
        wait_until(0.25 * d)
        exits.append(("SIGTERM", daemon.stop(signal.SIGTERM)))
        sample("stopped (SIGTERM), restarting at once")
        daemon.start()
        wait_until(0.45 * d)
        daemon.stop(signal.SIGKILL)
        sample(f"killed (-9), paused {gap_pause:.0f} s")
        wait_until(0.45 * d + gap_pause)
        daemon.start()
        sample_lag(daemon.lives)
        sample("restarted across a retention gap")
        wait_until(max(0.7 * d, 0.45 * d + gap_pause + 10))
        exits.append(("SIGTERM", daemon.stop(signal.SIGTERM)))
        sample(f"stopped (SIGTERM), paused {gap_pause:.0f} s")
        wait_until(max(0.7 * d, 0.45 * d + gap_pause + 10) + gap_pause)
        daemon.start()
        sample_lag(daemon.lives)
        sample("restarted across a retention gap")
        wait_until(d)  # sampling on to the writer's end
        writer.join(timeout=30)
        stop_writer.set()
        writer.join(timeout=30)
        stop_retention.set()
        retention.join()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and health(port)["reputFromOffset"] < end.value:
            time.sleep(0.2)
        time.sleep(3.0)  # one more clean-up pass (cleanResourceInterval 2 s) for the last retention deletions
        sample("writer stopped, caught up")
        exits.append(("SIGTERM", daemon.stop(signal.SIGTERM)))
        watch.life_started()  # the one-off run that follows cleans too
        # as an operator would before looking: one run to the end, which applies the retention rule once more
        # for the final checkpoint (the live clean-up trails the checkpoint, which trails by up to
        # flushConsumeQueueThoroughInterval)
        env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
        once = subprocess.run([sys.executable, "-m", "daemon.cli", "run", "--until-caught-up", "--config", str(config)],
                              check=False, cwd=args.reputd_root, env={**env, "PYTHONPATH": str(args.reputd_root)},
                              stdout=log, stderr=subprocess.STDOUT)
        exits.append(("run --until-caught-up", once.returncode))
        watch.life_stopped()
        watch.stop()
        v = subprocess.run([sys.executable, "-m", "daemon.cli", "verify", "--config", str(config)], check=False,
                           cwd=args.reputd_root,
                           env={**os.environ, "PYTHONPATH": str(args.reputd_root)}, capture_output=True, text=True)
        verify_code = v.returncode
        print(f"verify: exit {verify_code}: {v.stdout.strip().splitlines()[-1] if v.stdout.strip() else v.stderr}")
    finally:
        stop_writer.set()
        stop_retention.set()
        if daemon.proc is not None:
            daemon.proc.kill()
            daemon.proc.wait()
        if writer.is_alive():
            writer.terminate()
        log.close()

    # what the broker's rule would still delete from the final output
    min_offset = CommitLog(str(commitlog), args.segment_size, follow=True).min_offset
    store = ConsumeQueueStore(str(out), cq_file_size, readonly=True)
    store.load()
    cq_kept = sum(len(q.file_starts) for q in store.queues.values())
    cq_expired = sum(expired_queue_files(q, min_offset) for q in store.queues.values())
    service = IndexService(str(out), args.hash_slots, args.index_num)
    service.load(readonly=True)
    index_kept, index_expired = len(service.names), expired_index_files(service, min_offset)
    service.close()

    events = [json.loads(line) for line in (work / "reputd.log").read_text().splitlines() if line.startswith("{")]
    corrupt = sum(1 for e in events if e.get("event") == "corrupt_commitlog")
    deleted_cq = sum(e.get("consumequeue_files", 0) for e in events if e.get("event") == "expired_files_deleted")
    deleted_index = sum(e.get("index_files", 0) for e in events if e.get("event") == "expired_files_deleted")
    deleted_bytes = sum(e.get("deleted_bytes", 0) for e in events if e.get("event") == "expired_files_deleted")
    lives = []
    overall = LatencyHistogram()
    for i in range(1, daemon.lives + 1):
        path = work / f"latency-{i}.json"
        if path.exists():
            h = LatencyHistogram.load(str(path))
            overall.merge(h)
            lives.append({"life": i, **h.summary()})
    following = lives[0] if lives else {}
    running = [s for s in samples if "rss" in s]
    # the output is a saw-tooth (each clean-up pass waits for the checkpoint): its trend is a least-squares slope
    growth, cl_growth = slope(samples, "output_bytes"), slope(samples, "commitlog_bytes")
    elapsed = samples[-1]["t"] if samples else 0
    summary = {
        "seconds": args.seconds, "rate": args.rate, "written": count.value, "commitlog_end": end.value,
        "segments_deleted_by_retention": len(deleted_segments), "daemon_lives": daemon.lives,
        "exit_codes": exits, "verify_exit_code": verify_code, "corrupt_records": corrupt,
        "output_bytes_final": samples[-1]["output_bytes"] if samples else None,
        "commitlog_bytes_final": samples[-1]["commitlog_bytes"] if samples else None,
        "output_bytes_per_hour_trend": None if growth is None else round(growth),
        "commitlog_bytes_per_hour_trend": None if cl_growth is None else round(cl_growth),
        "output_bytes_max": max(s["output_bytes"] for s in samples) if samples else None,
        "output_bytes_mean": round(sum(s["output_bytes"] for s in samples) / len(samples)) if samples else None,
        "deleted": {"consumequeue_files": deleted_cq, "index_files": deleted_index, "bytes": deleted_bytes,
                    "bytes_per_hour": round(deleted_bytes / elapsed * 3600) if elapsed else None},
        "files_kept": {"consumequeue": cq_kept, "index": index_kept, "commit_log_min_offset": min_offset,
                       "expired_by_broker_rule_still_present": {"consumequeue": cq_expired, "index": index_expired}},
        "max_rss_mib": round(max(s["rss"] for s in running) / MIB, 1) if running else None,
        "fds_range": [min(s["fds"] for s in running), max(s["fds"] for s in running)] if running else None,
        "maps_range": [min(s["maps"] for s in running), max(s["maps"] for s in running)] if running else None,
        "latency_first_life": following, "latency_per_life": lives, "latency_all": overall.summary(),
        "lag_while_behind": lag_samples, "samples": samples,
    }
    kept_ratio = [(s["t"], round(s["output_bytes"] / s["commitlog_bytes"], 2)) for s in samples if s["commitlog_bytes"]]
    summary["output_to_commitlog"] = kept_ratio
    watch.recovered_at([datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                        for e in events if e.get("event") == "recovered" and "timestamp" in e])
    summary["retention"] = retention = watch.summary()
    retention["passes"] = pass_rates(events)
    missed = verdict(retention)
    ok = (verify_code == 0 and corrupt == 0 and all(code == 0 for _, code in exits) and cq_expired == 0
          and index_expired == 0 and not missed)
    summary["ok"] = ok
    summary["targets_missed"] = missed
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=1))

    print(f"\nwritten {count.value:,} records record by record; retention deleted {len(deleted_segments)} segments; "
          f"{daemon.lives} daemon lives, exits {exits}; verify exit {verify_code}; corrupt records met: {corrupt}")
    print(f"output {summary['output_bytes_final'] / MIB:.1f} MiB beside a CommitLog of "
          f"{summary['commitlog_bytes_final'] / MIB:.1f} MiB at the end (output mean "
          f"{summary['output_bytes_mean'] / MIB:.1f}, max {summary['output_bytes_max'] / MIB:.1f} MiB); trend "
          f"{'n/a' if growth is None else f'{growth / MIB:+,.1f} MiB/hour'} (CommitLog "
          f"{'n/a' if cl_growth is None else f'{cl_growth / MIB:+,.1f} MiB/hour'}, topics growing); "
          f"retention deleted {deleted_cq:,} "
          f"ConsumeQueue files and {deleted_index:,} IndexFiles ({deleted_bytes / MIB:,.1f} MiB, "
          f"{summary['deleted']['bytes_per_hour'] / MIB:,.0f} MiB/hour)")
    print(f"files kept: {cq_kept:,} ConsumeQueue files, {index_kept} IndexFiles; the broker's rule for CommitLog "
          f"min offset {min_offset} would still delete {cq_expired} and {index_expired}")
    print(f"daemon: max RSS {summary['max_rss_mib']} MiB, fds {summary['fds_range']}, mappings {summary['maps_range']}")
    print(f"dispatch latency (store time to ConsumeQueue unit): first life p50 {following.get('p50_ms')} ms "
          f"p99 {following.get('p99_ms')} ms max {following.get('max_ms')} ms; every life (catch-ups included) "
          f"p50 {overall.summary()['p50_ms']} p99 {overall.summary()['p99_ms']}")
    for s in lag_samples:
        print(f"lag after restart {s['life']} at {s['t']} s: behind_bytes gauge {s['behind_bytes_gauge']} "
              f"(true {s['behind_bytes_true']}), behind_seconds gauge {s['behind_seconds_gauge']} "
              f"(true {s['behind_seconds_true']})")
    print("output / CommitLog: " + ", ".join(f"{t:.0f}s {r}x" for t, r in kept_ratio[:: max(1, len(kept_ratio) // 20)]))
    for line in lines(retention):
        print(line)
    for line in missed:
        print(f"target missed: {line}")
    print(f"verdict: {'ok' if ok else 'FAILED'}; figures in {args.json}")
    if report is not None:
        report("life", seconds=args.seconds, written=count.value, verify_exit=verify_code, corrupt=corrupt,
               output_mib_per_hour_trend=None if growth is None else round(growth / MIB, 1),
               cq_kept=cq_kept, index_kept=index_kept, expired_still_present=cq_expired + index_expired,
               max_rss_mib=summary["max_rss_mib"], p50_ms=following.get("p50_ms"), p99_ms=following.get("p99_ms"),
               ok=ok)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
