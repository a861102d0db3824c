"""`reputd handoff`: its options and its front end (the hand-off itself is daemon/commands/handoff.py)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from daemon.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    _check_inputs,
    _check_output,
    _freeze_start_up,
    _handoff_command,
    _lock_output,
    _quiet_stdout,
    _store_command,
    raise_open_files_limit,
)

if TYPE_CHECKING:
    from daemon.config import Config


def _add_handoff(sub) -> None:
    p = _store_command(sub, "handoff", "With the broker stopped: complete the output to the CommitLog's end, check it, "
                                       "and leave the broker's checkpoint and abort files so that its next start "
                                       "takes consumequeue/ and index/ as its own (exit 0 handed off, 1 refused, "
                                       "2 the broker is running).")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be done and changed, change nothing (checks a complete output)")
    p.add_argument("--broker-files", action="store_true",
                   help="with --out other than the store root: also set the broker's checkpoint and remove its "
                        "abort file now (the printed moves must still be done before the broker starts)")
    p.set_defaults(handler=cmd_handoff)


def cmd_handoff(args, config: Config) -> int:
    import contextlib

    from daemon.commands.brokerfiles import BrokerRunning, broker_lock_held, hold_broker_lock
    from daemon.commands.handoff import HandoffRefused, handoff
    from daemon.ops.logs import configure_logging
    from indexcore.errors import StoreLayoutError

    root = config.store.store_path_root_dir
    try:  # what every command checks first; the output a writer's rule (the hand-off completes a new one)
        _check_inputs(args, config)
        _check_output(args, config, create=True)
    except UsageError as e:
        raise type(e)(f"{e}; nothing was changed") from None
    except StoreLayoutError as e:
        raise StoreLayoutError(e.path, f"{e.detail}; nothing was changed") from None
    if broker_lock_held(root):
        raise UsageError(f"{os.path.join(root, 'lock')} is held: the broker is running; stop it first (handoff "
                         "prepares the files for its next start); nothing was changed")
    if args.broker_files and os.path.realpath(config.output.dir) == os.path.realpath(root):
        raise UsageError("--broker-files goes with --out other than the store root (in the store root the "
                         "broker's files are always handled)")
    if not args.dry_run:
        try:
            args.broker_lock_fd = hold_broker_lock(root)
        except BrokerRunning as e:
            raise UsageError(f"{e}; nothing was changed") from None
        _lock_output(args, config)
    terminal = sys.stderr.isatty()
    configure_logging(config.logging.level if not terminal or config.logging.level in ("warning", "error")
                      else "warning", config.logging.format)
    raise_open_files_limit()
    _freeze_start_up()

    @contextlib.contextmanager
    def progress():
        """A progress line on stderr for each pass over the CommitLog (completing, then checking)."""
        from daemon.engine.rebuild import ProgressBar

        bar = ProgressBar()
        try:
            yield bar
        finally:
            bar.finish()

    def say(line: str) -> None:
        """Print a line; a reader that went away (`| head`) stops the printing, not the handoff, whose
        exit code stays its result."""
        if getattr(args, "stdout_gone", False):
            return
        try:
            print(line, flush=True)
        except BrokenPipeError:
            args.stdout_gone = True
            _quiet_stdout()

    try:
        handoff(config, dry_run=args.dry_run, broker_files=args.broker_files,
                handoff_command=_handoff_command(args, config), say=say, progress=progress if terminal else None)
    except HandoffRefused as e:
        print(f"reputd: error: handoff refused: {e}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
