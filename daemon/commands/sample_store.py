"""Seed a small sample store for `make run` when the configured CommitLog is empty."""

from __future__ import annotations

import argparse
import os
import sys

from daemon.commands.produce import produce
from daemon.config import ConfigError, load_config

SAMPLE_MESSAGES = 20_000
SAMPLE_TOPICS = ("TopicTest", "order-events", "%RETRY%cg-demo")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, os.environ)
    except ConfigError as e:
        print(f"reputd: config error: {e}", file=sys.stderr)
        return 2
    directory = config.store.commit_log_dirs[0]
    if os.path.isdir(directory) and os.listdir(directory):
        print(f"sample store: {directory} already holds a CommitLog; leaving it as it is")
        return 0
    summary = produce(config, SAMPLE_MESSAGES, topics=SAMPLE_TOPICS, keys=2)
    print(f"sample store: wrote {summary.messages} messages ({summary.bytes} bytes) to {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
