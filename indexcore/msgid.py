"""Offset message ids (`MessageDecoder.createMessageId`): upper-case hex of store host + CommitLog offset.

    IPv4: address 4 + port 4 + offset 8 = 16 bytes = 32 hex digits
    IPv6: address 16 + port 4 + offset 8 = 28 bytes = 56 hex digits

Client msgIds, the UNIQ_KEY (`MessageClientIDSetter.createUniqID`), are as long: ip 4 (16) + pid 2 +
classloader hash 4 + time 4 + counter 2 = 16 (28) bytes; the 5.x clients' `MessageIdCodec` writes 34
digits (version 0x01 + mac 6 + pid 2 + seconds 4 + sequence 4 = 17 bytes).
"""

from __future__ import annotations

import struct

from indexcore.commitlog import Host

MSG_ID_V4_LENGTH = 2 * (4 + 4 + 8)
MSG_ID_V6_LENGTH = 2 * (16 + 4 + 8)
UNIQ_KEY_V5_LENGTH = 2 * (1 + 6 + 2 + 4 + 4)
MSG_ID_LENGTHS = (MSG_ID_V4_LENGTH, UNIQ_KEY_V5_LENGTH, MSG_ID_V6_LENGTH)
PORT_MAX = 0xFFFF
_PORT_AND_OFFSET = struct.Struct(">iq")
_HEX = frozenset("0123456789abcdefABCDEF")


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


def msg_id_shape_error(msg_id: str) -> str | None:
    """Why `msg_id` can be neither an offset msgId nor a client msgId (not hex, or no length either has),
    or None when it may be one."""
    if len(msg_id) in MSG_ID_LENGTHS and set(msg_id) <= _HEX:
        return None
    what = "not hexadecimal" if not set(msg_id) <= _HEX else f"{len(msg_id)} hex digits"
    return (f"{msg_id!r} is not a msgId ({what}): an offset msgId is {MSG_ID_V4_LENGTH} hex digits "
            f"(IPv4 store host + port + CommitLog offset) or {MSG_ID_V6_LENGTH} (IPv6); a client msgId, the "
            f"UNIQ_KEY, {MSG_ID_V4_LENGTH} ({MSG_ID_V6_LENGTH} from an IPv6 producer, {UNIQ_KEY_V5_LENGTH} from "
            f"a 5.x client)")
