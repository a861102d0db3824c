"""Fast mode for `make test`, long mode for `make stress`, and the figures each suite reports.

`REPUTD_STRESS=1` selects the long mode. Every suite that has one calls `report()` with its figures:
the line goes to stdout (make stress runs pytest with -s) and, when `REPUTD_STRESS_REPORT` names a
file, one JSON object per line is appended to it so the run's figures can be collected afterwards.
"""

from __future__ import annotations

import json
import os

STRESS = os.environ.get("REPUTD_STRESS") == "1"


def scale(fast: int, stress: int) -> int:
    """The count to use in this mode."""
    return stress if STRESS else fast


def report(suite: str, **figures) -> None:
    print(f"\nSTRESS-REPORT {suite}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
    path = os.environ.get("REPUTD_STRESS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"suite": suite, "stress": STRESS, **figures}) + "\n")
