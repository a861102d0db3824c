"""The file system's floor of a rebuild over many queues: what creating each queue's directory and first file and
giving it its first write costs, with nothing of reputd around it, and the one syncfs after.

    python bench/fs_floor.py DIR [--topics 2000] [--queues 4] [--units 250]

DIR must not exist (it is made). The files are made as a rebuild makes them (`_kernels.create_files`, 128 at a time,
each new topic's directory by its first queue), each written once (`_kernels.pwrite_many`: UNITS units of 20 bytes)
and closed; then one syncfs. Prints the process's CPU a file (getrusage) and in all: divided by a store's messages
and set beside the 64-queue rebuild's CPU a message, it is the least a rebuild of that many queues can cost on this
file system (issue 43's 1.5x and 5 us targets were read against it). Deleting many files shortly before makes
creation dearer on ext4 (its recently-deleted scan, minutes): run it on a file system left alone for a while.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from indexcore import _kernels
from indexcore.mappedfile import sync_file_system

QUEUE_FILE_SIZE = 300_000 * 20  # mappedFileSizeConsumeQueue's default
PIECE = 128


def cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--topics", type=int, default=2_000)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--units", type=int, default=250, help="units each queue's first write puts (20 bytes each)")
    args = ap.parse_args()
    cq = args.dir / "consumequeue"
    os.makedirs(cq)
    data = b"\1" * (args.units * 20)
    items = [(f"{cq}/T{t}/{q}", f"{cq}/T{t}/{q}/{0:020d}", b"", _kernels.MAKE_PARENT if q == 0 else 0)
             for t in range(args.topics) for q in range(args.queues)]
    c0, s0 = cpu()
    t0 = time.perf_counter()
    for at in range(0, len(items), PIECE):
        fds = _kernels.create_files([(d, p, h, f | _kernels.KEEP_OPEN) for d, p, h, f in items[at : at + PIECE]],
                                    QUEUE_FILE_SIZE)
        failed = _kernels.pwrite_many([(fd, data, 0) for fd in fds])
        for fd in fds:
            os.close(fd)
        if failed is not None:
            raise OSError(failed[3], f"write {failed[0]} of piece at {at} failed")
    c1, s1 = cpu()
    sync_file_system(str(cq))
    c2, _ = cpu()
    wall = time.perf_counter() - t0
    n = len(items)
    print(f"{n} files: create+write {(c1 - c0) / n * 1e6:.1f} us CPU a file (sys {(s1 - s0) / n * 1e6:.1f}), syncfs "
          f"{(c2 - c1) / n * 1e6:.1f} us a file in-process, wall {wall:.2f} s; all {c2 - c0:.3f} CPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
