"""The `reputd` command line. Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from daemon.config import Config, ConfigError, load_config
from daemon.inspect_file import (
    file_kind,
    inspect_checkpoint,
    inspect_commitlog,
    inspect_consumequeue,
    inspect_indexfile,
    text_line,
)
from daemon.logs import configure_logging
from daemon.produce import produce
from daemon.query import message_json, query_key, query_msgid, query_offsets, query_queue
from daemon.rebuild import ProgressBar, RebuildSummary, rebuild
from indexcore.dispatch import DelayLevelTable
from indexcore.errors import StoreError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
LONG_MAX = 2**63 - 1


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reputd",
        description="Rebuild and query RocketMQ ConsumeQueue and IndexFile files from a broker's CommitLog.",
        epilog="Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", default=os.environ.get("REPUTD_CONFIG"),
                       help="YAML config file (default: $REPUTD_CONFIG, else built-in defaults)")
        p.add_argument("--store", help="store root, overrides store.storePathRootDir")
        p.add_argument("--out", help="output directory, overrides output.dir")
        return p

    p = add("run", "Follow the CommitLog as a broker writes it and keep consumequeue/ and index/ current.")
    p.add_argument("--until-caught-up", action="store_true",
                   help="dispatch everything readable now, flush, checkpoint and exit 0")
    p.set_defaults(handler=cmd_run)

    p = add("rebuild", "Build consumequeue/ and index/ from the CommitLog, from its start or --from.")
    p.add_argument("--from", dest="from_offset", type=_non_negative, help="CommitLog offset of a record to start at")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=cmd_rebuild)

    p = add("verify", "Check consumequeue/ and index/ against what the CommitLog implies, read-only (exit 0 "
                      "consistent, 1 differences found).")
    p.add_argument("--from", dest="from_offset", type=_non_negative,
                   help="CommitLog offset of a record to start at (default: the oldest segment)")
    p.add_argument("--json", action="store_true", help="one JSON object per finding, then a summary object")
    p.set_defaults(handler=cmd_verify)

    p = add("backfill", "Build consumequeue/ and index/ for CommitLog segments with Spark, byte-identical to rebuild.")
    p.add_argument("--segments", metavar="DIR_OR_URI",
                   help="CommitLog directory (or file:// URI; comma-separated for several) instead of "
                        "store.storePathCommitLog; every executor must see it at this path")
    p.add_argument("--master", default="local[*]",
                   help="Spark master URL: local[*] (default), local[N], spark://HOST:PORT, yarn, k8s://...")
    p.add_argument("--from", dest="from_offset", type=_non_negative, help="CommitLog offset of a record to start at")
    p.add_argument("--to", dest="to_offset", type=_positive,
                   help="stop before this CommitLog offset (a record boundary, e.g. where `reputd run` started)")
    p.add_argument("--partitions", type=_positive, help="tasks for the ConsumeQueue and IndexFile phases "
                                                        "(default: Spark's default parallelism)")
    p.add_argument("--catalog", metavar="PATH", help="also write the dispatch rows as Parquet, partitioned by topic "
                                                     "and date (any path or URI Spark can write)")
    p.add_argument("--conf", dest="spark_conf", action="append", type=_spark_setting, default=[],
                   metavar="KEY=VALUE", help="a Spark setting, e.g. spark.executor.memory=4g (repeatable)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=cmd_backfill)

    q = sub.add_parser("query", help="Query messages by key, queue offset or msgId.",
                       description="Query messages by key, queue offset or msgId.")
    qs = q.add_subparsers(dest="query", required=True, metavar="KIND")
    for name, help_text in (("key", "Messages whose topic and key match exactly, newest first."),
                            ("queue", "Messages of a ConsumeQueue from a queue offset."),
                            ("msgid", "The message of an offset msgId (store host + CommitLog offset).")):
        p = qs.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", default=os.environ.get("REPUTD_CONFIG"), help="YAML config file")
        p.add_argument("--store", help="store root, overrides store.storePathRootDir")
        p.add_argument("--out", help="directory holding consumequeue/ and index/, overrides output.dir")
        p.add_argument("--json", action="store_true", help="one JSON object per message")
        if name == "key":
            p.add_argument("topic")
            p.add_argument("key")
            p.add_argument("--begin", type=_int, default=0, help="earliest store time, ms (default 0)")
            p.add_argument("--end", type=_int, default=LONG_MAX, help="latest store time, ms (default: no limit)")
            p.add_argument("--max", dest="max_num", type=_positive, default=64,
                           help="maximum number of candidates (clamped to maxMsgsNumBatch, as the broker does)")
            p.add_argument("--raw", action="store_true",
                           help="print the index's candidate offsets as IndexService.queryOffset returns them")
            p.set_defaults(handler=cmd_query_key)
        elif name == "queue":
            p.add_argument("topic")
            p.add_argument("queue_id", type=_non_negative)
            p.add_argument("offset", type=_non_negative)
            p.add_argument("--count", type=_positive, default=32, help="maximum number of messages (default 32)")
            p.set_defaults(handler=cmd_query_queue)
        else:
            p.add_argument("msgid")
            p.set_defaults(handler=cmd_query_msgid)

    p = sub.add_parser("inspect", help="Decode a CommitLog segment, ConsumeQueue file, IndexFile or checkpoint.",
                       description="Decode a CommitLog segment, ConsumeQueue file, IndexFile or checkpoint.")
    p.add_argument("path")
    p.add_argument("--config", default=os.environ.get("REPUTD_CONFIG"),
                   help="YAML config (its maxHashSlotNum/maxIndexNum shape IndexFiles)")
    p.add_argument("--hash-slot-num", type=_positive, help="IndexFile slots (default: from the config)")
    p.add_argument("--index-num", type=_positive, help="IndexFile entries (default: from the config)")
    p.add_argument("--limit", type=_non_negative, help="show at most this many entries")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_inspect)

    p = add("produce", "Append sample messages to the CommitLog (demos and load).")
    p.add_argument("--messages", type=_positive, required=True)
    p.add_argument("--topics", type=_csv, default=["TopicTest"], help="comma-separated topics (default TopicTest)")
    p.add_argument("--queues", type=_positive, default=4, help="queues per topic (default 4)")
    p.add_argument("--body-size", type=_non_negative, default=256, help="body bytes (default 256)")
    p.add_argument("--keys", type=_non_negative, default=1, help="KEYS per message (default 1)")
    p.add_argument("--seed", type=_int, default=0)
    p.add_argument("--no-uniq-key", action="store_true", help="leave out the UNIQ_KEY property")
    p.set_defaults(handler=cmd_produce)
    return parser


def _config(args) -> Config:
    """The config file, the environment and the command's --store/--out flags, loaded once."""
    overrides = {"store.storePathRootDir": getattr(args, "store", None), "output.dir": getattr(args, "out", None)}
    if overrides["store.storePathRootDir"] and not overrides["output.dir"]:
        overrides["output.dir"] = overrides["store.storePathRootDir"]
    return load_config(args.config, os.environ, overrides)


def cmd_run(args, config: Config) -> int:
    configure_logging(config.logging.level, config.logging.format, stream=sys.stdout)
    from daemon.reput import run_daemon  # noqa: PLC0415 - watchdog, prometheus-client: only `run` needs them

    return run_daemon(config, until_caught_up=args.until_caught_up)


def cmd_rebuild(args, config: Config) -> int:
    bar = ProgressBar() if sys.stderr.isatty() else None
    summary = rebuild(config, from_offset=args.from_offset, progress=bar)
    if bar is not None:
        bar.finish()
    _print_summary(args, config, "rebuilt", summary)
    return EXIT_OK


def cmd_verify(args, config: Config) -> int:
    from daemon.verify import VerifyUsageError, format_text, verify  # noqa: PLC0415 - only `verify` needs it

    bar = ProgressBar() if sys.stderr.isatty() and not args.json else None
    try:
        report = verify(config, from_offset=args.from_offset, progress=bar)
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


def _print_summary(args, config: Config, verb: str, summary: RebuildSummary, where: str = "") -> None:
    """The closing line of rebuild and backfill (or the summary as JSON), then the notes."""
    if args.json:
        print(json.dumps(summary.as_dict()))
        return
    files = ", ".join(f"{n} {k} files" for k, n in summary.files.items())
    print(f"{verb} {summary.messages:,} messages, {summary.bytes:,} bytes "
          f"[{summary.start_offset}, {summary.end_offset}){where} in {summary.seconds:.2f} s "
          f"({summary.msgs_per_second:,.0f} msgs/s); {files}; output {config.output.dir}")
    for lo, hi, error in summary.skipped:
        print(f"note: skipped [{lo}, {hi}) (onCorruption: skip-segment): {error}")
    if summary.pending is not None:
        print(f"note: stopped before an incomplete record at the end of the CommitLog: {summary.pending}")


def _spark_setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), value


def cmd_backfill(args, config: Config) -> int:
    try:
        from daemon.backfill import backfill  # noqa: PLC0415 - PySpark is the optional [backfill] extra
    except ImportError as e:
        print(f"reputd: error: `reputd backfill` needs PySpark ({e}); install it with "
              f"pip install 'reputd[backfill]'", file=sys.stderr)
        return EXIT_FAILURE

    def say(text: str) -> None:
        print(f"\r{text}", file=sys.stderr, flush=True)

    summary = backfill(config, master=args.master, segments=args.segments, from_offset=args.from_offset,
                       to_offset=args.to_offset, partitions=args.partitions, catalog=args.catalog,
                       spark_conf=dict(args.spark_conf), progress=say)
    _print_summary(args, config, "backfilled", summary,
                   f" from {summary.segments} segments on {summary.master}")
    return EXIT_OK


def _print_messages(records, as_json: bool) -> None:

    for rec in records:
        m = message_json(rec)
        if as_json:
            print(json.dumps(m, ensure_ascii=False))
        else:
            print(" ".join(f"{k}={v}" for k, v in m.items() if k != "properties"))


def cmd_query_key(args, config: Config) -> int:
    if args.raw:
        result = query_offsets(config, args.topic, args.key, args.max_num, args.begin, args.end)
        if args.json:
            print(json.dumps({"phyOffsets": result.phy_offsets,
                              "indexLastUpdateTimestamp": result.index_last_update_timestamp,
                              "indexLastUpdatePhyoffset": result.index_last_update_phy_offset}))
        else:
            for offset in result.phy_offsets:
                print(offset)
        return EXIT_OK
    _print_messages(query_key(config, args.topic, args.key, args.max_num, args.begin, args.end), args.json)
    return EXIT_OK


def cmd_query_queue(args, config: Config) -> int:
    result = query_queue(config, args.topic, args.queue_id, args.offset, args.count)
    if result.status != "FOUND":
        print(f"{result.status}: {args.topic}/{args.queue_id} holds queue offsets "
              f"[{result.min_offset}, {result.max_offset})", file=sys.stderr)
    _print_messages(result.messages, args.json)
    return EXIT_OK


def cmd_query_msgid(args, config: Config) -> int:
    try:
        record = query_msgid(config, args.msgid)
    except ValueError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    _print_messages([record], args.json)
    return EXIT_OK


def cmd_inspect(args, config: Config) -> int:
    if not os.path.isfile(args.path):
        print(f"reputd: error: {args.path}: no such file", file=sys.stderr)
        return EXIT_FAILURE
    kind = file_kind(args.path)
    if kind == "commitlog":
        info = inspect_commitlog(args.path, args.limit, DelayLevelTable(config.store.message_delay_level))
    elif kind == "consumequeue":
        info = inspect_consumequeue(args.path, args.limit)
    elif kind == "indexfile":
        info = inspect_indexfile(args.path, args.hash_slot_num or config.store.max_hash_slot_num,
                                 args.index_num or config.store.max_index_num, args.limit)
    else:
        info = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(info.header, ensure_ascii=False))
        for row in info.rows:
            print(json.dumps(row, ensure_ascii=False))
    else:
        for key, value in info.header.items():
            print(f"{key}: {value}")
        for row in info.rows:
            print(text_line(row))
    for key, value in info.trailer.items():
        print(f"{key}: {value}", file=sys.stderr)
    if "error" in info.trailer:
        return EXIT_FAILURE
    return EXIT_OK


def cmd_produce(args, config: Config) -> int:
    s = produce(config, args.messages, topics=args.topics, queues=args.queues, body_size=args.body_size,
                keys=args.keys, seed=args.seed, uniq_key=not args.no_uniq_key)
    print(f"produced {s.messages:,} messages, {s.bytes:,} bytes at CommitLog offsets "
          f"[{s.first_offset}, {s.end_offset})")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = _config(args)
        configure_logging(config.logging.level, config.logging.format)
        return args.handler(args, config)
    except ConfigError as e:
        print(f"reputd: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StoreError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("reputd: interrupted", file=sys.stderr)
        return 130
    except ValueError as e:
        print(f"reputd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if os.environ.get("REPUTD_DEBUG"):
            raise
        print(f"reputd: internal error: {type(e).__name__}: {e} (REPUTD_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
