"""`reputd backfill`: its options, what it refuses before Spark starts, and its front end (the job is
daemon/backfill/)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from typing import TYPE_CHECKING

from daemon.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    OWN_PACKAGES,
    UsageError,
    _check_inputs,
    _check_record_boundaries,
    _check_store_root_sizes,
    _lock_output,
    _non_negative,
    _positive,
    _print_summary,
    _spark_setting,
    _store_command,
    _warn_abort,
)

if TYPE_CHECKING:
    from daemon.config import Config

# Set by the Dockerfile: which of its images this is, by stage (`runtime`, the daemon, or `backfill`).
IMAGE_ENV, RUNTIME_IMAGE = "REPUTD_IMAGE", "runtime"


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
    if local_catalog and os.path.isdir(os.path.join(args.catalog, "_reputd-backfills")) and any(
            name.startswith("topic=") for name in os.listdir(args.catalog)):  # catalog.LEGACY_PREFIX
        raise UsageError(f"--catalog {args.catalog} is in the topic=T/date=D/ layout of an earlier reputd, which this "
                         f"one does not extend: give a new --catalog path (and backfill the ranges named in "
                         f"{os.path.join(args.catalog, '_reputd-backfills')}/ into it)")
    if args.catalog and "://" not in args.catalog:
        parent = os.path.dirname(os.path.abspath(args.catalog))
        if os.path.isdir(parent) and not os.access(parent, os.W_OK):
            raise UsageError(f"--catalog {args.catalog}: its directory {parent} is not writable")
    from daemon.engine.sizes import check_output_sizes

    check_output_sizes(config.output.dir, config.store)  # the output's files against the sizes, before Spark
    if args.segments is None:  # the configured CommitLog, on this machine: its paths and offsets can be checked now
        _check_inputs(args, config)
        _check_record_boundaries(config, {"--from": args.from_offset, "--to": args.to_offset})


def backfill_import_error(error: ImportError) -> str:
    """What a failed import of daemon.backfill means: the optional extra is not installed, or reputd's own
    files are missing (an install that left out a module), which installing PySpark would not fix. The command
    it gives installs into the environment running this reputd, with requirements that pip finds anywhere
    (`reputd[backfill]` names a package only a checkout's own environment knows); in the daemon's container
    image, which has neither pip nor Java, the answer is the backfill image."""
    if (error.name or "").partition(".")[0] in OWN_PACKAGES:
        return (f"`reputd backfill` cannot load reputd's own module {error.name} ({error}): this reputd "
                f"installation is incomplete; reinstall reputd the way it was installed")
    if os.environ.get(IMAGE_ENV) == RUNTIME_IMAGE:
        return (f"`reputd backfill` needs PySpark and Java ({error}), which the daemon image leaves out: run it "
                f"in the backfill image (docker build --target backfill -t reputd-backfill .)")
    specs = " ".join(shlex.quote(spec) for spec in backfill_requirements())
    return (f"`reputd backfill` needs PySpark and the rest of the [backfill] extra ({error}); install them with "
            f"{shlex.quote(sys.executable)} -m pip install {specs} (and Java 17 or later for the driver)")


def backfill_requirements() -> list[str]:
    """The [backfill] extra's requirements: the installed metadata's, or pyproject.toml's in a source tree."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        found = requires("reputd") or []
    except PackageNotFoundError:
        found = []
    specs = [r.partition(";")[0].strip() for r in found if re.search(r"""extra\s*==\s*["']backfill["']""", r)]
    if specs:
        return specs
    import tomllib

    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "pyproject.toml")
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["optional-dependencies"]["backfill"])


def cmd_backfill(args, config: Config) -> int:
    import signal

    from daemon.cli.startsignals import command_finished

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a caller's main(argv): SIGTERM as SIGINT from here,
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # until backfill() handles both
    _backfill_checks(args, config)
    _check_store_root_sizes(config)
    _lock_output(args, config)
    try:
        from daemon.backfill import backfill  # PySpark is the optional [backfill] extra
    except ImportError as e:
        print(f"reputd: error: {backfill_import_error(e)}", file=sys.stderr)
        return EXIT_FAILURE
    from daemon.ops.logs import configure_logging

    configure_logging(config.logging.level, config.logging.format)
    _warn_abort(args, config)

    # over Spark's stage bar on a terminal; in a log file or the journal a carriage return is noise
    start_of_line = "\r" if sys.stderr.isatty() else ""

    def say(text: str) -> None:
        print(f"{start_of_line}{text}", file=sys.stderr, flush=True)

    from daemon.backfill import BrokerLockTaken, CommitInterrupted

    try:
        summary = backfill(config, master=args.master, segments=args.segments, from_offset=args.from_offset,
                           to_offset=args.to_offset, partitions=args.partitions, catalog=args.catalog,
                           spark_conf=dict(args.spark_conf), progress=say)
    except BrokerLockTaken as e:  # as `run` and `rebuild` stop for it: exit 2, which systemd does not restart
        command_finished()
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CommitInterrupted as e:  # a signal stopped the commit between two files: what the output holds
        command_finished()
        print(f"reputd: interrupted: {e}", file=sys.stderr)
        return EXIT_INTERRUPTED
    command_finished()
    _print_summary(args, config, "backfilled", summary,
                   f" from {summary.segments} segment{'s' * (summary.segments != 1)} on {summary.master}")
    return EXIT_OK
