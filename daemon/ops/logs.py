"""structlog set-up: JSON lines by default, console rendering on a terminal."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Route structlog events to `stream` (stderr by default, so command output on stdout stays clean)."""
    stream = stream or sys.stderr
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
    renderer = structlog.dev.ConsoleRenderer(colors=False) if console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def get_logger(**context):
    return structlog.get_logger("reputd").bind(**context)


REPEAT_INTERVAL_S = 60.0  # one line per identical failure per minute at most, after the first


class RepeatedFailures:
    """Rate limit for a failure that repeats identically (a full output disk fails every flush, twice a
    second): the first is logged at once; the same one again within REPEAT_INTERVAL_S is only counted, and
    the next after it is logged with `repeated` (how many were held back since the last line) and
    `repeated_over_s`. `ended(key)` says how many were held back when the failure stops, for one summary
    line. Keys are what makes two failures the same (event, file, errno, ...), never a changing figure.
    Thread-safe: the loop and the flusher both report."""

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S, clock=None):
        self.interval_s = interval_s
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._seen: dict[tuple, list] = {}  # key -> [time of the last line, repeats held back since]

    def admit(self, key: tuple) -> dict | None:
        """The fields to add to this failure's line, or None to hold it back (it is counted)."""
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                self._seen[key] = [now, 0]
                return {}
            if now - seen[0] < self.interval_s:
                seen[1] += 1
                return None
            fields = {"repeated": seen[1], "repeated_over_s": round(now - seen[0], 1)} if seen[1] else {}
            self._seen[key] = [now, 0]
            return fields

    def ended(self, match=lambda key: True) -> list[tuple[tuple, int, float]]:
        """Forget the failures whose key `match`es; (key, repeats held back since their last line, seconds
        since it) for those with any, for a closing line."""
        now = self._clock()
        with self._lock:
            done = [k for k in self._seen if match(k)]
            out = [(k, self._seen[k][1], round(now - self._seen[k][0], 1)) for k in done if self._seen[k][1]]
            for k in done:
                del self._seen[k]
            return out
