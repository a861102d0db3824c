"""`reputd produce`: append sample messages to a CommitLog, for demos and load tests.

Messages look like a Java producer's: a UNIQ_KEY (client message id), TAGS, KEYS, a random body;
queues are chosen round-robin per topic. With `lmq_queues`, each message also names `lmq_per_message`
distinct LMQ queues (`%LMQ%q-N`) in INNER_MULTI_DISPATCH, and the writer adds their offsets as a broker
with multi-dispatch on does. The same seed gives the same messages.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from daemon.config import Config, ConfigError
from daemon.engine.checkpoint import CHECKPOINT_FILE as REPUTD_CHECKPOINT_FILE
from daemon.ops.outlock import BROKER_LOCK_FILE, lock_holder
from indexcore.checkpoint import CHECKPOINT_FILE
from indexcore.consumequeue import CONSUME_QUEUE_DIR
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
    interrupted: bool = False  # stopped on request after `messages`, a message boundary


def broker_running(root: str) -> str | None:
    """Why sample messages must not go into `root`'s CommitLog: a broker holds its `lock` there (the test
    `rebuild` and `run` refuse a store root with). None when none does."""
    holder = lock_holder(os.path.join(root, BROKER_LOCK_FILE))
    if holder is None:
        return None
    who = f"PID {holder}" if holder > 0 else "another process"
    return (f"{root} is the store root of a running broker ({who} holds {os.path.join(root, BROKER_LOCK_FILE)}), "
            "which writes commitlog/ there itself: produce into another store root (--store DIR); nothing was "
            "written")


def broker_files(root: str) -> list[str]:
    """The files of a broker in store root `root` (a stopped broker's store, or a copy of one), whose CommitLog
    a broker started there would serve sample messages from as real ones: its `lock`, its `checkpoint`, and
    `consumequeue/` unless reputd wrote it (`reputd.checkpoint` beside it, as in the sample store `make run`
    follows)."""
    found = [name for name in (BROKER_LOCK_FILE, CHECKPOINT_FILE) if os.path.isfile(os.path.join(root, name))]
    if os.path.isdir(os.path.join(root, CONSUME_QUEUE_DIR)) and not (
            os.path.isfile(os.path.join(root, REPUTD_CHECKPOINT_FILE)) and not found):
        found.append(CONSUME_QUEUE_DIR + "/")
    return found


def lmq_name(n: int) -> str:
    return f"{LMQ_PREFIX}q-{n}"


def produce(config: Config, messages: int, *, topics: Sequence[str] = ("TopicTest",), queues: int = 4,
            body_size: int = 256, keys: int = 1, seed: int = 0, uniq_key: bool = True, lmq_queues: int = 0,
            lmq_per_message: int = 0, progress: Callable[[int, int], None] | None = None,
            stop: threading.Event | None = None) -> ProduceSummary:
    """Append `messages` sample messages; `progress(done, messages)` is called as they are written. When
    `stop` is set, it ends after the message in hand (`interrupted`), the CommitLog flushed as at the end."""
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
            if stop is not None and stop.is_set():
                return ProduceSummary(i, written, first, w.max_offset, interrupted=True)
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
