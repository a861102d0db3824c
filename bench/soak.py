"""Soak: `reputd run` follows a CommitLog written at a fixed rate for a long time; does it grow?

The paced writer (bench/paced_writer.py) appends at `--rate` msgs/s for `--seconds` while `reputd run`
follows. Every `--interval` seconds the daemon's memory and descriptors are sampled from /proc/PID/status
(VmRSS, RssAnon, RssFile) and /proc/PID/fd, with its CPU, lag and checkpoint from /proc/PID/stat and
/healthz. CommitLog segments the daemon has checkpointed past are deleted, as a broker's retention
would, keeping the newest `--keep-segments`, so the run fits on disk.

Verdict, "no growth after warm-up": over the samples taken while writing, after `--warmup` seconds,
the maximum over the second half of the run is compared with the maximum over the first half (which
starts with the first sample after warm-up). It passes when
  * RssAnon (the heap: what a leak grows) grew by at most max(10%, 16 MiB),
  * open descriptors grew by at most 2 (a flush or an HTTP request holds one for an instant),
  * memory mappings (/proc/PID/maps lines) grew by at most 8 (a file rolling is mapped next to the old
    one for a moment), and
  * RssFile never exceeded what the files the daemon may map at once can hold: one CommitLog segment,
    two IndexFiles and two ConsumeQueue files per queue, plus 64 MiB for the interpreter and libraries.
VmRSS is reported but not judged by growth: its file-backed part is a saw-tooth that fills as the
mapped segment, IndexFile and ConsumeQueue files are written and drops when they roll, so over a short
run its maxima can rise legitimately until every file kind has rolled once. The daemon must also keep
up: at the end it catches up within 60 s and exits 0 on SIGTERM.

    python bench/soak.py [--seconds 600] [--rate 50000] [--interval 10] [--warmup 60] [--json FILE]

Prints a table and the verdict, writes the figures as JSON, and hands them to tests/stress.py's
report() (so `REPUTD_STRESS_REPORT` collects them).
"""

from __future__ import annotations

import argparse
import json
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
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.paced_writer import PacedWriter  # noqa: E402

try:
    from tests.stress import report
except ImportError:  # an installed copy without the tests: the JSON file still has every figure
    report = None

CLK_TCK = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024
ANON_TOLERANCE = (0.10, 16 * MIB)
FD_TOLERANCE = 2
MAPS_TOLERANCE = 8
LIBRARIES_RSS = 64 * MIB
CQ_FILE_SIZE = 6_000_000
HASH_SLOTS, INDEX_NUM = 500_000, 2_000_000
INDEX_FILE_SIZE = 40 + 4 * HASH_SLOTS + 20 * INDEX_NUM
TOPICS = 2  # the paced writer's default topics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem, VmHWM in bytes; Threads."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out[key] = int(value)
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return json.loads(r.read())


def delete_dispatched_segments(commitlog: str, segment_size: int, below: int, keep: int) -> int:
    """Retention: remove segments that end at or before `below`, keeping the newest `keep`."""
    names = sorted(n for n in os.listdir(commitlog) if n.isdigit())
    removed = 0
    for name in names[: max(0, len(names) - keep)]:
        if int(name) + segment_size <= below:
            os.unlink(os.path.join(commitlog, name))
            removed += 1
    return removed


class Sampler(threading.Thread):
    def __init__(self, pid: int, port: int, writer: PacedWriter, interval: float, commitlog: str,
                 segment_size: int, keep: int):
        super().__init__(name="soak-sampler", daemon=True)
        self.pid, self.port, self.writer, self.interval = pid, port, writer, interval
        self.commitlog, self.segment_size, self.keep = commitlog, segment_size, keep
        self.samples: list[dict] = []
        self.deleted = 0
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self._cpu = (cpu_seconds(pid), self.t0)

    def sample(self) -> dict:
        now = time.monotonic()
        fds = open_fds(self.pid)  # before the /healthz request, which the daemon serves on a socket of its own
        status = proc_status(self.pid)
        cpu = cpu_seconds(self.pid)
        cpu_fraction = (cpu - self._cpu[0]) / max(now - self._cpu[1], 1e-9)
        self._cpu = (cpu, now)
        h = health(self.port)
        end = self.writer.max_offset
        self.deleted += delete_dispatched_segments(self.commitlog, self.segment_size, h["checkpointOffset"],
                                                   self.keep)
        s = {"t": round(now - self.t0, 1), "written": self.writer.count, "fds": fds, "maps": mappings(self.pid),
             **status,
             "cpu": round(cpu_fraction, 3), "lag_bytes": max(0, end - h["reputFromOffset"]),
             "checkpoint_lag_bytes": max(0, end - h["checkpointOffset"]), "status": h["status"]}
        self.samples.append(s)
        return s

    def run(self) -> None:
        next_at = self.t0 + self.interval
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.interval
            try:
                s = self.sample()
            except OSError as e:  # the daemon died: the main thread reports it
                print(f"sample failed: {e}", file=sys.stderr, flush=True)
                return
            print(row(s), flush=True)


HEADER = (f"{'t s':>6} {'written':>11} {'VmRSS MiB':>9} {'RssAnon':>8} {'RssFile':>8} {'fds':>4} {'maps':>5} "
          f"{'thr':>4} {'cpu %':>6} {'lag KiB':>9} {'status':>8}")


def row(s: dict) -> str:
    return (f"{s['t']:>6.0f} {s['written']:>11,} {s['VmRSS'] / MIB:>9.1f} {s['RssAnon'] / MIB:>8.1f} "
            f"{s['RssFile'] / MIB:>8.1f} {s['fds']:>4} {s['maps']:>5} {s['Threads']:>4} {s['cpu'] * 100:>6.1f} "
            f"{s['lag_bytes'] / 1024:>9.0f} {s['status']:>8}")


def verdict(samples: list[dict], warmup: float, seconds: float, rss_file_bound: int) -> dict:
    """Max over the second half vs max over the first half after warm-up (see the module docstring)."""
    post = [s for s in samples if warmup <= s["t"] <= seconds + 1]
    middle = (warmup + seconds) / 2
    first = [s for s in post if s["t"] < middle]
    second = [s for s in post if s["t"] >= middle]
    if not first or not second:
        return {"ok": False, "verdict": f"too few samples after warm-up ({len(post)}): run longer"}
    checks = {}
    for key, (frac, floor) in (("RssAnon", ANON_TOLERANCE), ("fds", (0.0, FD_TOLERANCE)),
                               ("maps", (0.0, MAPS_TOLERANCE)), ("VmRSS", (0.0, 0))):
        ref = max(s[key] for s in first)
        late = max(s[key] for s in second)
        allowed = max(ref * frac, floor)
        checks[key] = {"first_half_max": ref, "second_half_max": late, "growth": late - ref, "allowed": allowed,
                       "ok": late - ref <= allowed}
    checks["VmRSS"].update(allowed=None, ok=True)  # reported only, see the module docstring
    worst = max(s["RssFile"] for s in post)
    checks["RssFile"] = {"max": worst, "bound": rss_file_bound, "ok": worst <= rss_file_bound}
    # informative: least-squares slope of RssAnon after warm-up
    ts = [s["t"] for s in post]
    ys = [s["RssAnon"] for s in post]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0
    ok = all(c["ok"] for c in checks.values())
    grew = [k for k, c in checks.items() if not c["ok"]]
    return {"ok": ok, "verdict": "no growth after warm-up" if ok else "GROWTH after warm-up: " + ", ".join(grew),
            "checks": checks, "rss_anon_slope_mib_per_min": round(slope * 60 / MIB, 3),
            "samples_first_half": len(first), "samples_second_half": len(second)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="how long to write (default 600)")
    ap.add_argument("--rate", type=float, default=50_000, help="messages per second (default 50,000)")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples (default 10)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds of warm-up (default: 10%% of --seconds, "
                                                                "at least 2 intervals)")
    ap.add_argument("--body-size", type=int, default=256)
    ap.add_argument("--queues", type=int, default=8, help="queues per topic (two topics)")
    ap.add_argument("--segment-size", type=int, default=128 * MIB)
    ap.add_argument("--keep-segments", type=int, default=4, help="CommitLog segments kept by retention")
    ap.add_argument("--dir", help="working directory (default: a new temporary one, removed afterwards)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "soak.json"), help="figures as JSON")
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else max(2 * args.interval, 0.1 * args.seconds)

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="reputd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    commitlog = work / "store" / "commitlog"
    cfg = {"store": {"storePathRootDir": str(work / "store"), "mappedFileSizeCommitLog": args.segment_size,
                     "mappedFileSizeConsumeQueue": CQ_FILE_SIZE, "maxHashSlotNum": HASH_SLOTS,
                     "maxIndexNum": INDEX_NUM},
           "output": {"dir": str(work / "out")}, "metrics": {"port": port},
           "logging": {"level": "warning", "format": "json"}}
    (work / "reputd.yaml").write_text(yaml.safe_dump(cfg))
    writer = PacedWriter(str(commitlog), args.segment_size, queues=args.queues, body_size=args.body_size)
    log = open(work / "reputd.log", "w")  # noqa: SIM115 - open for the daemon's whole life
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "run", "--config", str(work / "reputd.yaml")],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    code = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if health(port)["status"] == "healthy":
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"reputd did not start; see {work / 'reputd.log'}")
            time.sleep(0.1)
        print(f"soak: {args.rate:,.0f} msgs/s for {args.seconds:.0f} s, {writer.record_size}-byte records, "
              f"warm-up {warmup:.0f} s, sample every {args.interval:.0f} s; daemon pid {proc.pid}, dir {work}",
              flush=True)
        print(HEADER, flush=True)
        sampler = Sampler(proc.pid, port, writer, args.interval, str(commitlog), args.segment_size,
                          args.keep_segments)
        sampler.start()
        written = writer.run(args.rate, args.seconds)
        writer.flush()
        caught_up_in = None
        t_end = time.monotonic()
        while time.monotonic() - t_end < 60 and proc.poll() is None:
            if health(port)["checkpointOffset"] >= writer.max_offset:
                caught_up_in = round(time.monotonic() - t_end, 2)
                break
            time.sleep(0.05)
        sampler.stop.set()
        sampler.join()
        final = sampler.sample()
        print(row(final), "(final, caught up)" if caught_up_in is not None else "(final, NOT caught up)")
        alive = proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        writer.close()
        log.close()

    samples = sampler.samples[:-1]  # the final sample is after the writer stopped
    bound = (args.segment_size + 2 * INDEX_FILE_SIZE + 2 * TOPICS * args.queues * CQ_FILE_SIZE + LIBRARIES_RSS)
    result = verdict(samples, warmup, args.seconds, bound)
    ok = result["ok"] and alive and code == 0 and caught_up_in is not None
    summary = {
        "rate": args.rate, "seconds": args.seconds, "warmup": warmup, "interval": args.interval,
        "writer": written, "daemon_exit_code": code, "caught_up_after_s": caught_up_in,
        "segments_deleted_by_retention": sampler.deleted, "max_VmRSS": max(s["VmRSS"] for s in sampler.samples),
        "VmHWM": final.get("VmHWM"), "max_fds": max(s["fds"] for s in sampler.samples),
        "mean_daemon_cpu_while_writing": round(sum(s["cpu"] for s in samples) / max(1, len(samples)), 3),
        "max_lag_bytes": max(s["lag_bytes"] for s in samples) if samples else None,
        **result, "ok": ok, "samples": sampler.samples,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"\nwriter: {written['messages']:,} messages in {written['seconds']:.0f} s = {written['msgs_per_s']:,} "
          f"msgs/s at {written['cpu_fraction'] * 100:.1f}% of a core; daemon CPU while writing "
          f"{summary['mean_daemon_cpu_while_writing'] * 100:.0f}% of a core; caught up {caught_up_in} s after the "
          f"writer stopped; exit {code}; {sampler.deleted} segments deleted by retention")
    for key, c in result.get("checks", {}).items():
        unit, scale = ("MiB", MIB) if key not in ("fds", "maps") else ("", 1)
        if key == "RssFile":
            print(f"  {key:8} max {c['max'] / MIB:.1f}MiB, bound {c['bound'] / MIB:.1f}MiB  "
                  f"{'ok' if c['ok'] else 'OVER'}")
            continue
        allowed = "reported only" if c["allowed"] is None else f"allowed {c['allowed'] / scale:.1f}{unit}"
        print(f"  {key:8} first-half max {c['first_half_max'] / scale:8.1f}{unit}  second-half max "
              f"{c['second_half_max'] / scale:8.1f}{unit}  growth {c['growth'] / scale:+7.1f}{unit} "
              f"({allowed})  {'ok' if c['ok'] else 'GREW'}")
    if "rss_anon_slope_mib_per_min" in result:
        print(f"  RssAnon trend after warm-up: {result['rss_anon_slope_mib_per_min']:+.2f} MiB/min")
    print(f"verdict: {result['verdict']}{'' if ok else ' (run FAILED)'}; figures in {args.json}")
    if report is not None:
        report("soak", rate=args.rate, seconds=args.seconds, achieved=written["msgs_per_s"],
               verdict=result["verdict"], ok=ok, max_rss_mib=round(summary["max_VmRSS"] / MIB, 1),
               rss_anon_growth_mib=round(result.get("checks", {}).get("RssAnon", {}).get("growth", 0) / MIB, 1),
               max_fds=summary["max_fds"], daemon_cpu=summary["mean_daemon_cpu_while_writing"],
               caught_up_after_s=caught_up_in)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
