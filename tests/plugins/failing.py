"""A third-party dispatcher for tests that fails on demand: while the file named by `options.fail_if`
exists, every batch raises, as a dispatcher on a full disk would."""

from __future__ import annotations

import os


class FailingDispatcher:
    name = "failing"

    def __init__(self, options, store, output_dir):
        self.fail_if = options["fail_if"]
        self.batches = 0

    def dispatch(self, batch) -> None:
        if os.path.exists(self.fail_if):
            raise OSError(28, f"No space left on device (simulated by {self.fail_if})")
        self.batches += 1

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
