"""The container image's HEALTHCHECK: `python -m daemon.healthcheck` (an entry that runs this module).

Asks the daemon's `/healthz` on the loopback and prints one line with its answer — the status and the
reason the daemon gives — because Docker keeps a check's output in `docker inspect` (State.Health.Log):
that line, not a Python traceback, is what an operator reads there. Exit 0 while reputd runs (healthy or
degraded), 1 when it is down or does not answer, as HEALTHCHECK expects. Standard library only (it runs
every interval; importing daemon.ops.metrics would triple its start-up), so the few names it shares with the
daemon are repeated here and tests/test_packaging.py holds them equal.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

HEALTH_PATH, DOWN = "/healthz", "down"  # daemon.ops.metrics.HEALTH_PATH and DOWN
PORT_VARIABLE = "REPUTD_METRICS_PORT"  # the daemon's own override of metrics.port
DEFAULT_PORT = 9108  # metrics.port in config/reputd.yaml
TIMEOUT_S = 4  # below the Dockerfile's HEALTHCHECK --timeout, so this process reports, not Docker's kill
EXIT_RUNNING, EXIT_UNHEALTHY = 0, 1
DETAIL_KEYS = ("reputFromOffset", "commitLogMaxOffset", "checkpointOffset")


def health_url(env: dict[str, str]) -> str:
    return f"http://127.0.0.1:{env.get(PORT_VARIABLE) or DEFAULT_PORT}{HEALTH_PATH}"


def probe(url: str, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """(exit code, the line to print) for one request to `url`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            code, body = response.status, response.read()
    except urllib.error.HTTPError as e:  # 503 while down: its body says why
        code, body = e.code, e.read()
    except (OSError, ValueError) as e:  # refused, timed out, unreachable: no daemon to ask
        return EXIT_UNHEALTHY, f"unhealthy: no answer from {url}: {getattr(e, 'reason', None) or e}"
    try:
        answer = json.loads(body)
        status = str(answer["status"])
    except (ValueError, TypeError, KeyError):
        return EXIT_UNHEALTHY, f"unhealthy: {url} answered HTTP {code} without a reputd health status: {body[:200]!r}"
    reason = answer.get("reason") or ""
    details = ", ".join(f"{k} {answer[k]}" for k in DETAIL_KEYS if k in answer)
    line = f"{status}{': ' + reason if reason else ''} (HTTP {code}{'; ' + details if details else ''})"
    return (EXIT_UNHEALTHY if status == DOWN or code >= 400 else EXIT_RUNNING), line


def main() -> int:
    code, line = probe(health_url(dict(os.environ)))
    print(line, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
