"""The command-line tools some tests run (promtool, jq, systemd-analyze, java): `.ci/system-tools` installs
them; a test that finds one missing skips saying why, or with CI=true fails, so CI never skips it unseen.
Also `catches`, for the tests that signal a command while it starts."""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(tool: str, package: str, what: str) -> str:
    """The path of `tool`; skip (fail under CI=true) naming its Debian package and what was not run."""
    path = shutil.which(tool)
    if path is not None:
        return path
    reason = (f"{tool} is not installed (Debian: apt-get install --no-install-recommends {package}, or as root "
              f".ci/system-tools --install); {what}")
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc): a test waits for it before
    signalling a command that is starting."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)
