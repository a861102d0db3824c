"""`query offset` and `query time` on issue 29's 16M-message store (issue 45's targets), process start to exit.

    .venv/bin/python bench/timequery.py [--workdir bench/results/suite] [--runs 30] [--quick] [--store DIR]

The store is bench_suite's `256b-1key-16m` (16,000,000 messages, 8 topics x 8 queues: 250,000 units a
queue), rebuilt once into WORK/out/timequery-16m. Timed, as an operator runs them (the installed `reputd`,
piped so every answer is JSON), each run a new process from start to exit, in interleaved rounds:

    offset     `reputd query offset BenchTopic0 Q T`, Q and T drawn at random (T within the topic's times)
    time       `reputd query time BenchTopic0 --begin T --end T+999`: a 1-second window of the topic's 8
               queues, the default --count (32 messages and the command that continues), a new window each
               run: those of its ~540 record heads not in the page cache are read from the disk
    time-warm  the window the `time` run before it asked for, again: the same reads from the page cache
    time-all   a new window with --count 1000000: every message stored in it printed
    key        `reputd query key BenchTopic0 KEY`: the query kind with a start-up target of its own (p50 80 ms,
               the `query` scenario), beside them as the yardstick of what any query pays to start

Each figure: median, p90 and max wall milliseconds, and the median CPU milliseconds (user + system of the
process, wait4). Targets: offset <= 100 ms, time <= 200 ms (medians; `time` held
to it both ways). Then the CommitLog reads: those of each
queue's searches for one window (library call), and those of one search over the first N units of a queue
for N = 1,000 ... 250,000, beside log2(N): a binary search reads about log2(N) + 1 record heads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_suite import PRODUCED, REPUTD, REPUTD_SCRIPT, ensure_data_set, run_measured, write_config  # noqa: E402

DATA_SET = "256b-1key-16m"
TOPIC = "BenchTopic0"
TARGET_MS = {"offset": 100, "time": 200, "time-warm": 200}
DEFAULT_RUNS = 30
PREFIXES = (1_000, 4_000, 16_000, 64_000, 250_000)


def ensure_output(work: Path, scale: float, store: Path | None = None) -> tuple[Path, int]:
    """The data set's store (`store`: one made already, by another work directory's bench, read only) and its
    output rebuilt once under WORK; (config, messages)."""
    if store is None:
        store, messages = ensure_data_set(work, DATA_SET, scale)
    else:
        messages = json.loads((store / PRODUCED).read_text())["messages"]
    out = work / "out" / "timequery-16m"
    config = write_config(work / "timequery.yaml", store, out)
    marker = out / "built.json"
    if not marker.exists() or json.loads(marker.read_text()).get("messages") != messages:
        print(f"rebuilding {DATA_SET} into {out} ...", flush=True)
        wall, _, _ = run_measured([*REPUTD, "rebuild", "--config", str(config)])
        marker.write_text(json.dumps({"messages": messages, "seconds": round(wall, 1)}))
    return config, messages


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """(wall ms, CPU ms, stdout lines) of one run, stdout to a pipe drained as it comes."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=ROOT)
        lines = sum(1 for _ in proc.stdout)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = (time.perf_counter() - t0) * 1000
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            sys.exit(f"{' '.join(cmd)} failed:\n{err.read().decode()[-2000:]}")
    return wall, (usage.ru_utime + usage.ru_stime) * 1000, lines


def summary(runs: list[tuple[float, float, int]]) -> dict:
    walls = sorted(r[0] for r in runs)
    return {"runs": len(runs), "wall_ms_p50": round(statistics.median(walls), 1),
            "wall_ms_p90": round(walls[int(0.9 * (len(walls) - 1))], 1), "wall_ms_max": round(walls[-1], 1),
            "cpu_ms_p50": round(statistics.median(r[1] for r in runs), 1),
            "lines_p50": statistics.median(r[2] for r in runs)}


def topic_times(config_path: Path) -> tuple[int, int]:
    """The store times of the topic's first and last message (queue 0's first and last units)."""
    from daemon.commands.query import query_queue  # noqa: PLC0415
    from daemon.config import load_config  # noqa: PLC0415

    config = load_config(str(config_path), {})
    first = query_queue(config, TOPIC, 0, 0, 1).messages[0].store_timestamp
    probe = query_queue(config, TOPIC, 0, 0, 1)
    last = query_queue(config, TOPIC, 0, probe.max_offset - 1, 1).messages[0].store_timestamp
    return first, last


def search_reads(config_path: Path, begin: int) -> dict:
    """The CommitLog reads of each queue's searches for one 1-second window, and of one lower-bound search
    over the first N units of queue 0 (20 random times within them, mean), beside log2(N)."""
    from daemon.commands.query import open_commit_log  # noqa: PLC0415
    from daemon.commands.queuetime import LogHeads, QueueTimes  # noqa: PLC0415
    from daemon.commands.timequery import query_time  # noqa: PLC0415
    from daemon.config import load_config  # noqa: PLC0415

    config = load_config(str(config_path), {})
    window = query_time(config, TOPIC, begin, begin + 999)
    per_queue = {w.queue_id: w.reads for w in window.windows}
    log = open_commit_log(config)
    rng = random.Random(3)
    growth = []
    for prefix in PREFIXES:
        counts = []
        for _ in range(20):
            heads = LogHeads(log, config.store.max_message_size)
            qt = QueueTimes(config, str(Path(config.output.dir) / "consumequeue" / TOPIC / "0"), TOPIC, 0, log, heads)
            n = min(prefix, qt.max_offset - qt.min_offset)
            target = qt.probe(qt.min_offset + rng.randrange(n)).store_timestamp
            qt.probes.clear()
            before = qt.reads
            qt.lower_bound(target, lo=qt.min_offset, hi=qt.min_offset + n)
            counts.append(qt.reads - before)
            qt.close()
            heads.close()
        growth.append({"units": n, "log2_units": round(math.log2(n), 1), "reads_mean": statistics.mean(counts),
                       "reads_max": max(counts)})
    return {"window_reads_per_queue": per_queue, "messages_in_window_printed": len(window.messages),
            "search_reads_by_queue_length": growth}


def bench_timequery(work: Path, scale: float, runs: int = DEFAULT_RUNS, store: Path | None = None) -> dict:
    config, messages = ensure_output(work, scale, store)
    first, last = topic_times(config)
    script = [str(REPUTD_SCRIPT)] if REPUTD_SCRIPT.exists() else REPUTD
    rng = random.Random(7)

    def begin() -> int:  # a 1-second window inside the topic's times
        return rng.randint(first, max(first, last - 999))

    last_window: list[int] = [first]

    def window(again: bool = False) -> list[str]:
        if not again:
            last_window[0] = begin()
        return ["--begin", str(last_window[0]), "--end", str(last_window[0] + 999)]

    kinds = {
        "offset": lambda: [*script, "query", "offset", "--config", str(config), TOPIC, str(rng.randrange(8)),
                           str(rng.randint(first, last))],
        "time": lambda: [*script, "query", "time", "--config", str(config), TOPIC, *window()],
        "time-warm": lambda: [*script, "query", "time", "--config", str(config), TOPIC, *window(again=True)],
        "time-all": lambda: [*script, "query", "time", "--config", str(config), TOPIC, *window(), "--count",
                             "1000000"],
        "key": lambda: [*script, "query", "key", "--config", str(config), TOPIC,
                        f"key-0-{8 * rng.randrange(messages // 8)}-0"],
    }
    for make in kinds.values():  # the page cache warmed for the files every kind reads
        timed(make())
    load_before = os.getloadavg()
    got: dict[str, list] = {k: [] for k in kinds}
    for _ in range(runs):  # interleaved: each round runs every kind once
        for kind, make in kinds.items():
            got[kind].append(timed(make()))
    load_after = os.getloadavg()
    result = {"scenario": "timequery", "messages": messages, "topic": TOPIC, "time_span_s": round((last - first) / 1000,
              1), **{kind: summary(r) for kind, r in got.items()}, "targets_ms": TARGET_MS,
              "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in load_after],
              "cli_command": "reputd" if script != REPUTD else "python -m daemon.cli",
              **search_reads(config, begin())}
    (work / "timequery.json").write_text(json.dumps(result, indent=2))
    return result


def report(r: dict) -> list[str]:
    """The scenario's lines for bench_suite's table."""
    lines = [f"timequery: {r['messages']:,} messages, {r['topic']}'s 8 queues ({r['time_span_s']} s of store "
             f"times), {r['offset']['runs']} interleaved rounds, `{r['cli_command']} query ...` process start to exit "
             f"(load {r['load_before']} -> {r['load_after']}):"]
    for kind in ("offset", "time", "time-warm", "time-all", "key"):
        s = r[kind]
        goal = r["targets_ms"].get(kind)
        target = "" if goal is None else f" (target <= {goal} ms: {'met' if s['wall_ms_p50'] <= goal else 'MISSED'})"
        lines.append(f"  {kind:<9} wall p50 {s['wall_ms_p50']} ms, p90 {s['wall_ms_p90']}, max {s['wall_ms_max']}; CPU "
                     f"p50 {s['cpu_ms_p50']} ms; {s['lines_p50']:.0f} lines out{target}")
    lines.append(f"  CommitLog reads of one window's searches, by queue: {r['window_reads_per_queue']}")
    lines.append("  one search over the first N units of a queue: " + ", ".join(
        f"N={g['units']:,} (log2 {g['log2_units']}): {g['reads_mean']:.1f} reads (max {g['reads_max']})"
        for g in r["search_reads_by_queue_length"]))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "suite")
    ap.add_argument("--runs", type=int, default=DEFAULT_RUNS)
    ap.add_argument("--quick", action="store_true", help="a tenth of the data set, 5 rounds")
    ap.add_argument("--store", type=Path, help=f"a {DATA_SET} store made already (its produced.json), read only")
    args = ap.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    r = bench_timequery(work, 0.1 if args.quick else 1.0, 5 if args.quick else args.runs, args.store)
    print("\n".join(report(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
