"""`reputd handoff`: its options and its front end (the hand-off itself is daemon/commands/handoff.py)."""

from __future__ import annotations

import errno
import os
import sys
from typing import TYPE_CHECKING

from daemon.cli import startsignals
from daemon.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    _check_inputs,
    _check_output,
    _freeze_start_up,
    _handoff_command,
    _lock_output,
    _output_flag,
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


def _not_writable(path: str) -> OSError | None:
    """Why this process could not write `path`, asked without writing (access(2) with the effective ids):
    None when it can."""
    if os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        return None
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    code = errno.EROFS if read_only else errno.EACCES
    return OSError(code, os.strerror(code), path)


def _unwritable(root: str, error: OSError) -> UsageError:
    return UsageError(f"store root {root} cannot be written ({error.strerror}: {error.filename}): handoff takes the "
                      "broker's lock there, sets its checkpoint and removes abort; nothing was changed")


def _check_store_root_writable(root: str) -> None:
    """The store root's `lock` and the directory itself, which the hand-off writes (dry run or not): a
    read-only store is refused before anything is locked or written (UsageError, exit 2)."""
    from daemon.commands.verify import LOCK_FILE

    lock = os.path.join(root, LOCK_FILE)
    for path in (lock, root) if os.path.exists(lock) else (root,):
        error = _not_writable(path)
        if error is not None:
            raise _unwritable(root, error)


def _dry_run_refusals(args, config: Config) -> None:
    """What the hand-off itself would refuse when it locks the output, found without taking a lock or
    writing (UsageError, exit 2, in the hand-off's own words): the output held by another reputd writer,
    or not writable."""
    from daemon.ops.outlock import OutputLocked, OutputNotWritable, writer_holding

    out = config.output.dir
    holder = writer_holding(out)
    if holder is not None:
        raise UsageError(str(OutputLocked(out, holder)))
    existing = out  # what the hand-off writes into, or creates the output in
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    error = _not_writable(existing)
    if error is not None:
        raise UsageError(f"{_output_flag(args)}: {OutputNotWritable(out, error)}")


def cmd_handoff(args, config: Config) -> int:
    import contextlib
    import signal
    import threading

    from daemon.commands.brokerfiles import BrokerRunning, broker_lock_held, hold_broker_lock
    from daemon.commands.handoff import HandoffInterrupted, HandoffRefused, handoff
    from daemon.engine.sizes import check_config_sizes
    from daemon.ops.logs import configure_logging
    from daemon.ops.outlock import LOCK_FILE
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
    check_config_sizes(config)  # before anything is locked or written
    _check_store_root_writable(root)
    stop = None
    signals: list[str] = []
    if args.dry_run:
        _dry_run_refusals(args, config)  # the start-up handler stays: a dry run writes nothing, a signal ends it
    else:
        # the output's lock first: refused there (a `reputd run` writing it), the broker's lock is never taken,
        # which that `run` would take for a broker starting on its root (daemon/engine/brokerlock.py)
        _lock_output(args, config)
        try:
            args.broker_lock_fd = hold_broker_lock(root)
        except BrokerRunning as e:
            raise UsageError(f"{e}; nothing was changed") from None
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise _unwritable(root, e) from None
        stop = threading.Event()

        def on_signal(signum, _frame) -> None:
            """Stop where the hand-off can (daemon.commands.handoff.handoff's `stop`)."""
            signals.append(signal.Signals(signum).name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
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

    lock = getattr(args, "output_lock", None)
    try:
        handoff(config, dry_run=args.dry_run, broker_files=args.broker_files,
                handoff_command=_handoff_command(args, config), say=say, progress=progress if terminal else None,
                stop=stop, reputd_lock_before=lock is None or LOCK_FILE in (lock.before or ()))
    except HandoffRefused as e:
        print(f"reputd: error: handoff refused: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except HandoffInterrupted as e:
        print(f"reputd: interrupted by {signals[0] if signals else 'a signal'}: handoff {e}; nothing of the broker's "
              f"was changed; run it again to hand off", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        startsignals.command_finished()
    return EXIT_OK
