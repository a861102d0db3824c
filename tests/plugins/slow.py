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
