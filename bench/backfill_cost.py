"""What a backfill message costs, and how much of the job runs in parallel (issue 29's table).

    .venv/bin/python bench/backfill_cost.py [--workdir bench/results/suite] [--data-set 256b-1key-16m] [--scale 1]
        [--master local[2]] [--catalog]

CPU-seconds of the whole process tree (the reputd driver, the Spark JVM, the Python workers: sampled from
/proc, so a JVM that py4j leaves to init is counted too), not wall time: the machine is shared. Rows:

    rebuild     `reputd rebuild` of the data set, CPU per message
    fixed       a backfill of the first 10,000 messages (`--to` at the 10,001st): start-up, the first task of
                each slot, the stop
    marginal    (the whole backfill minus the fixed job) per message beyond the first 10,000, and its parts by
                process (driver, JVM, Python workers) and by task kind (decode and write task time)
    catalog     with --catalog: the same whole backfill again, writing a catalog too; its extra CPU per
                message over the backfill without it, by process and by task kind
    serial      from Spark's event log of the whole backfill: over the jobs' window (first job submitted to
                last job ended), the time when fewer tasks run than there are slots; the projected speedup at
                16 and 64 slots is Amdahl's with the serial share of the one-slot work (the serial time
                counted once, the rest once per slot busy)

Every backfill's files are compared with the rebuild's (byte for byte).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_suite import (  # noqa: E402
    COST_DATA_SET,
    DATA_SETS,
    REPUTD,
    TreeSampler,
    _prime_class_archive,
    commitlog_bytes,
    ensure_data_set,
    last_json,
    raw_read_seconds,
    run_sampled,
    same_tree,
    write_config,
)

FIXED_MESSAGES = 10_000
TARGETS = {"marginal_vs_rebuild": 2.0, "serial_fraction": 0.10, "fixed_cpu_s": 8.0, "catalog_extra_us": 1.0}


def kind_of(pid: int, root: int) -> str:
    if pid == root:
        return "driver"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if cmd and cmd[0].endswith(b"java"):
        return "jvm"
    return "python_workers" if any(b"pyspark" in c or b"pydaemon" in c for c in cmd) else "other"


class KindSampler(TreeSampler):
    """TreeSampler that remembers what each process was (a process gone by the end keeps its kind)."""

    def __init__(self, pid: int):
        self.kinds: dict[int, str] = {}
        super().__init__(pid)

    def _tree(self) -> list[int]:
        tree = super()._tree()
        for pid in tree:  # again at every sample: Spark's launcher script execs the JVM in the same process
            kind = kind_of(pid, self.pid)
            if kind != "other" or pid not in self.kinds:
                self.kinds[pid] = kind
        return tree

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, cpu in self.cpu.items():
            k = self.kinds.get(pid, "other")
            out[k] = out.get(k, 0.0) + cpu
        return out


def boundary_after(store: Path, messages: int) -> int:
    """The CommitLog offset of message number `messages` (0-based): a record boundary for --to."""
    from indexcore.reader import CommitLog, CommitLogReader  # noqa: PLC0415

    log = CommitLog(str(store / "commitlog"), 1 << 30)
    reader = CommitLogReader(log, batch_bytes=4 << 20)
    offset, seen = log.min_offset, 0
    try:
        while True:
            res = reader.read(offset)
            n = len(res.batch)
            if seen + n > messages:
                return int(res.batch.phy_offset[messages - seen])
            seen += n
            offset = res.next_offset
            if n == 0:
                raise SystemExit(f"the data set has only {seen} messages")
    finally:
        reader.close()


def serial_from_event_log(directory: Path, slots: int) -> dict:
    """The jobs' window, the time in it when fewer than `slots` tasks ran, and the task time, from the one
    event log in `directory`."""
    logs = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("appstatus"))
    if not logs:
        raise SystemExit(f"no event log in {directory}")
    jobs_start, jobs_end, tasks = [], [], []
    for line in (line for p in logs for line in p.read_text().splitlines()):
        event = json.loads(line)
        kind = event.get("Event")
        if kind == "SparkListenerJobStart":
            jobs_start.append(event["Submission Time"])
        elif kind == "SparkListenerJobEnd":
            jobs_end.append(event["Completion Time"])
        elif kind == "SparkListenerTaskEnd":
            info = event["Task Info"]
            tasks.append((info["Launch Time"], info["Finish Time"]))
    lo, hi = min(jobs_start), max(jobs_end)
    edges = sorted({lo, hi, *(max(lo, min(hi, t)) for a, b in tasks for t in (a, b))})
    serial = busy = 0.0
    first_launch = min((s for s, _ in tasks), default=hi)
    places = {"start": 0.0, "idle": 0.0, "tails": 0.0}  # before the first task, no task running, some running
    for a, b in itertools.pairwise(edges):
        mid = (a + b) / 2
        running = sum(1 for s, e in tasks if s <= mid < e)
        busy += running * (b - a)
        if running < slots:
            serial += b - a
            places["start" if b <= first_launch else "idle" if running == 0 else "tails"] += b - a
    window = hi - lo
    parallel = window - serial
    one_slot = serial + slots * parallel  # the serial time once, the rest on every slot
    f1 = serial / one_slot if one_slot else 1.0
    return {"window_s": window / 1000, "serial_s": serial / 1000, "serial_fraction": serial / window,
            "serial_places_s": {k: v / 1000 for k, v in places.items()},
            "jobs": len(jobs_start), "tasks": len(tasks), "task_s": busy / 1000, "one_slot_serial_fraction": f1,
            "speedup_16": 1 / (f1 + (1 - f1) / 16), "speedup_64": 1 / (f1 + (1 - f1) / 64)}


def backfill_run(config: Path, out: Path, master: str, extra: list[str], event_dir: Path | None = None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [*REPUTD, "backfill", "--config", str(config), "--out", str(out), "--json", "--master", master,
           "--conf", "spark.ui.enabled=false", *extra]
    if event_dir is not None:
        shutil.rmtree(event_dir, ignore_errors=True)
        event_dir.mkdir(parents=True)
        cmd += ["--conf", "spark.eventLog.enabled=true", "--conf", f"spark.eventLog.dir={event_dir.as_uri()}",
                "--conf", "spark.eventLog.compress=false",
                "--conf", "spark.eventLog.rolling.enabled=false"]
    import bench.bench_suite as suite  # noqa: PLC0415

    kept = suite.TreeSampler
    suite.TreeSampler = KindSampler  # run_sampled builds the sampler
    try:
        wall, stdout, sampler, _ = run_sampled(cmd)
    finally:
        suite.TreeSampler = kept
    summary = last_json(stdout)
    return {"wall": wall, "cpu": sampler.cpu_seconds, "kinds": sampler.by_kind(), "summary": summary,
            "peak_rss_mb": {k: round(v / 2**20) for k, v in sampler.rss.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "suite")
    ap.add_argument("--data-set", default=COST_DATA_SET, choices=sorted(DATA_SETS),
                    help=f"default {COST_DATA_SET}: issue 29's 16,000,000 messages in 7 segments (made once, ~10 min)")
    ap.add_argument("--scale", type=float, default=1.0, help="of the data set's messages")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--catalog", action="store_true", help="also measure what a catalog adds")
    args = ap.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    result = measure(work, args.data_set, args.scale, args.master, args.catalog)
    print("\n".join(result["table"]))
    return 0 if result["identical"] else 1


def measure(work: Path, data_set: str, scale: float, master: str, catalog: bool) -> dict:
    """The cost table's figures (`table`: its Markdown lines), also written to WORK/backfill-cost.json."""
    slots = int(master.split("[")[1].split("]", maxsplit=1)[0].split(",", maxsplit=1)[0]) if "[" in master else 2
    store, messages = ensure_data_set(work, data_set, scale)
    reference = work / "out" / "cost-reference"
    config = write_config(work / "cost.yaml", store, reference)
    shutil.rmtree(reference, ignore_errors=True)
    raw_read_seconds(store, commitlog_bytes(store)[1])
    _, _, sampler, cpu = run_sampled([*REPUTD, "rebuild", "--config", str(config), "--json"])
    rebuild_us = 1e6 * max(cpu, sampler.cpu_seconds) / messages
    print(f"rebuild: {messages:,} messages, {max(cpu, sampler.cpu_seconds):.2f} CPU-s, {rebuild_us:.3f} us/msg",
          flush=True)
    _prime_class_archive(work, config)
    to = boundary_after(store, FIXED_MESSAGES)
    fixed = backfill_run(config, work / "out" / "cost-fixed", master, ["--to", str(to)])
    shutil.rmtree(work / "out" / "cost-fixed", ignore_errors=True)
    print(f"fixed ({FIXED_MESSAGES:,} messages): {fixed['cpu']:.2f} CPU-s, {fixed['wall']:.1f} s wall", flush=True)
    events = work / "out" / "cost-events"
    t0 = time.perf_counter()
    full = backfill_run(config, work / "out" / "cost-full", master, [], events)
    print(f"full ({messages:,} messages): {full['cpu']:.2f} CPU-s, {time.perf_counter() - t0:.1f} s wall", flush=True)
    identical = same_tree(reference, work / "out" / "cost-full")
    with_catalog = catalog_row = None
    if catalog:
        with_catalog, catalog_row = measure_catalog(work, config, master, messages, full)
        identical = identical and same_tree(reference, work / "out" / "cost-full-catalog")
    serial = serial_from_event_log(events, slots)
    extra_msgs = messages - FIXED_MESSAGES
    marginal_us, parts, decode_us, write_us = per_message(full, fixed, extra_msgs)
    s_full, s_fixed = full["summary"], fixed["summary"]
    jvm_bytes = (s_full["arrowBytesToJvm"] + s_full["arrowBytesFromJvm"]) / messages
    rows = [
        ("`reputd rebuild`", f"{rebuild_us:.3f} us", "one process"),
        (f"backfill `{master}`, all in", f"{1e6 * full['cpu'] / messages:.3f} us "
         f"({full['cpu'] / messages * 1e6 / rebuild_us:.1f}x)", f"{full['cpu']:.1f} CPU-s, {full['wall']:.1f} s wall"),
        (f"fixed cost (a {FIXED_MESSAGES:,}-message job)", f"{fixed['cpu']:.2f} CPU-s",
         f"target <= {TARGETS['fixed_cpu_s']:.0f}; {fixed['wall']:.1f} s wall; by process: driver "
         f"{fixed['kinds'].get('driver', 0.0):.2f}, JVM {fixed['kinds'].get('jvm', 0.0):.2f}, Python workers "
         f"{fixed['kinds'].get('python_workers', 0.0):.2f}; start-up "
         f"{s_fixed['phaseSeconds'].get('startup', 0.0):.2f} s"),
        (f"marginal ({messages:,} minus the {FIXED_MESSAGES:,} job)",
         f"**{marginal_us:.3f} us ({marginal_us / rebuild_us:.1f}x)**",
         f"target <= {TARGETS['marginal_vs_rebuild']:.0f}x; by process: driver {parts['driver']:.3f}, JVM "
         f"{parts['jvm']:.3f}, Python workers {parts['python_workers']:.3f}; task time: decode {decode_us:.3f}, "
         f"write {write_us:.3f}"),
        ("serial fraction (event log)", f"**{serial['serial_fraction']:.1%}**",
         f"target <= {TARGETS['serial_fraction']:.0%}; {serial['serial_s']:.2f} s of a {serial['window_s']:.2f} s "
         f"window with fewer than {slots} tasks running (before the first task "
         f"{serial['serial_places_s']['start']:.2f} s, none running {serial['serial_places_s']['idle']:.2f} s, "
         f"some {serial['serial_places_s']['tails']:.2f} s); {serial['jobs']} jobs, {serial['tasks']} tasks"),
        ("projected speedup (Amdahl)", f"{serial['speedup_16']:.1f}x at 16, {serial['speedup_64']:.1f}x at 64 slots",
         f"serial share of the one-slot work {serial['one_slot_serial_fraction']:.1%}"),
        ("Python <-> JVM bytes", f"{jvm_bytes:.2f} B/msg",
         f"staged as files: {s_full.get('stagedBytes', 0) / messages:.1f} B/msg"),
    ]
    if catalog_row is not None:
        rows.append(catalog_row)
    table = [f"| {messages:,} messages, `{master}` | CPU per message | note |",
             "|---|---:|---|", *(f"| {r[0]} | {r[1]} | {r[2]} |" for r in rows), "",
             f"identical to the rebuild: {identical}"]
    result = {"scenario": "backfill-cost", "messages": messages, "master": master, "rebuild_us": rebuild_us,
              "fixed": fixed, "full": full, "serial": serial, "marginal_us": marginal_us,
              "marginal_parts_us": parts, "decode_us": decode_us, "write_us": write_us, "identical": identical,
              "catalog": catalog, "with_catalog": with_catalog, "table": table}
    (work / "backfill-cost.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def per_message(run: dict, base: dict, messages: int) -> tuple[float, dict, float, float]:
    """What `run` cost beyond `base` per message, in us: CPU of the whole tree, by process kind, and the
    decode and write task time."""
    def us(a: float, b: float) -> float:
        return 1e6 * (a - b) / messages

    parts = {k: us(run["kinds"].get(k, 0.0), base["kinds"].get(k, 0.0)) for k in ("driver", "jvm", "python_workers")}
    return (us(run["cpu"], base["cpu"]), parts,
            us(run["summary"]["decodeTaskSeconds"], base["summary"]["decodeTaskSeconds"]),
            us(run["summary"]["writeTaskSeconds"], base["summary"]["writeTaskSeconds"]))


def measure_catalog(work: Path, config: Path, master: str, messages: int, full: dict) -> tuple[dict, tuple]:
    """The whole backfill again with `--catalog` (into a new catalog); its extra CPU per message over `full`."""
    catalog = work / "out" / "cost-catalog"
    shutil.rmtree(catalog, ignore_errors=True)
    t0 = time.perf_counter()
    run = backfill_run(config, work / "out" / "cost-full-catalog", master, ["--catalog", str(catalog)])
    print(f"full with catalog: {run['cpu']:.2f} CPU-s, {time.perf_counter() - t0:.1f} s wall", flush=True)
    shutil.rmtree(catalog, ignore_errors=True)
    extra_us, parts, decode_us, write_us = per_message(run, full, messages)
    rss = run["peak_rss_mb"]
    row = ("catalog (`--catalog`), extra", f"**{extra_us:.3f} us**",
           f"target <= {TARGETS['catalog_extra_us']:.0f} us; {run['cpu']:.1f} CPU-s with it, {run['wall']:.1f} s "
           f"wall; peak RSS MB driver {rss.get('driver')}, JVM {rss.get('jvm')} (default driver memory), Python "
           f"worker {rss.get('python_worker')}; by process: driver {parts['driver']:.3f}, JVM {parts['jvm']:.3f}, "
           "Python workers "
           f"{parts['python_workers']:.3f}; task time: decode {decode_us:.3f}, write {write_us:.3f}")
    return {**run, "extra_us": extra_us, "extra_parts_us": parts, "decode_us": decode_us, "write_us": write_us}, row


if __name__ == "__main__":
    sys.exit(main())
