"""`reputd query key|queue|msgid`: their options and front ends, the time syntax of --begin/--end, the
notes a person reads on stderr (the lookups are daemon/commands/query.py, the layouts daemon/commands/render.py)."""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING

from daemon.cli.common import (
    CONFIG_HELP,
    EXIT_FAILURE,
    EXIT_OK,
    FORMATS,
    LONG_MAX,
    QUERY_KINDS,
    UsageError,
    _check_inputs,
    _HelpFormatter,
    _non_negative,
    _positive,
    _quiet_stdout,
    _subparser,
    command_line,
)

if TYPE_CHECKING:
    from daemon.config import Config


_QUERY_HELP = {
    "key": "Messages whose topic and key (a KEYS token or the UNIQ_KEY) match exactly, newest first.",
    "queue": "Messages of a ConsumeQueue from a queue offset, as the broker's getMessage returns them.",
    "msgid": "The message of a msgId: an offset msgId (store host + CommitLog offset) or a client msgId (the "
             "UNIQ_KEY), as mqadmin queryMsgById takes them.",
}
TIME_HELP = ("epoch milliseconds, ISO 8601 (2026-11-21T10:00:00, local time unless it has an offset or Z) or "
             "relative (-1h, -30m, -2d)")


def _add_query(sub, kind: str | None):
    """The `query` command and its key, queue and msgid kinds (or `kind` alone); returns its subparsers, to
    which daemon/cli/querytime.py adds the time, offset and trace kinds."""
    q = sub.add_parser("query", formatter_class=_HelpFormatter,
                       help="Query messages by key, queue offset, msgId or store time, and message traces.",
                       description="Query messages by key, queue offset, msgId or store time, and message traces. "
                                   "On a terminal the answer is laid out as mqadmin lays it out; piped, or with "
                                   "--json, it is one JSON object per message.")
    qs = q.add_subparsers(dest="query", required=True, metavar="KIND", help="how to find the messages")
    for name in QUERY_KINDS:
        if (kind is not None and kind != name) or name not in _QUERY_HELP:
            continue
        p = kind_parser(qs, name, _QUERY_HELP[name])
        if name == "key":
            p.add_argument("topic", help="the topic the key was indexed under")
            p.add_argument("key", help="a KEYS token or a UNIQ_KEY")
            p.add_argument("--begin", default="0", help=f"earliest store time: {TIME_HELP} (default 0)")
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
    return qs


def kind_parser(qs, name: str, help_text: str):
    """A `query` kind's parser with the options every kind takes: --config, --store, --out, --format, --json."""
    p = _subparser(qs, name, help_text)
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--store", help="store root, overrides store.storePathRootDir")
    p.add_argument("--out", help="directory holding consumequeue/ and index/, overrides output.dir")
    p.add_argument("--format", choices=FORMATS,
                   help="text: mqadmin's layout; json: one JSON object per message (default: text on a "
                        "terminal, json otherwise)")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    return p


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


def _check_sizes(config: Config, *, queues: bool = False, index: bool = False, topic: str | None = None) -> None:
    """The files of the kinds a query does not read held to the config's sizes all the same (one stat when
    they are right): one mistake, one answer (a configuration error, exit 2) in every command."""
    from daemon.engine.sizes import check_output_sizes

    check_output_sizes(config.output.dir, config.store, queues=queues,
                       index=index and config.store.message_index_enable, topic=topic)


def cmd_query_key(args, config: Config) -> int:
    from daemon.commands.query import check_topic, query_key_result, query_offsets

    _check_inputs(args, config, commit_log=False, output=True)  # the index first: the CommitLog when it is read
    _check_sizes(config, index=True)  # the files it reads first, then the topic's queues, which it does not read
    _check_sizes(config, queues=True, topic=args.topic)
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
        from daemon.commands.render import message_json_line

        for rec in result.messages:
            print(message_json_line(rec))
    elif result.messages:
        from daemon.commands.render import key_table

        print("\n".join(key_table(result.messages)))
    if not result.messages:
        _note(args, f"no message with key {args.key!r} in topic {args.topic!r}"
                    + (" in that time range" if (begin, end) != (0, LONG_MAX) else ""))
    if result.damage is None and (begin, end) != (0, LONG_MAX):
        _index_time_hint(args, config, begin, end, result.messages)
    if result.cut:
        why = (f"--max {args.max_num}" if args.max_num < config.store.max_msgs_num_batch
               else f"maxMsgsNumBatch {config.store.max_msgs_num_batch}, the most one index query returns")
        _note(args, f"note: the index gave {result.candidates} candidates, the limit ({why}); older messages "
                    "with this key may exist: narrow the time range with --begin/--end")
    _removed_note(args, result.removed, result.commit_log_min_offset, "index candidate")
    return _damaged(result.damage)


def _index_time_hint(args, config: Config, begin: int, end: int, listed: list) -> None:
    """After an answer for a time range: the messages stored inside it that the index times before --begin
    (whole seconds, as the broker's IndexFile), with the --begin that finds them, and the listed ones stored
    outside it. The answer stays the broker's; these notes go to stderr, every format."""
    from daemon.commands.query import INDEX_TIME_UNIT_MS, window_facts
    from daemon.commands.render import human_time

    facts = window_facts(config, args.topic, args.key, args.max_num, begin, end, listed)
    if facts.left_out:
        first, n = min(rec.store_timestamp for rec in facts.left_out), len(facts.left_out)
        print(f"reputd: note: {n} message{'s' * (n > 1)} with this key stored inside the range (the first at "
              f"{human_time(first)}, {first}) {'are' if n > 1 else 'is'} left out: the index keeps store times in "
              f"whole seconds, as the broker's IndexFile does, and times {'them' if n > 1 else 'it'} before --begin; "
              f"widen the range by a second: --begin {begin - INDEX_TIME_UNIT_MS}", file=sys.stderr)
    for outside, side, pick in ((facts.after_end, "after --end", max), (facts.before_begin, "before --begin", min)):
        if outside:
            at, n = pick(rec.store_timestamp for rec in outside), len(outside)
            print(f"reputd: note: {n} message{'s' * (n > 1)} listed {'were' if n > 1 else 'was'} stored {side} ("
                  f"{'the last' if pick is max else 'the first'} at {human_time(at)}, {at}): the index keeps store "
                  "times in whole seconds, as the broker's IndexFile does, and times "
                  f"{'them' if n > 1 else 'it'} inside the range; the broker's query lists "
                  f"{'them' if n > 1 else 'it'} too", file=sys.stderr)
    if _format(args) == "json" and (facts.left_out or facts.after_end or facts.before_begin):
        import json  # the machine formats: the same facts in a last object, as `{"type": "removed"}` is

        print(json.dumps(facts.as_json(begin, end)))


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
    from daemon.commands.render import message_block, message_json_line, save_body

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
    from daemon.commands.query import check_queue, query_queue

    _check_inputs(args, config, commit_log=False, output=True)
    _check_sizes(config, queues=True, index=True, topic=args.topic)  # its queue's, and the IndexFiles it does not read
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
    from daemon.commands.query import query_msgid
    from indexcore.msgid import msg_id_shape_error

    why = msg_id_shape_error(args.msgid.strip())
    if why is not None:
        raise UsageError(why)
    _check_inputs(args, config, commit_log=False, output=True)
    _check_sizes(config, queues=True, index=True, topic=args.topic)
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
