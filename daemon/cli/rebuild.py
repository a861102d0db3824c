"""`reputd rebuild`: its options and its front end: progress bar, signals, the summary line (the rebuild
itself is daemon/engine/rebuild.py)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from daemon.cli import startsignals
from daemon.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    _check_commit_log,
    _check_inputs,
    _check_record_boundaries,
    _check_store_root_sizes,
    _command_with_out,
    _continue_command,
    _freeze_start_up,
    _lock_output,
    _non_negative,
    _print_summary,
    _store_command,
    _warn_abort,
    raise_open_files_limit,
)

if TYPE_CHECKING:
    from daemon.config import Config


def _add_rebuild(sub) -> None:
    p = _store_command(sub, "rebuild", "Build consumequeue/ and index/ from the CommitLog, from its start or --from.")
    p.add_argument("--from", dest="from_offset", type=_non_negative,
                   help="CommitLog offset of a record to start at (default: the CommitLog's first offset)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=cmd_rebuild)


def cmd_rebuild(args, config: Config) -> int:
    import signal
    import threading

    from daemon.engine.rebuild import FromOffsetError, IndexSequenceGap, ProgressBar, RebuildFailed, rebuild
    from daemon.ops.logs import configure_logging
    from daemon.ops.outlock import BrokerLockWatch

    _check_inputs(args, config)
    if args.from_offset is not None:  # inside a record is a usage error found before anything is written
        _check_record_boundaries(config, {"--from": args.from_offset})
    else:
        _check_commit_log(config)  # its size setting, before an output directory is created
    _check_store_root_sizes(config)
    _lock_output(args, config)
    raise_open_files_limit()
    bar = ProgressBar() if sys.stderr.isatty() else None
    if bar is None:
        configure_logging(config.logging.level, config.logging.format)
    else:  # log lines go above the bar; info events would only repeat the bar and the summary
        level = config.logging.level if config.logging.level in ("warning", "error") else "warning"
        configure_logging(level, config.logging.format, stream=bar)
    _warn_abort(args, config)
    stop = threading.Event()
    signals: list[str] = []

    def on_signal(signum, _frame) -> None:
        signals.append(signal.Signals(signum).name)
        if stop.is_set():  # a second signal: stop now, without the final flush
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    _freeze_start_up()
    broker = BrokerLockWatch(config.output.dir, 0.0)  # asked after every batch: a broker started on the root
    try:
        summary = rebuild(config, from_offset=args.from_offset, progress=bar, stop=stop, broker=broker)
    except FromOffsetError as e:
        raise UsageError(str(e)) from None
    except IndexSequenceGap as e:
        fresh = os.path.join(os.path.dirname(os.path.abspath(config.output.dir)), "reputd-rebuilt")
        command = _command_with_out(args, config, fresh)
        print(f"reputd: error: {e}; rebuild the index into an empty directory, then, with reputd and the broker "
              f"stopped, replace {os.path.dirname(e.after)} by its index/: {command}", file=sys.stderr)
        return EXIT_FAILURE
    except RebuildFailed as e:
        if bar is not None:
            bar.finish()
        _print_summary(args, config, "rebuilt", e.summary, error=e)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        startsignals.command_finished()  # the files are as the summary will say: a signal now changes nothing
    if bar is not None:
        bar.finish()
    _print_summary(args, config, "rebuilt", summary)
    if broker.holder is not None:
        out = config.output.dir
        who = f"PID {broker.holder}" if broker.holder else "another process"
        print(f"reputd: error: output directory {out} became the store root of a running broker ({who} took "
              f"{broker.path}), which writes consumequeue/ and index/ there itself: the rebuild stopped at CommitLog "
              f"offset {summary.end_offset} (a record boundary; everything before it is written and flushed) and "
              "the broker's reput dispatches the rest; rebuild elsewhere with --out DIR", file=sys.stderr)
        return EXIT_USAGE
    if summary.interrupted:
        print(f"reputd: interrupted by {signals[0]}: stopped at CommitLog offset {summary.end_offset} (a record "
              f"boundary; everything before it is written and flushed); continue with: "
              f"{_continue_command(args, config, summary.end_offset)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK
