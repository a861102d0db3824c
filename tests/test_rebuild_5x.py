"""A CommitLog written as RocketMQ 5.x writes it (v2 records for long topics, a trailing property separator,
the `__CRC32#` property) rebuilds to the units and index entries the 4.9 dispatch rules give."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from daemon.commands.query import query_offsets, query_queue
from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from indexcore.commitlog import TRANSACTION_COMMIT_TYPE, TRANSACTION_PREPARED_TYPE, TRANSACTION_ROLLBACK_TYPE, Host
from indexcore.javahash import index_key_hash, java_string_hash
from indexcore.queuestore import ConsumeQueueStore
from indexcore.writer import CommitLogWriter, Message

SEGMENT = 32 * 1024
LONG_TOPIC = "rmq_sys_" + "p" * 192  # 200 bytes: a v2 record
TOPICS = ("TopicA", "订单主题", LONG_TOPIC)


def write_5x_log(root: Path, seed: int) -> list[tuple[Message, object]]:
    rng = random.Random(seed)
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 37)).__next__
    out = []
    with CommitLogWriter(str(root / "commitlog"), SEGMENT, clock=clock, trailing_separator=True,
                         append_crc_property=True, allow_v2=True,
                         store_host=Host.parse("[2001:db8::1]:10911")) as w:
        for i in range(400):
            topic = rng.choice(TOPICS)
            keys = " ".join(rng.choice(["k1", "键2", "k😀3", "Aa", "BB", f"u{i}"]) for _ in range(rng.randint(0, 3)))
            props = {"TAGS": rng.choice(["TagA", "标签", ""]), "KEYS": keys, "UNIQ_KEY": f"{seed:08X}{i:024X}"}
            sys_flag = rng.choice([0, 0, 0, TRANSACTION_PREPARED_TYPE, TRANSACTION_COMMIT_TYPE,
                                   TRANSACTION_ROLLBACK_TYPE])
            msg = Message(topic, rng.randrange(3), rng.randbytes(rng.randint(0, 600)), props, sys_flag=sys_flag,
                          born_host=Host.parse("[2001:db8::2]:5000") if i % 2 else Host.parse("192.0.2.7:5000"))
            out.append((msg, w.append(msg)))
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_5x_commitlog_rebuilds_by_the_4_9_rules(tmp_path: Path, seed: int) -> None:
    """Every NOT/COMMIT record gets its unit at its queue offset; every key query returns the dict model's offsets."""
    written = write_5x_log(tmp_path, seed)
    cfg = {"store": {"storePathRootDir": str(tmp_path), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 200, "maxHashSlotNum": 53, "maxIndexNum": 5000},
           "logging": {"level": "warning"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    config = load_config(tmp_path / "c.yaml", env={})
    summary = rebuild(config)
    assert summary.messages == len(written)

    for msg, res in written:
        if msg.sys_flag & 0xC in (0, TRANSACTION_COMMIT_TYPE):
            got = query_queue(config, res.topic, res.queue_id, res.queue_offset, 1).messages
            assert [(m.physical_offset, m.total_size) for m in got] == [(res.phy_offset, res.msg_size)]

    model: dict[int, list[int]] = {}
    for msg, res in written:
        if msg.sys_flag & 0xC == TRANSACTION_ROLLBACK_TYPE:
            continue
        keys = [msg.properties["UNIQ_KEY"]] + [k for k in msg.properties["KEYS"].split(" ") if k]
        for k in keys:
            model.setdefault(index_key_hash(f"{res.topic}#{k}"), []).append(res.phy_offset)
    for topic in TOPICS:
        for key in ("k1", "键2", "k😀3", "Aa", "u7"):
            expected = list(reversed(model.get(index_key_hash(f"{topic}#{key}"), [])))[:64]
            assert query_offsets(config, topic, key, 64).phy_offsets == expected, (topic, key)


def test_5x_tags_code_is_the_java_hash(tmp_path: Path) -> None:
    """tagsCode of a 5.x record (trailing separator, CRC property after TAGS) is the Java hash of TAGS."""
    written = write_5x_log(tmp_path, 3)
    cfg = {"store": {"storePathRootDir": str(tmp_path), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 200}, "logging": {"level": "warning"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    config = load_config(tmp_path / "c.yaml", env={})
    rebuild(config)
    queues = ConsumeQueueStore(config.output.dir, 200, readonly=True)
    for msg, res in written:
        if msg.sys_flag & 0xC in (0, TRANSACTION_COMMIT_TYPE):
            unit = queues.queue(res.topic, res.queue_id).read_units(res.queue_offset, 1)[0]
            tags = msg.properties["TAGS"]
            assert unit.tags_code == (java_string_hash(tags) if tags else 0)
    queues.close()
