"""`reputd` with start-up beats every BEAT seconds instead of systemd's 10, for the start-up contract's tests:

    python -m tests.plugins.beats BEAT PROGRESS_CPU_S run --config ...

The daemon runs in a process of its own, so that what the beats measure (the process's CPU and I/O) is the
daemon's alone, not a test runner's (a garbage collection of a long pytest session's heap, another test's
thread)."""

from __future__ import annotations

import sys

from daemon.cli import main
from daemon.engine import reput

if __name__ == "__main__":
    reput.STARTUP_BEAT_S = float(sys.argv[1])
    reput.STARTUP_PROGRESS_CPU_S = float(sys.argv[2])
    sys.exit(main(sys.argv[3:]))
