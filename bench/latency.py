"""A dispatcher plug-in for benchmarks: append-to-dispatch latency of every record, from its store
timestamp (the writer's wall clock, in ms) to the moment the batch reaches this dispatcher (listed after
`consumequeue`, that is once the record's ConsumeQueue unit is written).

Samples go into a histogram of fixed buckets (`LatencyHistogram`), not a list: its memory is the same
after an hour at 100,000 msgs/s as after a second, and histograms of several runs (a daemon restarted)
add up. The file is written when the dispatcher closes and, so that a `kill -9` loses little, every
`WRITE_EVERY_S` from the flush thread's call.
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

# Bucket edges in ms: 0, then geometric from LOWEST_MS to HIGHEST_MS with STEP relative width (every
# percentile read from the histogram is within STEP of the true one); above the last edge, one bucket.
LOWEST_MS, HIGHEST_MS, STEP = 0.01, 3_600_000.0, 0.02
WRITE_EVERY_S = 10.0


def _edges() -> np.ndarray:
    n = math.ceil(math.log(HIGHEST_MS / LOWEST_MS) / math.log1p(STEP))
    return np.concatenate(([0.0], LOWEST_MS * (1 + STEP) ** np.arange(n + 1)))


EDGES_MS = _edges()


class LatencyHistogram:
    """Counts of latencies (ms) in the buckets of EDGES_MS, with the exact count, sum, min and max."""

    def __init__(self) -> None:
        self.counts = np.zeros(len(EDGES_MS) + 1, dtype=np.int64)  # [below 0, buckets..., above the last edge]
        self.count = 0
        self.total_ms = 0.0
        self.min_ms = math.inf
        self.max_ms = -math.inf

    def add(self, latency_ms: np.ndarray) -> None:
        if not len(latency_ms):
            return
        self.counts += np.bincount(np.searchsorted(EDGES_MS, latency_ms, side="right"), minlength=len(self.counts))
        self.count += len(latency_ms)
        self.total_ms += float(latency_ms.sum())
        self.min_ms = min(self.min_ms, float(latency_ms.min()))
        self.max_ms = max(self.max_ms, float(latency_ms.max()))

    def merge(self, other: LatencyHistogram) -> None:
        self.counts += other.counts
        self.count += other.count
        self.total_ms += other.total_ms
        self.min_ms = min(self.min_ms, other.min_ms)
        self.max_ms = max(self.max_ms, other.max_ms)

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0-100): the upper edge of the bucket holding it, capped by the maximum."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q / 100 * self.count))
        i = int(np.searchsorted(np.cumsum(self.counts), rank))
        upper = self.min_ms if i == 0 else self.max_ms if i >= len(EDGES_MS) else EDGES_MS[i]
        return float(min(max(upper, self.min_ms), self.max_ms))

    def summary(self) -> dict:
        def r(x):
            return None if x is None else round(x, 2)

        return {"count": self.count, "p50_ms": r(self.percentile(50)), "p99_ms": r(self.percentile(99)),
                "p999_ms": r(self.percentile(99.9)), "max_ms": r(self.max_ms if self.count else None),
                "mean_ms": r(self.total_ms / self.count if self.count else None)}

    def to_dict(self) -> dict:
        nonzero = np.flatnonzero(self.counts)
        return {**self.summary(), "min_ms": self.min_ms if self.count else None, "total_ms": self.total_ms,
                "step": STEP, "lowest_ms": LOWEST_MS, "highest_ms": HIGHEST_MS,
                "buckets": {str(int(i)): int(self.counts[i]) for i in nonzero}}

    @classmethod
    def from_dict(cls, d: dict) -> LatencyHistogram:
        if (d.get("step"), d.get("lowest_ms"), d.get("highest_ms")) != (STEP, LOWEST_MS, HIGHEST_MS):
            raise ValueError("a latency histogram with other buckets")
        h = cls()
        for i, c in d["buckets"].items():
            h.counts[int(i)] = c
        h.count = int(d["count"])
        h.total_ms = float(d["total_ms"])
        if h.count:
            h.min_ms, h.max_ms = float(d["min_ms"]), float(d["max_ms"])
        return h

    @classmethod
    def load(cls, path: str) -> LatencyHistogram:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


class LatencyDispatcher:
    name = "latency"

    def __init__(self, options, store, output_dir):
        self.path = options["path"]
        self.skip = int(options.get("skip", 0))  # the first records not counted: a warm-up before the measuring
        self.histogram = LatencyHistogram()
        self._written = time.monotonic()

    def dispatch(self, batch) -> None:
        now_ms = time.time() * 1000.0
        latency_ms = now_ms - batch.store_timestamp.astype(np.float64)
        if self.skip:
            skipped = min(self.skip, len(latency_ms))
            self.skip -= skipped
            latency_ms = latency_ms[skipped:]
        self.histogram.add(latency_ms)

    def flush(self) -> None:
        if time.monotonic() - self._written >= WRITE_EVERY_S:
            self._write()

    def close(self) -> None:
        self._write()

    def _write(self) -> None:
        self._written = time.monotonic()
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.histogram.to_dict(), f)
        os.replace(tmp, self.path)
