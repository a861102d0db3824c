"""`reputd run`: its options and its front end (the service itself is daemon/engine/reput.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from daemon.cli import startsignals
from daemon.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    _check_inputs,
    _check_store_root,
    _check_store_root_sizes,
    _config_in_use,
    _lock_output,
    _store_command,
    _warn_abort,
    created_note,
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
    else:  # but not for a store root: a path that does not exist is a mistake, as in every command
        _check_store_root(args, config)
    _check_store_root_sizes(config)
    _lock_output(args, config)  # a directory it creates is said once the service has opened it
    _warn_abort(args, config)
    raise_open_files_limit()

    ended: dict = {}
    code = run_daemon(config, until_caught_up=args.until_caught_up, on_exit=ended.update,
                      on_started=lambda: created_note(args))
    startsignals.command_finished()  # the service has stopped: a signal now changes nothing
    broker = ended.get("brokerLockTaken")  # exit 2 too, but no config error (daemon/engine/brokerlock.py)
    if args.until_caught_up and (code != EXIT_USAGE or broker):  # a config error dispatched nothing: its line is all
        s = ended
        seconds = max(s["seconds"], 1e-9)
        state = "caught up" if s["caughtUp"] else "stopped before the end"
        checkpoint = "no checkpoint written" if s["checkpointOffset"] is None else \
            f"checkpoint at {s['checkpointOffset']}"
        print(f"{state}: dispatched {s['messages']:,} messages, {s['bytes']:,} bytes [{s['startOffset']}, "
              f"{s['endOffset']}) in {s['seconds']:.2f} s ({s['messages'] / seconds:,.0f} msgs/s); {checkpoint}; "
              f"output {config.output.dir}", file=sys.stderr)
    if code != EXIT_OK:  # the log on stdout has the events; stderr has the one line every command gives
        why = ended.get("error") or "see the log's error events"
        if code == EXIT_USAGE and not broker:
            print(f"reputd: config error: {why} ({_config_in_use(args)})", file=sys.stderr)
        else:
            print(f"reputd: error: {why}", file=sys.stderr)
    return code
