"""The `reputd` command line. Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error,
130 interrupted (SIGINT or SIGTERM during rebuild or backfill).

Operators run `reputd query` by hand in an incident, so its start-up counts: this module imports only
argparse at the top, each command imports what it uses, and the query commands defer the modules their
imports pull in but a query never uses, numpy first (daemon/deferred.py; `make bench` measures it). Every
writing command (run, rebuild, backfill) locks the output directory first (daemon/outlock.py); readers
never do.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.config import Config
    from daemon.rebuild import RebuildSummary

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
OWN_PACKAGES = ("daemon", "indexcore")  # what the reputd distribution installs; anything else is a dependency
LONG_MAX = 2**63 - 1
TIME_OPTIONS = ("--begin", "--end")
FORMATS = ("text", "json")


class UsageError(Exception):
    """Arguments that cannot work, found before anything is read or written: exit 2."""


def _int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _positive(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _csv(text: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _spark_setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), value


class _Version(argparse.Action):
    """`--version`, looked up only when asked: reading the installed metadata costs start-up time."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from daemon import __version__

        print(f"reputd {__version__}")
        parser.exit()


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, sized without importing shutil (and bz2, lzma with it): argparse makes one
    for every option it defines, so this is on every command's start-up path."""

    def __init__(self, prog: str, **kwargs):
        try:
            width = int(os.environ.get("COLUMNS") or os.get_terminal_size(sys.__stdout__.fileno()).columns)
        except (OSError, ValueError, AttributeError):
            width = 80
        kwargs.setdefault("width", max(width, 40) - 2)
        super().__init__(prog, **kwargs)


CONFIG_HELP = ("YAML config file (default: $REPUTD_CONFIG, else ./config/reputd.yaml if it exists, "
               "else built-in defaults)")


COMMIT_LOG_DIR = "commitlog"  # under the store root, where storePathCommitLog points by default
COMMANDS = ("run", "rebuild", "verify", "handoff", "backfill", "query", "inspect", "produce")
QUERY_KINDS = ("key", "queue", "msgid")
OUT_HELP = "output directory for consumequeue/ and index/, overrides output.dir (default: the store root)"


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
    adders = {"run": _add_run, "rebuild": _add_rebuild, "verify": _add_verify, "handoff": _add_handoff,
              "backfill": _add_backfill,
              "query": lambda s: _add_query(s, kind), "inspect": _add_inspect, "produce": _add_produce}
    for name in COMMANDS:
        if command is None or command == name:
            adders[name](sub)
    return parser


def _subparser(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)


def _store_command(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    """A command that takes --config, --store and --out."""
    p = _subparser(sub, name, help_text)
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--store", help="store root, overrides store.storePathRootDir (and the output directory "
                                    "unless --out is given)")
    p.add_argument("--out", help=OUT_HELP)
    return p


def _add_run(sub) -> None:
    p = _store_command(sub, "run", "Follow the CommitLog as a broker writes it and keep consumequeue/ and index/ "
                                   "current.")
    p.add_argument("--until-caught-up", action="store_true",
                   help="dispatch everything readable now, flush, checkpoint, print a summary and exit 0")
    p.add_argument("--metrics", action="store_true",
                   help="with --until-caught-up: serve /metrics and /healthz too (without it, no port is opened)")
    p.set_defaults(handler=cmd_run)


def _add_rebuild(sub) -> None:
    p = _store_command(sub, "rebuild", "Build consumequeue/ and index/ from the CommitLog, from its start or --from.")
    p.add_argument("--from", dest="from_offset", type=_non_negative,
                   help="CommitLog offset of a record to start at (default: the CommitLog's first offset)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=cmd_rebuild)


def _add_verify(sub) -> None:
    p = _store_command(sub, "verify", "Check consumequeue/ and index/ against what the CommitLog implies, read-only "
                                      "(exit 0 consistent, 1 differences found).")
    p.add_argument("--from", dest="from_offset", type=_non_negative,
                   help="CommitLog offset of a record to start at (default: the oldest segment)")
    p.add_argument("--json", action="store_true", help="one JSON object per finding, then a summary object")
    p.set_defaults(handler=cmd_verify)


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


def _add_backfill(sub) -> None:
    p = _store_command(sub, "backfill", "Build consumequeue/ and index/ for CommitLog segments with Spark, "
                                        "byte-identical to rebuild.")
    p.add_argument("--segments", metavar="DIR_OR_URI",
                   help="CommitLog directory or URI instead of store.storePathCommitLog: a path or file:// (every "
                        "executor must see it at this path), s3://bucket/prefix or hdfs://namenode:port/path "
                        "(comma-separated for several)")
    p.add_argument("--master", default="local[*]",
                   help="Spark master URL: local[*] (default), local[N], spark://HOST:PORT, yarn, k8s://...")
    p.add_argument("--from", dest="from_offset", type=_non_negative,
                   help="CommitLog offset of a record to start at (default: the first segment)")
    p.add_argument("--to", dest="to_offset", type=_positive,
                   help="stop before this CommitLog offset (a record boundary, e.g. where `reputd run` started; "
                        "default: the end of the written data)")
    p.add_argument("--partitions", type=_positive, help="tasks for the ConsumeQueue and IndexFile phases "
                                                        "(default: Spark's default parallelism)")
    p.add_argument("--catalog", metavar="PATH", help="also write a Parquet catalog of the messages, one file per "
                                                     "topic and day (a path, file://, s3:// or hdfs://; must not "
                                                     "exist)")
    p.add_argument("--conf", dest="spark_conf", action="append", type=_spark_setting, default=[],
                   metavar="KEY=VALUE", help="a Spark setting, e.g. spark.executor.memory=4g (repeatable)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=cmd_backfill)


_QUERY_HELP = {
    "key": "Messages whose topic and key (a KEYS token or the UNIQ_KEY) match exactly, newest first.",
    "queue": "Messages of a ConsumeQueue from a queue offset, as the broker's getMessage returns them.",
    "msgid": "The message of a msgId: an offset msgId (store host + CommitLog offset) or a client msgId (the "
             "UNIQ_KEY), as mqadmin queryMsgById takes them.",
}


def _add_query(sub, kind: str | None) -> None:
    q = sub.add_parser("query", formatter_class=_HelpFormatter, help="Query messages by key, queue offset or msgId.",
                       description="Query messages by key, queue offset or msgId. On a terminal the answer is "
                                   "laid out as mqadmin lays it out; piped, or with --json, it is one JSON object "
                                   "per message.")
    qs = q.add_subparsers(dest="query", required=True, metavar="KIND", help="how to find the messages")
    for name in QUERY_KINDS:
        if kind is not None and kind != name:
            continue
        p = _subparser(qs, name, _QUERY_HELP[name])
        p.add_argument("--config", help=CONFIG_HELP)
        p.add_argument("--store", help="store root, overrides store.storePathRootDir")
        p.add_argument("--out", help="directory holding consumequeue/ and index/, overrides output.dir")
        p.add_argument("--format", choices=FORMATS,
                       help="text: mqadmin's layout; json: one JSON object per message (default: text on a "
                            "terminal, json otherwise)")
        p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
        if name == "key":
            p.add_argument("topic", help="the topic the key was indexed under")
            p.add_argument("key", help="a KEYS token or a UNIQ_KEY")
            p.add_argument("--begin", default="0",
                           help="earliest store time: epoch milliseconds, ISO 8601 (2026-11-21T10:00:00, local "
                                "time unless it has an offset or Z) or relative (-1h, -30m, -2d) (default 0)")
            p.add_argument("--end", default=None, help="latest store time, written as --begin (default: no limit)")
            p.add_argument("--max", dest="max_num", type=_positive, default=64,
                           help="maximum number of candidates (clamped to maxMsgsNumBatch, as the broker does)")
            p.add_argument("--raw", action="store_true",
                           help="print the index's candidate offsets as IndexService.queryOffset returns them")
            p.set_defaults(handler=cmd_query_key)
            continue
        if name == "queue":
            p.add_argument("topic", help="the ConsumeQueue's topic")
            p.add_argument("queue_id", type=_non_negative, help="the queue id")
            p.add_argument("offset", type=_non_negative, help="the queue offset to start at")
            p.add_argument("--count", type=_positive, default=32, help="maximum number of messages (default 32)")
            p.set_defaults(handler=cmd_query_queue)
        else:
            p.add_argument("msgid", help="an offset msgId or a UNIQ_KEY (32 hex digits, 56 with IPv6)")
            p.add_argument("--topic", help="look the UNIQ_KEY up under this topic only (default: every topic the "
                                           "output's ConsumeQueues know)")
            p.set_defaults(handler=cmd_query_msgid)
        p.add_argument("--body", action="store_true",
                       help="print each message's body too (a compressed one decompressed, as mqadmin shows it)")
        p.add_argument("--save-body", metavar="DIR",
                       help="write each message's body to DIR/<offset msgId>, as mqadmin does (decompressed)")
        p.add_argument("--raw-body", action="store_true",
                       help="show (implies --body) and save a compressed body as stored, without decompressing it")


def _add_inspect(sub) -> None:
    p = _subparser(sub, "inspect", "Decode a CommitLog segment, ConsumeQueue file, IndexFile or checkpoint file.")
    p.add_argument("path", help="the file: a segment, consumequeue/TOPIC/QUEUE/FILE, an IndexFile, the broker's "
                                "checkpoint or reputd.checkpoint")
    p.add_argument("--config", help=CONFIG_HELP + "; its maxHashSlotNum/maxIndexNum shape IndexFiles")
    p.add_argument("--hash-slot-num", type=_positive, help="IndexFile slots (default: from the config)")
    p.add_argument("--index-num", type=_positive, help="IndexFile entries (default: from the config)")
    p.add_argument("--limit", type=_non_negative, help="show at most this many entries")
    p.add_argument("--json", action="store_true", help="JSON Lines: the header object, then one object per entry")
    p.set_defaults(handler=cmd_inspect)


def _add_produce(sub) -> None:
    p = _subparser(sub, "produce", "Append sample messages to the CommitLog (demos and load).")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--store", help="store root, overrides store.storePathRootDir (the CommitLog is written there)")
    p.add_argument("--messages", type=_positive, required=True, help="how many messages to append")
    p.add_argument("--topics", type=_csv, default=["TopicTest"], help="comma-separated topics (default TopicTest)")
    p.add_argument("--queues", type=_positive, default=4, help="queues per topic (default 4)")
    p.add_argument("--body-size", type=_non_negative, default=256, help="body bytes (default 256)")
    p.add_argument("--keys", type=_non_negative, default=1, help="KEYS per message (default 1)")
    p.add_argument("--seed", type=_int, default=0, help="random seed: the same seed gives the same messages "
                                                        "(default 0)")
    p.add_argument("--no-uniq-key", action="store_true", help="leave out the UNIQ_KEY property")
    p.add_argument("--lmq-queues", type=_non_negative, default=0,
                   help="LMQ queues (%%LMQ%%q-0 ...) to spread messages over (needs store.enableMultiDispatch and "
                        "store.enableLmq)")
    p.add_argument("--lmq-per-message", type=_non_negative, default=1,
                   help="distinct LMQ queues each message names in INNER_MULTI_DISPATCH (default 1)")
    p.set_defaults(handler=cmd_produce)


# --- configuration ------------------------------------------------------------------------------------

def _config(args) -> Config:
    """The config file (daemon.config.config_path's rule), the environment and the command's --store/--out
    flags, loaded once."""
    from daemon.config import config_path, load_config

    overrides = {"store.storePathRootDir": getattr(args, "store", None), "output.dir": getattr(args, "out", None)}
    if overrides["store.storePathRootDir"] and not overrides["output.dir"]:
        overrides["output.dir"] = overrides["store.storePathRootDir"]
    args.config_file, args.config_origin = config_path(args.config, os.environ, os.getcwd())
    # commands that import no plug-ins may take the file's parsed text from daemon/configmemo.py
    return load_config(args.config_file, os.environ, overrides, memo=args.command in ("query", "inspect"))


def _config_in_use(args) -> str:
    if args.config_file is None:
        return f"config: built-in defaults ({args.config_origin})"
    return f"config: {args.config_file} ({args.config_origin})"


def _size_setting(path: str) -> str:
    """The store setting that fixes the size of the file at `path`."""
    from indexcore.consumequeue import CONSUME_QUEUE_DIR
    from indexcore.indexservice import INDEX_DIR

    parts = os.path.normpath(path).split(os.sep)
    if INDEX_DIR in parts[-2:-1]:
        return "store.maxHashSlotNum and store.maxIndexNum"
    if CONSUME_QUEUE_DIR in parts[:-1]:
        return "store.mappedFileSizeConsumeQueue"
    return "store.mappedFileSizeCommitLog"


def _output_flag(args) -> str:
    return "--out" if getattr(args, "out", None) else "--store" if getattr(args, "store", None) else "output.dir"


def _check_inputs(args, config: Config, *, commit_log: bool = True, output: bool = False,
                  data: bool = True) -> None:
    """The directories a command reads, looked at before anything is read or written. One rule for every
    command: a path named by an option or a config key that does not exist is a usage error (exit 2, naming
    the option or key); a store root that exists without its `commitlog/` is data missing (StoreLayoutError,
    exit 1), as a missing segment is (with `data` False left to the command, which reports it its way)."""
    from indexcore.errors import StoreLayoutError

    store = config.store
    root = store.store_path_root_dir
    if store.enable_d_leger_commit_log:  # settings that locate no DLedger log: a usage error, for queries too
        from daemon.dledgermode import input_problem

        problem = input_problem(store, "--store" if getattr(args, "store", None) else "store.storePathRootDir")
        if problem:
            raise UsageError(problem)
    elif commit_log:
        for d in store.commit_log_dirs:
            if os.path.isdir(d):
                continue
            if os.path.normpath(d) != os.path.normpath(os.path.join(root, COMMIT_LOG_DIR)):
                raise UsageError(f"{d}: no such CommitLog directory (store.storePathCommitLog)")
            if not os.path.isdir(root):
                option = "--store" if getattr(args, "store", None) else "store.storePathRootDir"
                raise UsageError(f"{root}: no such store root directory ({option})")
            if data:
                raise StoreLayoutError(d, f"the store root {root} has no {COMMIT_LOG_DIR}/ directory: no CommitLog to "
                                          "read")
    if output and not os.path.isdir(config.output.dir):
        raise UsageError(f"{config.output.dir}: no such output directory ({_output_flag(args)})")


def command_line(args, config: Config, *words: str, out: str | None = None) -> str:
    """`reputd WORDS...` with the options that chose this command's config, store and output (`out`
    instead of the output when given), as absolute paths quoted for a shell: printed for the operator to
    run, it reads and writes what it says."""
    import shlex

    chosen = []
    if config.source:  # also when $REPUTD_CONFIG or ./config/reputd.yaml chose it: another directory may not
        chosen += ["--config", config.source]
    if getattr(args, "store", None):
        chosen += ["--store", config.store.store_path_root_dir]
    if out is not None or getattr(args, "out", None):
        chosen += ["--out", out if out is not None else config.output.dir]
    return shlex.join(["reputd", *words, *chosen])


def _lock_output(args, config: Config) -> None:
    """Take the output directory's writer lock for the rest of the process (daemon/outlock.py); a running
    broker's store root is refused before anything is created. `main` removes what taking it created when
    the command fails having written nothing."""
    from daemon.outlock import BrokerRunning, OutputLocked, OutputNotWritable, lock_output

    try:
        args.output_lock = lock_output(config.output.dir, args.command)
    except (BrokerRunning, OutputLocked) as e:
        raise UsageError(str(e)) from None
    except OutputNotWritable as e:
        raise UsageError(f"{_output_flag(args)}: {e}") from None


# --- rebuild, run, backfill ---------------------------------------------------------------------------

def cmd_run(args, config: Config) -> int:
    import dataclasses

    from daemon.logs import configure_logging

    configure_logging(config.logging.level, config.logging.format, stream=sys.stdout)
    from daemon.reput import run_daemon  # watchdog, prometheus-client: only `run` needs them

    if args.metrics and not args.until_caught_up:
        raise UsageError("--metrics goes with --until-caught-up (`run` serves metrics as metrics.enabled says)")
    if args.until_caught_up and not args.metrics:
        config = dataclasses.replace(config, metrics=dataclasses.replace(config.metrics, enabled=False))
    if args.until_caught_up:  # the daemon waits for a CommitLog that is not there yet (a mount, a new broker)
        _check_inputs(args, config, data=False)  # a missing commitlog/ it logs (recovery_failed) and exits 1
    _lock_output(args, config)
    _warn_abort(args, config)
    raise_open_files_limit()

    def summary(s: dict) -> None:
        if not args.until_caught_up:
            return
        seconds = max(s["seconds"], 1e-9)
        state = "caught up" if s["caughtUp"] else "stopped before the end"
        print(f"{state}: dispatched {s['messages']:,} messages, {s['bytes']:,} bytes [{s['startOffset']}, "
              f"{s['endOffset']}) in {s['seconds']:.2f} s ({s['messages'] / seconds:,.0f} msgs/s); checkpoint "
              f"at {s['checkpointOffset']}; output {config.output.dir}", file=sys.stderr)
        if s.get("error"):
            print(f"reputd: error: {s['error']}", file=sys.stderr)

    return run_daemon(config, until_caught_up=args.until_caught_up, on_exit=summary)


def _freeze_start_up() -> None:
    """Before a pass over a whole CommitLog: what start-up made (modules, config, the logger) lives as
    long as the command, so it is moved out of the cyclic collector's reach. The pass allocates enough
    to trigger collections, which would otherwise walk all of it each time while holding the GIL the
    read-ahead thread waits for (an LMQ rebuild of the bench store: 31 ms of collections, 10 ms frozen).
    A command's business, not the library's: `rebuild()` called in a longer-lived process leaves its gc
    alone."""
    import gc

    gc.freeze()


# What a process may raise its descriptor limit to when the hard limit is unlimited: Linux refuses more than
# fs.nr_open, 1,048,576 unless an administrator raised it.
NOFILE_WHEN_UNLIMITED = 1 << 20


def raise_open_files_limit() -> None:
    """Raise the soft limit on open descriptors to the hard one, as the broker's JVM does for itself
    (HotSpot's MaxFDLimit, on by default). A store keeps half the soft limit of its queue files open
    (`open_queue_files_limit`): under a shell's usual 1,024 an LMQ store's thousand queues would be opened
    and closed again batch after batch. Where the kernel refuses, the limit stays as it was."""
    import contextlib
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NOFILE_WHEN_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def cmd_rebuild(args, config: Config) -> int:
    import signal
    import threading

    from daemon.logs import configure_logging
    from daemon.rebuild import FromOffsetError, IndexSequenceGap, ProgressBar, RebuildFailed, rebuild

    _check_inputs(args, config)
    if args.from_offset is not None:  # inside a record is a usage error found before anything is written
        _check_record_boundaries(config, {"--from": args.from_offset})
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
    try:
        summary = rebuild(config, from_offset=args.from_offset, progress=bar, stop=stop)
    except FromOffsetError as e:
        raise UsageError(str(e)) from None
    except IndexSequenceGap as e:
        fresh = os.path.join(os.path.dirname(os.path.abspath(config.output.dir)), "reputd-rebuilt")
        command = _command_with_out(fresh)
        print(f"reputd: error: {e}; rebuild the index into an empty directory, then, with reputd and the broker "
              f"stopped, replace {os.path.dirname(e.after)} by its index/: {command}", file=sys.stderr)
        return EXIT_FAILURE
    except RebuildFailed as e:
        if bar is not None:
            bar.finish()
        _print_summary(args, config, "rebuilt", e.summary)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if bar is not None:
        bar.finish()
    _print_summary(args, config, "rebuilt", summary)
    if summary.interrupted:
        print(f"reputd: interrupted by {signals[0]}: stopped at CommitLog offset {summary.end_offset} (a record "
              f"boundary; everything before it is written and flushed); continue with: "
              f"{_continue_command(summary.end_offset)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def _handoff_command(args, config: Config) -> str:
    """The `reputd handoff` command for this config's store root, runnable as printed."""
    import shlex

    words = ["reputd", "handoff"]
    if args.config_file:
        words += ["--config", os.path.abspath(args.config_file)]
    words += ["--store", os.path.abspath(config.store.store_path_root_dir)]
    return shlex.join(words)


def _warn_abort(args, config: Config) -> None:
    """Writing into a store root whose broker did not exit cleanly: unless `reputd handoff` runs before the
    broker starts, 4.9.3's recovery discards these IndexFiles and re-dispatches over these ConsumeQueues."""
    from daemon.logs import get_logger
    from daemon.verify import ABORT_FILE

    root, out = config.store.store_path_root_dir, config.output.dir
    abort = os.path.join(root, ABORT_FILE)
    if not os.path.exists(abort) or os.path.realpath(out) != os.path.realpath(root):
        return
    command = _handoff_command(args, config)
    print(f"reputd: warning: {abort} exists (the broker's last exit was not clean): a 4.9.3 broker started on this "
          f"store discards these IndexFiles and re-dispatches over these ConsumeQueues unless `{command}` runs "
          "first", file=sys.stderr)
    get_logger(command=args.command).warning("broker_abort_present", path=abort, handoff=command)


def cmd_handoff(args, config: Config) -> int:
    import contextlib

    from daemon.brokerfiles import BrokerRunning, broker_lock_held, hold_broker_lock
    from daemon.handoff import HandoffRefused, handoff
    from daemon.logs import configure_logging

    root = config.store.store_path_root_dir
    for d in () if config.store.enable_d_leger_commit_log else config.store.commit_log_dirs:
        if not os.path.isdir(d):
            raise UsageError(f"{d}: no CommitLog directory (store.storePathCommitLog / --store); nothing was changed")
    if config.store.enable_d_leger_commit_log:
        from daemon.dledgermode import input_problem

        problem = input_problem(config.store)
        if problem:
            raise UsageError(f"{problem}; nothing was changed")
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
        from daemon.rebuild import ProgressBar

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


def cmd_verify(args, config: Config) -> int:
    """A reader: it takes no lock on the output directory."""
    import json

    from daemon.logs import configure_logging
    from daemon.rebuild import ProgressBar
    from daemon.verify import VerifyUsageError, format_text, verify

    _check_inputs(args, config, output=True)
    bar = ProgressBar() if sys.stderr.isatty() and not args.json else None
    configure_logging(config.logging.level, config.logging.format, stream=bar)
    raise_open_files_limit()
    _freeze_start_up()
    try:
        report = verify(config, from_offset=args.from_offset, progress=bar,
                        rebuild_command=lambda out: command_line(args, config, "rebuild", out=out))
    except VerifyUsageError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if bar is not None:
            bar.finish()
    if args.json:
        for finding in report.findings:
            print(json.dumps({"type": "finding", **finding.as_dict()}, ensure_ascii=False))
        print(json.dumps(report.summary(), ensure_ascii=False))
    else:
        print("\n".join(format_text(report)))
    return EXIT_OK if report.consistent else EXIT_FAILURE


def _command_with_out(directory: str) -> str:
    """This command line with `--out directory` instead of its own."""
    import shlex

    argv, out, skip = sys.argv[1:], ["reputd"], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--from"):
            skip = True
        elif not a.startswith(("--out=", "--from=")):
            out.append(a)
    return shlex.join([*out, "--out", directory])


def _continue_command(offset: int) -> str:
    """This command line with `--from offset`, for a rebuild stopped at `offset`."""
    import shlex

    argv, out, skip = sys.argv[1:], ["reputd"], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--from":
            skip = True
        elif not a.startswith("--from="):
            out.append(a)
    return shlex.join([*out, "--from", str(offset)])


def _print_summary(args, config: Config, verb: str, summary: RebuildSummary, where: str = "") -> None:
    """The closing line of rebuild and backfill (or the summary as JSON), then the notes."""
    import json

    if args.json:
        print(json.dumps(summary.as_dict()))
        return
    files = ", ".join(f"{n} {k} files" for k, n in summary.files.items())
    restored = getattr(summary, "restored_units", 0)
    if getattr(summary, "new_messages", summary.messages) == 0 and not restored and not summary.interrupted:
        print(f"{verb} 0 new messages: nothing to dispatch from CommitLog offset {summary.start_offset}{where}; "
              f"{files}; output {config.output.dir}")
    else:  # a stopped rebuild says so on this line too: read alone (a log, `| tail -1`) it is not a success
        new = getattr(summary, "new_messages", summary.messages)
        read = f"{summary.messages:,} messages" + (f" ({new:,} new to the output)" if new != summary.messages else "")
        print(f"{'interrupted: ' * summary.interrupted}{verb} {read}, {summary.bytes:,} bytes [{summary.start_offset}, "
              f"{summary.end_offset}){where} in {summary.seconds:.2f} s ({summary.msgs_per_second:,.0f} msgs/s); "
              f"{files}; output {config.output.dir}")
    if restored:
        print(f"note: restored {restored:,} ConsumeQueue units below the output's end ({summary.output_end}): "
              "queues whose files were missing or ended early")
    for lo, hi, error in summary.skipped:
        print(f"note: skipped [{lo}, {hi}) (onCorruption: skip-segment): {error}")
    if summary.pending is not None:
        print(f"note: stopped before an incomplete record at the end of the CommitLog: {summary.pending}")
    if getattr(summary, "class_archive_saved", None):
        print(f"note: then {summary.class_archive_seconds:.2f} s once, not in the time and rate above, to save the "
              f"driver JVM's classes in {summary.class_archive_saved}, which later local backfills start from")


# The master URLs Spark parses (SparkContext's scheduler choice); any other one fails only once the JVM is up.
_HOST_PORT = r"(\[[0-9A-Fa-f:.]+\]|[^\s,:\[\]/]+):\d+"
SPARK_MASTER_URL = re.compile(r"local(\[(\d+|\*)(\s*,\s*\d+)?\])?|local-cluster\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]"
                              rf"|yarn|spark://{_HOST_PORT}(,{_HOST_PORT})*|(k8s|mesos)://\S+")


def _backfill_checks(args, config: Config) -> None:
    """What `backfill` can refuse without reading data or starting Spark (UsageError, exit 2)."""
    if not SPARK_MASTER_URL.fullmatch(args.master):
        raise UsageError(f"--master {args.master} is not a Spark master URL: local, local[N], local[*], "
                         "spark://HOST:PORT, yarn or k8s://...")
    if args.from_offset is not None and args.to_offset is not None and args.from_offset >= args.to_offset:
        raise UsageError(f"--from {args.from_offset} is not before --to {args.to_offset}")
    local_catalog = args.catalog and "://" not in args.catalog
    if local_catalog and os.path.lexists(args.catalog) and (
            not os.path.isdir(args.catalog)
            or (os.listdir(args.catalog) and not os.path.isdir(os.path.join(args.catalog, "_reputd-backfills")))):
        raise UsageError(f"--catalog {args.catalog} exists and is not a reputd catalog: give a new path or an earlier "
                         "backfill's catalog (a later backfill appends to it)")
    if args.catalog and "://" not in args.catalog:
        parent = os.path.dirname(os.path.abspath(args.catalog))
        if os.path.isdir(parent) and not os.access(parent, os.W_OK):
            raise UsageError(f"--catalog {args.catalog}: its directory {parent} is not writable")
    if args.segments is None:  # the configured CommitLog, on this machine: its paths and offsets can be checked now
        _check_inputs(args, config)
        _check_record_boundaries(config, {"--from": args.from_offset, "--to": args.to_offset})


def _check_record_boundaries(config: Config, offsets: dict[str, int | None]) -> None:
    """Each given offset must be a record boundary of the CommitLog (UsageError naming the nearest ones),
    found before anything starts rather than by the job that would stop there."""
    from daemon.dledgermode import open_commit_log

    log = open_commit_log(config.store)
    for option, offset in offsets.items():
        if offset is None:
            continue
        lo, hi = log.record_around(offset)
        if lo != offset:
            raise UsageError(f"{option} {offset} is not a record boundary: it falls inside the record at "
                             f"[{lo}, {hi}) of {log.find_segment(offset)}; the nearest boundaries are {lo} and {hi}")


def backfill_import_error(error: ImportError) -> str:
    """What a failed import of daemon.backfill means: the optional extra is not installed, or reputd's own
    files are missing (an install that left out a module), which installing PySpark would not fix."""
    if (error.name or "").partition(".")[0] in OWN_PACKAGES:
        return (f"`reputd backfill` cannot load reputd's own module {error.name} ({error}): this reputd "
                f"installation is incomplete; reinstall reputd (pip install --force-reinstall 'reputd[backfill]')")
    return (f"`reputd backfill` needs PySpark and the rest of the [backfill] extra ({error}); install them with "
            f"pip install 'reputd[backfill]'")


def cmd_backfill(args, config: Config) -> int:
    import signal

    # SIGTERM as SIGINT from here, until backfill() handles both: importing PySpark takes a second
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    _backfill_checks(args, config)
    _lock_output(args, config)
    try:
        from daemon.backfill import backfill  # PySpark is the optional [backfill] extra
    except ImportError as e:
        print(f"reputd: error: {backfill_import_error(e)}", file=sys.stderr)
        return EXIT_FAILURE
    from daemon.logs import configure_logging

    configure_logging(config.logging.level, config.logging.format)
    _warn_abort(args, config)

    def say(text: str) -> None:
        print(f"\r{text}", file=sys.stderr, flush=True)

    summary = backfill(config, master=args.master, segments=args.segments, from_offset=args.from_offset,
                       to_offset=args.to_offset, partitions=args.partitions, catalog=args.catalog,
                       spark_conf=dict(args.spark_conf), progress=say)
    _print_summary(args, config, "backfilled", summary,
                   f" from {summary.segments} segments on {summary.master}")
    return EXIT_OK


# --- queries ------------------------------------------------------------------------------------------

def _format(args) -> str:
    return args.format or ("text" if sys.stdout.isatty() else "json")


def _note(args, text: str) -> None:
    """A remark for a person reading a terminal (no message, a result cut short): stderr, text format only."""
    if _format(args) == "text":
        print(text, file=sys.stderr)


def _removed_note(args, removed: int, first_offset: int, what: str, *, as_object: bool = True) -> None:
    """Say that an answer left out messages retention removed: one line on stderr in every format, and in
    the machine formats a last object, `{"type": "removed", ...}`, after the messages (unless the caller's
    own last object carries it: `as_object=False`)."""
    if not removed:
        return
    print(f"reputd: note: left out {removed} {what}{'s' * (removed > 1)} below the CommitLog's first offset "
          f"{first_offset}: retention deleted {'their segments' if removed > 1 else 'its segment'}", file=sys.stderr)
    if as_object and _format(args) == "json":
        import json

        print(json.dumps({"type": "removed", "removed": removed, "unit": what, "commitLogMinOffset": first_offset}))


def parse_time(option: str, text: str, now_ms: int | None = None) -> int:
    """A --begin/--end value as epoch milliseconds: an integer is epoch ms; `now`; a relative time
    (-90s, -30m, -1h, -2d, -1w, -500ms); or ISO 8601 (local time unless it carries an offset or Z)."""
    import re
    import time

    text = text.strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if text.lower() == "now":
        return now
    m = re.fullmatch(r"-(\d+(?:\.\d+)?)(ms|s|m|h|d|w)", text)
    if m:
        unit = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}[m[2]]
        return now - int(float(m[1]) * unit)
    from datetime import datetime

    try:
        when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a time: give epoch milliseconds, an ISO 8601 time "
                         "(2026-11-21T10:00:00, 2026-11-21 10:00:00+08:00) or a relative one (-1h, -30m, -2d)"
                         ) from None
    return int(when.timestamp() * 1000)  # a naive time is local, as datetime.timestamp takes it


def cmd_query_key(args, config: Config) -> int:
    from daemon.query import check_topic, query_key_result, query_offsets

    _check_inputs(args, config, commit_log=False, output=True)  # the index first: the CommitLog when it is read
    begin = parse_time("--begin", args.begin)
    end = LONG_MAX if args.end is None else parse_time("--end", args.end)
    if begin > end:
        raise UsageError(f"--begin {args.begin} ({begin}) is later than --end {args.end} ({end})")
    if args.raw:
        import json

        from indexcore.indexservice import IndexQueryDamaged

        damage = None
        try:
            result = query_offsets(config, args.topic, args.key, args.max_num, begin, end)
        except IndexQueryDamaged as e:  # the candidates before the damage are still the index's answer
            result, damage = e.partial, e
        if not result.phy_offsets and damage is None:
            check_topic(config, args.topic)
        if args.format == "json":
            print(json.dumps({"phyOffsets": result.phy_offsets,
                              "indexLastUpdateTimestamp": result.index_last_update_timestamp,
                              "indexLastUpdatePhyoffset": result.index_last_update_phy_offset}))
        else:
            for offset in result.phy_offsets:
                print(offset)
        return _damaged(damage)
    result = query_key_result(config, args.topic, args.key, args.max_num, begin, end)
    if not result.messages and result.damage is None:
        check_topic(config, args.topic)
    if _format(args) == "json":
        from daemon.render import message_json_line

        for rec in result.messages:
            print(message_json_line(rec))
    elif result.messages:
        from daemon.render import key_table

        print("\n".join(key_table(result.messages)))
    if not result.messages:
        _note(args, f"no message with key {args.key!r} in topic {args.topic!r}"
                    + (" in that time range" if (begin, end) != (0, LONG_MAX) else ""))
    if result.cut:
        why = (f"--max {args.max_num}" if args.max_num < config.store.max_msgs_num_batch
               else f"maxMsgsNumBatch {config.store.max_msgs_num_batch}, the most one index query returns")
        _note(args, f"note: the index gave {result.candidates} candidates, the limit ({why}); older messages "
                    "with this key may exist: narrow the time range with --begin/--end")
    _removed_note(args, result.removed, result.commit_log_min_offset, "index candidate")
    return _damaged(result.damage)


def _damaged(damage: Exception | None) -> int:
    """After the answer found before it, the damage a query met: one line on stderr, exit 1."""
    if damage is None:
        return EXIT_OK
    try:
        sys.stdout.flush()  # the answer first, then the line saying where it stops
    except BrokenPipeError:
        _quiet_stdout()
    print(f"reputd: error: {damage}", file=sys.stderr)
    return EXIT_FAILURE


def _print_records(args, records, found_header: str | None = None) -> None:
    from daemon.render import message_block, message_json_line, save_body

    as_json = _format(args) == "json"
    body, raw = args.body or args.raw_body, args.raw_body
    for i, rec in enumerate(records):
        path = save_body(rec, args.save_body, raw) if args.save_body else None
        if as_json:
            print(message_json_line(rec, body=body, body_path=path, raw_body=raw))
        else:
            if i or found_header:
                print()
            print("\n".join(message_block(rec, body=body, body_path=path, raw_body=raw)))


def cmd_query_queue(args, config: Config) -> int:
    from daemon.query import check_queue, query_queue

    _check_inputs(args, config, commit_log=False, output=True)
    check_queue(config, args.topic, args.queue_id)
    result = query_queue(config, args.topic, args.queue_id, args.offset, args.count)
    where = f"{args.topic}/{args.queue_id} holds queue offsets [{result.min_offset}, {result.max_offset})"
    if _format(args) == "json":  # the messages, then the GetMessageResult a script pages on
        import json

        _print_records(args, result.messages)
        print(json.dumps({"status": result.status, "nextBeginOffset": result.next_begin_offset,
                          "minOffset": result.min_offset, "maxOffset": result.max_offset,
                          "messageCount": len(result.messages), "topic": args.topic, "queueId": args.queue_id,
                          "offset": args.offset, "removed": result.removed,
                          "commitLogMinOffset": result.commit_log_min_offset}
                         | ({"damage": str(result.damage)} if result.damage is not None else {}), ensure_ascii=False))
        _removed_note(args, result.removed, result.commit_log_min_offset, "unit", as_object=False)
        return _damaged(result.damage)  # exit 1: a script paging on nextBeginOffset stops at the damaged unit
    if result.status != "FOUND":
        print(f"{result.status}: {where}", file=sys.stderr)
    else:
        _note(args, f"FOUND {len(result.messages)} messages at queue offsets [{args.offset}, "
                    f"{result.next_begin_offset}); {where}")
    _print_records(args, result.messages)
    if result.damage is None and result.status in ("FOUND", "MESSAGE_WAS_REMOVING") \
            and result.next_begin_offset < result.max_offset:
        more = [str(args.queue_id), str(result.next_begin_offset)] + (["--count", str(args.count)] if args.count != 32
                                                                       else []) + (["--body"] if args.body else [])
        _note(args, f"\nnote: more from queue offset {result.next_begin_offset}: "
                    f"{command_line(args, config, 'query', 'queue', args.topic, *more)}")
    _removed_note(args, result.removed, result.commit_log_min_offset, "unit")
    return _damaged(result.damage)


def cmd_query_msgid(args, config: Config) -> int:
    from daemon.query import query_msgid
    from indexcore.msgid import msg_id_shape_error

    why = msg_id_shape_error(args.msgid.strip())
    if why is not None:
        raise UsageError(why)
    _check_inputs(args, config, commit_log=False, output=True)
    result = query_msgid(config, args.msgid.strip(), args.topic)
    if not result.messages:  # one line saying what was tried (and the damage that stopped a look)
        _removed_note(args, result.removed, result.commit_log_min_offset, "index candidate")
        tried = "; ".join(note.removeprefix("warning: ") for note in result.notes)
        damage = f"; {result.damage}" if result.damage is not None else ""
        print(f"reputd: error: no message with msgId {args.msgid.strip()}: {tried}{damage}", file=sys.stderr)
        return EXIT_FAILURE
    for note in result.notes:
        if note.startswith("warning:"):
            print(f"reputd: {note}", file=sys.stderr)
    if result.found_by == "uniqKey":
        n = len(result.messages)
        _note(args, f"msgId {args.msgid.strip()} is a UNIQ_KEY (a client msgId): {n} message{'s' * (n > 1)}")
    _print_records(args, result.messages)
    _removed_note(args, result.removed, result.commit_log_min_offset, "index candidate")
    return _damaged(result.damage)


# --- inspect, produce ---------------------------------------------------------------------------------

def cmd_inspect(args, config: Config) -> int:
    import json

    from daemon.inspect_file import inspect_path, text_line, text_value

    if os.path.isdir(args.path):
        raise UsageError(f"{args.path}: is a directory; inspect decodes one file: a CommitLog segment "
                         "(commitlog/<20 digits>), a ConsumeQueue file (consumequeue/TOPIC/QUEUE/<20 digits>), an "
                         "IndexFile (index/<17 digits>), the broker's checkpoint or reputd.checkpoint")
    if not os.path.isfile(args.path):
        raise UsageError(f"{args.path}: no such file")
    info = inspect_path(args.path, config, limit=args.limit, hash_slot_num=args.hash_slot_num,
                        index_num=args.index_num)
    if args.json:
        print(json.dumps(info.header, ensure_ascii=False))
        for row in info.rows:
            print(json.dumps(row, ensure_ascii=False))
    else:
        for key, value in info.header.items():
            print(f"{key}: {text_value(value)}")
        for row in info.rows:
            print(text_line(row))
    for key, value in info.trailer.items():
        print(f"{key}: {value}", file=sys.stderr)
    if "error" in info.trailer:
        return EXIT_FAILURE
    return EXIT_OK


def cmd_produce(args, config: Config) -> int:
    from daemon.produce import produce

    bar = None
    if sys.stderr.isatty():
        from daemon.rebuild import ProgressBar

        bar = ProgressBar(unit="messages")
    s = produce(config, args.messages, topics=args.topics, queues=args.queues, body_size=args.body_size,
                keys=args.keys, seed=args.seed, uniq_key=not args.no_uniq_key, lmq_queues=args.lmq_queues,
                lmq_per_message=args.lmq_per_message if args.lmq_queues else 0,
                progress=(lambda done, total: bar(done, total, done)) if bar is not None else None)
    if bar is not None:
        bar.finish()
    print(f"produced {s.messages:,} messages, {s.bytes:,} bytes at CommitLog offsets "
          f"[{s.first_offset}, {s.end_offset})")
    return EXIT_OK


# --- main ---------------------------------------------------------------------------------------------

def _joined_time_options(argv: list[str]) -> list[str]:
    """`--begin -1h` as `--begin=-1h`: argparse would take a value starting with '-' for an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in TIME_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the command `argv` names (all of them when it names none: help, a mistyped name)."""
    command = argv[0] if argv and argv[0] in COMMANDS else None
    kind = argv[1] if command == "query" and len(argv) > 1 and argv[1] in QUERY_KINDS else None
    if command == "query" and kind is None:
        command = None
    return build_parser(command, kind)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; a writing command that failed before writing leaves no trace of its output
    directory (daemon/outlock.py)."""
    args = argparse.Namespace()
    code = _main(argv, args)
    lock = getattr(args, "output_lock", None)
    if code != EXIT_OK and lock is not None:
        lock.forget()
    return code


def _main(argv: Sequence[str] | None, args: argparse.Namespace) -> int:
    argv = _joined_time_options(list(sys.argv[1:] if argv is None else argv))
    _parser_for(argv).parse_args(argv, namespace=args)
    if args.command == "query":  # modules a query imports but never uses (daemon/deferred.py)
        from daemon.deferred import defer

        defer("numpy")  # indexcore's batch paths
        defer("inspect")  # dataclasses, for classes without a docstring
        defer("datetime")  # yaml, for timestamps (and --begin/--end in ISO 8601)
        defer("base64")  # yaml, for !!binary
    from daemon.config import ConfigError
    from indexcore.errors import SizeMismatchError, StoreError

    args.config_file, args.config_origin = None, ""
    if sys.stdout is None:  # started with stdout closed (`>&-`): what it would print goes nowhere
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stdout for the rest of the process
    guard = sys.stdout = _StdoutGuard(sys.stdout)
    try:
        config = _config(args)
        return args.handler(args, config)
    except ConfigError as e:
        print(f"reputd: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SizeMismatchError as e:
        print(f"reputd: config error: {e}: set {_size_setting(e.path)} to the broker's values "
              f"({_config_in_use(args)})", file=sys.stderr)
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
        sys.stdout = guard.stream


class _StdoutGuard:
    """sys.stdout while a command runs. When the reader closes the pipe (`| head -1`, `| true`), the write
    or flush that meets it sends the rest of stdout to /dev/null instead of raising, so the command goes
    on to its own result: the exit code says what happened, whatever happened to stdout."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            _quiet_stdout()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            _quiet_stdout()
            self.stream.flush()  # what was buffered goes to /dev/null

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _quiet_stdout() -> None:
    """After a reader closed the pipe (`| head`), send what is left to /dev/null, so the interpreter's
    final flush raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
