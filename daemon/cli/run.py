"""`reputd run`: its options and its front end (the service itself is daemon/engine/reput.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from daemon.cli import startsignals
from daemon.cli.common import (
    UsageError,
    _check_inputs,
    _check_store_root_sizes,
    _lock_output,
    _store_command,
    _warn_abort,
    raise_open_files_limit,
)

if TYPE_CHECKING:
    from daemon.config import Config


def _add_run(sub) -> None:
    p = _store_command(sub, "run", "Follow the CommitLog as a broker writes it and keep consumequeue/ and index/ "
                                   "current.")
    p.add_argument("--until-caught-up", action="store_true",
                   help="dispatch everything readable now, flush, checkpoint, print a summary and exit 0")
    p.add_argument("--metrics", action="store_true",
                   help="with --until-caught-up: serve /metrics and /healthz too (without it, no port is opened)")
    p.set_defaults(handler=cmd_run)


def cmd_run(args, config: Config) -> int:
    import dataclasses

    from daemon.ops.logs import configure_logging

    configure_logging(config.logging.level, config.logging.format, stream=sys.stdout)
    from daemon.engine.reput import run_daemon  # watchdog, prometheus-client: only `run` needs them

    if args.metrics and not args.until_caught_up:
        raise UsageError("--metrics goes with --until-caught-up (`run` serves metrics as metrics.enabled says)")
    if args.until_caught_up and not args.metrics:
        config = dataclasses.replace(config, metrics=dataclasses.replace(config.metrics, enabled=False))
    if args.until_caught_up:  # the daemon waits for a CommitLog that is not there yet (a mount, a new broker)
        _check_inputs(args, config, data=False)  # a missing commitlog/ it logs (recovery_failed) and exits 1
    _check_store_root_sizes(config)
    _lock_output(args, config)
    _warn_abort(args, config)
    raise_open_files_limit()

    def summary(s: dict) -> None:
        startsignals.command_finished()  # the service has stopped: a signal now changes nothing
        if args.until_caught_up:
            seconds = max(s["seconds"], 1e-9)
            state = "caught up" if s["caughtUp"] else "stopped before the end"
            print(f"{state}: dispatched {s['messages']:,} messages, {s['bytes']:,} bytes [{s['startOffset']}, "
                  f"{s['endOffset']}) in {s['seconds']:.2f} s ({s['messages'] / seconds:,.0f} msgs/s); checkpoint "
                  f"at {s['checkpointOffset']}; output {config.output.dir}", file=sys.stderr)
        if s.get("error"):  # in every mode: a broker that took the lock (daemon/engine/brokerlock.py) ends any run
            print(f"reputd: error: {s['error']}", file=sys.stderr)

    return run_daemon(config, until_caught_up=args.until_caught_up, on_exit=summary)
