"""The trace records RocketMQ clients write to the trace topic, as the 4.9.3 client's `TraceDataEncoder` lays
them out. A client format, not a store one: the broker stores a trace message as it stores any message and
never reads its body, and the layout changes with client versions (the field counts below), so it lives
with the command that reads it rather than in indexcore, whose modules are the store's own files.

A trace message's body is UTF-8 text: records, each ended by FIELD_SPLITOR (char 2), each a list of fields
joined by CONTENT_SPLITOR (char 1), the first field its TraceType. Fields by type, with the client versions'
variants:

    Pub             type timeStamp regionId groupName topic msgId tags keys storeHost bodyLength costTime
                    msgType [offsetMsgId] success [clientHost]                   13, 14 or 15+ fields
    SubBefore       type timeStamp regionId groupName requestId msgId retryTimes keys         8 fields
    SubAfter        type requestId msgId costTime success keys [contextCode [timeStamp groupName]]
                                                                                  6, 7 or 9+ fields
    EndTransaction  type timeStamp regionId groupName topic msgId tags keys storeHost msgType
                    transactionId transactionState fromTransactionCheck              13 fields

msgType is an ordinal of MessageType, contextCode one of ConsumeReturnType, transactionState a
LocalTransactionState name, success and fromTransactionCheck `Boolean.parseBoolean`. A null string field
is written as "null" (StringBuilder.append), as the client writes a message's missing tags. Empty fields at
a record's end are kept as written: Java's `String.split` drops them, and the client's decoder then misses a
SubAfter's time when its group is empty and fails on a SubBefore whose keys are empty.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTENT_SPLITOR = "\x01"  # TraceConstants.CONTENT_SPLITOR
FIELD_SPLITOR = "\x02"  # TraceConstants.FIELD_SPLITOR
RMQ_SYS_TRACE_TOPIC = "RMQ_SYS_TRACE_TOPIC"  # TopicValidator: the default trace topic
PUB, SUB_BEFORE, SUB_AFTER, END_TRANSACTION = "Pub", "SubBefore", "SubAfter", "EndTransaction"  # TraceType
MESSAGE_TYPES = ("Normal_Msg", "Trans_Msg_Half", "Trans_msg_Commit", "Delay_Msg")  # MessageType, by ordinal
CONSUME_RETURN_TYPES = ("SUCCESS", "TIME_OUT", "EXCEPTION", "RETURNNULL", "FAILED")  # ConsumeReturnType
TRANSACTION_STATES = ("COMMIT_MESSAGE", "ROLLBACK_MESSAGE", "UNKNOW")  # LocalTransactionState
PUB_FIELDS, PUB_FIELDS_OFFSET_MSG_ID, PUB_FIELDS_CLIENT_HOST = 13, 14, 15
SUB_BEFORE_FIELDS = 8
SUB_AFTER_FIELDS, SUB_AFTER_FIELDS_CODE, SUB_AFTER_FIELDS_TIME = 6, 7, 9
END_TRANSACTION_FIELDS = 13


class TraceDecodeError(ValueError):
    """A record whose fields the client's decoder would fail on (a number that is not one, a field too few):
    `index` is its place in the body, `field` the field at fault."""

    def __init__(self, index: int, field: str, detail: str):
        super().__init__(f"trace record {index}: field {field}: {detail}")
        self.index, self.field, self.detail = index, field, detail


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One decoded record (a TraceContext with its one TraceBean), the fields its type carries set; None
    where the type or the writing client's version has none (an old SubAfter has no time and no group)."""

    trace_type: str
    msg_id: str
    timestamp: int | None = None
    region_id: str | None = None
    group_name: str | None = None
    request_id: str | None = None
    topic: str | None = None
    tags: str | None = None
    keys: str | None = None
    store_host: str | None = None
    body_length: int | None = None
    cost_time: int | None = None
    msg_type: str | None = None
    offset_msg_id: str | None = None
    success: bool | None = None
    client_host: str | None = None
    retry_times: int | None = None
    context_code: int | None = None
    transaction_id: str | None = None
    transaction_state: str | None = None
    from_transaction_check: bool | None = None

    def encode(self) -> str:
        """The record as `TraceDataEncoder.encoderFromContextBean` writes it (the current layouts: Pub with
        offsetMsgId, SubAfter with contextCode, time and group), FIELD_SPLITOR included."""
        t = self.trace_type
        if t == PUB:
            fields = [t, self.timestamp, self.region_id, self.group_name, self.topic, self.msg_id, self.tags,
                      self.keys, self.store_host, self.body_length, self.cost_time, MESSAGE_TYPES.index(self.msg_type),
                      self.offset_msg_id, _bool(self.success)]
        elif t == SUB_BEFORE:
            fields = [t, self.timestamp, self.region_id, self.group_name, self.request_id, self.msg_id,
                      self.retry_times, self.keys]
        elif t == SUB_AFTER:
            fields = [t, self.request_id, self.msg_id, self.cost_time, _bool(self.success), self.keys,
                      self.context_code, self.timestamp, self.group_name]
        elif t == END_TRANSACTION:
            fields = [t, self.timestamp, self.region_id, self.group_name, self.topic, self.msg_id, self.tags,
                      self.keys, self.store_host, MESSAGE_TYPES.index(self.msg_type), self.transaction_id,
                      self.transaction_state, _bool(self.from_transaction_check)]
        else:
            raise ValueError(f"no trace type {t!r}")
        return CONTENT_SPLITOR.join("null" if f is None else str(f) for f in fields) + FIELD_SPLITOR


def _bool(value: bool | None) -> str:
    return "true" if value else "false"


def _long(index: int, field: str, text: str, bits: int = 64) -> int:
    """`Long.parseLong` (`Integer.parseInt` with 32 `bits`): an optional sign and decimal digits, in range."""
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not digits.isascii() or not digits.isdigit():
        raise TraceDecodeError(index, field, f"{text!r} is not a number")
    value = int(text)
    if not -(1 << (bits - 1)) <= value < 1 << (bits - 1):
        raise TraceDecodeError(index, field, f"{text} is out of range for a {bits}-bit number")
    return value


def _of(index: int, field: str, values: tuple[str, ...], text: str, by_ordinal: bool) -> str:
    if by_ordinal:
        n = _long(index, field, text, 32)
        if not 0 <= n < len(values):
            raise TraceDecodeError(index, field, f"{n} is no {field} (0 to {len(values) - 1})")
        return values[n]
    if text not in values:
        raise TraceDecodeError(index, field, f"{text!r} is no {field} ({', '.join(values)})")
    return text


def _decode_record(index: int, line: list[str]) -> TraceRecord | None:
    t, n = line[0], len(line)
    need = {PUB: PUB_FIELDS, SUB_BEFORE: SUB_BEFORE_FIELDS, SUB_AFTER: SUB_AFTER_FIELDS,
            END_TRANSACTION: END_TRANSACTION_FIELDS}.get(t)
    if need is None:
        return None  # the client's decoder passes over a type it does not know
    if n < need:
        raise TraceDecodeError(index, "fields", f"a {t} record has {need} or more, this one {n}")
    if t == PUB:
        offset_msg_id, client_host = (line[12], line[14] if n >= PUB_FIELDS_CLIENT_HOST else None) \
            if n >= PUB_FIELDS_OFFSET_MSG_ID else (None, None)
        success = line[13] if n >= PUB_FIELDS_OFFSET_MSG_ID else line[12]
        return TraceRecord(PUB, line[5], _long(index, "timeStamp", line[1]), line[2], line[3], topic=line[4],
                           tags=line[6], keys=line[7], store_host=line[8],
                           body_length=_long(index, "bodyLength", line[9], 32),
                           cost_time=_long(index, "costTime", line[10], 32),
                           msg_type=_of(index, "msgType", MESSAGE_TYPES, line[11], True),
                           offset_msg_id=offset_msg_id, success=success.lower() == "true", client_host=client_host)
    if t == SUB_BEFORE:
        return TraceRecord(SUB_BEFORE, line[5], _long(index, "timeStamp", line[1]), line[2], line[3],
                           request_id=line[4], retry_times=_long(index, "retryTimes", line[6], 32), keys=line[7])
    if t == SUB_AFTER:
        code = _long(index, "contextCode", line[6], 32) if n >= SUB_AFTER_FIELDS_CODE else None
        timestamp, group = (_long(index, "timeStamp", line[7]), line[8]) if n >= SUB_AFTER_FIELDS_TIME else (None, None)
        return TraceRecord(SUB_AFTER, line[2], timestamp, None, group, request_id=line[1], keys=line[5],
                           cost_time=_long(index, "costTime", line[3], 32), success=line[4].lower() == "true",
                           context_code=code)
    return TraceRecord(END_TRANSACTION, line[5], _long(index, "timeStamp", line[1]), line[2], line[3], topic=line[4],
                       tags=line[6], keys=line[7], store_host=line[8],
                       msg_type=_of(index, "msgType", MESSAGE_TYPES, line[9], True), transaction_id=line[10],
                       transaction_state=_of(index, "transactionState", TRANSACTION_STATES, line[11], False),
                       from_transaction_check=line[12].lower() == "true")


def decode_trace_data(text: str) -> tuple[list[TraceRecord], list[TraceDecodeError]]:
    """`TraceDataEncoder.decoderFromTraceDataString`: the records of a trace message's body, and the records
    the client's decoder would have failed on (each left out here, where the client gives up the message)."""
    records, errors = [], []
    if not text:
        return records, errors
    contexts = text.split(FIELD_SPLITOR)
    while contexts and not contexts[-1]:  # what follows the last record's FIELD_SPLITOR
        contexts.pop()
    for index, context in enumerate(contexts):
        try:
            rec = _decode_record(index, context.split(CONTENT_SPLITOR))
        except TraceDecodeError as e:
            errors.append(e)
            continue
        if rec is not None:
            records.append(rec)
    return records, errors


def consume_return_type(code: int | None) -> str | None:
    """The ConsumeReturnType a SubAfter's contextCode names (None for an unknown or missing code)."""
    return CONSUME_RETURN_TYPES[code] if code is not None and 0 <= code < len(CONSUME_RETURN_TYPES) else None


__all__ = ["CONTENT_SPLITOR", "END_TRANSACTION", "FIELD_SPLITOR", "PUB", "RMQ_SYS_TRACE_TOPIC", "SUB_AFTER",
           "SUB_BEFORE", "TraceDecodeError", "TraceRecord", "consume_return_type", "decode_trace_data"]
