"""The `reputd` command line. Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error, 130
interrupted (SIGINT or SIGTERM; `run` stops on them with 0).

Operators run `reputd query` by hand in an incident, so its start-up counts: this package's modules import
only argparse at the top, a command line defines and imports only its own command's module
(daemon/cli/NAME.py: its options and its front end), each command imports what it uses when it runs, and the
query commands defer the modules their imports pull in but a query never uses, numpy first
(daemon/ops/deferred.py; `make bench` measures it). Every writing command (run, rebuild, backfill) locks the
output directory first (daemon/ops/outlock.py); readers never do.
"""

from __future__ import annotations

from daemon.cli import startsignals

startsignals.install()  # first of all, every command: the rest of the start-up takes a good part of a second

import argparse  # noqa: E402 - after the handlers above
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from daemon.cli.common import (  # noqa: E402
    COMMANDS,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    OWN_PACKAGES,
    QUERY_KINDS,
    QUERYTIME_KINDS,
    TIME_OPTIONS,
    SettingsMismatch,
    UsageError,
    _config,
    _config_in_use,
    _HelpFormatter,
    _quiet_stdout,
    created_note,
    quiet,
)

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "OWN_PACKAGES", "build_parser", "main"]


class _Version(argparse.Action):
    """`--version`, looked up only when asked: reading the installed metadata costs start-up time."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from daemon import __version__

        print(f"reputd {__version__}")
        parser.exit()


def build_parser(command: str | None = None, kind: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or with `command` (and for `query`, `kind`) of that one only: a
    process parses one command line, and defining every command's options is a good part of a query's
    start-up."""
    parser = argparse.ArgumentParser(
        prog="reputd", formatter_class=_HelpFormatter,
        description="Rebuild and query RocketMQ ConsumeQueue and IndexFile files from a broker's CommitLog.",
        epilog="Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error, 130 interrupted.")
    parser.add_argument("--version", action=_Version, help="print reputd's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")
    for name in COMMANDS:
        if command is None or command == name:
            _add_command(sub, name, kind)
    return parser


def _add_command(sub, name: str, kind: str | None) -> None:
    """Define command `name`'s options; its module (daemon/cli/NAME.py, with its front end) is imported only
    when its command line is parsed."""
    if name == "run":
        from daemon.cli.run import _add_run as add
    elif name == "rebuild":
        from daemon.cli.rebuild import _add_rebuild as add
    elif name == "verify":
        from daemon.cli.verify import _add_verify as add
    elif name == "handoff":
        from daemon.cli.handoff import _add_handoff as add
    elif name == "backfill":
        from daemon.cli.backfill import _add_backfill as add
    elif name == "query":
        from daemon.cli.query import _add_query

        kinds = _add_query(sub, kind)
        if kind is None or kind in QUERYTIME_KINDS:
            from daemon.cli.querytime import add_kinds

            add_kinds(kinds, kind)
        return
    elif name == "inspect":
        from daemon.cli.inspect import _add_inspect as add
    else:
        from daemon.cli.produce import _add_produce as add
    add(sub)


def _joined_time_options(argv: list[str]) -> list[str]:
    """`--begin -1h` as `--begin=-1h`: argparse would take a value starting with '-' for an option. The same
    for `query offset`'s TIME, its last positional: a relative time moves after `--`."""
    out: list[str] = []
    relative = []
    i = 0
    while i < len(argv):
        if argv[i] in TIME_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        if argv[:2] == ["query", "offset"] and _RELATIVE_TIME.fullmatch(argv[i]) and "--" not in argv[:i] \
                and not (out and out[-1] in _VALUED_OPTIONS):
            relative.append(argv[i])
        else:
            out.append(argv[i])
        i += 1
    return [*out, "--", *relative] if relative else out


_RELATIVE_TIME = re.compile(r"-\d+(?:\.\d+)?(?:ms|s|m|h|d|w)")
_VALUED_OPTIONS = ("--config", "--store", "--out", "--format")


def _parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the command `argv` names (all of them when it names none: help, a mistyped name)."""
    command = argv[0] if argv and argv[0] in COMMANDS else None
    kind = argv[1] if command == "query" and len(argv) > 1 and argv[1] in QUERY_KINDS else None
    if command == "query" and kind is None:
        command = None
    return build_parser(command, kind)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; a writing command that failed before writing leaves no trace of its output
    directory (daemon/ops/outlock.py)."""
    args = argparse.Namespace()
    if argv is None:
        startsignals.starting(args)  # this process's own command line: a signal forgets the lock it takes
    try:
        code = _main(argv, args)
        lock = getattr(args, "output_lock", None)
        if code != EXIT_OK and lock is not None and lock.forget():
            args.output_created = None  # removed again: nothing came of it
        if code in (EXIT_OK, EXIT_INTERRUPTED):
            created_note(args)  # the output directory it created and kept: a mistyped --out shows
    finally:
        if argv is None:
            startsignals.process_ending()  # the exit code is decided: a signal now changes nothing
    return code


def _main(argv: Sequence[str] | None, args: argparse.Namespace) -> int:
    argv = _joined_time_options(list(sys.argv[1:] if argv is None else argv))
    _parser_for(argv).parse_args(argv, namespace=args)
    if args.command == "query":  # modules a query imports but never uses (daemon/ops/deferred.py)
        from daemon.ops.deferred import defer

        defer("numpy")  # indexcore's batch paths
        defer("inspect")  # dataclasses, for classes without a docstring
        defer("datetime")  # yaml, for timestamps (and --begin/--end in ISO 8601)
        defer("base64")  # yaml, for !!binary
    from daemon.config import ConfigError
    from indexcore.errors import SizeMismatchError, StoreError

    args.config_file, args.config_origin = None, ""
    if sys.stdout is None:  # started with stdout closed (`>&-`): what it would print goes nowhere
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stdout for the rest of the process
    if sys.stderr is None:  # the same for stderr (`2>&-`), or print(file=sys.stderr) would go to stdout
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - stderr for the rest of the process
    guard = sys.stdout = _PipeGuard(sys.stdout)
    # stderr too (`2>&1 | head`): a log line meeting a closed pipe must not end a rebuild or the daemon halfway
    err_guard = sys.stderr = _PipeGuard(sys.stderr)
    try:
        config = _config(args)
        return args.handler(args, config)
    except ConfigError as e:
        print(f"reputd: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SizeMismatchError as e:
        from daemon.engine.sizes import size_advice

        print(f"reputd: config error: {size_advice(e)} ({_config_in_use(args)})", file=sys.stderr)
        return EXIT_USAGE
    except SettingsMismatch as e:
        print(f"reputd: config error: {e} ({_config_in_use(args)})", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StoreError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError as e:  # not stdout's (the guard takes those): a pipe the command itself wrote to
        _quiet_stdout()
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("reputd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as e:  # a value the command cannot use (backfill's --segments, --to)
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if os.environ.get("REPUTD_DEBUG"):
            raise
        print(f"reputd: internal error: {type(e).__name__}: {e} (REPUTD_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_FAILURE
    finally:
        guard.flush()
        err_guard.flush()
        sys.stdout = guard.stream
        sys.stderr = err_guard.stream


class _PipeGuard:
    """sys.stdout (or sys.stderr) while a command runs. When the reader closes the pipe (`| head -1`,
    `| true`, `2>&1 | head`), the write or flush that meets it sends the rest of the stream to /dev/null
    instead of raising, so the command goes on to its own result: the exit code says what happened,
    whatever happened to its output."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            quiet(self.stream)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            quiet(self.stream)
            self.stream.flush()  # what was buffered goes to /dev/null

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

