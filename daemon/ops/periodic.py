"""The daemon's one shape of a thread that works every interval until stopped (STYLE.md 9): it waits on a
`threading.Event` with the interval, never `time.sleep`, so `stop()` returns within the tick in hand."""

from __future__ import annotations

import threading


class Periodic:
    """Calls `tick()` every `interval` seconds on a thread named `name`, from `start()` until `stop()`;
    `_stop` is the event a long tick may wait on too, to stop part-way."""

    def __init__(self, name: str, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()
