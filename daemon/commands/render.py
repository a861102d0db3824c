"""How query results look: on a terminal, the layouts RocketMQ operators know from `mqadmin` (a table for
`queryMsgByKey`, one block of `Label: value` lines per message for `queryMsgById`); elsewhere, and with
`--json`, one JSON object per line (`daemon.commands.query.message_json`, plus the body when asked for).

A body stored compressed (sysFlag COMPRESSED_FLAG) is shown and saved decompressed, as mqadmin shows it
(`MessageDecoder.decode(deCompressBody=true)`, zlib as `UtilAll.uncompress`), and the output says so;
`raw` keeps the stored bytes, and a body that does not decompress is shown as stored, saying why.

Times are local, with milliseconds, as mqadmin prints them (`UtilAll.timeMillisToHumanString2`).
"""

from __future__ import annotations

import json
import os
import time
import unicodedata
import zlib
from collections.abc import Iterable
from typing import NamedTuple

from daemon.commands.query import message_json
from indexcore.commitlog import (
    COMPRESSED_FLAG,
    COMPRESSION_TYPE_MASK,
    COMPRESSION_TYPE_SHIFT,
    COMPRESSION_TYPES,
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX,
    MessageRecord,
)
from indexcore.msgid import create_offset_msg_id

LABEL_WIDTH = 20  # mqadmin's "%-20s %s"
MAX_DECOMPRESSED_BODY = 64 * 1024 * 1024  # a body inflating past this is shown as stored (a zlib bomb)
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}


def human_time(ms: int) -> str:
    """`yyyy-MM-dd HH:mm:ss,SSS` in local time."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms // 1000)) + f",{ms % 1000:03d}"
    except (OverflowError, OSError, ValueError):  # a timestamp no calendar holds
        return f"{ms} ms"


def printable(text: str) -> str:
    """The text with control characters escaped, so a stored value cannot move the terminal's cursor."""
    return text.translate(_CONTROL)


class Body(NamedTuple):
    """The body as shown and saved: `data`, and for a compressed one `compression` (the codec), whether
    `decompressed`, and `error` (why not, when it should have been)."""

    data: bytes
    compression: str | None = None
    decompressed: bool = False
    error: str | None = None

    def describe(self) -> str | None:
        """For a compressed body, one phrase: what is shown and how to get the other form."""
        if self.compression is None:
            return None
        if self.decompressed:
            return f"{self.compression}; shown decompressed ({len(self.data):,} bytes; --raw-body: as stored)"
        if self.error is not None:
            return f"{self.compression}, but {self.error}; shown as stored"
        return f"{self.compression}; shown as stored (--raw-body)"

    def as_json(self) -> dict | None:
        if self.compression is None:
            return None
        return {"type": self.compression, "decompressed": self.decompressed,
                **({"size": len(self.data)} if self.decompressed else {}),
                **({"error": self.error} if self.error is not None else {})}


def shown_body(rec: MessageRecord, raw: bool = False) -> Body:
    """The body to show or save: decompressed when the record says it is compressed with zlib, unless
    `raw`; a codec this build cannot read (5.x lz4, zstd) or bytes that do not inflate stay as stored."""
    if not rec.sys_flag & COMPRESSED_FLAG:
        return Body(rec.body)
    kind = (rec.sys_flag & COMPRESSION_TYPE_MASK) >> COMPRESSION_TYPE_SHIFT
    codec = COMPRESSION_TYPES.get(kind, f"compression type {kind}")
    if raw:
        return Body(rec.body, codec)
    if codec != "zlib":
        return Body(rec.body, codec, error=f"reputd does not decompress {codec}")
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(rec.body, MAX_DECOMPRESSED_BODY)
    except zlib.error as e:
        return Body(rec.body, codec, error=f"it does not decompress ({e})")
    if inflater.unconsumed_tail:
        return Body(rec.body, codec, error=f"it decompresses to more than {MAX_DECOMPRESSED_BODY:,} bytes")
    if not inflater.eof:
        return Body(rec.body, codec, error="it does not decompress (the zlib stream is cut short)")
    return Body(data, codec, decompressed=True)


def message_block(rec: MessageRecord, *, body: bool = False, body_path: str | None = None,
                  raw_body: bool = False) -> list[str]:
    """The lines mqadmin's `printMsg` shows for one message, plus the UNIQ_KEY and the body size."""
    props = rec.property_map()
    shown = shown_body(rec, raw_body)

    def bracket(name: str) -> str:
        value = props.get(name)
        return f"[{printable(value)}]" if value is not None else "[]"

    fields = [
        ("OffsetID", create_offset_msg_id(rec.store_host, rec.physical_offset)),
        ("Message ID", printable(props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX, "")) or "(no UNIQ_KEY)"),
        ("Topic", printable(rec.topic)),
        ("Tags", bracket(PROPERTY_TAGS)),
        ("Keys", bracket(PROPERTY_KEYS)),
        ("Queue ID", rec.queue_id),
        ("Queue Offset", rec.queue_offset),
        ("CommitLog Offset", rec.physical_offset),
        ("Reconsume Times", rec.reconsume_times),
        ("Born Timestamp", human_time(rec.born_timestamp)),
        ("Store Timestamp", human_time(rec.store_timestamp)),
        ("Born Host", rec.born_host),
        ("Store Host", rec.store_host),
        ("System Flag", rec.sys_flag),
        ("Properties", "{" + ", ".join(f"{printable(k)}={printable(v)}" for k, v in props.items()) + "}"),
        ("Body Size", len(rec.body)),
    ]
    if shown.compression is not None:
        fields.append(("Body Compression", shown.describe()))
    if body_path is not None:
        fields.append(("Message Body Path", body_path))
    lines = [f"{label + ':':<{LABEL_WIDTH}} {value}" for label, value in fields]
    if body:
        lines.append(f"{'Body:':<{LABEL_WIDTH}} {printable(shown.data.decode('utf-8', 'backslashreplace'))}")
    return lines


def display_width(text: str) -> int:
    """Terminal columns `text` takes: East Asian wide and full-width characters (CJK, most emoji) take two,
    combining marks none, so a table's columns line up after tags such as 标签A or 😀tag."""
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
               for ch in text)


def key_table(messages: Iterable[MessageRecord], *, tags: bool = False) -> list[str]:
    """mqadmin's `queryMsgByKey` table (`#Message ID  #QID  #Offset`), with the store time, the CommitLog
    offset, the tags (with `tags`) and the keys added. The message id is the UNIQ_KEY, or the offset msgId
    when there is none, as the Java client's `MessageClientExt.getMsgId` gives it."""
    header = ("#Message ID", "#QID", "#Offset", "#Store Time", "#CommitLog Offset", *("#Tags",) * tags, "#Keys")
    rows = []
    for rec in messages:
        props = rec.property_map()
        msg_id = props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) or create_offset_msg_id(rec.store_host,
                                                                                           rec.physical_offset)
        rows.append((printable(msg_id), str(rec.queue_id), str(rec.queue_offset), human_time(rec.store_timestamp),
                     str(rec.physical_offset), *(printable(props.get(PROPERTY_TAGS, "")),) * tags,
                     printable(props.get(PROPERTY_KEYS, ""))))
    widths = [max(display_width(r[i]) for r in (header, *rows)) for i in range(len(header))]
    right = {1, 2, 4}  # numbers

    def line(row: tuple[str, ...]) -> str:
        cells = []
        for i, (cell, w) in enumerate(zip(row, widths, strict=True)):
            pad = " " * (w - display_width(cell))
            cells.append(pad + cell if i in right else cell + pad)
        return "  ".join(cells).rstrip()

    return [line(header), *(line(r) for r in rows)]


TRACE_ROW = "{:<10} {:<20} {:<20} {:<20} {:<10} {:<10}"  # queryMsgTraceById's "%-10s %-20s %-20s %-20s %-10s %-10s"
TRACE_TIME = "%Y-%m-%d %H:%M:%S"  # its DateFormatUtils pattern, local time


def _trace_time(ms: int | None) -> str:
    if ms is None:
        return "-"
    try:
        return time.strftime(TRACE_TIME, time.localtime(ms // 1000))
    except (OverflowError, OSError, ValueError):
        return f"{ms} ms"


def _trace_status(record) -> str:
    return "success" if record.success else "failed"  # TraceView.status


def trace_table(result) -> list[str]:
    """`mqadmin queryMsgTraceById`'s layout for a `daemon.commands.trace.TraceResult`: the Pub rows, then
    each consumer group's Sub rows (its SubAfter records), with a #RetryTimes column added from the matching
    SubBefore, then the EndTransaction rows mqadmin leaves out."""
    lines: list[str] = []

    def row(*cells) -> None:
        shown = [printable(str(c)) for c in cells]
        lines.append((TRACE_ROW.format(*shown[:6]) + "".join(f" {c:<10}" for c in shown[6:])).rstrip())

    for v in result.views:
        if v.record.trace_type == "Pub":
            r = v.record
            row("#Type", "#ProducerGroup", "#ClientHost", "#SendTime", "#CostTimes", "#Status")
            row("Pub", r.group_name, v.client_host, _trace_time(r.timestamp), f"{r.cost_time}ms", _trace_status(r))
            lines.append("")
    for views in result.consumer_groups().values():
        row("#Type", "#ConsumerGroup", "#ClientHost", "#ConsumerTime", "#CostTimes", "#Status", "#RetryTimes")
        for v in views:
            r, retry = v.record, result.retry_times(v)
            row("Sub", r.group_name, v.client_host, _trace_time(r.timestamp), f"{r.cost_time}ms", _trace_status(r),
                "-" if retry is None else retry)
        lines.append("")
    for v in result.by_type("EndTransaction"):
        r = v.record
        row("#Type", "#ProducerGroup", "#ClientHost", "#EndTime", "#State", "#FromCheck", "#TransactionId")
        row("EndTx", r.group_name, v.client_host, _trace_time(r.timestamp), r.transaction_state,
            str(r.from_transaction_check).lower(), r.transaction_id)
        lines.append("")
    return lines[:-1] if lines and not lines[-1] else lines


_TRACE_JSON_FIELDS = (("regionId", "region_id"), ("requestId", "request_id"), ("topic", "topic"), ("tags", "tags"),
                      ("keys", "keys"), ("storeHost", "store_host"), ("bodyLength", "body_length"),
                      ("costTime", "cost_time"), ("msgType", "msg_type"), ("offsetMsgId", "offset_msg_id"),
                      ("retryTimes", "retry_times"), ("contextCode", "context_code"),
                      ("transactionId", "transaction_id"), ("transactionState", "transaction_state"),
                      ("fromTransactionCheck", "from_transaction_check"), ("recordedClientHost", "client_host"))


def trace_json_line(view, retry_times: int | None = None) -> str:
    """One trace record (a `daemon.commands.trace.TraceView`) as JSON: TraceView's fields (`type`, `msgId`,
    `timestamp`, `groupName`, `clientHost`, `status`) and the record's others, named as the client names them,
    and the trace message it came from."""
    from daemon.commands.tracedata import consume_return_type  # noqa: PLC0415 - trace output only

    r = view.record
    out = {"type": r.trace_type, "msgId": r.msg_id, "timestamp": r.timestamp, "groupName": r.group_name,
           "clientHost": view.client_host}
    if r.success is not None:
        out["status"] = _trace_status(r)
    out.update({name: getattr(r, attr) for name, attr in _TRACE_JSON_FIELDS if getattr(r, attr) is not None})
    if r.context_code is not None:
        out["consumeReturnType"] = consume_return_type(r.context_code)
    if retry_times is not None and r.trace_type == "SubAfter":
        out["retryTimes"] = retry_times
    out["traceMessage"] = {"commitLogOffset": view.trace_offset, "msgId": view.trace_msg_id,
                           "storeTimestamp": view.trace_store_timestamp}
    return json.dumps(out, ensure_ascii=False)


def message_json_line(rec: MessageRecord, *, body: bool = False, body_path: str | None = None,
                      raw_body: bool = False) -> str:
    """`bodySize` and `bodyCRC` are the stored body's; `bodyCompression` (a compressed body only) says
    whether `body` and the saved file are decompressed."""
    m = message_json(rec)
    shown = shown_body(rec, raw_body)
    if shown.compression is not None:
        m["bodyCompression"] = shown.as_json()
    if body_path is not None:
        m["bodyPath"] = body_path
    if body:
        try:
            m["body"] = shown.data.decode("utf-8")
        except UnicodeDecodeError:
            import base64  # noqa: PLC0415 - only for bodies that are not text

            m["bodyBase64"] = base64.b64encode(shown.data).decode("ascii")
    return json.dumps(m, ensure_ascii=False)


def save_body(rec: MessageRecord, directory: str, raw_body: bool = False) -> str:
    """Write the body (decompressed, unless `raw_body`, as `shown_body` gives it) to DIRECTORY/<offset
    msgId> (mqadmin writes /tmp/rocketmq/msgbodys/<msgId>)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, create_offset_msg_id(rec.store_host, rec.physical_offset))
    with open(path, "wb") as f:
        f.write(shown_body(rec, raw_body).data)
    return path


__all__ = ["Body", "human_time", "key_table", "message_block", "message_json_line", "printable", "save_body",
           "shown_body", "trace_json_line", "trace_table"]
