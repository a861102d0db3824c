"""Time `reputd backfill` with local[1] and local[2] against `reputd rebuild` on the same CommitLog.

    .venv/bin/python bench/bench_backfill.py [--messages 2000000] [--workdir bench/results/backfill]

Generates the CommitLog once with `reputd produce` (kept in the work directory and reused when it already
holds that many messages), then runs each command as an operator would, into its own empty output
directory, and checks that every backfilled file equals the rebuilt one. Wall seconds include process and
JVM start-up; the commands' own summaries give msgs/s over their run.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
REPUTD = [sys.executable, "-m", "daemon.cli"]
STORE = {"mappedFileSizeCommitLog": 64 * 1024 * 1024, "mappedFileSizeConsumeQueue": 6_000_000,
         "maxHashSlotNum": 500_000, "maxIndexNum": 2_000_000}


def reputd(*args: str) -> tuple[float, dict | str]:
    t0 = time.perf_counter()
    res = subprocess.run([*REPUTD, *args], capture_output=True, text=True, cwd=REPO, check=False)
    seconds = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"reputd {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    try:
        return seconds, json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return seconds, res.stdout.strip()


def same_tree(a: Path, b: Path) -> bool:
    names_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    names_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    return names_a == names_b and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names_a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2_000_000)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "results" / "backfill")
    parser.add_argument("--masters", default="local[1],local[2]")
    args = parser.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = work / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(work / "store"), **STORE},
                                      "output": {"dir": str(work / "out")}, "logging": {"level": "warning"}}))
    marker = work / "store" / "produced.json"
    if not marker.exists() or json.loads(marker.read_text()).get("messages") != args.messages:
        shutil.rmtree(work / "store", ignore_errors=True)
        seconds, out = reputd("produce", "--config", str(config), "--messages", str(args.messages), "--keys", "1")
        print(f"produced in {seconds:.1f} s: {out}")
        marker.write_text(json.dumps({"messages": args.messages}))
    segments = len(os.listdir(work / "store" / "commitlog"))
    size = sum(p.stat().st_size for p in (work / "store" / "commitlog").iterdir())
    print(f"CommitLog: {args.messages:,} messages, {segments} segments of 64 MiB ({size / 2**20:,.0f} MiB), "
          f"{os.cpu_count()} cores")

    rows = []
    runs = [("rebuild", ["rebuild", "--json"])]
    runs += [(f"backfill {m}", ["backfill", "--master", m, "--json", "--conf", "spark.ui.enabled=false"])
             for m in args.masters.split(",")]
    reference = None
    for name, cmd in runs:
        out = work / ("out-" + name.replace(" ", "-").replace("[", "").replace("]", ""))
        shutil.rmtree(out, ignore_errors=True)
        seconds, summary = reputd(*cmd, "--config", str(config), "--out", str(out))
        if reference is None:
            reference = out
            identical = "(reference)"
        else:
            identical = "yes" if same_tree(reference, out) else "NO"
        rows.append((name, seconds, summary["seconds"], summary["messages"], summary["msgsPerSecond"], identical,
                     summary.get("phaseSeconds", {})))
        print(f"{name}: {seconds:.1f} s wall", flush=True)

    print()
    print("| command | wall s | own s | messages | msgs/s (own) | identical to rebuild | phases (s) |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name, wall, own, messages, rate, identical, phases in rows:
        phase_text = ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
        print(f"| {name} | {wall:.1f} | {own:.1f} | {messages:,} | {rate:,} | {identical} | {phase_text} |")


if __name__ == "__main__":
    main()
