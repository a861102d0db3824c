"""Offset message ids (`MessageDecoder.createMessageId`): upper-case hex of store host + CommitLog offset.

    IPv4: address 4 + port 4 + offset 8 = 16 bytes = 32 hex digits
    IPv6: address 16 + port 4 + offset 8 = 28 bytes = 56 hex digits
"""

from __future__ import annotations

import struct

from indexcore.commitlog import Host

MSG_ID_V4_LENGTH = 2 * (4 + 4 + 8)
MSG_ID_V6_LENGTH = 2 * (16 + 4 + 8)
_PORT_AND_OFFSET = struct.Struct(">iq")


def create_offset_msg_id(store_host: Host, commit_log_offset: int) -> str:
    return (store_host.address + _PORT_AND_OFFSET.pack(store_host.port, commit_log_offset)).hex().upper()


def decode_offset_msg_id(msg_id: str) -> tuple[Host, int]:
    """The store host and CommitLog offset of an offset msgId; ValueError if it is not one."""
    if len(msg_id) not in (MSG_ID_V4_LENGTH, MSG_ID_V6_LENGTH):
        raise ValueError(f"an offset msgId has {MSG_ID_V4_LENGTH} or {MSG_ID_V6_LENGTH} hex digits, "
                         f"not {len(msg_id)}")
    try:
        raw = bytes.fromhex(msg_id)
    except ValueError:
        raise ValueError(f"msgId {msg_id!r} is not hexadecimal") from None
    address = raw[:-_PORT_AND_OFFSET.size]
    port, offset = _PORT_AND_OFFSET.unpack(raw[-_PORT_AND_OFFSET.size:])
    return Host(address, port), offset
