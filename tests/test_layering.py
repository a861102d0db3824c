"""indexcore is the pure format library: it must not pull in the service, threads, logging or config."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import indexcore

FORBIDDEN = ("daemon", "structlog", "yaml", "prometheus_client", "pyspark", "watchdog", "logging", "threading",
             "concurrent", "asyncio")


def test_indexcore_imports_no_runtime_machinery():
    """Importing every indexcore module in a fresh interpreter loads none of the daemon's runtime modules."""
    modules = [f"indexcore.{m.name}" for m in pkgutil.iter_modules(indexcore.__path__)]
    code = (
        "import importlib, json, sys\n"
        f"before = set(sys.modules)\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert len(modules) >= 10
    assert [m for m in loaded if m.split(".")[0] in FORBIDDEN] == []


def test_the_cli_and_the_daemon_do_not_load_pyspark():
    """PySpark is the optional [backfill] extra: every other command, and the daemon image, do without it."""
    code = "import sys, daemon.cli, daemon.engine.reput; sys.exit(1 if 'pyspark' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
