"""`reputd produce`: its options and its front end (the writing is daemon/commands/produce.py)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from daemon.cli import startsignals
from daemon.cli.common import (
    CONFIG_HELP,
    EXIT_INTERRUPTED,
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
    p.add_argument("--topic-count", type=_positive, default=None, metavar="N",
                   help="N topics per --topics name, NAME0 ... NAME{N-1} (a broker's thousands of topics)")
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
    p.add_argument("--broker-store", action="store_true",
                   help="append even though the store root holds a broker's files (lock, checkpoint, "
                        "consumequeue/): a stopped broker started there serves the sample messages as real ones")
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
        if os.path.exists(path) or os.path.isdir(parent):
            continue
        if path == root:  # the words every command uses for a store root that is not there
            raise UsageError(f"{store.store_path_root_dir}: no such store root directory ({_whence(args, option)})")
        raise UsageError(f"{path}: no such directory, and no directory {parent} to create it in "
                         f"({_whence(args, option)})")


def cmd_produce(args, config: Config) -> int:
    import signal
    import threading

    from daemon.commands.produce import broker_files, broker_running, produce
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
    root = config.store.store_path_root_dir
    refused = broker_running(root)  # a live broker's CommitLog: never, whatever the options say
    if refused:
        raise UsageError(refused)
    found = broker_files(root)
    if found and not args.broker_store:
        raise UsageError(f"{root} holds a broker's files ({', '.join(found)}): produce appends sample messages to "
                         "its CommitLog, which a broker started there serves as real ones; produce into another "
                         "store root (--store DIR), or pass --broker-store to append anyway; nothing was written")
    bar = None
    if sys.stderr.isatty():
        from daemon.engine.rebuild import ProgressBar

        bar = ProgressBar(unit="messages")
    topics = args.topics if args.topic_count is None else \
        [f"{name}{i}" for name in args.topics for i in range(args.topic_count)]
    stop = threading.Event()
    signals: list[str] = []

    def on_signal(signum, _frame) -> None:
        """Stop after the message in hand: the CommitLog then ends at a message boundary, flushed."""
        signals.append(signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        s = produce(config, args.messages, topics=topics, queues=args.queues, body_size=args.body_size,
                    keys=args.keys, seed=args.seed, uniq_key=not args.no_uniq_key, lmq_queues=args.lmq_queues,
                    lmq_per_message=args.lmq_per_message if args.lmq_queues else 0,
                    progress=(lambda done, total: bar(done, total, done)) if bar is not None else None, stop=stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        startsignals.command_finished()  # the CommitLog is as the summary will say
    if bar is not None:
        bar.finish()
    print(f"{'interrupted: ' * s.interrupted}produced {s.messages:,} messages, {s.bytes:,} bytes at CommitLog "
          f"offsets [{s.first_offset}, {s.end_offset})")
    if s.interrupted:
        print(f"reputd: interrupted by {signals[0]}: stopped after {s.messages:,} of {args.messages:,} messages; the "
              f"CommitLog ends at offset {s.end_offset}, a message boundary", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK
