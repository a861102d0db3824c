"""`reputd produce`: its options and its front end (the writing is daemon/commands/produce.py)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from daemon.cli.common import (
    CONFIG_HELP,
    EXIT_OK,
    SettingsMismatch,
    UsageError,
    _check_commit_log,
    _csv,
    _int,
    _non_negative,
    _positive,
    _subparser,
    _whence,
)

if TYPE_CHECKING:
    from daemon.config import Config


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


def _check_new_store(args, config: Config) -> None:
    """The writers' rule for what produce may create: a new store root (and its commitlog/) when the root's
    parent exists, a configured CommitLog directory when its parent exists; a path whose parent does not exist
    is a mistyped one (exit 2), not a store to make."""
    store = config.store
    root = os.path.abspath(store.store_path_root_dir)
    paths = [(root, "--store" if args.store else "store.storePathRootDir")]
    paths += [(os.path.abspath(d), "store.storePathCommitLog") for d in store.commit_log_dirs
              if os.path.dirname(os.path.abspath(d)) != root]
    for path, option in paths:
        parent = os.path.dirname(path)
        if not os.path.exists(path) and not os.path.isdir(parent):
            raise UsageError(f"{path}: no such directory, and no directory {parent} to create it in "
                             f"({_whence(args, option)})")


def cmd_produce(args, config: Config) -> int:
    from daemon.commands.produce import produce
    from daemon.engine.dledgermode import commit_log_path, store_mode_problem
    from daemon.engine.sizes import check_output_sizes

    mismatch = store_mode_problem(config.store)  # a DLedger broker's root: a plain commitlog/ there is a mistake
    if mismatch:
        raise SettingsMismatch(mismatch)
    if any(os.path.isdir(d) for d in (commit_log_path(config.store), *config.store.commit_log_dirs)):
        _check_commit_log(config)  # the segments' size, as every command checks it
    check_output_sizes(config.output.dir, config.store)  # settings that are not the broker's, as every command
    if config.store.enable_d_leger_commit_log:
        raise SettingsMismatch("store.enableDLegerCommitLog is true: produce writes a plain CommitLog "
                               f"({config.store.commit_log_dirs[0]}), not a DLedger log")
    _check_new_store(args, config)

    bar = None
    if sys.stderr.isatty():
        from daemon.engine.rebuild import ProgressBar

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
