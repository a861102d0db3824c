"""Live benchmark: a writer appends at a fixed rate while `reputd run` follows the CommitLog.

Prints append-to-dispatch latency (p50/p99/max, from each record's store timestamp to the moment its
batch reaches a latency-recording dispatcher placed after the built-ins), the daemon's CPU while
following, and its idle CPU once the writer stops.

    python bench/bench_live.py [--rate 20000] [--seconds 10] [--idle-seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from indexcore.writer import CommitLogWriter, Message  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
SEGMENT = 128 * 1024 * 1024


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, default=20000, help="messages per second")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--body-size", type=int, default=256)
    ap.add_argument("--port", type=int, default=19108)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="reputd-live-") as tmp_name:
        tmp = Path(tmp_name)
        latency_file = tmp / "latency.json"
        cfg = {"store": {"storePathRootDir": str(tmp / "store"), "mappedFileSizeCommitLog": SEGMENT},
               "output": {"dir": str(tmp / "out")}, "metrics": {"port": args.port},
               "logging": {"level": "warning", "format": "json"},
               "dispatchers": ["consumequeue", "index",
                               {"name": "bench.latency:LatencyDispatcher", "options": {"path": str(latency_file)}}]}
        (tmp / "reputd.yaml").write_text(yaml.safe_dump(cfg))
        writer = CommitLogWriter(str(tmp / "store" / "commitlog"), SEGMENT)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "run", "--config", str(tmp / "reputd.yaml")],
                                env=env, cwd=ROOT)
        deadline = time.monotonic() + 30
        while True:
            try:
                health(args.port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        body = b"x" * args.body_size
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        sent = 0
        while (elapsed := time.monotonic() - t0) < args.seconds:
            due = int(elapsed * args.rate)
            while sent < due:
                writer.append(Message("BenchTopic", sent % 8, body, {"KEYS": f"k{sent}", "UNIQ_KEY": f"{sent:032X}"}))
                sent += 1
            time.sleep(0.0005)
        achieved = sent / (time.monotonic() - t0)
        while health(args.port)["reputFromOffset"] < writer.max_offset:
            time.sleep(0.01)
        busy_cpu = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
        time.sleep(1.0)
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(args.idle_seconds)
        idle_cpu = (cpu_seconds(proc.pid) - cpu1) / (time.monotonic() - t1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        writer.close()
        lat = np.array(json.loads(latency_file.read_text())["latency_ms"])
        print(f"rate requested {args.rate:,} msgs/s, achieved {achieved:,.0f} msgs/s for {args.seconds:.0f} s "
              f"({sent:,} messages, {lat.size:,} dispatched)")
        print(f"append-to-dispatch latency ms: p50 {np.percentile(lat, 50):.1f}  p99 {np.percentile(lat, 99):.1f}  "
              f"max {lat.max():.1f}  (store timestamps have 1 ms resolution)")
        print(f"daemon CPU while following: {busy_cpu * 100:.1f}% of a core; idle: {idle_cpu * 100:.2f}% of a core "
              f"over {args.idle_seconds:.0f} s")
        print(f"daemon exit code on SIGTERM: {code}")
        return 0 if code == 0 and lat.size == sent else 1


if __name__ == "__main__":
    sys.exit(main())
