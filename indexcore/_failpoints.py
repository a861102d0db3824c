"""Test hook, not an API: the named steps of creating and rolling an output file, where the crash matrix
(tests/test_crash_matrix.py) stops the process to check that recovery from each of them is exact.

`hook` is None, and `reached` a no-op, unless a test installs one (the daemon does so only when its
REPUTD_FAILPOINT variable is set: daemon/ops/failpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable

hook: Callable[[str], None] | None = None


def reached(point: str) -> None:
    if hook is not None:
        hook(point)
