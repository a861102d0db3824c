"""`query trace`: a message's trace as `mqadmin queryMsgTraceById` finds it. The trace topic's messages
carrying the msgId among their keys are looked up in the IndexFiles (`queryMessage(traceTopic, msgId, 64,
0, now)`, collisions dropped as the client drops them), their bodies decoded (`daemon.commands.tracedata`,
decompressed first when the trace producer compressed them) and the records naming the msgId kept
(`TraceView.decodeFromTraceTransData`), each with its trace message's born host as the client host.

The msgId is the client msgId (UNIQ_KEY), the one a trace records and indexes; an offset msgId naming a
record here is looked up by that record's UNIQ_KEY when it finds nothing itself.
"""

from __future__ import annotations

from typing import NamedTuple

from daemon.commands.query import _record_starts_at, open_commit_log, query_key_result
from daemon.commands.render import shown_body
from daemon.commands.tracedata import (
    END_TRANSACTION,
    PUB,
    RMQ_SYS_TRACE_TOPIC,
    SUB_AFTER,
    SUB_BEFORE,
    TraceDecodeError,
    TraceRecord,
    decode_trace_data,
)
from daemon.config import Config
from indexcore.commitlog import PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX, Host, MessageRecord
from indexcore.errors import StoreError
from indexcore.msgid import create_offset_msg_id, decode_offset_msg_id

TRACE_TYPES = (PUB, SUB_BEFORE, SUB_AFTER, END_TRANSACTION)


class TraceView(NamedTuple):
    """One trace record of the msgId, with where it was found: the trace message's CommitLog offset, offset
    msgId and store time, its place in the message's body, and the client host (the trace message's born
    host address, as `MessageExt.getBornHostString` gives it)."""

    record: TraceRecord
    client_host: str
    trace_offset: int
    trace_msg_id: str
    trace_store_timestamp: int
    position: int


class TraceResult(NamedTuple):
    """The trace of `msg_id` (looked up as given, or as the UNIQ_KEY of the record an offset msgId names:
    `notes` say so), in time order; `trace_messages`: the trace messages read; `errors`: records the
    client's decoder would fail on, each with its trace message's CommitLog offset; `removed`: index
    candidates retention deleted; `damage`: the first damaged IndexFile entry or record met."""

    msg_id: str
    topic: str
    views: list[TraceView]
    trace_messages: int
    errors: list[tuple[int, TraceDecodeError]]
    notes: list[str]
    removed: int = 0
    commit_log_min_offset: int = 0
    damage: StoreError | None = None

    def by_type(self, trace_type: str) -> list[TraceView]:
        return [v for v in self.views if v.record.trace_type == trace_type]

    def consumer_groups(self) -> dict[str, list[TraceView]]:
        """Each consumer group's SubAfter records (its consume attempts), groups in the order of their first."""
        groups: dict[str, list[TraceView]] = {}
        for v in self.by_type(SUB_AFTER):
            groups.setdefault(v.record.group_name or "", []).append(v)
        return groups

    def retry_times(self, view: TraceView) -> int | None:
        """The retry count of a SubAfter's attempt: its SubBefore's (the same requestId)."""
        return next((v.record.retry_times for v in self.by_type(SUB_BEFORE)
                     if v.record.request_id == view.record.request_id), None)


def born_host_string(host: Host) -> str:
    """`MessageExt.getBornHostString`: the address alone, IPv6 as Java's `Inet6Address.getHostAddress`
    writes it (eight groups in lower-case hex, no `::`)."""
    a = host.address
    if len(a) == 4:
        return ".".join(map(str, a))
    return ":".join(f"{int.from_bytes(a[i : i + 2], 'big'):x}" for i in range(0, 16, 2))


def _views(msg_id: str, messages: list[MessageRecord]) -> tuple[list[TraceView], list[tuple[int, TraceDecodeError]]]:
    views, errors = [], []
    for rec in messages:
        text = shown_body(rec).data.decode("utf-8", "replace")
        records, bad = decode_trace_data(text)
        errors.extend((rec.physical_offset, e) for e in bad)
        host = born_host_string(rec.born_host)
        offset_msg_id = create_offset_msg_id(rec.store_host, rec.physical_offset)
        views.extend(TraceView(r, host, rec.physical_offset, offset_msg_id, rec.store_timestamp, i)
                     for i, r in enumerate(records) if r.msg_id == msg_id)
    views.sort(key=lambda v: (v.record.timestamp if v.record.timestamp is not None else v.trace_store_timestamp,
                              TRACE_TYPES.index(v.record.trace_type), v.trace_offset, v.position))
    return views, errors


def _uniq_key_of(config: Config, msg_id: str) -> str | None:
    """The UNIQ_KEY of the record an offset msgId names in this CommitLog (stored by the host it names), or None."""
    try:
        host, offset = decode_offset_msg_id(msg_id)
    except ValueError:
        return None
    log = open_commit_log(config)
    if not 0 <= offset < log.max_offset or not _record_starts_at(log, offset):
        return None
    try:
        rec = log.read_record(offset, max_message_size=config.store.max_message_size)
    except StoreError:
        return None
    return rec.property_map().get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) if rec.store_host == host else None


def query_trace(config: Config, msg_id: str, trace_topic: str = RMQ_SYS_TRACE_TOPIC) -> TraceResult:
    """The trace of `msg_id` in `trace_topic`, as `queryMsgTraceById` shows it."""
    notes: list[str] = []
    found = query_key_result(config, trace_topic, msg_id, config.store.max_msgs_num_batch)
    views, errors = _views(msg_id, found.messages)
    looked_up = msg_id
    if not views and found.damage is None:
        uniq = _uniq_key_of(config, msg_id)
        if uniq is not None and uniq != msg_id:
            notes.append(f"msgId {msg_id} is an offset msgId: its message's client msgId (UNIQ_KEY), which traces "
                         f"record, is {uniq}")
            found = query_key_result(config, trace_topic, uniq, config.store.max_msgs_num_batch)
            views, errors = _views(uniq, found.messages)
            looked_up = uniq
    if found.cut:
        notes.append(f"the index gave {found.candidates} trace messages, the most one query returns "
                     f"(maxMsgsNumBatch {found.limit}): later ones may hold more of this trace")
    return TraceResult(looked_up, trace_topic, views, len(found.messages), errors, notes, found.removed,
                       found.commit_log_min_offset, found.damage)


__all__ = ["TraceResult", "TraceView", "born_host_string", "query_trace"]
