"""The CommitLog and its reader as the configuration shapes them: the one place `run` (its session),
`rebuild`, `verify` and `handoff` open them, so every pass reads the store by the same rules."""

from __future__ import annotations

from daemon.config import Config
from daemon.engine import dledgermode
from indexcore.dispatch import DelayLevelTable
from indexcore.multidispatch import multi_dispatch_flags
from indexcore.reader import CommitLog, CommitLogReader


def open_commit_log(config: Config) -> CommitLog:
    return dledgermode.open_commit_log(config.store)


def make_reader(config: Config, log: CommitLog, batch_bytes: int | None = None) -> CommitLogReader:
    store = config.store
    return CommitLogReader(log, check_crc=store.check_crc_on_recover, max_message_size=store.max_message_size,
                           delay_table=DelayLevelTable(store.message_delay_level),
                           batch_bytes=batch_bytes or config.reput.batch_bytes,
                           multi_flags=multi_dispatch_flags(store.enable_multi_dispatch, store.enable_lmq))
