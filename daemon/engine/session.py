"""A session: one life of the live pipeline, from a recovery to a stop or a failure.

It holds what the reput loop (`daemon.engine.reput`), the flusher thread (`daemon.engine.flusher`) and the metrics
share: the CommitLog and its reader, the dispatchers, and how far records are dispatched, flushed and
checkpointed. `open_session` makes one from what recovery (`daemon.engine.recovery`) decided.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from daemon.config import Config
from daemon.engine.dispatchers import ConsumeQueueDispatcher, Dispatcher
from daemon.engine.dledgermode import open_commit_log
from daemon.engine.reading import make_reader
from daemon.engine.recovery import recover_output
from daemon.ops.metrics import ReputMetrics, RetentionBehind
from indexcore.reader import CommitLog, CommitLogReader


@dataclass(eq=False)
class Session:
    """The state the loop, the flusher and the metrics share; the lock is held for each dispatch."""

    config: Config
    output_dir: str
    commit_log: CommitLog
    reader: CommitLogReader
    dispatchers: list[Dispatcher]
    metrics: ReputMetrics
    dispatched_offset: int
    flushed_offset: int = 0
    checkpoint_offset: int = -1
    checkpoint_states: dict[str, Any] = field(default_factory=dict)
    checkpoint_written_at: float = 0.0
    poisoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # held by the flusher from its plan to its last sync and by the cleaner while it deletes (taken before
    # `lock` by both): no file planned for a sync vanishes
    files_lock: threading.Lock = field(default_factory=threading.Lock)
    synced_paths: set[str] = field(default_factory=set)  # files and directories whose entries are durable
    dispatched_counters: list = field(default_factory=list)  # per dispatcher, labels resolved once
    retention_behind: RetentionBehind | None = None  # published by the clean-up (`daemon.engine.cleaner`)
    # set by the clean-up when expired files wait for a newer checkpoint (a recovery to this one would need
    # them): the flusher's next cycle is thorough, so that one comes within flushIntervalConsumeQueue
    checkpoint_wanted: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.dispatched_counters = [self.metrics.dispatched.labels(dispatcher=d.name) for d in self.dispatchers]

    def files(self, name: str) -> int:
        for d in self.dispatchers:
            if d.name == name and hasattr(d, "files"):
                return d.files()
        return 0


def open_session(config: Config, metrics: ReputMetrics) -> Session:
    """Recover the output (`daemon.engine.recovery`) and open a session of the live loop reading from there."""
    commit_log = open_commit_log(config.store, follow=True)
    r = recover_output(config, commit_log, metrics=metrics)
    for d in r.dispatchers:  # the live loop's ConsumeQueue writes are made off its thread
        if isinstance(d, ConsumeQueueDispatcher):
            d.write_behind()
    session = Session(config, config.output.dir, commit_log, make_reader(config, commit_log), r.dispatchers, metrics,
                      dispatched_offset=r.start, flushed_offset=r.start)
    session.checkpoint_offset = r.checkpoint.reput_from_offset
    session.checkpoint_states = r.checkpoint.dispatchers
    session.checkpoint_written_at = time.time()
    return session
