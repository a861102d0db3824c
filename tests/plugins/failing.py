"""A third-party dispatcher for tests that fails on demand: while the file named by `options.fail_if`
exists, every batch raises, as a dispatcher on a full disk would; while `options.fail_flush_if` exists,
every flush does."""

from __future__ import annotations

import os


class FailingDispatcher:
    name = "failing"

    def __init__(self, options, store, output_dir):
        self.fail_if = options.get("fail_if", "")
        self.fail_flush_if = options.get("fail_flush_if", "")
        self.batches = 0

    def dispatch(self, batch) -> None:
        if self.fail_if and os.path.exists(self.fail_if):
            raise OSError(28, f"No space left on device (simulated by {self.fail_if})")
        self.batches += 1

    def flush(self) -> None:
        if self.fail_flush_if and os.path.exists(self.fail_flush_if):
            raise OSError(5, f"Input/output error (simulated by {self.fail_flush_if})")

    def close(self) -> None:
        pass
