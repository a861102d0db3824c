"""Queries over a store: by key (through the IndexFiles), by queue offset, by offset msgId.

Everything is opened read-only; a query never changes a file.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.config import Config
from daemon.rebuild import open_commit_log
from indexcore.commitlog import (
    KEY_SEPARATOR,
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX,
    MessageRecord,
)
from indexcore.consumequeue import ConsumeQueueStore
from indexcore.indexservice import IndexService, QueryOffsetResult
from indexcore.msgid import create_offset_msg_id, decode_offset_msg_id

LONG_MAX = 2**63 - 1


def message_json(rec: MessageRecord) -> dict:
    """The fields an operator looks at, named as RocketMQ's MessageExt names them."""
    props = rec.property_map()
    return {
        "commitLogOffset": rec.physical_offset,
        "msgId": create_offset_msg_id(rec.store_host, rec.physical_offset),
        "topic": rec.topic,
        "queueId": rec.queue_id,
        "queueOffset": rec.queue_offset,
        "storeSize": rec.total_size,
        "storeTimestamp": rec.store_timestamp,
        "bornTimestamp": rec.born_timestamp,
        "bornHost": str(rec.born_host),
        "storeHost": str(rec.store_host),
        "tags": props.get(PROPERTY_TAGS),
        "keys": props.get(PROPERTY_KEYS),
        "uniqKey": props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX),
        "sysFlag": rec.sys_flag,
        "flag": rec.flag,
        "reconsumeTimes": rec.reconsume_times,
        "preparedTransactionOffset": rec.prepared_transaction_offset,
        "bodySize": len(rec.body),
        "bodyCRC": rec.body_crc,
        "properties": props,
    }


def _index_service(config: Config) -> IndexService:
    s = config.store
    service = IndexService(config.output.dir, s.max_hash_slot_num, s.max_index_num, s.max_msgs_num_batch)
    service.load(readonly=True)
    return service


def query_offsets(config: Config, topic: str, key: str, max_num: int, begin: int = 0,
                  end: int = LONG_MAX) -> QueryOffsetResult:
    """`IndexService.queryOffset`: hash candidates, as the broker returns them."""
    service = _index_service(config)
    try:
        return service.query_offset(topic, key, max_num, begin, end)
    finally:
        service.close()


def matches_key(rec: MessageRecord, topic: str, key: str) -> bool:
    """The Java client's filter (`MQAdminImpl`): same topic, and the key is the UNIQ_KEY or a KEYS token."""
    if rec.topic != topic:
        return False
    props = rec.property_map()
    if props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) == key:
        return True
    return key in props.get(PROPERTY_KEYS, "").split(KEY_SEPARATOR)


def query_key(config: Config, topic: str, key: str, max_num: int = 64, begin: int = 0,
              end: int = LONG_MAX) -> list[MessageRecord]:
    """Messages whose topic and key match exactly, newest first, each listed once."""
    candidates = query_offsets(config, topic, key, max_num, begin, end).phy_offsets
    log = open_commit_log(config)
    records = (log.read_record(offset, max_message_size=config.store.max_message_size)
               for offset in sorted(set(candidates), reverse=True))
    return [rec for rec in records if matches_key(rec, topic, key)]


@dataclass(frozen=True, slots=True)
class QueueQueryResult:
    """`GetMessageResult` in brief: status as the broker names it, the queue's bounds, the messages."""

    status: str
    min_offset: int
    max_offset: int
    next_begin_offset: int
    messages: list[MessageRecord]


def query_queue(config: Config, topic: str, queue_id: int, offset: int, count: int = 32) -> QueueQueryResult:
    store = ConsumeQueueStore(config.output.dir, config.store.mapped_file_size_consume_queue, readonly=True)
    cq = store.queue(topic, queue_id)
    log = open_commit_log(config)
    cq.correct_min_offset(log.min_offset)
    try:
        lo, hi = cq.min_offset, cq.max_offset
        if hi == 0:
            return QueueQueryResult("NO_MESSAGE_IN_QUEUE", lo, hi, 0, [])
        if offset < lo:
            return QueueQueryResult("OFFSET_TOO_SMALL", lo, hi, lo, [])
        if offset == hi:
            return QueueQueryResult("OFFSET_OVERFLOW_ONE", lo, hi, offset, [])
        if offset > hi:
            return QueueQueryResult("OFFSET_OVERFLOW_BADLY", lo, hi, lo if lo == 0 else hi, [])
        units = cq.read_units(offset, count)
        msgs = [log.read_record(u.commit_log_offset, max_message_size=config.store.max_message_size)
                for u in units if u.is_valid]
        return QueueQueryResult("FOUND", lo, hi, offset + len(units), msgs)
    finally:
        store.close()


def query_msgid(config: Config, msg_id: str) -> MessageRecord:
    _, offset = decode_offset_msg_id(msg_id)
    return open_commit_log(config).read_record(offset, max_message_size=config.store.max_message_size)


__all__ = ["matches_key", "message_json", "query_key", "query_msgid", "query_offsets", "query_queue"]
