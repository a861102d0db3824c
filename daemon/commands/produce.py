"""`reputd produce`: append sample messages to a CommitLog, for demos and load tests.

Messages look like a Java producer's: a UNIQ_KEY (client message id), TAGS, KEYS, a random body;
queues are chosen round-robin per topic. With `lmq_queues`, each message also names `lmq_per_message`
distinct LMQ queues (`%LMQ%q-N`) in INNER_MULTI_DISPATCH, and the writer adds their offsets as a broker
with multi-dispatch on does. The same seed gives the same messages.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from daemon.config import Config, ConfigError
from indexcore.multidispatch import LMQ_PREFIX, MULTI_DISPATCH_QUEUE_SPLITTER, PROPERTY_INNER_MULTI_DISPATCH
from indexcore.writer import CommitLogWriter, Message

TAGS = ("TagA", "TagB", "TagC", "order_created", "标签A")
PROGRESS_EVERY = 4096  # messages between two progress calls


@dataclass(slots=True)
class ProduceSummary:
    messages: int
    bytes: int
    first_offset: int
    end_offset: int


def lmq_name(n: int) -> str:
    return f"{LMQ_PREFIX}q-{n}"


def produce(config: Config, messages: int, *, topics: Sequence[str] = ("TopicTest",), queues: int = 4,
            body_size: int = 256, keys: int = 1, seed: int = 0, uniq_key: bool = True, lmq_queues: int = 0,
            lmq_per_message: int = 0, progress: Callable[[int, int], None] | None = None) -> ProduceSummary:
    """Append `messages` sample messages; `progress(done, messages)` is called as they are written."""
    store = config.store
    if lmq_queues and not (store.enable_multi_dispatch and store.enable_lmq):
        raise ConfigError("store.enableMultiDispatch", "LMQ messages need enableMultiDispatch and enableLmq set")
    if lmq_per_message > lmq_queues:
        raise ConfigError("", f"{lmq_per_message} LMQ queues per message, but only {lmq_queues} LMQ queues")
    directory = store.commit_log_dirs[0]
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    prefix = f"{rng.getrandbits(80):020X}"
    stride = lmq_queues // lmq_per_message if lmq_per_message else 0
    with CommitLogWriter(directory, store.mapped_file_size_commit_log, max_message_size=store.max_message_size,
                         enable_multi_dispatch=store.enable_multi_dispatch, enable_lmq=store.enable_lmq) as w:
        first = w.max_offset
        written = 0
        for i in range(messages):
            topic = topics[i % len(topics)]
            props = {"TAGS": TAGS[i % len(TAGS)]}
            if keys:
                props["KEYS"] = " ".join(f"key-{seed}-{i}-{j}" for j in range(keys))
            if uniq_key:
                props["UNIQ_KEY"] = f"{prefix}{i & 0xFFFFFFFFFFFF:012X}"
            if lmq_per_message:
                base = rng.randrange(lmq_queues)
                props[PROPERTY_INNER_MULTI_DISPATCH] = MULTI_DISPATCH_QUEUE_SPLITTER.join(
                    lmq_name((base + j * stride) % lmq_queues) for j in range(lmq_per_message))
            result = w.append(Message(topic, (i // len(topics)) % queues, rng.randbytes(body_size), props))
            written += result.msg_size
            if progress is not None and (i + 1 == messages or (i + 1) % PROGRESS_EVERY == 0):
                progress(i + 1, messages)
        return ProduceSummary(messages, written, first, w.max_offset)
