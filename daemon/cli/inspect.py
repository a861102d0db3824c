"""`reputd inspect`: its options and its front end (the decoding is daemon/commands/inspect_file.py)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from daemon.cli.common import (
    CONFIG_HELP,
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    _non_negative,
    _positive,
    _subparser,
)

if TYPE_CHECKING:
    from daemon.config import Config


def _add_inspect(sub) -> None:
    p = _subparser(sub, "inspect", "Decode a CommitLog segment, ConsumeQueue file, IndexFile, checkpoint file or "
                                   "a DLedger CommitLog's file.")
    p.add_argument("path", help="the file: a segment, consumequeue/TOPIC/QUEUE/FILE, an IndexFile, the broker's "
                                "checkpoint, reputd.checkpoint, or dledger-ID/data/FILE, dledger-ID/index/FILE, "
                                "dledger-ID/checkpoint")
    p.add_argument("--config", help=CONFIG_HELP + "; its maxHashSlotNum/maxIndexNum shape IndexFiles")
    p.add_argument("--hash-slot-num", type=_positive, help="IndexFile slots (default: from the config)")
    p.add_argument("--index-num", type=_positive, help="IndexFile entries (default: from the config)")
    p.add_argument("--limit", type=_non_negative, help="show at most this many entries")
    p.add_argument("--json", action="store_true", help="JSON Lines: the header object, then one object per entry")
    p.set_defaults(handler=cmd_inspect)


def cmd_inspect(args, config: Config) -> int:
    import json

    from daemon.commands.inspect_file import ACCEPTED_KINDS, UnknownFileKind, inspect_path, text_line, text_value

    if os.path.isdir(args.path):
        raise UsageError(f"{args.path}: is a directory; {ACCEPTED_KINDS}")
    if not os.path.isfile(args.path):
        raise UsageError(f"{args.path}: no such file")
    try:
        info = inspect_path(args.path, config, limit=args.limit, hash_slot_num=args.hash_slot_num,
                            index_num=args.index_num)
    except UnknownFileKind as e:
        raise UsageError(str(e)) from None
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
