"""Production shapes (issue 43): rebuild and run over thousands of queues beside the 64-queue store, one run.

    .venv/bin/python bench/many_queues.py [--workdir bench/results/suite] [--rounds 3] [--quick]
        [--only steps,rebuild,java,live]

* **steps**: what each step of creating a ConsumeQueue file costs on this file system, microseconds per file
  (8,000 files in 2,000 topic directories, as a rebuild of the 8,000-queue store makes them): the steps as
  they were (`before`: mkdir of the queue directory, of its topic's on ENOENT, an lstat, open of a temporary
  name, ftruncate, rename, and at the end a stat of every file and directory for the whole-file-system sync)
  and as they are (`after`: one mkdir per topic and per queue, open O_EXCL at the final name, ftruncate),
  rounds interleaved; the fdatasync a file with pre-blank units paid before its rename; and the C kernel
  (`_kernels.create_files`) creating them on 1, 2 and 4 threads (CPU-seconds and wall), whether creating in
  parallel pays here. Every directory made is kept until the scenario ends: this file system skips the
  inodes freed in the last minutes when it allocates one, so a creation right after a deletion pays for it
  (ext4's `recently_deleted()` scan: 3-7x the cost of creating on a fresh tree, measured on this VM).
* **rebuild**: `reputd rebuild` of three stores of 256-byte messages (UNIQ_KEY + 1 KEY), into empty outputs,
  rounds interleaved: 2,000,000 messages over 8 topics x 8 queues (the suite's `rebuild` data set), 2,000,000
  over 2,000 topics x 4 queues (8,000 queues) and 1,000,000 over 25,000 topics x 4 (100,000 queues). CPU-seconds
  of the process (user + system, from wait4), wall, peak RSS, and the most descriptors and mappings it held
  (/proc sampled every 20 ms); medians and ranges, and the ratios of the 8,000-queue store to the 64-queue one.
  Every round writes into a directory of its own that no earlier round used and keeps its queue files until
  the scenario ends (a 100,000-queue output holds about 0.9 GB of blocks besides its IndexFile); what earlier
  invocations left is deleted only after the measuring, so no round creates its inodes right after a deletion
  of many (`--stores` picks the stores).
* **java**: the real RocketMQ 4.9.3 store's own rebuild (`JavaRebuild`, ../shared/realbroker) of the 64- and
  8,000-queue CommitLogs, once each, its ConsumeQueue files compared byte for byte and its IndexFiles in
  name order with the output of reputd's last rebuild of the same CommitLog.
* **live**: a writer appending at 100,000 msgs/s while `reputd run` follows, over 8 topics x 8 queues and over
  2,500 topics x 4 queues (10,000 queues, every one written every second): append-to-dispatch latency,
  the daemon's CPU, peak RSS, descriptors and mappings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_suite import (  # noqa: E402
    GIB,
    PRODUCED,
    REPUTD,
    Handles,
    _health,
    _proc_cpu,
    _proc_rss,
    _wait_up,
    commitlog_bytes,
    ensure_data_set,
    last_json,
    produced_already,
    raw_read_seconds,
    write_config,
)
from bench.latency import LatencyHistogram  # noqa: E402
from bench.paced_writer import PacedWriter  # noqa: E402
from indexcore import _kernels  # noqa: E402

QUEUE_FILE_SIZE = 6_000_000  # mappedFileSizeConsumeQueue's default
REALBROKER = Path(os.environ.get("REPUTD_REALBROKER_DIR", ROOT.parent / "shared" / "realbroker"))

# name: (messages, topics, queues per topic); 256-byte bodies, UNIQ_KEY + 1 KEY, as the suite's `rebuild`
STORES = {
    "64": (2_000_000, 8, 8),
    "8k": (2_000_000, 2_000, 4),
    "100k": (1_000_000, 25_000, 4),
}
TARGET_CPU_RATIO, TARGET_WALL_RATIO = 1.5, 2.0  # 8,000 queues against 64 (issue 43)
TARGET_100K_US = 5.0  # CPU per message at 100,000 queues, all in
TARGET_FDS, TARGET_MAPS, TARGET_RSS_MB = 1_000, 10_000, 1_024
TARGET_LIVE_P99_MS, TARGET_LIVE_CPU_RATIO = 10.0, 1.5
LIVE_RATE = 100_000
LIVE_SHAPES = {"64": (8, 8), "10k": (2_500, 4)}  # topics, queues per topic


# --- measuring a process ------------------------------------------------------------------------------

def run_process(cmd: list[str], env: dict | None = None) -> dict:
    """Run to completion: wall, CPU (user + system of the process, wait4), peak RSS, the most descriptors and
    mappings it held (bench_suite.Handles: /proc every 20 ms), stdout."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env={**os.environ, **(env or {})})
        handles = Handles(proc.pid)
        handles.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        handles.done.set()
        handles.join()
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{' '.join(cmd)} failed ({os.waitstatus_to_exitcode(status)}):\n{err.read()[-3000:]}")
        return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime, "cpu": usage.ru_utime + usage.ru_stime,
                "rss_mb": usage.ru_maxrss / 1024, "fds": handles.fds, "maps": handles.maps, "stdout": out.read()}


def median_range(values: list[float], digits: int = 3) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def fmt(m: dict, unit: str = "", digits: int = 2) -> str:
    return f"{m['median']:.{digits}f}{unit} ({m['min']:.{digits}f}-{m['max']:.{digits}f})"


# --- the stores --------------------------------------------------------------------------------------

def ensure_store(work: Path, name: str, scale: float) -> tuple[Path, int]:
    """A store of STORES[name], produced once; (store root, messages). The 64-queue store is the suite's
    `rebuild` data set (bench_suite.ensure_data_set), the others are made by `reputd produce --topic-count`."""
    if name == "64":
        return ensure_data_set(work, "256b-1key", scale)
    messages, topics, queues = STORES[name]
    messages = max(1_000, int(messages * scale))
    topics = max(8, int(topics * scale))  # --quick: a tenth of the topics too
    store = work / "data" / f"256b-1key-{topics * queues}q"
    if produced_already(store, messages):
        return store, messages
    config = write_config(work / f"produce-{name}q.yaml", store, work / "unused")
    print(f"producing {name} queues: {messages:,} messages over {topics:,} topics x {queues} ...", flush=True)
    run_process([*REPUTD, "produce", "--config", str(config), "--messages", str(messages), "--body-size", "256",
                 "--keys", "1", "--topics", "BenchTopic", "--topic-count", str(topics), "--queues", str(queues)])
    (store / PRODUCED).write_text(json.dumps({"messages": messages}))
    return store, messages


def warm(store: Path) -> None:
    """Read the CommitLog once, so every rebuild starts from the same warm page cache."""
    raw_read_seconds(store, commitlog_bytes(store)[1])


def fresh_dir(parent: Path, name: str) -> tuple[Path, list[Path]]:
    """A directory under `parent` that no earlier invocation used (`name`-<time>), and the ones earlier
    invocations left there (`name`-*): delete those with `drop_later` after measuring, never before, since a
    file system that has just freed many inodes makes the next creations pay for scanning past them."""
    parent.mkdir(parents=True, exist_ok=True)
    left = sorted(parent.glob(f"{name}-*"))
    fresh = parent / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    fresh.mkdir()
    return fresh, left


def drop_later(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


OUTPUTS_KEPT = ("every round's output in a directory of its own, kept until the scenario ends; "
                "earlier invocations' outputs deleted only after measuring")


# --- steps: what creating a ConsumeQueue file costs ------------------------------------------------------

class StepClock:
    """Microseconds spent in each named system call, summed."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}

    def __call__(self, step: str, fn, *args):
        t = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            self.ns[step] = self.ns.get(step, 0) + time.perf_counter_ns() - t


def _try(fn, *args):
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        return fn(*args)
    return None


def create_before(root: Path, topics: int, queues: int, header: bytes, clock: StepClock) -> None:
    """The steps from 341713d to aa0e540 (`_kernels.create_files` then, and the last flush's stats), file by file."""
    cq = root / "consumequeue"
    os.makedirs(cq, exist_ok=True)
    made = []
    for t in range(topics):
        for q in range(queues):
            d = f"{cq}/T{t}/{q}"
            path = f"{d}/{0:020d}"
            try:
                clock("mkdir", os.mkdir, d)
            except FileNotFoundError:  # the topic's first queue: mkdir -p
                clock("mkdir", os.mkdir, f"{cq}/T{t}")
                clock("mkdir", os.mkdir, d)
            clock("lstat", _try, os.lstat, path)
            fd = clock("open", os.open, path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            clock("ftruncate", os.ftruncate, fd, QUEUE_FILE_SIZE)
            if header:
                clock("pwrite header", os.pwrite, fd, header, 0)
                clock("fdatasync", os.fdatasync, fd)
            clock("rename", os.rename, path + ".tmp", path)
            clock("close", os.close, fd)
            made.append(path)
    for path in made:  # sync_file_systems stat'ed every file and directory of the last flush
        clock("stat (last flush)", os.stat, path)
        clock("stat (last flush)", os.stat, os.path.dirname(path))
    for t in range(topics):
        clock("stat (last flush)", os.stat, f"{cq}/T{t}")


def create_after(root: Path, topics: int, queues: int, header: bytes, clock: StepClock) -> None:
    """The steps now (`mappedfile.create_in_place`), file by file."""
    cq = root / "consumequeue"
    os.makedirs(cq, exist_ok=True)
    for t in range(topics):
        clock("mkdir", os.mkdir, f"{cq}/T{t}")
        for q in range(queues):
            d = f"{cq}/T{t}/{q}"
            clock("mkdir", os.mkdir, d)
            fd = clock("open", os.open, f"{d}/{0:020d}", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            clock("ftruncate", os.ftruncate, fd, QUEUE_FILE_SIZE)
            if header:
                clock("pwrite header", os.pwrite, fd, header, 0)
            clock("close", os.close, fd)


def create_kernel(root: Path, topics: int, queues: int, threads: int) -> tuple[float, float]:
    """`_kernels.create_files` over the topics split into `threads` slices, each on a thread: (wall, CPU)."""
    cq = root / "consumequeue"
    os.makedirs(cq, exist_ok=True)
    items = [(f"{cq}/T{t}/{q}", f"{cq}/T{t}/{q}/{0:020d}", b"", _kernels.MAKE_PARENT if q == 0 else 0)
             for t in range(topics) for q in range(queues)]
    step = -(-topics // threads) * queues
    slices = [items[at : at + step] for at in range(0, len(items), step)]
    c0, t0 = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for made in pool.map(lambda s: _kernels.create_files(s, QUEUE_FILE_SIZE), slices):
            assert all(fd == _kernels.CLOSED for fd in made)
    return time.perf_counter() - t0, time.process_time() - c0


def bench_steps(work: Path, rounds: int, topics: int = 2_000, queues: int = 4, headers: int = 500) -> dict:
    """Per-step microseconds per file, before and after, rounds interleaved; the kernel on 1, 2, 4 threads. What
    it made stays until the scenario ends (`measure`), so the rebuilds after it do not create past its deletion."""
    base, left = fresh_dir(work / "out", "steps")
    files = topics * queues
    per_round: dict[str, list[dict[str, float]]] = {"before": [], "after": [], "before, pre-blanks": [],
                                                     "after, pre-blanks": []}
    kernel: dict[int, list[tuple[float, float]]] = {1: [], 2: [], 4: []}
    for r in range(rounds):
        for name, fn in ((("before", create_before), ("after", create_after)) if r % 2 == 0 else
                         (("after", create_after), ("before", create_before))):
            clock = StepClock()
            c0, t0 = time.process_time(), time.perf_counter()
            fn(base / f"{name}-{r}", topics, queues, b"", clock)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            per_round[name].append({**{k: v / 1000 / files for k, v in clock.ns.items()},
                                    "all (wall)": wall * 1e6 / files, "all (CPU)": cpu * 1e6 / files})
            clock = StepClock()  # a first file with pre-blank units (a queue met past its offset 0)
            fn(base / f"{name}-blanks-{r}", headers // queues, queues, b"\0" * 20, clock)
            per_round[f"{name}, pre-blanks"].append({k: v / 1000 / headers for k, v in clock.ns.items()})
        for threads, runs in kernel.items():
            runs.append(create_kernel(base / f"kernel-{threads}-{r}", topics, queues, threads))
    steps = {name: {k: median_range([row[k] for row in rows], 1) for k in rows[0]} for name, rows in per_round.items()}
    par = {threads: {"wall_us": median_range([w * 1e6 / files for w, _ in runs], 1),
                     "cpu_us": median_range([c * 1e6 / files for _, c in runs], 1)} for threads, runs in kernel.items()}
    return {"scenario": "many-queues steps", "files": files, "topics": topics, "rounds": rounds, "steps": steps,
            "kernel_threads": par, "load": os.getloadavg()[0], "kept": OUTPUTS_KEPT, "directory": str(base),
            "left_before": [str(p) for p in left]}


def steps_table(r: dict) -> list[str]:
    before, after = r["steps"]["before"], r["steps"]["after"]
    names = [k for k in before if not k.startswith("all")] + [k for k in after if k not in before]
    lines = [f"\ncreating a ConsumeQueue file, us per file ({r['files']:,} files in {r['topics']:,} topic directories, "
             f"median (range) of {r['rounds']} interleaved rounds, load {r['load']:.1f}; {r['kept']}):",
             "| step | before (341713d to aa0e540) | after |", "|---|---:|---:|"]
    for k in [*names, "all (wall)", "all (CPU)"]:
        b = fmt(before[k], digits=1) if k in before else "-"
        a = fmt(after[k], digits=1) if k in after else "-"
        lines.append(f"| {k} | {b} | {a} |")
    # a queue met past its offset 0: its first file starts with pre-blank units
    blanks_before, blanks_after = r["steps"]["before, pre-blanks"], r["steps"]["after, pre-blanks"]
    for k in ("pwrite header", "fdatasync"):
        b = fmt(blanks_before[k], digits=1) if k in blanks_before else "-"
        a = fmt(blanks_after[k], digits=1) if k in blanks_after else "-"
        lines.append(f"| a first file with pre-blank units: {k} | {b} | {a} |")
    lines.append("\n| `_kernels.create_files`, threads | wall us per file | CPU us per file |")
    lines.append("|---|---:|---:|")
    for threads, m in r["kernel_threads"].items():
        lines.append(f"| {threads} | {fmt(m['wall_us'], digits=1)} | {fmt(m['cpu_us'], digits=1)} |")
    return lines


# --- rebuild: 64, 8,000 and 100,000 queues ------------------------------------------------------------

def bench_rebuilds(work: Path, scale: float, rounds: int, names: tuple[str, ...] = ("64", "8k", "100k")) -> dict:
    """Every store rebuilt `rounds` times into empty outputs of their own, round by round; the queue files kept
    until the scenario ends (`measure` removes them, and what earlier invocations left)."""
    stores = {name: ensure_store(work, name, scale) for name in names}
    outs, left = fresh_dir(work / "out", "many-queues")  # a writing command creates its output, not its parent
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            store, messages = stores[name]
            out = outs / f"{name}-{r}"
            config = write_config(work / f"many-{name}.yaml", store, out)
            warm(store)
            m = run_process([*REPUTD, "rebuild", "--config", str(config), "--json"])
            summary = last_json(m.pop("stdout"))
            assert summary["messages"] == messages, summary
            m["queues"] = summary["files"].get("consumequeue")
            runs[name].append(m)
            if r < rounds - 1:  # its IndexFile (one inode, 400 MB) now; its queue files stay till the end
                shutil.rmtree(out / "index", ignore_errors=True)
            print(f"rebuild {name} queues, round {r + 1}: {m['wall']:.2f} s, {m['cpu']:.2f} CPU-s "
                  f"({m['user']:.2f} user + {m['sys']:.2f} sys), {m['rss_mb']:.0f} MB, {m['fds']} fds, "
                  f"{m['maps']} maps", flush=True)
    last = {name: outs / f"{name}-{rounds - 1}" for name in names}
    result = {"scenario": "many-queues rebuild", "rounds": rounds, "load": os.getloadavg()[0], "stores": {},
              "kept": OUTPUTS_KEPT, "directory": str(outs), "left_before": [str(p) for p in left]}
    for name in names:
        messages = stores[name][1]
        rows = runs[name]
        result["stores"][name] = {
            "messages": messages, "queues": rows[-1]["queues"],
            "cpu_us_per_msg": median_range([m["cpu"] * 1e6 / messages for m in rows]),
            "wall_s": median_range([m["wall"] for m in rows]), "cpu_s": median_range([m["cpu"] for m in rows]),
            "user_s": median_range([m["user"] for m in rows]), "sys_s": median_range([m["sys"] for m in rows]),
            "rss_mb": median_range([m["rss_mb"] for m in rows], 0), "fds": max(m["fds"] for m in rows),
            "maps": max(m["maps"] for m in rows),
            "runs": [{k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()} for m in rows]}
    if "64" in runs:
        base = runs["64"]
        for name in names:
            if name == "64":
                continue
            rows, n64, n = runs[name], stores["64"][1], stores[name][1]
            # each round's ratio to the 64-queue rebuild of the same round
            result["stores"][name]["cpu_per_msg_ratio"] = median_range(
                [(m["cpu"] / n) / (b["cpu"] / n64) for m, b in zip(rows, base, strict=True)], 2)
            result["stores"][name]["wall_ratio"] = median_range(
                [(m["wall"] / n) / (b["wall"] / n64) for m, b in zip(rows, base, strict=True)], 2)
    result["outputs"] = {name: str(path) for name, path in last.items()}
    return result


def rebuild_table(r: dict) -> list[str]:
    lines = [f"\nrebuild, median (range) of {r['rounds']} interleaved rounds, load {r['load']:.1f} at the end; "
             f"{r['kept']}:",
             "| store | queues | CPU us/msg | CPU-s (user + sys) | wall s | x 64 queues, per message: CPU, wall | "
             "peak RSS MB | peak fds | peak maps |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["stores"].items():
        ratio = (f"{fmt(s['cpu_per_msg_ratio'], 'x')}, {fmt(s['wall_ratio'], 'x')}" if "cpu_per_msg_ratio" in s
                 else "1, 1")
        lines.append(f"| {s['messages']:,} messages, {name} | {s['queues']:,} | {fmt(s['cpu_us_per_msg'], digits=3)} | "
                     f"{s['cpu_s']['median']:.2f} ({s['user_s']['median']:.2f} + {s['sys_s']['median']:.2f}) | "
                     f"{fmt(s['wall_s'])} | {ratio} | {s['rss_mb']['median']:.0f} | {s['fds']:,} | {s['maps']:,} |")
    targets = []
    if "8k" in r["stores"] and "cpu_per_msg_ratio" in r["stores"]["8k"]:
        s = r["stores"]["8k"]
        targets.append(f"8,000 queues: CPU/msg {s['cpu_per_msg_ratio']['median']}x the 64-queue figure (target <= "
                       f"{TARGET_CPU_RATIO}x), wall {s['wall_ratio']['median']}x (<= {TARGET_WALL_RATIO}x)")
    if "100k" in r["stores"]:
        s = r["stores"]["100k"]
        targets.append(f"100,000 queues: {s['cpu_us_per_msg']['median']} us/msg (target <= {TARGET_100K_US}), "
                       f"{s['fds']} fds (<= {TARGET_FDS}), {s['maps']} maps (<= {TARGET_MAPS}), "
                       f"{s['rss_mb']['max']:.0f} MB (<= {TARGET_RSS_MB})")
    return lines + [f"targets: {t}" for t in targets]


def file_system_floor(steps: dict, rebuilds: dict) -> dict:
    """What the file system alone asks of each many-queue store in this run: its queues' files created as a rebuild
    creates them (`_kernels.create_files` on one thread: mkdir, open, ftruncate, close; CPU a file, median), per
    message, and that added to the 64-queue rebuild's CPU a message, as a ratio to it: a rebuild of that store
    cannot cost less here (its writes and its sync not counted)."""
    per_file = steps["kernel_threads"][1]["cpu_us"]["median"]
    base = rebuilds["stores"].get("64")
    out = {"cpu_us_per_file": per_file, "files": steps["files"], "stores": {}}
    for name, s in rebuilds["stores"].items():
        if name == "64":
            continue
        floor = per_file * s["queues"] / s["messages"]
        row = {"queues": s["queues"], "create_us_per_msg": round(floor, 3)}
        if base is not None:
            b = base["cpu_us_per_msg"]["median"]
            row["ratio_with_64q"] = round((b + floor) / b, 2)
        out["stores"][name] = row
    return out


def floor_lines(floor: dict) -> list[str]:
    lines = [f"\nthe file system's share: creating the files alone (`_kernels.create_files`, one thread), "
             f"{floor['cpu_us_per_file']} us CPU a file over {floor['files']:,} files (the same a file assumed for "
             f"every store):"]
    for row in floor["stores"].values():
        ratio = (f"; with the 64-queue rebuild's CPU a message: {row['ratio_with_64q']}x it"
                 if "ratio_with_64q" in row else "")
        lines.append(f"- {row['queues']:,} queues: {row['create_us_per_msg']} us a message{ratio}")
    return lines


# --- java: the 4.9.3 store's own rebuild ---------------------------------------------------------------

def java_command() -> list[str] | None:
    """The JavaRebuild command line, or None (and why, printed) without a JDK or the real store's build."""
    if shutil.which("java") is None or shutil.which("javac") is None or not (REALBROKER / "build.sh").is_file():
        print(f"java: skipped (needs java, javac and {REALBROKER}/build.sh)", flush=True)
        return None
    res = subprocess.run([str(REALBROKER / "build.sh")], capture_output=True, text=True, timeout=1800, check=False)
    if res.returncode != 0 or not res.stdout.strip():
        print(f"java: skipped (building the real store failed: {res.stderr.strip()[-300:]})", flush=True)
        return None
    build = res.stdout.strip().splitlines()[-1]
    return ["java", "-Xms256m", "-Xmx512m", "-Duser.timezone=UTC", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "--add-opens", "java.base/java.nio=ALL-UNNAMED", "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED",
            "--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED", "--add-exports", "java.base/sun.nio.ch=ALL-UNNAMED",
            "-cp", f"{build}/harness:{build}/classes:{build}/lib/*", "JavaRebuild"]


def _data_regions(fd: int, size: int) -> list[tuple[int, int]]:
    regions, at = [], 0
    while at < size:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole from here
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        regions.append((start, end))
        at = end
    return regions


def same_file(a: Path, b: Path) -> bool:
    """Byte for byte, reading only the parts either file holds data in (a sparse 6,000,000-byte queue file
    holds a page or two): the rest is zeros in both."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        size = os.fstat(fa.fileno()).st_size
        if size != os.fstat(fb.fileno()).st_size:
            return False
        for start, end in _data_regions(fa.fileno(), size) + _data_regions(fb.fileno(), size):
            if os.pread(fa.fileno(), end - start, start) != os.pread(fb.fileno(), end - start, start):
                return False
    return True


def same_as_broker(broker: Path, ours: Path) -> dict:
    """ConsumeQueue files byte for byte by path, IndexFiles byte for byte in name order."""
    def queue_files(root: Path) -> dict[str, Path]:
        return {str(p.relative_to(root)): p for p in (root / "consumequeue").rglob("*") if p.is_file()}

    b, o = queue_files(broker), queue_files(ours)
    same = sum(1 for n in b if n in o and same_file(b[n], o[n]))
    ib, io = sorted((broker / "index").iterdir()), sorted((ours / "index").iterdir())
    index_same = sum(1 for x, y in zip(ib, io, strict=False) if same_file(x, y))
    return {"queue_files": len(b), "queue_files_ours": len(o), "queue_files_identical": same,
            "index_files": len(ib), "index_files_identical": index_same,
            "identical": same == len(b) == len(o) and index_same == len(ib) == len(io)}


def bench_java(work: Path, scale: float, outputs: dict[str, str], names: tuple[str, ...] = ("64", "8k")) -> list[dict]:
    cmd = java_command()
    if cmd is None:
        return []
    rows = []
    for name in names:
        store, messages = ensure_store(work, name, scale)
        root = work / "out" / f"java-{name}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        warm(store)
        m = run_process([*cmd, "--store", str(root), "--commitlog", str(store / "commitlog"), "--messages",
                         str(messages), "--ha-port", "0"])
        figures = last_json(m.pop("stdout"))
        row = {"scenario": f"java rebuild {name}", "store": name, "messages": messages, "wall": round(m["wall"], 3),
               "cpu": round(m["cpu"], 3), "rss_mb": round(m["rss_mb"]), "java": figures}
        if name in outputs:
            row["compared"] = same_as_broker(root, Path(outputs[name]))
        shutil.rmtree(root, ignore_errors=True)
        rows.append(row)
        print(f"java rebuild {name} queues: {m['wall']:.1f} s, {m['cpu']:.1f} CPU-s; {row.get('compared')}",
              flush=True)
    return rows


def java_table(rows: list[dict], rebuilds: dict | None) -> list[str]:
    lines = ["\nthe 4.9.3 store's own rebuild (JavaRebuild, process start to exit) beside reputd's:",
             "| store | Java wall s | Java CPU-s | reputd wall s (median) | reputd x faster | files identical |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        ours = rebuilds["stores"].get(row["store"]) if rebuilds else None
        wall = ours["wall_s"]["median"] if ours else None
        c = row.get("compared")
        same = (f"{c['identical']} ({c['queue_files_identical']:,} of {c['queue_files']:,} queue files, "
                f"{c['index_files_identical']} of {c['index_files']} IndexFiles)") if c else "not compared"
        lines.append(f"| {row['messages']:,} messages, {row['store']} queues | {row['wall']:.1f} | {row['cpu']:.1f} | "
                     f"{wall if wall is not None else '-'} | "
                     f"{round(row['wall'] / wall, 1) if wall else '-'} | {same} |")
    return lines


# --- live: 100,000 msgs/s over 64 and 10,000 queues ------------------------------------------------------

def bench_live(work: Path, shape: str, seconds: float, rate: int = LIVE_RATE, scale: float = 1.0) -> dict:
    """`reputd run` following a writer at `rate` over LIVE_SHAPES[shape]; every queue made before the clock
    starts (a first round of one message each), then `seconds` of writing, measured."""
    topics, queues = LIVE_SHAPES[shape]
    if shape != "64":
        topics = max(8, int(topics * scale))
    tmp = work / f"live-{shape}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    latency_file = tmp / "latency.json"
    port = 19000 + random.randrange(900)
    cfg = {"store": {"storePathRootDir": str(tmp / "store")}, "output": {"dir": str(tmp / "out")},
           "metrics": {"port": port}, "logging": {"level": "warning", "format": "json"},
           "dispatchers": ["consumequeue", "index",
                           {"name": "bench.latency:LatencyDispatcher",
                            # the first round, one message a queue that creates the queues, is not counted
                            "options": {"path": str(latency_file), "skip": topics * queues}}]}
    (tmp / "reputd.yaml").write_text(yaml.safe_dump(cfg))
    width = len(str(topics - 1))
    writer = PacedWriter(str(tmp / "store" / "commitlog"), GIB,
                         topics=tuple(f"LiveTopic{i:0{width}d}" for i in range(topics)), queues=queues)
    proc = subprocess.Popen([*REPUTD, "run", "--config", str(tmp / "reputd.yaml")], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    handles = Handles(proc.pid)
    handles.start()
    try:
        _wait_up(proc, port)
        writer.write(topics * queues)  # every queue once: created before the measured part
        writer.flush()
        while _health(port)["reputFromOffset"] < writer.max_offset:
            time.sleep(0.01)
        time.sleep(2.0)
        cpu0, t0 = _proc_cpu(proc.pid), time.monotonic()
        wrote = writer.run(rate, seconds)
        writer.flush()
        while _health(port)["reputFromOffset"] < writer.max_offset:
            time.sleep(0.01)
        busy = (_proc_cpu(proc.pid) - cpu0) / (time.monotonic() - t0)
        rss = _proc_rss(proc.pid) / 2**20
    finally:
        handles.done.set()
        handles.join()
        proc.terminate()
        code = proc.wait(timeout=60)
        writer.close()
    lat = LatencyHistogram.load(str(latency_file)).summary()
    shutil.rmtree(tmp, ignore_errors=True)
    return {"scenario": f"many-queues live {shape}", "shape": shape, "queues": topics * queues,
            "rate_achieved": wrote["msgs_per_s"], "messages": wrote["messages"], "seconds": wrote["seconds"],
            "latency_ms_p50": lat["p50_ms"], "latency_ms_p99": lat["p99_ms"], "latency_ms_max": lat["max_ms"],
            "daemon_cpu": round(busy, 3), "peak_rss_mb": round(rss), "fds": handles.fds, "maps": handles.maps,
            "exit_code": code,
            "writer_stalls": wrote["stalls"], "load": os.getloadavg()[0]}


def live_table(rows: list[dict]) -> list[str]:
    lines = ["\nrun, a writer at 100,000 msgs/s (every queue written every second), append-to-dispatch latency:",
             "| queues | msgs/s | p50 ms | p99 ms | max ms | daemon CPU (of a core) | peak RSS MB | peak fds | "
             "peak maps | load |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['queues']:,} | {r['rate_achieved']:,} | {r['latency_ms_p50']} | {r['latency_ms_p99']} | "
                     f"{r['latency_ms_max']} | {r['daemon_cpu']:.1%} | {r['peak_rss_mb']} | {r['fds']} | "
                     f"{r['maps']} | {r['load']:.1f} |")
    by = {r["shape"]: r for r in rows}
    if "64" in by and "10k" in by:
        lines.append(f"targets: 10,000 queues p99 {by['10k']['latency_ms_p99']} ms (<= {TARGET_LIVE_P99_MS}), "
                     f"CPU {by['10k']['daemon_cpu'] / by['64']['daemon_cpu']:.2f}x the 64-queue run's "
                     f"(<= {TARGET_LIVE_CPU_RATIO}x)")
    return lines


# --- the scenario ---------------------------------------------------------------------------------------

PARTS = ("steps", "rebuild", "java", "live")


def measure(work: Path, scale: float = 1.0, rounds: int = 3, only: tuple[str, ...] = PARTS,
            live_seconds: float = 20.0, stores: tuple[str, ...] = tuple(STORES)) -> dict:
    """Every part `only` names; the figures and a `table` of printable lines."""
    out: dict = {"scenario": "many-queues", "parts": {}}
    table: list[str] = []
    try:
        _measure(out, table, work, scale, rounds, only, live_seconds, stores)
    finally:  # every part's outputs, and what earlier invocations left, once nothing is measured any more
        drop_later([Path(p) for part in out["parts"].values() if isinstance(part, dict) and "directory" in part
                    for p in (part["directory"], *part["left_before"])])
    out["table"] = table
    return out


def _measure(out: dict, table: list[str], work: Path, scale: float, rounds: int, only: tuple[str, ...],
             live_seconds: float, stores: tuple[str, ...]) -> None:
    if "steps" in only:
        out["parts"]["steps"] = r = bench_steps(work, rounds, topics=max(20, int(2_000 * scale)))
        table += steps_table(r)
    rebuilds = None
    if "rebuild" in only:
        out["parts"]["rebuild"] = rebuilds = bench_rebuilds(work, scale, rounds, stores)
        table += rebuild_table(rebuilds)
    if "steps" in only and rebuilds is not None:
        out["parts"]["floor"] = floor = file_system_floor(out["parts"]["steps"], rebuilds)
        table += floor_lines(floor)
    if "java" in only:
        out["parts"]["java"] = rows = bench_java(work, scale, rebuilds["outputs"] if rebuilds else {},
                                                 tuple(n for n in ("64", "8k") if n in stores))
        if rows:
            table += java_table(rows, rebuilds)
    if "live" in only:
        out["parts"]["live"] = rows = [bench_live(work, shape, live_seconds, scale=scale) for shape in LIVE_SHAPES]
        table += live_table(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "suite")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tenth of every store, one round, short live runs")
    ap.add_argument("--only", default="steps,rebuild,java,live")
    ap.add_argument("--live-seconds", type=float, default=20.0)
    ap.add_argument("--stores", default=",".join(STORES), help="the rebuild's stores (and java's): 64,8k,100k")
    args = ap.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    result = measure(work, 0.1 if args.quick else 1.0, 1 if args.quick else args.rounds,
                     tuple(args.only.split(",")), 5.0 if args.quick else args.live_seconds,
                     tuple(args.stores.split(",")))
    print("\n".join(result.pop("table")))
    (work / "many-queues.json").write_text(json.dumps(result, indent=2))
    print(f"\nfigures: {work / 'many-queues.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
