"""SIGINT and SIGTERM while a command starts (daemon/cli/__init__.py installs the handler first of all)."""

from __future__ import annotations

import os
import signal
import sys

# The commands whose SIGINT and SIGTERM mean "interrupted" (one line, exit 130) from the process's first
# instant: the rest of this package, the command's modules, numpy and PySpark take a good part of a second to
# import, and a signal meanwhile printed a KeyboardInterrupt traceback (SIGTERM: exit 143, silent). Until
# the command hands them to its own handling (backfill's Interrupt, once Spark is about to start; rebuild's
# stop at a batch boundary, once it starts reading) nothing but the output lock exists, so the process ends
# there and then: a KeyboardInterrupt raised inside an extension module's import came out as an ImportError
# with a traceback. The readers (verify, query, inspect) write nothing, and keep this handling to the end.
# Not `run` (SIGTERM is its normal stop, handled once it runs), `produce` or `handoff` (they change a store:
# their own handling decides where they may stop).
_INTERRUPTIBLE = ("backfill", "rebuild", "verify", "query", "inspect")
_INTERRUPTED_LINE = b"reputd: interrupted\n"
_starting: dict = {}  # "args": the command line's namespace, once parsed into (its output_lock, once taken)


def _interrupted_while_starting(_signum, _frame) -> None:
    """A signal while the command starts: remove what taking the output lock created, one line, exit 130."""
    import contextlib

    with contextlib.suppress(OSError):  # stderr a pipe whose reader is gone: the exit code still says it
        os.write(2, _INTERRUPTED_LINE)
    lock = getattr(_starting.get("args"), "output_lock", None)
    if lock is not None:
        with contextlib.suppress(Exception):  # ending anyway; forget() leaves everything as it is on doubt
            lock.forget()
    os._exit(130)


def command_finished() -> None:
    """Called by a command whose work is done (files written, Spark stopped): a signal from now on is
    ignored, so the exit code and the summary say what happened rather than "interrupted"."""
    if signal.getsignal(signal.SIGTERM) is _interrupted_while_starting:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def install() -> None:
    """For this process's own command line, when it names one of the _INTERRUPTIBLE commands."""
    if sys.argv[1:2] and sys.argv[1] in _INTERRUPTIBLE:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupted_while_starting)


def starting(args) -> bool:
    """Whether this process's start-up handler is in place; if so, `args` (the command line's namespace) is
    what a signal looks in for an output lock to forget."""
    if signal.getsignal(signal.SIGTERM) is _interrupted_while_starting:
        _starting["args"] = args
        return True
    return False
