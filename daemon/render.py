"""How query results look: on a terminal, the layouts RocketMQ operators know from `mqadmin` (a table for
`queryMsgByKey`, one block of `Label: value` lines per message for `queryMsgById`); elsewhere, and with
`--json`, one JSON object per line (`daemon.query.message_json`, plus the body when asked for).

Times are local, with milliseconds, as mqadmin prints them (`UtilAll.timeMillisToHumanString2`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

from daemon.query import message_json
from indexcore.commitlog import (
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX,
    MessageRecord,
)
from indexcore.msgid import create_offset_msg_id

LABEL_WIDTH = 20  # mqadmin's "%-20s %s"
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


def message_block(rec: MessageRecord, *, body: bool = False, body_path: str | None = None) -> list[str]:
    """The lines mqadmin's `printMsg` shows for one message, plus the UNIQ_KEY and the body size."""
    props = rec.property_map()

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
    if body_path is not None:
        fields.append(("Message Body Path", body_path))
    lines = [f"{label + ':':<{LABEL_WIDTH}} {value}" for label, value in fields]
    if body:
        lines.append(f"{'Body:':<{LABEL_WIDTH}} {printable(rec.body.decode('utf-8', 'backslashreplace'))}")
    return lines


def key_table(messages: Iterable[MessageRecord]) -> list[str]:
    """mqadmin's `queryMsgByKey` table (`#Message ID  #QID  #Offset`), with the store time, the CommitLog
    offset and the keys added. The message id is the UNIQ_KEY, or the offset msgId when there is none,
    as the Java client's `MessageClientExt.getMsgId` gives it."""
    header = ("#Message ID", "#QID", "#Offset", "#Store Time", "#CommitLog Offset", "#Keys")
    rows = []
    for rec in messages:
        props = rec.property_map()
        msg_id = props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) or create_offset_msg_id(rec.store_host,
                                                                                           rec.physical_offset)
        rows.append((printable(msg_id), str(rec.queue_id), str(rec.queue_offset), human_time(rec.store_timestamp),
                     str(rec.physical_offset), printable(props.get(PROPERTY_KEYS, ""))))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    right = {1, 2, 4}  # numbers

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths,
                                                                                                  strict=True))]
        return "  ".join(cells).rstrip()

    return [line(header), *(line(r) for r in rows)]


def message_json_line(rec: MessageRecord, *, body: bool = False, body_path: str | None = None) -> str:
    m = message_json(rec)
    if body_path is not None:
        m["bodyPath"] = body_path
    if body:
        try:
            m["body"] = rec.body.decode("utf-8")
        except UnicodeDecodeError:
            import base64  # noqa: PLC0415 - only for bodies that are not text

            m["bodyBase64"] = base64.b64encode(rec.body).decode("ascii")
    return json.dumps(m, ensure_ascii=False)


def save_body(rec: MessageRecord, directory: str) -> str:
    """Write the body to DIRECTORY/<offset msgId> (mqadmin writes /tmp/rocketmq/msgbodys/<msgId>)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, create_offset_msg_id(rec.store_host, rec.physical_offset))
    with open(path, "wb") as f:
        f.write(rec.body)
    return path


__all__ = ["human_time", "key_table", "message_block", "message_json_line", "printable", "save_body"]
