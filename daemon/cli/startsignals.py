"""SIGINT and SIGTERM from a command's first line (daemon/cli/__init__.py installs the handler before anything
else it imports).

The rest of this package, the command's modules, numpy and PySpark take a good part of a second to import
(several seconds on a loaded host), and a signal meanwhile printed a KeyboardInterrupt traceback, or, for
SIGTERM, ended the process silently (status 143: a supervisor sees a crash). So for this process's own
command line, every command, both signals end the start-up there and then: one line on stderr, what taking
the output lock created removed, and the command's exit code for a stop by a signal — 130, or 0 for `run`,
whose normal stop is SIGTERM (docs/recovery.md). Nothing but the output lock exists before a command hands
the signals to its own handling: `run`'s service, rebuild's stop at a batch boundary, backfill's Interrupt,
produce's stop at a message boundary, handoff's phases. The readers (verify, query, inspect) write
nothing, and keep this handling to the end.

Only the interpreter's own start comes before it (exec, Python's `site`: a few milliseconds on an idle host);
nothing of reputd's runs there. This module imports only `_signal`, `os` and `sys`, which the interpreter has
loaded before any script runs: `signal` would import enum, functools and collections first (12 ms on a
loaded host, during which a signal was not handled).
"""

from __future__ import annotations

import _signal
import os
import sys

STOP_SIGNALS = (_signal.SIGINT, _signal.SIGTERM)
_NAMES = {_signal.SIGINT: "SIGINT", _signal.SIGTERM: "SIGTERM"}
INTERRUPTED_LINE = "reputd: interrupted"
_starting: dict = {}  # "command": this process's command; "args": its namespace, once parsed (its output_lock)


def own_command() -> str | None:
    """The command this process's own command line names ("" for none: `reputd --help`), None when this
    process is not `reputd` (a test or a program importing daemon.cli). Read while daemon.cli is being
    imported: by the console script (argv[0] ends in `reputd`) or by `python -m daemon.cli` (argv[0] is
    still "-m" then, and the interpreter's own command line names the module)."""
    argv = sys.argv
    if not argv:
        return None
    if argv[0] == "-m":
        orig = " ".join(getattr(sys, "orig_argv", ())) + " "
        if " -m daemon.cli " not in orig and " -mdaemon.cli " not in orig:
            return None
    elif os.path.basename(argv[0]) != "reputd":
        return None
    return argv[1] if len(argv) > 1 else ""


def _interrupted_while_starting(signum, _frame) -> None:
    """A signal before the command handed the signals over: remove what taking the output lock created, one
    line, and the command's exit code for a stop by a signal. It imports nothing: it may run in the middle of
    an import (`contextlib` here met `types` half imported: an ImportError and a traceback)."""
    if _starting.get("command") == "run":  # `run`'s documented stop: exit 0, as once it runs
        line, code = f"reputd: stopped by {_NAMES.get(signum, signum)} while starting: nothing was read or written", 0
    else:
        line, code = INTERRUPTED_LINE, 130
    try:  # noqa: SIM105 - contextlib is an import
        os.write(2, line.encode() + b"\n")
    except OSError:  # stderr a pipe whose reader is gone: the exit code still says it
        pass
    lock = getattr(_starting.get("args"), "output_lock", None)
    if lock is not None:
        try:  # noqa: SIM105 - contextlib is an import
            lock.forget()
        except Exception:  # ending anyway; forget() leaves everything as it is on doubt
            pass
    os._exit(code)


def install() -> None:
    """For this process's own command line (`own_command`), whatever command it names."""
    command = own_command()
    if command is None:
        return
    _starting["command"] = command
    for sig in STOP_SIGNALS:
        _signal.signal(sig, _interrupted_while_starting)


def starting(args) -> bool:
    """Whether this process's start-up handler is in place; if so, `args` (the command line's namespace) is
    what a signal looks in for an output lock to forget."""
    if installed():
        _starting["args"] = args
        return True
    return False


def installed() -> bool:
    """Whether the start-up handler still handles the signals (no command took them over yet)."""
    return _signal.getsignal(_signal.SIGTERM) is _interrupted_while_starting


def command_finished() -> None:
    """Called by a command whose work is done (files written, Spark stopped): a signal from now on is
    ignored, so the exit code and the summary say what happened rather than "interrupted"."""
    if installed():
        for sig in STOP_SIGNALS:
            _signal.signal(sig, _signal.SIG_IGN)


def process_ending() -> None:
    """Called by `main` once this process's own command has its result: both signals are ignored from here.
    The interpreter's exit takes milliseconds more (modules torn down, files flushed), and it resets a
    handler of Python's own to the default first, so a signal then ended the process by the signal
    (status 143 after a command that had succeeded); an ignored signal stays ignored."""
    if "command" in _starting:
        for sig in STOP_SIGNALS:
            _signal.signal(sig, _signal.SIG_IGN)

