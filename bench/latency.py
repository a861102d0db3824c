"""A dispatcher plug-in for benchmarks: append-to-dispatch latency of every record, from its store
timestamp (the writer's wall clock, in ms) to the moment the batch reaches this dispatcher."""

from __future__ import annotations

import json
import time

import numpy as np


class LatencyDispatcher:
    name = "latency"

    def __init__(self, options, store, output_dir):
        self.path = options["path"]
        self.samples: list[np.ndarray] = []

    def dispatch(self, batch) -> None:
        now_ms = time.time() * 1000.0
        self.samples.append(now_ms - batch.store_timestamp.astype(np.float64))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        lat = np.concatenate(self.samples) if self.samples else np.zeros(0)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump({"count": len(lat), "latency_ms": lat.tolist()}, f)
