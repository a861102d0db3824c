"""`reputd produce`: append sample messages to a CommitLog, for demos and load tests.

Messages look like a Java producer's: a UNIQ_KEY (client message id), TAGS, KEYS, a random body;
queues are chosen round-robin per topic. The same seed gives the same messages.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from daemon.config import Config
from indexcore.writer import CommitLogWriter, Message

TAGS = ("TagA", "TagB", "TagC", "order_created", "标签A")
PROGRESS_EVERY = 4096  # messages between two progress calls


@dataclass(slots=True)
class ProduceSummary:
    messages: int
    bytes: int
    first_offset: int
    end_offset: int


def produce(config: Config, messages: int, *, topics: Sequence[str] = ("TopicTest",), queues: int = 4,
            body_size: int = 256, keys: int = 1, seed: int = 0, uniq_key: bool = True,
            progress: Callable[[int, int], None] | None = None) -> ProduceSummary:
    """Append `messages` sample messages; `progress(done, messages)` is called as they are written."""
    store = config.store
    directory = store.commit_log_dirs[0]
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    prefix = f"{rng.getrandbits(80):020X}"
    with CommitLogWriter(directory, store.mapped_file_size_commit_log, max_message_size=store.max_message_size) as w:
        first = w.max_offset
        written = 0
        for i in range(messages):
            topic = topics[i % len(topics)]
            props = {"TAGS": TAGS[i % len(TAGS)]}
            if keys:
                props["KEYS"] = " ".join(f"key-{seed}-{i}-{j}" for j in range(keys))
            if uniq_key:
                props["UNIQ_KEY"] = f"{prefix}{i & 0xFFFFFFFFFFFF:012X}"
            result = w.append(Message(topic, (i // len(topics)) % queues, rng.randbytes(body_size), props))
            written += result.msg_size
            if progress is not None and (i + 1 == messages or (i + 1) % PROGRESS_EVERY == 0):
                progress(i + 1, messages)
        return ProduceSummary(messages, written, first, w.max_offset)
