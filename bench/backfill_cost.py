"""What a backfill message costs, and how much of the job runs in parallel (issue 29's table).

    .venv/bin/python bench/backfill_cost.py [--workdir bench/results/suite] [--data-set 256b-1key-16m] [--scale 1]
        [--master local[2]] [--catalog] [--rounds 5]

CPU-seconds of the whole process tree (the reputd driver, the Spark JVM, the Python workers: sampled from
/proc, so a JVM that py4j leaves to init is counted too), not wall time: the machine is shared. Rows:

    rebuild     `reputd rebuild` of the data set, CPU per message
    fixed       a backfill of the first 10,000 messages (`--to` at the 10,001st): start-up, the first task of
                each slot, the stop
    marginal    (the whole backfill minus the fixed job) per message beyond the first 10,000, and its parts by
                process (driver, JVM, Python workers) and by task kind (decode and write task time)
    catalog     with --catalog: the same whole backfill again, writing a catalog too; its extra CPU per
                message over the backfill without it, by process and by task kind
    queues      with --many-queues DATA_SET: the fixed job and the whole backfill again on a data set of the
                same messages over many more queues (2,000 topics x 8: 16,000 queues), their marginal cost
                per message and its ratio to the 64 queues' (target <= 1.5x), by process and task kind; its
                rebuild's cost, once
    serial      from Spark's event log of the whole backfill: over the jobs' window (first job submitted to
                last job ended), the time when fewer tasks run than there are slots; the projected speedup at
                16 and 64 slots is Amdahl's with the serial share of the one-slot work (the serial time
                counted once, the rest once per slot busy)

Every backfill writes Spark's event log (the serial fraction reads the whole backfill's), so that the runs
subtracted from one another differ in their work only. Every run is repeated in --rounds interleaved rounds
(a round: the rebuild, the fixed job, the whole backfill, the catalog backfill); the table gives each figure's
median and range, and how many rounds met each target.
Every backfill's files are compared with the rebuild's (byte for byte).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_suite import (  # noqa: E402
    COST_DATA_SET,
    DATA_SET_TOPICS,
    DATA_SETS,
    MANY_QUEUES_DATA_SET,
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
DEFAULT_ROUNDS = 5
KINDS = ("driver", "jvm", "python_workers")
TARGETS = {"marginal_vs_rebuild": 2.0, "serial_fraction": 0.10, "fixed_cpu_s": 8.0, "catalog_extra_us": 1.0,
           "many_queues_ratio": 1.5}
QUEUES_PER_TOPIC = 8  # every data set's (bench_suite.ensure_data_set)


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
    ap.add_argument("--many-queues", metavar="DATA_SET", choices=sorted(DATA_SETS),
                    help=f"also measure the marginal cost on this data set of many queues ({MANY_QUEUES_DATA_SET}: "
                         "16,000 queues, made once, ~8 min)")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                    help=f"rounds of every run, interleaved; each figure is their median (default {DEFAULT_ROUNDS})")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    result = measure(work, args.data_set, args.scale, args.master, args.catalog, args.rounds, args.many_queues)
    print("\n".join(result["table"]))
    return 0 if result["identical"] else 1


def measure(work: Path, data_set: str, scale: float, master: str, catalog: bool,
            rounds: int = DEFAULT_ROUNDS, many_queues: str | None = None) -> dict:
    """The cost table's figures (`table`: its Markdown lines), also written to WORK/backfill-cost.json.

    Every run is repeated `rounds` times, a round being the rebuild, the fixed job, the whole backfill and
    (with `catalog`) the whole backfill with a catalog, one after the other: a round's ratios compare runs
    made within a minute of each other, and the table gives each figure's median over the rounds with the
    rounds' range beside it. On this shared 2-core machine one run of the same backfill moved by 20% between
    two hours, and consecutive runs by as much: the virtual machine hands memory that stayed free for a
    while back to its host (`page_reporting` on the kernel's command line), and touching it again costs
    several times more (1 GiB written into page-cache pages: 1.06-1.20 s of system time after 10-30 s idle,
    against 0.23-0.27 right after the last GiB was freed), so a run's cost depends on what ran before it.
    The median of five interleaved rounds is what a second `make bench` repeats. With `many_queues` (a data
    set of the same messages over many queues) each round ends with its fixed job and whole backfill too."""
    slots = int(master.split("[")[1].split("]", maxsplit=1)[0].split(",", maxsplit=1)[0]) if "[" in master else 2
    store, messages = ensure_data_set(work, data_set, scale)
    (work / "out").mkdir(exist_ok=True)  # the parent of every output here (a writing command makes only the last)
    reference = work / "out" / "cost-reference"
    config = write_config(work / "cost.yaml", store, reference)
    raw_read_seconds(store, commitlog_bytes(store)[1])
    _prime_class_archive(work, config)
    to = boundary_after(store, FIXED_MESSAGES)
    many = prepare_many_queues(work, many_queues, scale) if many_queues else None
    runs = []
    shutil.rmtree(many_outputs(work), ignore_errors=True)  # an earlier scenario's (a run that was stopped)
    try:
        for number in range(1, rounds + 1):
            runs.append(_round(work, config, reference, messages, master, slots, catalog, to, many, number, rounds))
    finally:
        shutil.rmtree(many_outputs(work), ignore_errors=True)
    identical = all(r["identical"] for r in runs)
    table = cost_table(runs, messages, master, slots, catalog, many)
    result = {"scenario": "backfill-cost", "messages": messages, "master": master, "rounds": runs,
              "median": medians(runs, catalog), "identical": identical, "catalog": catalog, "table": table,
              "many_queues": {k: v for k, v in many.items() if k in ("data_set", "messages", "queues", "rebuild_us",
                                                                     "rebuild_cpu")} if many else None}
    (work / "backfill-cost.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _round(work: Path, config: Path, reference: Path, messages: int, master: str, slots: int, catalog: bool,
           to: int, many: dict | None, number: int, rounds: int) -> dict:
    """One round (`one_round`, then the many-queue runs), its line printed."""
    r = one_round(work, config, reference, messages, master, slots, catalog, to)
    if many is not None:
        r["many"] = many_round(work, many, master, r["marginal_us"], number)
        r["identical"] = r["identical"] and r["many"]["identical"]
    extra = f", catalog +{r['with_catalog']['extra_us']:.3f} us" if catalog else ""
    if many is not None:
        extra += (f", at {many['queues']:,} queues marginal {r['many']['marginal_us']:.3f} us "
                  f"({r['many']['ratio']:.2f}x)")
    print(f"round {number}/{rounds}: rebuild {r['rebuild_us']:.3f} us, fixed {r['fixed']['cpu']:.2f} CPU-s, "
          f"marginal {r['marginal_us']:.3f} us ({r['marginal_us'] / r['rebuild_us']:.2f}x), serial "
          f"{r['serial']['serial_fraction']:.1%}{extra}, identical {r['identical']}", flush=True)
    return r


def one_round(work: Path, config: Path, reference: Path, messages: int, master: str, slots: int, catalog: bool,
              to: int) -> dict:
    """One of each run: the rebuild, the fixed job, the whole backfill (its event log kept) and, with `catalog`,
    the whole backfill writing a catalog; every backfill compared with this round's rebuild."""
    shutil.rmtree(reference, ignore_errors=True)
    _, _, sampler, cpu = run_sampled([*REPUTD, "rebuild", "--config", str(config), "--json"])
    rebuild_cpu = max(cpu, sampler.cpu_seconds)
    rebuild_us = 1e6 * rebuild_cpu / messages
    print(f"rebuild: {messages:,} messages, {rebuild_cpu:.2f} CPU-s, {rebuild_us:.3f} us/msg", flush=True)
    # every backfill writes Spark's event log, which the serial fraction needs from the whole one: the runs that
    # are subtracted from each other then differ only in their work (the log costs the JVM per task)
    fixed = backfill_run(config, work / "out" / "cost-fixed", master, ["--to", str(to)],
                         work / "out" / "cost-events-fixed")
    shutil.rmtree(work / "out" / "cost-fixed", ignore_errors=True)
    print(f"fixed ({FIXED_MESSAGES:,} messages): {fixed['cpu']:.2f} CPU-s, {fixed['wall']:.1f} s wall", flush=True)
    events = work / "out" / "cost-events"
    full = backfill_run(config, work / "out" / "cost-full", master, [], events)
    print(f"full ({messages:,} messages): {full['cpu']:.2f} CPU-s, {full['wall']:.1f} s wall", flush=True)
    identical = same_tree(reference, work / "out" / "cost-full")
    shutil.rmtree(work / "out" / "cost-full", ignore_errors=True)
    with_catalog = None
    if catalog:
        with_catalog = measure_catalog(work, config, master, messages, full)
        identical = identical and same_tree(reference, work / "out" / "cost-full-catalog")
        shutil.rmtree(work / "out" / "cost-full-catalog", ignore_errors=True)
    marginal_us, parts, decode_us, write_us = per_message(full, fixed, messages - FIXED_MESSAGES)
    return {"rebuild_us": rebuild_us, "rebuild_cpu": rebuild_cpu, "fixed": fixed, "full": full,
            "serial": serial_from_event_log(events, slots), "marginal_us": marginal_us,
            "marginal_parts_us": parts, "decode_us": decode_us, "write_us": write_us, "identical": identical,
            "with_catalog": with_catalog}


def prepare_many_queues(work: Path, data_set: str, scale: float) -> dict:
    """The many-queue data set, its rebuild (the reference its backfills are compared with; its cost reported
    once) and the boundary its fixed job stops at."""
    store, messages = ensure_data_set(work, data_set, scale)
    reference = work / "out" / "cost-reference-many"
    config = write_config(work / "cost-many.yaml", store, reference)
    raw_read_seconds(store, commitlog_bytes(store)[1])
    shutil.rmtree(reference, ignore_errors=True)
    _, _, sampler, cpu = run_sampled([*REPUTD, "rebuild", "--config", str(config), "--json"])
    rebuild_cpu = max(cpu, sampler.cpu_seconds)
    queues = DATA_SET_TOPICS.get(data_set, 8) * QUEUES_PER_TOPIC
    print(f"rebuild at {queues:,} queues: {messages:,} messages, {rebuild_cpu:.2f} CPU-s, "
          f"{1e6 * rebuild_cpu / messages:.3f} us/msg", flush=True)
    return {"data_set": data_set, "store": store, "messages": messages, "config": config, "reference": reference,
            "queues": queues, "to": boundary_after(store, FIXED_MESSAGES), "rebuild_cpu": rebuild_cpu,
            "rebuild_us": 1e6 * rebuild_cpu / messages}


def many_round(work: Path, many: dict, master: str, marginal_64: float, number: int) -> dict:
    """The fixed job and the whole backfill of the many-queue data set (with event logs, as the others), their
    marginal cost per message and its ratio to this round's 64-queue marginal; the output compared with its
    rebuild. The outputs are kept until the scenario ends (`many_outputs`, removed by `measure`): ext4 makes
    inodes created within minutes of as many being deleted several times dearer (it scans for recently freed
    ones, `recently_deleted()`), so deleting the last output and backfilling at once measured that scan."""
    raw_read_seconds(many["store"], commitlog_bytes(many["store"])[1])  # from the page cache, as the others
    fixed_out, full_out = (many_outputs(work) / f"{kind}-{number}" for kind in ("fixed", "full"))
    many_outputs(work).mkdir(exist_ok=True)  # their parent: a writing command makes only the last directory
    fixed = backfill_run(many["config"], fixed_out, master, ["--to", str(many["to"])],
                         work / "out" / "cost-events-many-fixed")
    full = backfill_run(many["config"], full_out, master, [], work / "out" / "cost-events-many")
    identical = same_tree(many["reference"], full_out)
    marginal_us, parts, decode_us, write_us = per_message(full, fixed, many["messages"] - FIXED_MESSAGES)
    print(f"at {many['queues']:,} queues: fixed {fixed['cpu']:.2f} CPU-s, full {full['cpu']:.2f} CPU-s, "
          f"{full['wall']:.1f} s wall", flush=True)
    return {"fixed": fixed, "full": full, "marginal_us": marginal_us, "marginal_parts_us": parts,
            "decode_us": decode_us, "write_us": write_us, "ratio": marginal_us / marginal_64, "identical": identical}


def many_outputs(work: Path) -> Path:
    """Where the many-queue backfills' outputs stay until the scenario ends (one per run)."""
    return work / "out" / "cost-many"


def _figures(runs: list[dict], catalog: bool) -> dict[str, list[float]]:
    """Each figure of the table, one value per round."""
    def each(f) -> list[float]:
        return [float(f(r)) for r in runs]

    out = {
        "rebuild_us": each(lambda r: r["rebuild_us"]),
        "rebuild_cpu": each(lambda r: r["rebuild_cpu"]),
        "full_us": each(lambda r: 1e6 * r["full"]["cpu"] / r["full"]["summary"]["messages"]),
        "full_ratio": each(lambda r: 1e6 * r["full"]["cpu"] / r["full"]["summary"]["messages"] / r["rebuild_us"]),
        "full_cpu": each(lambda r: r["full"]["cpu"]),
        "full_wall": each(lambda r: r["full"]["wall"]),
        "fixed_cpu": each(lambda r: r["fixed"]["cpu"]),
        "fixed_wall": each(lambda r: r["fixed"]["wall"]),
        "fixed_startup": each(lambda r: r["fixed"]["summary"]["phaseSeconds"].get("startup", 0.0)),
        "marginal_us": each(lambda r: r["marginal_us"]),
        "marginal_ratio": each(lambda r: r["marginal_us"] / r["rebuild_us"]),
        "decode_us": each(lambda r: r["decode_us"]),
        "write_us": each(lambda r: r["write_us"]),
        "jvm_bytes": each(lambda r: r["full"]["summary"]["bytesToJvm"] / r["full"]["summary"]["messages"]),
        "staged_bytes": each(lambda r: r["full"]["summary"].get("stagedBytes", 0) / r["full"]["summary"]["messages"]),
    }
    for kind in KINDS:
        out[f"fixed_{kind}"] = each(lambda r, k=kind: r["fixed"]["kinds"].get(k, 0.0))
        out[f"marginal_{kind}"] = each(lambda r, k=kind: r["marginal_parts_us"][k])
    for key in ("serial_fraction", "serial_s", "window_s", "one_slot_serial_fraction", "speedup_16", "speedup_64"):
        out[key] = each(lambda r, k=key: r["serial"][k])
    for place in ("start", "idle", "tails"):
        out[f"serial_{place}"] = each(lambda r, p=place: r["serial"]["serial_places_s"][p])
    if all("many" in r for r in runs):
        for key in ("marginal_us", "ratio", "decode_us", "write_us"):
            out[f"many_{key}"] = each(lambda r, k=key: r["many"][k])
        out["many_full_cpu"] = each(lambda r: r["many"]["full"]["cpu"])
        out["many_full_wall"] = each(lambda r: r["many"]["full"]["wall"])
        out["many_fixed_cpu"] = each(lambda r: r["many"]["fixed"]["cpu"])
        for kind in KINDS:
            out[f"many_{kind}"] = each(lambda r, k=kind: r["many"]["marginal_parts_us"][k])
    if catalog:
        out["catalog_extra_us"] = each(lambda r: r["with_catalog"]["extra_us"])
        out["catalog_cpu"] = each(lambda r: r["with_catalog"]["cpu"])
        out["catalog_wall"] = each(lambda r: r["with_catalog"]["wall"])
        out["catalog_decode_us"] = each(lambda r: r["with_catalog"]["decode_us"])
        out["catalog_write_us"] = each(lambda r: r["with_catalog"]["write_us"])
        for kind in KINDS:
            out[f"catalog_{kind}"] = each(lambda r, k=kind: r["with_catalog"]["extra_parts_us"][k])
    return out


def medians(runs: list[dict], catalog: bool) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in _figures(runs, catalog).items()}


def cost_table(runs: list[dict], messages: int, master: str, slots: int, catalog: bool,
               many: dict | None = None) -> list[str]:
    """The Markdown table: each figure the median of the rounds; the targeted ones with every round's value
    and how many rounds met the target."""
    fig = _figures(runs, catalog)
    m = {k: statistics.median(v) for k, v in fig.items()}
    n = len(runs)

    def span(key: str, spec: str, unit: str = "") -> str:
        lo, hi = min(fig[key]), max(fig[key])
        return f"{format(m[key], spec)}{unit}" if n == 1 else \
            f"{format(m[key], spec)}{unit} ({format(lo, spec)}-{format(hi, spec)})"

    def rounds(key: str, spec: str, target: float) -> str:
        # a figure at or below 0 is a subtraction lost in noise (too few messages): it meets nothing
        met = sum(1 for v in fig[key] if 0 < v <= target)
        values = ", ".join(format(v, spec) for v in fig[key])
        void = sum(1 for v in fig[key] if v <= 0)
        noise = f"; {void} at or below 0: noise, too few messages to measure" if void else ""
        return f"met in {met} of {n} rounds ({values}{noise})"

    peak = {k: max(r["with_catalog"]["peak_rss_mb"].get(k) or 0 for r in runs) for k in ("driver", "jvm",
            "python_worker")} if catalog else {}
    rows = [
        ("`reputd rebuild`", span("rebuild_us", ".3f", " us"), f"one process, {span('rebuild_cpu', '.2f')} CPU-s"),
        (f"backfill `{master}`, all in", f"{span('full_us', '.3f', ' us')} ({m['full_ratio']:.1f}x)",
         f"{span('full_cpu', '.1f')} CPU-s, {span('full_wall', '.1f')} s wall"),
        (f"fixed cost (a {FIXED_MESSAGES:,}-message job)", f"**{span('fixed_cpu', '.2f')} CPU-s**",
         f"target <= {TARGETS['fixed_cpu_s']:.0f}, {rounds('fixed_cpu', '.2f', TARGETS['fixed_cpu_s'])}; "
         f"{m['fixed_wall']:.1f} s wall; by process: driver {m['fixed_driver']:.2f}, JVM {m['fixed_jvm']:.2f}, "
         f"Python workers {m['fixed_python_workers']:.2f}; start-up {m['fixed_startup']:.2f} s"),
        (f"marginal ({messages:,} minus the {FIXED_MESSAGES:,} job)",
         f"**{span('marginal_us', '.3f', ' us')}, {span('marginal_ratio', '.2f', 'x')}**",
         f"target <= {TARGETS['marginal_vs_rebuild']:.0f}x each round's rebuild, "
         f"{rounds('marginal_ratio', '.2f', TARGETS['marginal_vs_rebuild'])}; by process: driver "
         f"{m['marginal_driver']:.3f}, JVM {m['marginal_jvm']:.3f}, Python workers {m['marginal_python_workers']:.3f}; "
         f"task time: decode {m['decode_us']:.3f}, write {m['write_us']:.3f}"),
        ("serial fraction (event log)", f"**{span('serial_fraction', '.1%')}**",
         f"target <= {TARGETS['serial_fraction']:.0%}, {rounds('serial_fraction', '.1%', TARGETS['serial_fraction'])}; "
         f"{m['serial_s']:.2f} s of a {m['window_s']:.2f} s window with fewer than {slots} tasks running (before "
         f"the first task {m['serial_start']:.2f} s, none running {m['serial_idle']:.2f} s, some "
         f"{m['serial_tails']:.2f} s); {runs[0]['serial']['jobs']} jobs, {runs[0]['serial']['tasks']} tasks"),
        ("projected speedup (Amdahl)", f"{m['speedup_16']:.1f}x at 16, {m['speedup_64']:.1f}x at 64 slots",
         f"serial share of the one-slot work {m['one_slot_serial_fraction']:.1%}"),
        ("Python <-> JVM bytes", f"{m['jvm_bytes']:.2f} B/msg", f"staged as files: {m['staged_bytes']:.1f} B/msg"),
    ]
    if catalog:
        rows.append((
            "catalog (`--catalog`), extra", f"**{span('catalog_extra_us', '.3f', ' us')}**",
            f"target <= {TARGETS['catalog_extra_us']:.0f} us, "
            f"{rounds('catalog_extra_us', '.3f', TARGETS['catalog_extra_us'])}; {m['catalog_cpu']:.1f} CPU-s with "
            f"it, {m['catalog_wall']:.1f} s wall; peak RSS MB over the rounds: driver {peak['driver']}, JVM "
            f"{peak['jvm']} (default driver memory), Python worker {peak['python_worker']}; by process: driver "
            f"{m['catalog_driver']:.3f}, JVM {m['catalog_jvm']:.3f}, Python workers {m['catalog_python_workers']:.3f}; "
            f"task time: decode {m['catalog_decode_us']:.3f}, write {m['catalog_write_us']:.3f}"))
    if many is not None:
        rows.append((
            f"marginal at {many['queues']:,} queues (2,000 topics x 8, same messages)",
            f"**{span('many_marginal_us', '.3f', ' us')}, {span('many_ratio', '.2f', 'x')} the 64 queues'**",
            f"target <= {TARGETS['many_queues_ratio']}x, {rounds('many_ratio', '.2f', TARGETS['many_queues_ratio'])}; "
            f"whole backfill {m['many_full_cpu']:.1f} CPU-s, {m['many_full_wall']:.1f} s wall; fixed job "
            f"{m['many_fixed_cpu']:.2f} CPU-s; by process: driver {m['many_driver']:.3f}, JVM {m['many_jvm']:.3f}, "
            f"Python workers {m['many_python_workers']:.3f}; task time: decode {m['many_decode_us']:.3f}, write "
            f"{m['many_write_us']:.3f}; its rebuild {many['rebuild_us']:.3f} us (once)"))
    head = "median of 1 round" if n == 1 else f"median of {n} rounds (range)"
    return [f"| {messages:,} messages, `{master}` | CPU per message, {head} | note |",
            "|---|---:|---|", *(f"| {r[0]} | {r[1]} | {r[2]} |" for r in rows), "",
            f"identical to the rebuild: {all(r['identical'] for r in runs)} (every backfill of every round)"]


def per_message(run: dict, base: dict, messages: int) -> tuple[float, dict, float, float]:
    """What `run` cost beyond `base` per message, in us: CPU of the whole tree, by process kind, and the
    decode and write task time."""
    def us(a: float, b: float) -> float:
        return 1e6 * (a - b) / messages

    parts = {k: us(run["kinds"].get(k, 0.0), base["kinds"].get(k, 0.0)) for k in KINDS}
    return (us(run["cpu"], base["cpu"]), parts,
            us(run["summary"]["decodeTaskSeconds"], base["summary"]["decodeTaskSeconds"]),
            us(run["summary"]["writeTaskSeconds"], base["summary"]["writeTaskSeconds"]))


def measure_catalog(work: Path, config: Path, master: str, messages: int, full: dict) -> dict:
    """The whole backfill again with `--catalog` (into a new catalog); its extra CPU per message over `full`."""
    catalog = work / "out" / "cost-catalog"
    shutil.rmtree(catalog, ignore_errors=True)
    run = backfill_run(config, work / "out" / "cost-full-catalog", master, ["--catalog", str(catalog)],
                       work / "out" / "cost-events-catalog")
    print(f"full with catalog: {run['cpu']:.2f} CPU-s, {run['wall']:.1f} s wall", flush=True)
    shutil.rmtree(catalog, ignore_errors=True)
    extra_us, parts, decode_us, write_us = per_message(run, full, messages)
    return {**run, "extra_us": extra_us, "extra_parts_us": parts, "decode_us": decode_us, "write_us": write_us}


if __name__ == "__main__":
    sys.exit(main())
