"""A CommitLog record read in parts, without its body: its head (the fields up to BODYLENGTH) and its tail
(topic and properties, after the body). For the queries that need a record's store time or its TAGS only:
a binary search over store times reads one head per step, a tag count one head and one tail per message,
however large the bodies. The layout is indexcore/commitlog.py's; nothing here defines its own.

    head: fixed_part_struct(SYSFLAG) at the record's start, 88 to 112 bytes (IPv4 or IPv6 hosts), the
          first HEAD_READ_SIZE bytes of the record holding it whatever the hosts
    tail: [head + BODYLENGTH, TOTALSIZE): TOPICLENGTH, TOPIC, PROPERTIESLENGTH, PROPERTIES
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from indexcore.commitlog import (
    BORNHOST_V6_FLAG,
    ERR_BODY_LENGTH,
    ERR_FIXED_PART,
    ERR_MAGIC,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    RECORD_PREFIX,
    STOREHOSTADDRESS_V6_FLAG,
    SYS_FLAG_OFFSET,
    check_total_size,
    fixed_part_struct,
    locate_parts,
    record_error,
)
from indexcore.errors import CorruptRecordError

HEAD_READ_SIZE = fixed_part_struct(BORNHOST_V6_FLAG | STOREHOSTADDRESS_V6_FLAG).size  # 112: any record's head
_SYS_FLAG = struct.Struct(">i")


class RecordHead(NamedTuple):
    """The fields of a record's head a query uses; `body_at` is where its body starts in the record."""

    total_size: int
    magic: int
    queue_id: int
    queue_offset: int
    physical_offset: int
    sys_flag: int
    store_timestamp: int
    body_length: int
    body_at: int

    @property
    def tail_at(self) -> int:
        """Where the topic's length field starts, relative to the record's start."""
        return self.body_at + self.body_length


def decode_head(buf: bytes | memoryview, max_message_size: int) -> RecordHead:
    """The head at the start of `buf` (HEAD_READ_SIZE bytes, or all of a shorter record); CorruptRecordError
    (offset 0) when they are no message record's, with the checks MessageRecord.decode makes first."""
    if len(buf) < RECORD_PREFIX.size:
        raise CorruptRecordError("total_size", "fewer than 8 bytes left", offset=0)
    total, magic = RECORD_PREFIX.unpack_from(buf)
    try:
        if magic not in (MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2):
            raise record_error(ERR_MAGIC, magic)
        check_total_size(total, total, max_message_size)
        fixed = fixed_part_struct(_SYS_FLAG.unpack_from(buf, SYS_FLAG_OFFSET)[0]) if len(buf) >= SYS_FLAG_OFFSET + 4 \
            else None
        if fixed is None or total < fixed.size or len(buf) < fixed.size:
            raise record_error(ERR_FIXED_PART, total, fixed.size if fixed else HEAD_READ_SIZE)
        (_, _, _, queue_id, _, queue_offset, phy, sys_flag, _, _, _, store_ts, _, _, _, _,
         body_len) = fixed.unpack_from(buf)
        if body_len < 0 or fixed.size + body_len > total:
            raise record_error(ERR_BODY_LENGTH, body_len)
    except CorruptRecordError as e:
        raise CorruptRecordError(e.field, e.detail, offset=0) from None
    return RecordHead(total, magic, queue_id, queue_offset, phy, sys_flag, store_ts, body_len, fixed.size)


def decode_tail(tail: bytes | memoryview, magic: int) -> tuple[bytes, bytes]:
    """(topic, properties) as stored, from the bytes of a record after its body (`RecordHead.tail_at` to
    TOTALSIZE): the walk `locate_parts` makes, over an empty body."""
    topic_at, topic_len, props_at, props_len = locate_parts(tail, 0, 0, len(tail), magic, None)
    return bytes(tail[topic_at : topic_at + topic_len]), bytes(tail[props_at : props_at + props_len])


__all__ = ["HEAD_READ_SIZE", "RecordHead", "decode_head", "decode_tail"]
