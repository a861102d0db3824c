"""The command-line tools some tests run (promtool, jq, systemd-analyze, java): `.ci/system-tools` installs
them; a test that finds one missing skips saying why, or with CI=true fails, so CI never skips it unseen."""

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
