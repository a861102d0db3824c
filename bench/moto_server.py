"""An S3-API server for the backfill's archive paths: moto in server mode, a subprocess on a free port of
127.0.0.1. The benchmark's S3 row and tests/test_backfill_s3.py both read segments from it."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

from bench.spark_cluster import HOST, free_port

START_TIMEOUT_S = 60.0


class MotoServerError(RuntimeError):
    """The server did not answer in time (or exited)."""


def start_moto_server(timeout: float = START_TIMEOUT_S) -> tuple[subprocess.Popen, str]:
    """Start the server and wait until it answers; (the process, its endpoint URL). Stop it with
    `proc.terminate(); proc.wait()`."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://{HOST}:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
            return proc, endpoint
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                proc.wait()
                raise MotoServerError(f"moto server did not start on {endpoint}") from None
            time.sleep(0.2)
