"""Queries over a store: by key (through the IndexFiles), by queue offset, by msgId.

Everything is opened read-only; a query never changes a file. A query that cannot look (no `index/` or
`consumequeue/` where the output should be, a topic or queue the output does not have) raises a
StoreLayoutError naming what is missing, so it is never mistaken for an empty answer.

This module is on the path of `reputd query`, whose start-up time operators feel: it imports no numpy
(daemon/ops/deferred.py), no logging and no rebuild machinery, and its results are NamedTuples (a dataclass
costs a millisecond or more to create at import).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from daemon.config import Config, StoreConfig
from daemon.engine import dledgermode
from indexcore.commitlog import (
    KEY_SEPARATOR,
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX,
    RECORD_START_SIZE,
    MessageRecord,
    is_record_start,
)
from indexcore.consumequeue import BLANK_UNIT_MSG_SIZE, CONSUME_QUEUE_DIR, CQ_UNIT_SIZE
from indexcore.errors import CorruptEntryError, StoreError, StoreLayoutError
from indexcore.indexservice import INDEX_DIR, IndexQueryDamaged, IndexService, QueryOffsetResult
from indexcore.mappedfile import offset_to_file_name
from indexcore.msgid import PORT_MAX, create_offset_msg_id, decode_offset_msg_id
from indexcore.reader import CommitLog

LONG_MAX = 2**63 - 1
MAX_FILTER_MESSAGE_UNITS = 16000 // 20  # getMessage looks at no more units than this (or maxMsgNums)


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


def open_commit_log(config: Config) -> CommitLog:
    return dledgermode.open_commit_log(config.store)


def _read(config: Config, log: CommitLog, offset: int) -> MessageRecord:
    return log.read_record(offset, max_message_size=config.store.max_message_size)


def is_removed(log: CommitLog, offset: int) -> bool:
    """Whether retention deleted the segment of `offset`: it lies below the CommitLog's first offset. The
    broker skips such a message (`queryMessage` ignores a body it cannot read); a missing segment above the
    first one is damage, not retention, and reading it stays an error."""
    return 0 <= offset < log.min_offset


def split_removed(log: CommitLog, offsets: list[int]) -> tuple[list[int], list[int]]:
    """`offsets` split into those the CommitLog still holds and those retention removed, order kept."""
    retained = [o for o in offsets if not is_removed(log, o)]
    removed = [o for o in offsets if is_removed(log, o)]
    return retained, removed


def _index_service(config: Config) -> IndexService:
    s = config.store
    directory = os.path.join(config.output.dir, INDEX_DIR)
    if not os.path.isdir(directory):
        why = ("the index is off (store.messageIndexEnable: false)" if not s.message_index_enable
               else "no IndexFiles here: is the output directory (--out, output.dir) the right one?")
        raise StoreLayoutError(directory, f"no index directory; {why}")
    service = IndexService(config.output.dir, s.max_hash_slot_num, s.max_index_num, s.max_msgs_num_batch)
    service.load(readonly=True)
    return service


def query_offsets(config: Config, topic: str, key: str, max_num: int, begin: int = 0,
                  end: int = LONG_MAX) -> QueryOffsetResult:
    """`IndexService.queryOffset`: hash candidates, as the broker returns them; a damaged IndexFile is an
    IndexQueryDamaged carrying the candidates found before the damage."""
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


class KeyQueryResult(NamedTuple):
    """The matching messages, newest first, and how many candidates the index gave out of at most `limit`
    (`maxMsgsNumBatch`, or less with --max): when it gave `limit`, older matches may exist. `removed`:
    candidates below the CommitLog's first offset, `commit_log_min_offset`, left out (retention deleted
    their segments; whether they matched cannot be known). `damage`: the first damaged IndexFile entry
    met; the messages are then those found before it."""

    messages: list[MessageRecord]
    candidates: int
    limit: int
    removed: int = 0
    commit_log_min_offset: int = 0
    damage: StoreError | None = None

    @property
    def cut(self) -> bool:
        return self.candidates >= self.limit


def _candidate_damage(log: CommitLog, source: tuple[str, int] | None, offset: int, error: StoreError) -> StoreError:
    """Why a candidate cannot be read: an IndexFile entry whose phy_offset is no record start is damage of
    that entry; a record that starts there but fails its checks is the CommitLog's own damage."""
    if source is None or _record_starts_at(log, offset):
        return error
    path, n = source
    return CorruptEntryError(path, f"entry {n}", "phy_offset", f"CommitLog offset {offset} is not the start of a "
                                                               f"record ({error})")


def _read_candidates(config: Config, log: CommitLog, found: QueryOffsetResult,
                     damage: StoreError | None) -> tuple[list[MessageRecord], StoreError | None, list[int]]:
    """The records of the candidates, newest first, each once; those that cannot be read are left out and
    the first reason kept (after `damage`, the index's own); those retention removed are left out and
    returned apart, as the broker's `queryMessage` skips them."""
    where = dict(zip(found.phy_offsets, found.sources, strict=False))
    records = []
    retained, removed = split_removed(log, sorted(set(found.phy_offsets), reverse=True))
    for offset in retained:
        try:
            records.append(_read(config, log, offset))
        except StoreError as e:
            damage = damage or _candidate_damage(log, where.get(offset), offset, e)
    return records, damage, removed


def query_key_result(config: Config, topic: str, key: str, max_num: int = 64, begin: int = 0,
                     end: int = LONG_MAX) -> KeyQueryResult:
    """Messages whose topic and key match exactly, newest first, each listed once."""
    damage = None
    try:
        found = query_offsets(config, topic, key, max_num, begin, end)
    except IndexQueryDamaged as e:
        found, damage = e.partial, e
    log = open_commit_log(config)
    records, damage, removed = _read_candidates(config, log, found, damage)
    return KeyQueryResult([rec for rec in records if matches_key(rec, topic, key)], len(found.phy_offsets),
                          min(max_num, config.store.max_msgs_num_batch), len(removed), log.min_offset, damage)


INDEX_TIME_UNIT_MS = 1000  # an IndexFile entry keeps its store time as whole seconds after the file's first


def stored_in_window(config: Config, topic: str, key: str, max_num: int, begin: int, end: int) -> list[MessageRecord]:
    """The messages of this topic and key whose real store time lies in [begin, end] but which an index
    query for that range leaves out, as the broker's does: an entry's time is its file's first store time
    plus whole seconds (IndexFile.putKey), up to 999 ms before the real one, so a message stored less than a
    second after `begin` may be timed before it. Their candidates are read anyway to check their keys."""
    if begin <= 0:
        return []
    wider = query_key_result(config, topic, key, max_num, max(0, begin - INDEX_TIME_UNIT_MS + 1), end)
    return [rec for rec in wider.messages if begin <= rec.store_timestamp <= end]


class WindowFacts(NamedTuple):
    """What a --begin/--end answer does not say by itself, since index times are whole seconds (as the
    broker's): `left_out`, messages stored inside [begin, end] that the answer leaves out (timed before
    --begin); `after_end`/`before_begin`, messages it lists whose real store time is outside the range."""

    left_out: list[MessageRecord]
    after_end: list[MessageRecord]
    before_begin: list[MessageRecord]

    def as_json(self, begin: int, end: int) -> dict:
        """The `--json` answer's last object: the messages by CommitLog offset, and the --begin that finds those
        left out."""
        return {"type": "timeRange", "begin": begin, "end": end, "indexTimeUnitMs": INDEX_TIME_UNIT_MS,
                "leftOut": [rec.physical_offset for rec in self.left_out],
                "widerBegin": begin - INDEX_TIME_UNIT_MS if self.left_out else None,
                "listedAfterEnd": [rec.physical_offset for rec in self.after_end],
                "listedBeforeBegin": [rec.physical_offset for rec in self.before_begin]}


def window_facts(config: Config, topic: str, key: str, max_num: int, begin: int, end: int,
                 listed: list[MessageRecord]) -> WindowFacts:
    """The answer `listed` (the broker's, kept as it is) held against the real store times of its messages
    and of those the index times just before `begin`."""
    shown = {rec.physical_offset for rec in listed}
    inside = stored_in_window(config, topic, key, max_num, begin, end)
    left_out = [rec for rec in inside if rec.physical_offset not in shown]
    return WindowFacts(left_out, [rec for rec in listed if rec.store_timestamp > end],
                       [rec for rec in listed if rec.store_timestamp < begin])


def query_key(config: Config, topic: str, key: str, max_num: int = 64, begin: int = 0,
              end: int = LONG_MAX) -> list[MessageRecord]:
    """Messages whose topic and key match exactly, newest first, each listed once."""
    return query_key_result(config, topic, key, max_num, begin, end).messages


class QueueQueryResult(NamedTuple):
    """`GetMessageResult` in brief: status as the broker names it, the queue's bounds, the messages, how
    many units pointed into segments retention deleted (skipped, as the broker skips them); `damage`: a
    unit that points at no record, met after the messages before it."""

    status: str
    min_offset: int
    max_offset: int
    next_begin_offset: int
    messages: list[MessageRecord]
    removed: int = 0
    commit_log_min_offset: int = 0
    damage: StoreError | None = None


def topics(config: Config) -> list[str]:
    """The topics the output's ConsumeQueues know, sorted."""
    root = os.path.join(config.output.dir, CONSUME_QUEUE_DIR)
    try:
        return sorted(t for t in os.listdir(root) if os.path.isdir(os.path.join(root, t)))
    except FileNotFoundError:
        return []


def _listing(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_output(config: Config) -> str:
    root = os.path.join(config.output.dir, CONSUME_QUEUE_DIR)
    if not os.path.isdir(root):
        raise StoreLayoutError(root, "no consumequeue directory: is the output directory (--out, output.dir) "
                                     "the right one?")
    return root


def check_queue(config: Config, topic: str, queue_id: int) -> None:
    """That the output has this ConsumeQueue; StoreLayoutError naming what it has instead (the command line
    asks first: for a person a queue that is not there is a mistake, for the broker an empty queue)."""
    root = _check_output(config)
    tdir = os.path.join(root, topic)
    if not os.path.isdir(tdir):
        known = topics(config)
        raise StoreLayoutError(tdir, f"no ConsumeQueue of topic {topic!r} here (topics: {_listing(known) or 'none'})")
    if not os.path.isdir(os.path.join(tdir, str(queue_id))):
        queues = sorted(int(q) for q in os.listdir(tdir) if q.isdigit())
        raise StoreLayoutError(os.path.join(tdir, str(queue_id)),
                               f"topic {topic!r} has no queue {queue_id} here (queues: "
                               f"{_listing([str(q) for q in queues]) or 'none'})")


def check_topic(config: Config, topic: str) -> None:
    """After an empty answer by key: a topic the output has no ConsumeQueue for is a mistake more likely
    than a key that is not there, so StoreLayoutError names the topics it has (as `check_queue`). Asked
    only when nothing was found: a topic whose records are all PREPARED has keys but no ConsumeQueue. An
    output without consumequeue/ (the index alone) cannot tell."""
    root = os.path.join(config.output.dir, CONSUME_QUEUE_DIR)
    if os.path.isdir(root) and not os.path.isdir(os.path.join(root, topic)):
        raise StoreLayoutError(os.path.join(root, topic), f"no ConsumeQueue of topic {topic!r} here, so no key of it "
                                                          f"(topics: {_listing(topics(config)) or 'none'})")


def _batch_full(taken: int, taken_bytes: int, size: int, count: int, store: StoreConfig) -> bool:
    """`isTheBatchFull` for messages in memory: the broker's page-cache limits on one pull."""
    if taken == 0:
        return False
    return (taken >= count or taken_bytes + size > store.max_transfer_bytes_on_message_in_memory
            or taken > store.max_transfer_count_on_message_in_memory - 1)


def query_queue(config: Config, topic: str, queue_id: int, offset: int, count: int = 32) -> QueueQueryResult:
    """`getMessage` without a filter, with the transfer limits of messages in memory (a broker whose
    CommitLog outgrows its memory ratio uses the smaller on-disk ones; that depends on its RAM). An LMQ is
    read as topic = its name, queue 0. A queue the output does not have is empty (NO_MESSAGE_IN_QUEUE), as
    the broker answers for it; `check_queue` tells it from a mistake."""
    # numpy comes with these (the queue store's tables): query queue's start-up only, not every query's
    from indexcore.queuestore import ConsumeQueueStore  # noqa: PLC0415
    from indexcore.retention import expired_queue_files  # noqa: PLC0415

    _check_output(config)
    store = ConsumeQueueStore(config.output.dir, config.store.mapped_file_size_consume_queue, readonly=True)
    cq = store.queue(topic, queue_id)
    log = open_commit_log(config)
    first = log.min_offset
    # the min offset the broker's clean-up leaves (`indexcore.retention`), even where it has not run yet
    cq.correct_min_offset(first, expired_queue_files(cq, first) if cq.file_count > 1 else 0)
    try:
        lo, hi = cq.min_offset, cq.max_offset
        if hi == 0:
            return QueueQueryResult("NO_MESSAGE_IN_QUEUE", lo, hi, 0, [], 0, first)
        if offset < lo:
            return QueueQueryResult("OFFSET_TOO_SMALL", lo, hi, lo, [], 0, first)
        if offset == hi:
            return QueueQueryResult("OFFSET_OVERFLOW_ONE", lo, hi, offset, [], 0, first)
        if offset > hi:
            return QueueQueryResult("OFFSET_OVERFLOW_BADLY", lo, hi, lo if lo == 0 else hi, [], 0, first)
        units = cq.read_units(offset, max(count, MAX_FILTER_MESSAGE_UNITS))
        taken = taken_bytes = seen = removed = 0
        next_segment = None  # `nextPhyFileStartOffset`: after a removed unit, units below it are passed over
        msgs: list[MessageRecord] = []
        damage = None
        for u in units:
            if next_segment is not None and u.commit_log_offset < next_segment:
                seen += 1
                continue
            if u.commit_log_offset == 0 and u.msg_size == BLANK_UNIT_MSG_SIZE:
                seen += 1  # a pre-blank unit, or a blank one filling a gap: no message, passed over
                continue
            if is_removed(log, u.commit_log_offset):
                if _batch_full(taken, taken_bytes, u.msg_size, count, config.store):
                    break
                seen += 1
                removed += 1
                next_segment = log.segment_start(u.commit_log_offset) + log.segment_size
                continue
            next_segment = None
            damage = _unit_fault(config, log, cq, offset + seen, u)
            if damage is not None or _batch_full(taken, taken_bytes, u.msg_size, count, config.store):
                break
            rec, damage = _unit_record(config, log, cq, offset + seen, u)
            if damage is not None:
                break
            seen += 1
            taken += 1
            taken_bytes += u.msg_size
            msgs.append(rec)
        status = "FOUND" if taken or not removed else "MESSAGE_WAS_REMOVING"
        return QueueQueryResult(status, lo, hi, offset + seen, msgs, removed, first, damage)
    finally:
        store.close()


def _unit_damage(cq, queue_offset: int, field: str, detail: str) -> CorruptEntryError:
    logical = queue_offset * CQ_UNIT_SIZE
    path = os.path.join(cq.directory, offset_to_file_name(logical - logical % cq.file_size))
    return CorruptEntryError(path, f"unit at queue offset {queue_offset}", field, detail)


def _unit_fault(config: Config, log: CommitLog, cq, queue_offset: int, u) -> CorruptEntryError | None:
    """A ConsumeQueue unit whose offset or size no record can have: damage of the unit (file, queue offset,
    field), found before the transfer limits look at its size."""
    phy, size = u.commit_log_offset, u.msg_size
    if phy < 0:
        return _unit_damage(cq, queue_offset, "commit_log_offset", f"{phy} is negative")
    if size <= 0 or size > config.store.max_message_size:
        return _unit_damage(cq, queue_offset, "msg_size", f"{size} is not a record size (1 to maxMessageSize "
                                                          f"{config.store.max_message_size})")
    if phy + size > log.max_offset:
        return _unit_damage(cq, queue_offset, "commit_log_offset", f"record [{phy}, {phy + size}) runs past the "
                                                                   f"CommitLog's end {log.max_offset}")
    return None


def _unit_record(config: Config, log: CommitLog, cq, queue_offset: int,
                 u) -> tuple[MessageRecord | None, StoreError | None]:
    """The record a ConsumeQueue unit points at, or why it cannot be read: no record starting there, or one of
    another size, is damage of the unit; a record that is there but fails its own checks is the CommitLog's."""
    phy, size = u.commit_log_offset, u.msg_size
    if not _record_starts_at(log, phy):
        return None, _unit_damage(cq, queue_offset, "commit_log_offset", f"no record starts at CommitLog offset {phy}")
    try:
        rec = _read(config, log, phy)
    except StoreError as e:
        return None, e
    if rec.total_size != size:
        return None, _unit_damage(cq, queue_offset, "msg_size", f"{size}, the record at CommitLog offset {phy} is "
                                                                f"{rec.total_size} bytes")
    return rec, None


class MsgIdResult(NamedTuple):
    """What `query msgid` found: by `offset` (an offset msgId naming a record start) or by `uniqKey`
    (the UNIQ_KEY looked up in the index), newest first; `notes` say what else the lookup saw; `removed`:
    index candidates below the CommitLog's first offset, left out (retention deleted their segments);
    `damage`: the first damaged IndexFile entry met (the messages are then those found without it)."""

    messages: list[MessageRecord]
    found_by: str | None
    notes: list[str]
    removed: int = 0
    commit_log_min_offset: int = 0
    damage: StoreError | None = None


def _record_starts_at(log: CommitLog, offset: int) -> bool:
    """Whether a message record starts at `offset` (`is_record_start`). Anything else is not damage: the
    id may name another broker's CommitLog, or not be an offset msgId at all."""
    path = log.find_segment(offset) if offset >= 0 else None
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            head = os.pread(f.fileno(), RECORD_START_SIZE, offset - log.segment_start(offset))
    except OSError:
        return False
    return is_record_start(head, offset)


def query_msgid(config: Config, msg_id: str, topic: str | None = None) -> MsgIdResult:
    """The message(s) a msgId names, as `mqadmin queryMsgById` finds them: an offset msgId (store host +
    CommitLog offset, `MessageDecoder.decodeMessageId`) when a record starts at its offset, else the id
    as a UNIQ_KEY (`MessageClientIDSetter`), looked up in the index under `topic`, or under every topic
    the output's ConsumeQueues know. Both kinds are 32 (or, with IPv6, 56) hex digits."""
    notes: list[str] = []
    log = open_commit_log(config)
    try:
        host, offset = decode_offset_msg_id(msg_id)
    except ValueError:
        host, offset = None, -1
    if host is not None and not 0 <= host.port <= PORT_MAX:  # a UNIQ_KEY read as host, port and offset
        notes.append(f"not an offset msgId (its port would be {host.port}, not in 0-{PORT_MAX})")
    elif host is not None and not 0 <= offset < log.max_offset:
        notes.append(f"not an offset msgId of this CommitLog (its offset would be {offset}, outside the "
                     f"CommitLog's [0, {log.max_offset}))")
    elif host is not None:
        # a DLedger log serves only committed entries (DLedgerCommitLog.getData stops at committedPos)
        if _record_starts_at(log, offset) and (log.read_limit is None or offset < log.read_limit):
            rec = _read(config, log, offset)
            if rec.store_host != host:
                notes.append(f"warning: msgId {msg_id} names store host {host}, the record at CommitLog "
                             f"offset {offset} was stored by {rec.store_host}: is this the broker that "
                             f"stored it?")
            if topic is None or rec.topic == topic:
                return MsgIdResult([rec], "offset", notes)
            notes.append(f"the record at offset {offset} belongs to topic {rec.topic!r}, not {topic!r}")
        elif is_removed(log, offset):
            notes.append(f"as an offset msgId ({host}, CommitLog offset {offset}): below the CommitLog's first "
                         f"offset {log.min_offset}; retention deleted that segment")
        else:
            notes.append(f"as an offset msgId ({host}, CommitLog offset {offset}): no message at that "
                         f"offset (the CommitLog's segments span [{log.min_offset}, {log.max_offset}))")
    names = [topic] if topic is not None else topics(config)
    if not names:
        notes.append(f"as a UNIQ_KEY: no topics to look under (no consumequeue/ in {config.output.dir}); "
                     "name one with --topic")
        return MsgIdResult([], None, notes)
    service = _index_service(config)
    found: dict[int, MessageRecord] = {}
    removed: set[int] = set()
    damage = None
    try:
        for name in names:
            try:
                result = service.query_offset(name, msg_id, config.store.max_msgs_num_batch, 0, LONG_MAX)
            except IndexQueryDamaged as e:  # the damage is in this topic's chain: the others are still looked at
                result, damage = e.partial, damage or e
            fresh = QueryOffsetResult([o for o in result.phy_offsets if o not in found], 0, 0,
                                      [s for o, s in zip(result.phy_offsets, result.sources, strict=False)
                                       if o not in found])
            records, damage, gone = _read_candidates(config, log, fresh, damage)
            removed.update(gone)
            for rec in records:
                if rec.topic == name and rec.property_map().get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) == msg_id:
                    found[rec.physical_offset] = rec
    finally:
        service.close()
    if not found:
        where = f"topic {topic!r}" if topic is not None else f"any of {len(names)} topics"
        notes.append(f"as a UNIQ_KEY: not in the index under {where}" + (" (as far as it could be read)"
                                                                            if damage is not None else ""))
    return MsgIdResult([found[o] for o in sorted(found, reverse=True)], "uniqKey" if found else None, notes,
                       len(removed), log.min_offset, damage)


__all__ = ["KeyQueryResult", "MsgIdResult", "QueueQueryResult", "WindowFacts", "check_queue", "check_topic",
           "is_removed", "matches_key", "message_json", "open_commit_log", "query_key", "query_key_result",
           "query_msgid", "query_offsets", "query_queue", "split_removed", "topics", "window_facts"]
