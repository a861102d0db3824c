"""What deleting an output file costs on this disk, and what a deletion rate does to the flusher's syncs.

Files shaped like reputd's (a 300-unit ConsumeQueue file of 6,000 bytes, a default 6,000,000-byte one
written in full, an IndexFile allocated in full) are created and synced, then unlinked at a given rate
(files a second; 0: as fast as one thread can) while a probe writes 4 KiB and fdatasyncs every 20 ms, as
the flusher does. It prints per kind and rate: the unlink's own time (mean, max), files and MiB a second,
and the probe's sync latency before and during the deletions (and 6 s after, when the journal commits the
frees, and a disk mounted with discard trims them). The defaults of `retention.deleteFilesPerSecond` and
`deleteBytesPerSecond` come from this (daemon/engine/cleanplan.py).

    .venv/bin/python bench/unlink_cost.py [--dir /path/on/the/output/disk] [--runs cq6k:20000:0,...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

MIB = 1024 * 1024
# kind: (file size, bytes written, allocated in full)
KINDS = {"cq6k": (6000, 6000, False), "cq6m": (6_000_000, 6_000_000, False), "index4m": (4_020_040, 40, True)}
DEFAULT_RUNS = "cq6k:20000:0,cq6k:20000:1000,cq6k:20000:2000,cq6m:500:0,cq6m:500:40,index4m:200:0"


def make(path: str, size: int, written: int, allocate: bool) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        if allocate:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        os.pwrite(fd, b"\x01" * written, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


def one(root: str, kind: str, n: int, rate: float) -> str:
    size, written, allocate = KINDS[kind]
    directory = tempfile.mkdtemp(prefix=f"unlink-{kind}-", dir=root)
    paths = [os.path.join(directory, f"{i:020d}") for i in range(n)]
    for path in paths:
        make(path, size, written, allocate)
    os.sync()
    time.sleep(8)  # the journal commits what the creations left
    probe = os.open(os.path.join(directory, "probe"), os.O_CREAT | os.O_WRONLY, 0o644)
    latencies: list[float] = []
    stop = threading.Event()

    def prober() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            os.pwrite(probe, b"x" * 4096, 0)
            os.fdatasync(probe)
            latencies.append(time.perf_counter() - started)
            stop.wait(0.02)

    thread = threading.Thread(target=prober)
    thread.start()
    time.sleep(5)
    before, latencies[:] = list(latencies), []
    costs = []
    began = time.perf_counter()
    for i, path in enumerate(paths):
        started = time.perf_counter()
        os.unlink(path)
        costs.append(time.perf_counter() - started)
        if rate:
            delay = began + (i + 1) / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
    wall = time.perf_counter() - began
    time.sleep(6)
    during = list(latencies)
    stop.set()
    thread.join()
    os.close(probe)
    shutil.rmtree(directory)
    return (f"| {kind} | {n:,} | {rate or 'max'} | {n / wall:,.0f} | {n * size / wall / MIB:,.0f} | "
            f"{statistics.mean(costs) * 1e6:,.0f} | {max(costs) * 1e3:.1f} | "
            f"{quantile(before, 0.5):.1f} / {quantile(before, 0.99):.1f} | "
            f"{quantile(during, 0.5):.1f} / {quantile(during, 0.99):.1f} / {quantile(during, 1):.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="kind:files:rate,... (rate 0: as fast as possible)")
    args = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.2f}; {args.dir}")
    print("| kind | files | rate asked | files/s | MiB/s | unlink mean us | unlink max ms | probe sync ms p50 / p99 "
          "before | during (+6 s) p50 / p99 / max |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for run in args.runs.split(","):
        kind, n, rate = run.split(":")
        print(one(args.dir, kind, int(n), float(rate)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
