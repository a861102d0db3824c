"""`make bench`'s retention scenario (issue 46): bench/life.py with the issue's shapes, 10,000 queues.

4 MiB CommitLog segments (retention keeps the newest 11, ~30 s of data), 300-unit ConsumeQueue files,
200,000-entry IndexFiles (5,000 slots: 4,020,040 bytes), a writer appending record by record at 6,000
msgs/s over topics growing from 100 to 2,500 (x 4 queues), the broker's own retention settings
(cleanResourceInterval 10 s, deleteConsumeQueueFilesInterval 100 ms); reputd stopped with SIGTERM, killed
with `kill -9` and stopped across retention gaps. Targets: every expired IndexFile deleted within 60 s of
expiring (or of the start of the daemon life that deleted it), the output at most twice what the live
window needs in every 30-s sample, nothing deleted before the broker's rule expires it, verify clean.

    .venv/bin/python bench/retention_life.py [--seconds 900] [--reputd-root DIR] [--json FILE]

`--reputd-root` runs another checkout's daemon with this harness (the same writer and measures): a
before/after pair is one run with main's worktree and one with this one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ["--segment-size", str(4 * 1024 * 1024), "--keep-segments", "11", "--rate", "6000",
            "--topics", "100,2500", "--cq-units", "300", "--index-num", "200000", "--hash-slots", "5000",
            "--clean-interval", "10000", "--delete-interval", "100", "--interval", "30", "--watch-interval", "5",
            "--sample-every", "30"]
SECONDS, QUICK_SECONDS = 900, 120


def run(seconds: float, json_path: Path, reputd_root: Path = ROOT, work: Path | None = None,
        topics: str | None = None) -> dict:
    """One accelerated life; its figures (bench/life.py's JSON) with its exit code."""
    args = [sys.executable, str(ROOT / "bench" / "life.py"), *SCENARIO, "--seconds", str(seconds),
            "--json", str(json_path), "--reputd-root", str(reputd_root)]
    if topics:
        args[args.index("--topics") + 1] = topics
    if work is not None:
        args += ["--dir", str(work)]
    done = subprocess.run(args, check=False)
    figures = json.loads(json_path.read_text()) if json_path.exists() else {}
    return {**figures, "exit_code": done.returncode}


def bench_retention_life(work: Path, quick: bool) -> dict:
    """bench_suite's scenario: one life, its retention figures."""
    figures = run(QUICK_SECONDS if quick else SECONDS, work / "retention-life.json",
                  topics="100,500" if quick else None)
    retention = figures.get("retention", {})
    return {"scenario": "retention-life", "seconds": figures.get("seconds"), "ok": figures.get("ok"),
            "targets_missed": figures.get("targets_missed"), "index": retention.get("index"),
            "consumequeue": retention.get("consumequeue"), "ratio_to_needed_max": retention.get("ratio_to_needed_max"),
            "passes": retention.get("passes"), "output_to_commitlog": figures.get("output_to_commitlog"),
            "verify_exit_code": figures.get("verify_exit_code")}


def print_line(r: dict) -> None:
    index, cq, passes = r.get("index") or {}, r.get("consumequeue") or {}, r.get("passes") or {}
    ratios = [x for _, x in r.get("output_to_commitlog") or []]
    print(f"\nretention-life ({r.get('seconds')} s, 10,000 queues, restarts across retention gaps): IndexFile deletion "
          f"delay p99 {index.get('delay_s_p99')} s max {index.get('delay_s_max')} s; ConsumeQueue p99 "
          f"{cq.get('delay_s_p99')} s max {cq.get('delay_s_max')} s; output at most {r.get('ratio_to_needed_max')}x "
          f"what the live window needs; output/CommitLog max {max(ratios, default=None)}x; ConsumeQueue deletions "
          f"{passes.get('files_per_s_p50')}/s (p50 of passes of 100+); deleted too early "
          f"{index.get('deleted_before_expiry')} + {cq.get('deleted_before_expiry')}; verify exit "
          f"{r.get('verify_exit_code')}; {'targets met' if r.get('ok') else 'FAILED: ' + str(r.get('targets_missed'))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=SECONDS)
    ap.add_argument("--reputd-root", type=Path, default=ROOT)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "retention-life.json")
    args = ap.parse_args()
    figures = run(args.seconds, args.json, args.reputd_root, args.dir)
    return figures["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
