"""`reputd query time|offset|trace`: their options and front ends (the lookups are daemon/commands/timequery.py
and daemon/commands/trace.py; what every query prints alike, the time syntax and the notes, daemon/cli/query.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from daemon.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    LONG_MAX,
    UsageError,
    _check_inputs,
    _non_negative,
    _positive,
    command_line,
)
from daemon.cli.query import (
    TIME_HELP,
    _check_sizes,
    _damaged,
    _format,
    _note,
    _print_records,
    _removed_note,
    kind_parser,
    parse_time,
)

if TYPE_CHECKING:
    from daemon.commands.timequery import QueueWindow
    from daemon.config import Config

_HELP = {
    "time": "Messages of a topic (or one queue) stored in a time window, optionally of some tags, ordered by store "
            "time, as mqadmin printMsg and the dashboard list them; with --tag-counts, how many of each tag.",
    "offset": "The queue offset for a time, as the broker's searchOffset (mqadmin, the consumer's "
              "searchOffset) answers it.",
    "trace": "A message's trace (its publish, each consumer group's consume attempts, its transaction end), as "
             "mqadmin queryMsgTraceById shows it.",
}
DEFAULT_COUNT = 32


def add_kinds(qs, kind: str | None) -> None:
    """Add the time, offset and trace kinds (or `kind` alone) to `query`'s subparsers."""
    for name in ("time", "offset", "trace"):
        if kind is not None and kind != name:
            continue
        p = kind_parser(qs, name, _HELP[name])
        if name == "time":
            p.add_argument("topic", help="the topic (an LMQ by its name, %%LMQ%%...)")
            p.add_argument("--begin", required=True, help=f"earliest store time, inclusive: {TIME_HELP}")
            p.add_argument("--end", help="latest store time, inclusive, written as --begin (default: no limit)")
            p.add_argument("--queue", type=_non_negative, help="one queue id (default: every queue of the topic)")
            p.add_argument("--tags", help="a TAG subscription: TAG, 'A || B', or '*' for every message (default)")
            p.add_argument("--count", type=_positive, default=DEFAULT_COUNT,
                           help=f"most messages to print; a note gives the command that continues (default "
                                f"{DEFAULT_COUNT})")
            p.add_argument("--from", dest="from_offset", type=_non_negative,
                           help="of the messages stored in --begin's millisecond, start at this CommitLog offset "
                                "(what a continuation sets)")
            p.add_argument("--tag-counts", action="store_true",
                           help="print how many messages of each tag the window holds, per queue and in all "
                                "(mqadmin printMsgByQueue -f), reading no body")
            p.add_argument("--scan", action="store_true",
                           help="read every unit's store time instead of searching: exact even where the broker's "
                                "clock was set back, at one CommitLog read per unit")
            p.add_argument("--body", action="store_true", help="print each message's body too (decompressed)")
            p.add_argument("--save-body", metavar="DIR", help="write each message's body to DIR/<offset msgId>")
            p.add_argument("--raw-body", action="store_true",
                           help="show (implies --body) and save a compressed body as stored")
            p.set_defaults(handler=cmd_query_time)
        elif name == "offset":
            p.add_argument("topic", help="the ConsumeQueue's topic")
            p.add_argument("queue_id", type=_non_negative, help="the queue id")
            p.add_argument("time", help=f"the time: {TIME_HELP}")
            p.set_defaults(handler=cmd_query_offset)
        else:
            p.add_argument("msgid", help="the client msgId (UNIQ_KEY) a trace records; an offset msgId of a message "
                                         "here is looked up by its UNIQ_KEY")
            p.add_argument("--trace-topic", default="RMQ_SYS_TRACE_TOPIC",
                           help="the trace topic (default RMQ_SYS_TRACE_TOPIC)")
            p.set_defaults(handler=cmd_query_trace)


def _window(args) -> tuple[int, int]:
    begin = parse_time("--begin", args.begin)
    end = LONG_MAX if args.end is None else parse_time("--end", args.end)
    if begin > end:
        raise UsageError(f"--begin {args.begin} ({begin}) is later than --end {args.end} ({end})")
    return begin, end


def _where(args, topic: str) -> str:
    return f"{topic}/{args.queue}" if args.queue is not None else topic


def _out_of_order_notes(windows: list[QueueWindow], topic: str) -> None:
    """One line per queue whose store times were met going down: it was read through (every format)."""
    from daemon.commands.render import human_time

    for w in windows:
        if w.out_of_order is None:
            continue
        a, b = w.out_of_order
        print(f"reputd: note: store times go down in {topic}/{w.queue_id}: queue offset {a.queue_offset} at "
              f"{human_time(a.store_timestamp)}, {b.queue_offset} at {human_time(b.store_timestamp)} (the broker's "
              f"clock was set back?): read its {w.max_offset - w.min_offset:,} units through", file=sys.stderr)


def cmd_query_time(args, config: Config) -> int:
    from daemon.commands.timequery import tag_filter

    if args.tag_counts and (args.body or args.raw_body or args.save_body or args.from_offset is not None):
        raise UsageError("--tag-counts reads no body and prints no message: it takes no --body, --save-body, "
                         "--raw-body or --from")
    _check_inputs(args, config, commit_log=False, output=True)
    _check_sizes(config, queues=True, index=True, topic=args.topic)  # the topic's queues, and the IndexFiles too
    begin, end = _window(args)
    try:
        tags = tag_filter(args.tags)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.tag_counts:
        return _tag_counts(args, config, begin, end, tags)
    from daemon.commands.timequery import query_time

    result = query_time(config, args.topic, begin, end, queue_id=args.queue, tags=tags, count=args.count,
                        from_offset=-1 if args.from_offset is None else args.from_offset, scan=args.scan)
    _out_of_order_notes(result.windows, args.topic)
    as_json = _format(args) == "json"
    if as_json or args.body or args.raw_body or args.save_body:
        _print_records(args, result.messages)
    elif result.messages:
        from daemon.commands.render import key_table

        print("\n".join(key_table(result.messages, tags=True)))
    n = len(result.messages)
    what = f"message{'s' * (n != 1)} of {_where(args, args.topic)}" + (f" tagged {args.tags!r}" if tags else "")
    if n:
        _note(args, f"{n} {what} stored in [{_shown(begin)}, {_shown(end)}], by store time"
                    + (" across its queues" if args.queue is None and len(result.windows) > 1 else ""))
    else:
        _note(args, f"no {what} stored in [{_shown(begin)}, {_shown(end)}]")
    if result.next is not None:
        more = _continuation(args, config, end, *result.next)
        if as_json:
            import json

            print(json.dumps({"type": "more", "nextBegin": result.next[0], "nextFrom": result.next[1],
                              "command": more}))
        _note(args, f"note: more stored from {_shown(result.next[0])} (CommitLog offset {result.next[1]}): {more}")
    _removed_note(args, sum(w.removed for w in result.windows), result.commit_log_min_offset, "unit")
    return _damaged(result.damage)


def _shown(ms: int) -> str:
    from daemon.commands.render import human_time

    return "no limit" if ms == LONG_MAX else human_time(ms)


def _continuation(args, config: Config, end: int, begin: int, from_offset: int) -> str:
    """The command printing the messages after this page: the next message's store time as --begin and its
    CommitLog offset as --from, the window's end in epoch milliseconds (a relative --end would move)."""
    words = ["query", "time", args.topic, "--begin", str(begin)]
    if end != LONG_MAX:
        words += ["--end", str(end)]
    words += ["--from", str(from_offset)]
    if args.queue is not None:
        words += ["--queue", str(args.queue)]
    if args.tags is not None:
        words += ["--tags", args.tags]
    if args.count != DEFAULT_COUNT:
        words += ["--count", str(args.count)]
    words += ["--scan"] * args.scan + ["--body"] * args.body + ["--raw-body"] * args.raw_body
    if args.save_body:
        import os

        words += ["--save-body", os.path.abspath(args.save_body)]
    if args.format is not None:
        words += ["--format", args.format]
    return command_line(args, config, *words)


def _tag_counts(args, config: Config, begin: int, end: int, tags) -> int:
    from daemon.commands.timequery import tag_counts

    result = tag_counts(config, args.topic, begin, end, queue_id=args.queue, tags=tags, scan=args.scan)
    _out_of_order_notes(result.windows, args.topic)
    window = {"topic": args.topic, "begin": begin, "end": end}
    counts = [*result.queues, result.total] if len(result.queues) > 1 else result.queues
    if _format(args) == "json":
        import json

        for c in counts:
            print(json.dumps({"type": "tagCounts", **window, "queueId": c.queue_id, "messages": c.messages,
                              "tags": dict(sorted(c.tags.items(), key=lambda kv: (-kv[1], kv[0]))),
                              "untagged": c.untagged}, ensure_ascii=False))
    else:
        from daemon.commands.render import printable

        for i, c in enumerate(counts):
            where = (f"{args.topic}/{c.queue_id}" if c.queue_id is not None
                     else f"{args.topic}, all {len(counts) - 1} queues")
            print(("\n" if i else "") + f"{where}: {c.messages:,} message{'s' * (c.messages != 1)} stored in "
                  f"[{_shown(begin)}, {_shown(end)}]")
            for tag, n in sorted(c.tags.items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"Tag: {printable(tag):<30} Count: {n}")  # printMsgByQueue -f
            if c.untagged:
                print(f"{'(no tag)':<35} Count: {c.untagged}")
    _removed_note(args, sum(w.removed for w in result.windows), result.commit_log_min_offset, "unit")
    return _damaged(result.damage)


def cmd_query_offset(args, config: Config) -> int:
    from daemon.commands.queuetime import query_offset

    _check_inputs(args, config, commit_log=False, output=True)
    _check_sizes(config, queues=True, index=True, topic=args.topic)
    timestamp = parse_time("TIME", args.time)
    r = query_offset(config, args.topic, args.queue_id, timestamp)
    where = f"{args.topic}/{args.queue_id}"
    if r.out_of_order is not None or _format(args) != "json":
        from daemon.commands.render import human_time
    if r.out_of_order is not None:
        a, b = r.out_of_order
        print(f"reputd: warning: store times go down in {where} (queue offset {a.queue_offset} at "
              f"{human_time(a.store_timestamp)}, {b.queue_offset} at {human_time(b.store_timestamp)}): a binary "
              f"search over them, the broker's too, can land anywhere", file=sys.stderr)
    if _format(args) == "json":
        import json

        print(json.dumps({"topic": args.topic, "queueId": args.queue_id, "timestamp": timestamp,
                          "queueOffset": r.queue_offset, "storeTimestamp": r.store_timestamp,
                          "firstOffsetAtOrAfter": r.first_at_or_after, "minOffset": r.min_offset,
                          "maxOffset": r.max_offset, "commitLogReads": r.reads}))
        return EXIT_OK
    from daemon.commands.render import LABEL_WIDTH

    at = f"{human_time(r.store_timestamp)} (the unit at that offset)" if r.store_timestamp is not None else "-"
    for label, value in (("Topic", args.topic), ("Queue ID", args.queue_id),
                         ("Time", f"{human_time(timestamp)} ({timestamp})"), ("Queue Offset", r.queue_offset),
                         ("Store Timestamp", at), ("First At Or After", r.first_at_or_after),
                         ("Queue Offsets", f"[{r.min_offset}, {r.max_offset})")):
        print(f"{label + ':':<{LABEL_WIDTH}} {value}")
    if r.max_offset == r.min_offset:
        _note(args, f"note: {where} holds no unit: the broker answers 0")
    elif r.first_at_or_after == r.max_offset:
        _note(args, f"note: the time is after {where}'s last message: the broker answers the last unit's offset; "
                    f"the next message will be at {r.max_offset}")
    elif r.queue_offset != r.first_at_or_after:
        _note(args, f"note: the broker answers the unit its search meets first or nearest; the first stored at or "
                    f"after the time is at {r.first_at_or_after}")
    return EXIT_OK


def cmd_query_trace(args, config: Config) -> int:
    import os

    from daemon.commands.query import check_topic
    from daemon.commands.trace import query_trace
    from indexcore.msgid import msg_id_shape_error

    msg_id = args.msgid.strip()
    why = msg_id_shape_error(msg_id)
    if why is not None:
        raise UsageError(why)
    _check_inputs(args, config, commit_log=False, output=True)
    _check_sizes(config, index=True)  # the files it reads first, then the trace topic's queues (every topic's
    # when there is none: that the topic is missing is the answer only when the sizes are right)
    traced = os.path.isdir(os.path.join(config.output.dir, "consumequeue", args.trace_topic))
    _check_sizes(config, queues=True, topic=args.trace_topic if traced else None)
    result = query_trace(config, msg_id, args.trace_topic)
    if not result.views and result.damage is None:
        check_topic(config, args.trace_topic)
    for note in result.notes:
        _note(args, f"note: {note}")
    if _format(args) == "json":
        from daemon.commands.render import trace_json_line

        for v in result.views:
            print(trace_json_line(v, result.retry_times(v)))
    elif result.views:
        from daemon.commands.render import trace_table

        print("\n".join(trace_table(result)))
    else:
        _note(args, f"no trace of msgId {result.msg_id} in topic {args.trace_topic!r}")
    for offset, e in result.errors:
        print(f"reputd: warning: the trace message at CommitLog offset {offset}: {e} (left out; the client's decoder "
              f"fails on it)", file=sys.stderr)
    _removed_note(args, result.removed, result.commit_log_min_offset, "index candidate")
    code = _damaged(result.damage)
    return EXIT_FAILURE if result.errors else code
