"""A third-party dispatcher for tests of the daemon's start and stop: its construction (part of start-up
recovery) can work for `options.startup_cpu_seconds` or hang for `options.startup_sleep_seconds`, and its
flush waits while the file named by `options.hold_flush_while` exists. `options.startup_times_file` receives
the construction's start and end (time.monotonic(), one clock for every process), for a test that runs the
daemon in a process of its own."""

from __future__ import annotations

import os
import time


class GatedDispatcher:
    name = "gated"
    startup: tuple[float, float] | None = None  # time.monotonic() when the slow construction began and ended

    def __init__(self, options, store, output_dir):
        self.hold = options.get("hold_flush_while", "")
        began = time.monotonic()
        deadline = began + float(options.get("startup_cpu_seconds", 0))
        while time.monotonic() < deadline:  # a recovery that works: it uses CPU
            sum(range(10_000))
        time.sleep(float(options.get("startup_sleep_seconds", 0)))  # one that hangs: it does not
        GatedDispatcher.startup = (began, time.monotonic())
        if options.get("startup_times_file"):
            with open(options["startup_times_file"], "w") as f:
                f.write(" ".join(map(repr, GatedDispatcher.startup)))

    def dispatch(self, batch) -> None:
        pass

    def flush(self) -> None:
        while self.hold and os.path.exists(self.hold):
            time.sleep(0.01)

    def close(self) -> None:
        pass
