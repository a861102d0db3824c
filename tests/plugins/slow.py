"""A third-party dispatcher for tests whose flush takes `options.flush_seconds`, as on a stalled disk."""

from __future__ import annotations

import time


class SlowFlushDispatcher:
    name = "slow"

    def __init__(self, options, store, output_dir):
        self.flush_seconds = float(options["flush_seconds"])

    def dispatch(self, batch) -> None:
        pass

    def flush(self) -> None:
        time.sleep(self.flush_seconds)

    def close(self) -> None:
        pass


class SlowDispatchDispatcher:
    """Takes `options.dispatch_seconds` over every batch and touches `options.started` at the first one,
    so a test can signal a rebuild while it is in the middle of the CommitLog."""

    name = "slow-dispatch"

    def __init__(self, options, store, output_dir):
        self.seconds = float(options["dispatch_seconds"])
        self.started = options["started"]

    def dispatch(self, batch) -> None:
        with open(self.started, "a", encoding="utf-8") as f:
            f.write(f"{batch.start_offset}\n")
        time.sleep(self.seconds)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
