"""What every command's front end shares: exit codes, argument types, the config a command line chooses,
the checks of its input paths, the output lock, the commands it prints for the operator to run."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.config import Config
    from daemon.engine.rebuild import RebuildSummary


EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
OWN_PACKAGES = ("daemon", "indexcore")  # what the reputd distribution installs; anything else is a dependency
LONG_MAX = 2**63 - 1
TIME_OPTIONS = ("--begin", "--end")
FORMATS = ("text", "json")


class UsageError(Exception):
    """Arguments that cannot work, found before anything is read or written: exit 2."""


class SettingsMismatch(UsageError):
    """Settings that do not read the files there (a CommitLog of the other kind, a DLedger log of another
    id): a configuration error, exit 2, printed with the config in use."""


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
QUERY_KINDS = ("key", "queue", "msgid", "time", "offset", "trace")
QUERYTIME_KINDS = ("time", "offset", "trace")  # the kinds daemon/cli/querytime.py defines
OUT_HELP = "output directory for consumequeue/ and index/, overrides output.dir (default: the store root)"


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


def _config(args) -> Config:
    """The config file (daemon.config.config_path's rule), the environment and the command's --store/--out
    flags, loaded once."""
    from daemon.config import config_path, load_config

    overrides = {"store.storePathRootDir": getattr(args, "store", None), "output.dir": getattr(args, "out", None)}
    if overrides["store.storePathRootDir"] and not overrides["output.dir"]:
        overrides["output.dir"] = overrides["store.storePathRootDir"]
    args.config_file, args.config_origin = config_path(args.config, os.environ, os.getcwd())
    # commands that import no plug-ins may take the file's parsed text from daemon/config/memo.py
    config = load_config(args.config_file, os.environ, overrides, memo=args.command in ("query", "inspect"))
    args.defaulted = config.defaulted  # for `_whence`: a path the config file left out is the built-in default
    return config


def _config_in_use(args) -> str:
    if args.config_file is None:
        return f"config: built-in defaults ({args.config_origin})"
    return f"config: {args.config_file} ({args.config_origin})"


def _output_flag(args) -> str:
    return "--out" if getattr(args, "out", None) else "--store" if getattr(args, "store", None) else "output.dir"


def _whence(args, option: str) -> str:
    """What gave a path, for an error about it: the command-line option, or the config key with the variable
    that set it, or, when no config file was found, the built-in defaults (a path the operator never set); a
    key the config file leaves out is its built-in default too, and the line says so."""
    if option.startswith("--"):
        return option
    from daemon.config.model import env_var_name

    section, _, key = option.partition(".")
    variable = env_var_name(section, key)
    if variable in os.environ:
        return f"{option}, from {variable}"
    if args.config_file is None:
        return f"{option}; {_config_in_use(args)}"
    if option in getattr(args, "defaulted", ()):
        return f"{option}: built-in default, not in {os.path.abspath(args.config_file)}"
    return option


def _check_store_root(args, config: Config) -> None:
    """The store root must exist, in every command that reads or writes it (`produce`, which may create a new
    one, refuses only a path whose parent does not exist either): one line naming what chose it."""
    root = config.store.store_path_root_dir
    if not os.path.isdir(root):
        option = "--store" if getattr(args, "store", None) else "store.storePathRootDir"
        raise UsageError(f"{root}: no such store root directory ({_whence(args, option)})")


def _check_inputs(args, config: Config, *, commit_log: bool = True, output: bool = False,
                  data: bool = True) -> None:
    """The directories a command reads, looked at before anything is read or written. One rule for every
    command: a path named by an option or a config key that does not exist is a usage error (exit 2, naming
    the option or key); a store root holding a CommitLog of the other kind than the config reads (a DLedger
    log without the DLedger keys, a plain `commitlog/` with them) is a configuration error (exit 2, naming
    the settings that read it), whether or not the command reads the CommitLog first; a store root that
    exists without its `commitlog/` is data missing (StoreLayoutError, exit 1), as a missing segment is (with
    `data` False left to the command, which reports it its way)."""
    from daemon.engine.dledgermode import input_problem, store_mode_problem
    from indexcore.errors import StoreLayoutError

    store = config.store
    root = store.store_path_root_dir
    root_option = _whence(args, "--store" if getattr(args, "store", None) else "store.storePathRootDir")
    _check_store_root(args, config)
    mismatch = store_mode_problem(store)
    if mismatch:
        raise SettingsMismatch(mismatch)
    if store.enable_d_leger_commit_log:  # settings that locate no DLedger log: a usage error, for queries too
        problem = input_problem(store, root_option)
        if problem:
            raise UsageError(problem)
    else:
        for d in store.commit_log_dirs:
            if os.path.isdir(d):
                continue
            if os.path.normpath(d) != os.path.normpath(os.path.join(root, COMMIT_LOG_DIR)):  # a key names it
                raise UsageError(f"{d}: no such CommitLog directory ({_whence(args, 'store.storePathCommitLog')})")
            if commit_log and data:
                raise StoreLayoutError(d, f"the store root {root} has no {COMMIT_LOG_DIR}/ directory: no CommitLog to "
                                          "read")
    if output:
        _check_output(args, config, create=False)


def _check_output(args, config: Config, *, create: bool) -> bool:
    """The output directory: it must be a directory. A reader needs it to exist (exit 2 naming what gave it);
    a writer (`create`) makes it when its parent exists, so that `--out NEW` starts a new output, and
    refuses a path whose parent does not exist (a mistyped path, not a new directory). True when the
    writer is to create it."""
    out = config.output.dir
    whence = _whence(args, _output_flag(args))
    if os.path.isdir(out):
        return False
    if os.path.lexists(out):
        raise UsageError(f"{out}: not a directory ({whence}): the output directory is where consumequeue/ and "
                         "index/ are")
    parent = os.path.dirname(os.path.abspath(out))
    if not create:
        raise UsageError(f"{out}: no such output directory ({whence})")
    if not os.path.isdir(parent):
        raise UsageError(f"{out}: no such output directory, and no directory {parent} to create it in ({whence}): "
                         "a writing command creates the output directory, not the path to it")
    return True


PROGRAM = "reputd"


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def program() -> list[str]:
    """The words that start this very reputd again, for the command lines it prints: `reputd` when the
    first `reputd` on PATH is this program, else the path of the `reputd` script that is running (after
    `make run` `.venv/bin/reputd`, which is not on PATH); for `python -m daemon.cli` the `reputd` script
    beside that interpreter (the same installation), else the interpreter with `-m daemon.cli`."""
    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == PROGRAM and _executable(argv0):
        script = argv0
    else:  # `python -m daemon.cli`, or main(argv) called by another program
        script = os.path.join(os.path.dirname(sys.executable), PROGRAM)
        if not _executable(script):
            return [sys.executable, "-m", "daemon.cli"]
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        found = os.path.join(directory or ".", PROGRAM)
        if _executable(found):  # the first one on PATH is what a shell runs
            return [PROGRAM] if os.path.realpath(found) == os.path.realpath(script) else [script]
    return [script]


def runnable(*words: str) -> str:
    """A reputd command line as printed for the operator: this program (`program()`), then `words`, quoted
    for a shell. Every command line reputd prints (repair plans, `continue with:`, a query's `more from`,
    hand-off steps) is built here or by `command_line`, so that it runs as printed from any directory."""
    import shlex

    return shlex.join([*program(), *words])


def _check_store_root_sizes(config: Config) -> None:
    """The output's files and, with the output elsewhere, the store root's own ConsumeQueue files and IndexFiles
    held to the configured sizes before anything is written (SizeMismatchError, exit 2: the files written would
    not be the broker's; daemon/engine/sizes.py)."""
    from daemon.engine.sizes import check_config_sizes

    check_config_sizes(config)


def command_line(args, config: Config, *words: str, out: str | None = None) -> str:
    """`reputd WORDS...` (`runnable`) with the options that chose this command's config, store and output
    (`out` instead of the output when given), as absolute paths quoted for a shell: printed for the operator
    to run, it reads and writes what it says."""
    chosen = []
    if config.source:  # also when $REPUTD_CONFIG or ./config/reputd.yaml chose it: another directory may not
        chosen += ["--config", os.path.abspath(config.source)]
    if getattr(args, "store", None):
        chosen += ["--store", os.path.abspath(config.store.store_path_root_dir)]
    if out is not None or getattr(args, "out", None):
        chosen += ["--out", os.path.abspath(out if out is not None else config.output.dir)]
    return runnable(*words, *chosen)


def _lock_output(args, config: Config) -> None:
    """Take the output directory's writer lock for the rest of the process (daemon/ops/outlock.py); a running
    broker's store root is refused before anything is created. `main` removes what taking it created when
    the command fails having written nothing, and says that it created it when it is kept (`created_note`;
    `run` says it once its first session has opened the output)."""
    from daemon.ops.outlock import BrokerRunning, OutputLocked, OutputNotWritable, lock_output

    create = _check_output(args, config, create=True)
    try:
        args.output_lock = lock_output(config.output.dir, args.command)
    except (BrokerRunning, OutputLocked) as e:
        raise UsageError(str(e)) from None
    except OutputNotWritable as e:
        raise UsageError(f"{_output_flag(args)}: {e}") from None
    args.output_created = os.path.abspath(config.output.dir) if create else None


def created_note(args) -> None:
    """`reputd: note: created the output directory ...`, when this command created it (once)."""
    import contextlib

    created = getattr(args, "output_created", None)
    if created:
        args.output_created = None
        with contextlib.suppress(OSError):  # stderr's reader gone: the exit code still says it all
            print(f"reputd: note: created the output directory {created} (it did not exist)", file=sys.stderr)


def _check_commit_log(config: Config) -> None:
    """Open the CommitLog as the command will: its segments' size against mappedFileSizeCommitLog
    (SizeMismatchError, the configuration error), found before the output directory is created."""
    from daemon.engine.dledgermode import open_commit_log

    open_commit_log(config.store)


def _freeze_start_up() -> None:
    """Before a pass over a whole CommitLog: what start-up made (modules, config, the logger) lives as
    long as the command, so it is moved out of the cyclic collector's reach. The pass allocates enough
    to trigger collections, which would otherwise walk all of it each time while holding the GIL the
    read-ahead thread waits for (an LMQ rebuild of the bench store: 31 ms of collections, 10 ms frozen).
    A command's business, not the library's: `rebuild()` called in a longer-lived process leaves its gc
    alone. The youngest generation is collected every PASS_GC_YOUNG allocations instead of 700: a pass over
    100,000 queues keeps several objects per queue alive, and collections took 0.32 CPU-s of 1.96 putting a
    million units into them in 31 batches; 0.07 s with this threshold."""
    import gc

    gc.freeze()
    gc.set_threshold(PASS_GC_YOUNG, *gc.get_threshold()[1:])
    _keep_freed_memory()


PASS_GC_YOUNG = 50_000
# glibc's mallopt(3) parameters, and what a pass sets them to: memory freed by one batch is kept for the next
# (up to PASS_TRIM_THRESHOLD at the top of the heap), and arrays up to PASS_MMAP_THRESHOLD (glibc's most) come
# from the heap, instead of fresh pages from the kernel, zeroed, for every batch. Batches widened over thousands
# of queues allocate hundreds of MB each: the kernel's page zeroing was a tenth of an 8,000-queue rebuild's CPU
# (perf), and 6 interleaved pairs with these values took 1.48 against 1.58 CPU-s (0.86 against 0.97 s of system
# time). The memory stays with the process until it exits, which a pass does when it ends.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
PASS_TRIM_THRESHOLD = 1 << 30
PASS_MMAP_THRESHOLD = 32 << 20


PASS_STATE: dict[str, bool] = {}  # what `_keep_freed_memory` did in this process ("memory_kept")


def _keep_freed_memory(libc=None) -> bool:
    """mallopt the pass's thresholds; False where there is no glibc mallopt (another C library: nothing done)."""
    import ctypes

    try:
        mallopt = (libc if libc is not None else ctypes.CDLL(None)).mallopt
    except (AttributeError, OSError):
        kept = False
    else:
        kept = bool(mallopt(M_TRIM_THRESHOLD, PASS_TRIM_THRESHOLD)) & bool(
            mallopt(M_MMAP_THRESHOLD, PASS_MMAP_THRESHOLD))
    PASS_STATE["memory_kept"] = kept
    return kept


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


def _handoff_command(args, config: Config) -> str:
    """The `reputd handoff` command for this config's store root, runnable as printed."""
    words = ["handoff"]
    if args.config_file:
        words += ["--config", os.path.abspath(args.config_file)]
    words += ["--store", os.path.abspath(config.store.store_path_root_dir)]
    return runnable(*words)


def _warn_abort(args, config: Config) -> None:
    """Writing into a store root whose broker did not exit cleanly: unless `reputd handoff` runs before the
    broker starts, 4.9.3's recovery discards these IndexFiles and re-dispatches over these ConsumeQueues."""
    from daemon.ops.logs import get_logger
    from daemon.ops.outlock import BROKER_ABORT_FILE  # not daemon.commands.verify: a rebuild needs none of it

    root, out = config.store.store_path_root_dir, config.output.dir
    abort = os.path.join(root, BROKER_ABORT_FILE)
    if not os.path.exists(abort) or os.path.realpath(out) != os.path.realpath(root):
        return
    command = _handoff_command(args, config)
    print(f"reputd: warning: {abort} exists (the broker's last exit was not clean): a 4.9.3 broker started on this "
          f"store discards these IndexFiles and re-dispatches over these ConsumeQueues unless `{command}` runs "
          "first", file=sys.stderr)
    get_logger(command=args.command).warning("broker_abort_present", path=abort, handoff=command)


def _command_with_out(args, config: Config, directory: str) -> str:
    """This rebuild's command line with `--out directory` instead of its own (and no --from)."""
    return command_line(args, config, "rebuild", out=directory)


def _continue_command(args, config: Config, offset: int) -> str:
    """This rebuild's command line with `--from offset`, for a rebuild stopped at `offset`."""
    return command_line(args, config, "rebuild", "--from", str(offset), *(["--json"] if args.json else []))


def _print_summary(args, config: Config, verb: str, summary: RebuildSummary, where: str = "",
                   error: Exception | None = None) -> None:
    """The closing line of rebuild and backfill (or the summary as JSON), then the notes. With `error` (the
    command failed there: its line on stderr follows) the line starts `failed:` and says how far it got, so
    that read alone (a log, `| tail -1`) it is not a success."""
    import json

    if args.json:
        print(json.dumps(summary.as_dict() | ({"failed": True, "error": str(error)} if error is not None else {})))
        return
    files = ", ".join(f"{n} {k} file{'s' * (n != 1)}" for k, n in summary.files.items())
    restored = getattr(summary, "restored_units", 0)
    if error is not None:
        print(f"failed: {verb} {summary.messages:,} messages, {summary.bytes:,} bytes [{summary.start_offset}, "
              f"{summary.end_offset}){where} before the error below; {files}; output {config.output.dir}")
    elif summary.messages == 0 and not restored and not summary.interrupted:
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
    for lo, hi, skipped in summary.skipped:
        print(f"note: skipped [{lo}, {hi}) (onCorruption: skip-segment): {skipped}")
    if summary.pending is not None:
        print(f"note: stopped before an incomplete record at the end of the CommitLog: {summary.pending}")
    if getattr(summary, "class_archive_saved", None):
        print(f"note: then {summary.class_archive_seconds:.2f} s once, not in the time and rate above, to save the "
              f"driver JVM's classes in {summary.class_archive_saved}, which later local backfills start from")


def _check_record_boundaries(config: Config, offsets: dict[str, int | None]) -> None:
    """Each given offset must be a record boundary of the CommitLog (UsageError naming the nearest ones),
    found before anything starts rather than by the job that would stop there."""
    from daemon.engine.dledgermode import open_commit_log

    log = open_commit_log(config.store)
    for option, offset in offsets.items():
        if offset is None:
            continue
        lo, hi = log.record_around(offset)
        if lo != offset:
            raise UsageError(f"{option} {offset} is not a record boundary: it falls inside the record at "
                             f"[{lo}, {hi}) of {log.find_segment(offset)}; the nearest boundaries are {lo} and {hi}")


def _quiet_stdout() -> None:
    """After a reader closed the pipe (`| head`), send what is left to /dev/null, so the interpreter's
    final flush raises nothing."""
    quiet(sys.stdout)


def quiet(stream) -> None:
    """Point the stream's descriptor at /dev/null (its reader is gone): later writes, the child processes'
    that share it included, and the final flush go nowhere instead of failing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)
