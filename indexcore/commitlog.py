"""The CommitLog record format (RocketMQ 4.9.3, plus the 5.x v2 magic and trailing separators).

A segment is a pre-allocated file of `mappedFileSizeCommitLog` bytes holding records back to back; a
record never spans two files. All integers are big-endian. With B and S the born/store host lengths
(8 for IPv4 + port, 20 for IPv6 + port, chosen by SYSFLAG bits 4 and 5) and T the topic-length field
(1 byte for magic v1, 2 for v2):

    offset      size  field
    0           4     TOTALSIZE                 whole record, this field included
    4           4     MAGICCODE                 v1 0xDAA320A7, v2 0xDAA320AB, BLANK 0xCBD43194
    8           4     BODYCRC                   crc32(body) & 0x7FFFFFFF
    12          4     QUEUEID
    16          4     FLAG                      opaque user flag
    20          8     QUEUEOFFSET               unit index in the ConsumeQueue
    28          8     PHYSICALOFFSET            absolute CommitLog offset of the record
    36          4     SYSFLAG
    40          8     BORNTIMESTAMP
    48          B     BORNHOST                  address + port (int32)
    48+B        8     STORETIMESTAMP
    56+B        S     STOREHOST
    56+B+S      4     RECONSUMETIMES
    60+B+S      8     PREPARED TRANSACTION OFFSET
    68+B+S      4     BODYLENGTH (L)
    72+B+S      L     BODY
    72+B+S+L    T     TOPICLENGTH (K), signed
    ...         K     TOPIC (UTF-8)
    ...         2     PROPERTIESLENGTH (P), signed
    ...         P     PROPERTIES: name \\x01 value, joined by \\x02

    TOTALSIZE = 74 + B + S + T + L + K + P        (IPv4/IPv4, v1: 91 + L + K + P)

A segment ends with a BLANK record: TOTALSIZE = the bytes left in the file, the BLANK magic, and
nothing else written (at least 8 bytes), because a writer only appends a record of length n at
position p when n + 8 <= file size - p. Unwritten space is zeros from pre-allocation, so a TOTALSIZE
of 0 is where the written data ends; a crash can leave a record torn at that point.
"""

from __future__ import annotations

import struct
import unicodedata
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from indexcore.errors import CorruptRecordError

MESSAGE_MAGIC_CODE = -626843481  # 0xDAA320A7
MESSAGE_MAGIC_CODE_V2 = -626843477  # 0xDAA320AB, [5.x] 2-byte topic length
BLANK_MAGIC_CODE = -875286124  # 0xCBD43194
END_FILE_MIN_BLANK_LENGTH = 4 + 4

TOTAL_SIZE_OFFSET = 0
MAGIC_CODE_OFFSET = 4
BODY_CRC_OFFSET = 8
QUEUE_ID_OFFSET = 12
FLAG_OFFSET = 16
QUEUE_OFFSET_OFFSET = 20
PHYSICAL_OFFSET_OFFSET = 28
SYS_FLAG_OFFSET = 36
BORN_TIMESTAMP_OFFSET = 40
BORN_HOST_OFFSET = 48

RECORD_PREFIX = struct.Struct(">ii")  # TOTALSIZE, MAGICCODE
HOST_V4_LENGTH = 4 + 4
HOST_V6_LENGTH = 16 + 4
TOPIC_LENGTH_SIZE_V1 = 1
TOPIC_LENGTH_SIZE_V2 = 2
PROPERTIES_LENGTH = struct.Struct(">h")
TOPIC_LENGTH_V2 = struct.Struct(">h")
MAX_TOPIC_LENGTH_V1 = 127
MAX_TOPIC_NAME_BYTES = 255  # NAME_MAX: the topic is a directory name under consumequeue/
MAX_PROPERTIES_LENGTH = 32767
DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024
DEFAULT_MAPPED_FILE_SIZE_COMMIT_LOG = 1024 * 1024 * 1024
BODY_CRC_MASK = 0x7FFFFFFF  # BODYCRC keeps 31 bits of the CRC-32
_SIZE_CONSTANT = 74  # TOTALSIZE minus the two hosts, the topic-length field, body, topic and properties

# SYSFLAG bits (MessageSysFlag)
COMPRESSED_FLAG = 0x1
COMPRESSION_TYPE_MASK = 0x7 << 8  # 5.x: the codec of a COMPRESSED_FLAG body; 0 (4.x) and 3 are zlib
COMPRESSION_TYPE_SHIFT = 8
COMPRESSION_TYPES = {0: "zlib", 1: "lz4", 2: "zstd", 3: "zlib"}
MULTI_TAGS_FLAG = 0x2
TRANSACTION_TYPE_MASK = 0xC
TRANSACTION_NOT_TYPE = 0x0
TRANSACTION_PREPARED_TYPE = 0x4
TRANSACTION_COMMIT_TYPE = 0x8
TRANSACTION_ROLLBACK_TYPE = 0xC
BORNHOST_V6_FLAG = 0x10
STOREHOSTADDRESS_V6_FLAG = 0x20

# Properties (MessageDecoder / MessageConst)
NAME_VALUE_SEPARATOR = b"\x01"
PROPERTY_SEPARATOR = b"\x02"
PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX = "UNIQ_KEY"
PROPERTY_DELAY_TIME_LEVEL = "DELAY"
PROPERTY_REAL_TOPIC = "REAL_TOPIC"
PROPERTY_REAL_QUEUE_ID = "REAL_QID"
PROPERTY_WAIT_STORE_MSG_OK = "WAIT"
PROPERTY_CRC32 = "__CRC32#"  # [5.x] enabledAppendPropCRC
KEY_SEPARATOR = " "
CRC32_PROPERTY_DIGITS = 10
CRC32_RESERVED_LENGTH = len(PROPERTY_CRC32) + 1 + CRC32_PROPERTY_DIGITS + 1  # 20

SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"


def fixed_part_struct(sys_flag: int) -> struct.Struct:
    """Struct of fields 1 to 15a (up to and including BODYLENGTH) for the record's host kinds."""
    return _FIXED_PARTS[sys_flag & (BORNHOST_V6_FLAG | STOREHOSTADDRESS_V6_FLAG)]


def _fixed_struct(born_v6: bool, store_v6: bool) -> struct.Struct:
    born = "16si" if born_v6 else "4si"
    store = "16si" if store_v6 else "4si"
    return struct.Struct(f">iiiiiqqiq{born}q{store}iqi")


_FIXED_PARTS = {
    flags: _fixed_struct(bool(flags & BORNHOST_V6_FLAG), bool(flags & STOREHOSTADDRESS_V6_FLAG))
    for flags in (0, BORNHOST_V6_FLAG, STOREHOSTADDRESS_V6_FLAG, BORNHOST_V6_FLAG | STOREHOSTADDRESS_V6_FLAG)
}
MIN_RECORD_SIZE = _SIZE_CONSTANT + 2 * HOST_V4_LENGTH + TOPIC_LENGTH_SIZE_V1  # 91: empty body, topic, properties


def host_length(sys_flag: int, v6_bit: int) -> int:
    return HOST_V6_LENGTH if sys_flag & v6_bit else HOST_V4_LENGTH


def record_size(sys_flag: int, magic: int, body_length: int, topic_length: int, properties_length: int) -> int:
    """`CommitLog.calMsgLength`: the TOTALSIZE a record with these parts must declare."""
    t = TOPIC_LENGTH_SIZE_V2 if magic == MESSAGE_MAGIC_CODE_V2 else TOPIC_LENGTH_SIZE_V1
    return (
        _SIZE_CONSTANT
        + host_length(sys_flag, BORNHOST_V6_FLAG)
        + host_length(sys_flag, STOREHOSTADDRESS_V6_FLAG)
        + t
        + max(body_length, 0)
        + topic_length
        + max(properties_length, 0)
    )


def body_crc32(body: bytes | memoryview) -> int:
    """BODYCRC as the broker stores it: CRC-32 (IEEE) with the top bit cleared."""
    return zlib.crc32(body) & BODY_CRC_MASK


def transaction_type(sys_flag: int) -> int:
    return sys_flag & TRANSACTION_TYPE_MASK


# --- topics -------------------------------------------------------------------------------------------

def check_topic(raw: bytes, magic: int = MESSAGE_MAGIC_CODE) -> str:
    """Decode a stored topic, refusing names that are unsafe as a directory name.

    The topic becomes `consumequeue/{topic}/`, so a stored `../x`, a slash, a NUL or a control character
    must never reach the file system, nor may `.` or `..` as the whole name. Dots inside a name are
    ordinary: the broker stores an LMQ named `%LMQ%v2..double.dot` in a directory of that name.
    Raises CorruptRecordError(field="topic").
    """
    if not raw:
        raise CorruptRecordError("topic", "empty topic")
    if magic != MESSAGE_MAGIC_CODE_V2 and len(raw) > MAX_TOPIC_LENGTH_V1:
        raise CorruptRecordError("topic", f"{len(raw)} bytes, over the v1 limit of {MAX_TOPIC_LENGTH_V1}")
    try:
        topic = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptRecordError("topic", f"not valid UTF-8: {raw!r}") from None
    if len(raw) > MAX_TOPIC_NAME_BYTES:
        raise CorruptRecordError("topic", f"{len(raw)} bytes, over the {MAX_TOPIC_NAME_BYTES} of a directory name")
    if "/" in topic or "\\" in topic:
        raise CorruptRecordError("topic", f"path separator in topic {topic!r}")
    if topic in (".", ".."):
        raise CorruptRecordError("topic", f"topic {topic!r} names a directory itself, not one of its own")
    if any(unicodedata.category(c) == "Cc" for c in topic):  # C0, DEL and C1
        raise CorruptRecordError("topic", f"NUL or control character in topic {topic!r}")
    return topic


# --- properties ---------------------------------------------------------------------------------------

def encode_properties(items: Mapping[str, str] | Iterable[tuple[str, str]], *, trailing_separator: bool = False
                      ) -> bytes:
    """`messageProperties2String`: 4.9 writers drop the final separator, 5.x writers keep it."""
    pairs = items.items() if isinstance(items, Mapping) else items
    parts = [f"{k}\x01{v}".encode() for k, v in pairs if v is not None]
    out = PROPERTY_SEPARATOR.join(parts)
    if trailing_separator and parts:
        out += PROPERTY_SEPARATOR
    return out


def parse_properties(raw: bytes) -> dict[str, str]:
    """`string2messageProperties`: segments without a name, a separator or a value are skipped; last wins."""
    out: dict[str, str] = {}
    for segment in raw.split(PROPERTY_SEPARATOR):
        i = segment.find(NAME_VALUE_SEPARATOR)
        if 0 < i < len(segment) - 1:
            out[segment[:i].decode("utf-8", "replace")] = segment[i + 1 :].decode("utf-8", "replace")
    return out


def find_properties(raw: bytes, names: Mapping[bytes, int]) -> list[bytes | None]:
    """The raw values `parse_properties` would give the wanted names, in one pass and without decoding.

    `names` maps each wanted name to its slot in the result; a segment counts only with a non-empty name
    before its first separator and a non-empty value after it, and the last one of a name wins.
    """
    out: list[bytes | None] = [None] * len(names)
    for segment in raw.split(PROPERTY_SEPARATOR):
        name, _, value = segment.partition(NAME_VALUE_SEPARATOR)
        slot = names.get(name)
        if slot is not None and value:
            out[slot] = value
    return out


def encode_crc32_property(value: int) -> bytes:
    """[5.x] `__CRC32#` entry: ten digits, least significant first."""
    digits = "".join(str((value // 10**i) % 10) for i in range(CRC32_PROPERTY_DIGITS))
    return f"{PROPERTY_CRC32}\x01{digits}\x02".encode("ascii")


def decode_crc32_digits(digits: str) -> int:
    return int(digits[::-1])


PHYSICAL_OFFSET = struct.Struct(">q")
RECORD_START_SIZE = PHYSICAL_OFFSET_OFFSET + PHYSICAL_OFFSET.size  # the bytes that tell a record's start


def is_record_start(head: bytes | memoryview, offset: int) -> bool:
    """Whether `head`, the RECORD_START_SIZE bytes at CommitLog `offset`, begin a message record: a message
    magic code and a PHYSICALOFFSET naming `offset`, which the broker writes into every record. A position
    inside a record, or in a BLANK or unwritten space, fails one or the other."""
    if len(head) < RECORD_START_SIZE:
        return False
    magic = RECORD_PREFIX.unpack_from(head)[1]
    return (magic in (MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2)
            and PHYSICAL_OFFSET.unpack_from(head, PHYSICAL_OFFSET_OFFSET)[0] == offset)


# --- hosts --------------------------------------------------------------------------------------------

class Host(NamedTuple):
    """A born or store host: 4 or 16 address bytes and a port."""

    address: bytes
    port: int

    @classmethod
    def parse(cls, text: str) -> Host:
        """`192.0.2.1:10911` or `[2001:db8::1]:10911`."""
        import ipaddress  # noqa: PLC0415 - see __str__

        addr, _, port = text.rpartition(":")
        ip = ipaddress.ip_address(addr.strip("[]"))
        return cls(ip.packed, int(port))

    @property
    def is_v6(self) -> bool:
        return len(self.address) == 16

    def __str__(self) -> str:
        if len(self.address) == 4:
            return f"{'.'.join(map(str, self.address))}:{self.port}"
        # ipaddress only for IPv6 (its import is a good part of a `reputd query`'s start-up)
        import ipaddress  # noqa: PLC0415

        return f"[{ipaddress.ip_address(self.address)}]:{self.port}"


# --- whole records ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MessageRecord:
    """One CommitLog message record, every field as stored. Encoding and decoding do no I/O."""

    topic: str
    queue_id: int
    flag: int
    queue_offset: int
    physical_offset: int
    sys_flag: int
    born_timestamp: int
    born_host: Host
    store_timestamp: int
    store_host: Host
    reconsume_times: int
    prepared_transaction_offset: int
    body: bytes
    properties: bytes
    body_crc: int
    magic: int = MESSAGE_MAGIC_CODE

    @property
    def topic_bytes(self) -> bytes:
        return self.topic.encode("utf-8")

    @property
    def total_size(self) -> int:
        return record_size(self.sys_flag, self.magic, len(self.body), len(self.topic_bytes), len(self.properties))

    def property_map(self) -> dict[str, str]:
        return parse_properties(self.properties)

    def encode(self) -> bytes:
        topic = self.topic_bytes
        head = fixed_part_struct(self.sys_flag).pack(
            self.total_size, self.magic, self.body_crc, self.queue_id, self.flag, self.queue_offset,
            self.physical_offset, self.sys_flag, self.born_timestamp, *self.born_host, self.store_timestamp,
            *self.store_host, self.reconsume_times, self.prepared_transaction_offset, len(self.body),
        )
        if self.magic == MESSAGE_MAGIC_CODE_V2:
            topic_length = TOPIC_LENGTH_V2.pack(len(topic))
        else:
            topic_length = bytes([len(topic)])
        return b"".join(
            (head, self.body, topic_length, topic, PROPERTIES_LENGTH.pack(len(self.properties)), self.properties)
        )

    @classmethod
    def decode(cls, buf: bytes | memoryview, pos: int = 0, *, check_crc: bool = True,
               max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> MessageRecord:
        """Decode the message record at `pos`; CorruptRecordError (offset = `pos`) if it is not one."""
        try:
            return _decode(cls, buf, pos, check_crc, max_message_size)
        except CorruptRecordError as e:
            raise CorruptRecordError(e.field, e.detail, offset=pos) from None


# What can be wrong with a record: the code the batch decoder reports, and the field and message of the
# CorruptRecordError it becomes (the single-record decoder raises the same ones).
ERR_NO_BLANK = 1
ERR_BLANK_SIZE = 2
ERR_MAGIC = 3
ERR_TOTAL_SMALL = 4
ERR_TOTAL_MAX = 5
ERR_TOTAL_PAST = 6
ERR_PHYSICAL_OFFSET = 7
ERR_BODY_LENGTH = 8
ERR_BODY_CRC = 9
ERR_TOPIC_LENGTH_END = 10
ERR_TOPIC_LENGTH = 11
ERR_PROPERTIES_LENGTH = 12
ERR_PARTS = 13
ERR_FIXED_PART = 14
RECORD_ERRORS = {
    ERR_NO_BLANK: ("total_size", "segment ends without a BLANK record"),
    ERR_BLANK_SIZE: ("total_size", "BLANK record declares {} bytes, {} are left"),
    ERR_MAGIC: ("magic_code", "0x{:08X} is not a message magic code"),
    ERR_TOTAL_SMALL: ("total_size", "{} is below the smallest record (" + str(MIN_RECORD_SIZE) + ")"),
    ERR_TOTAL_MAX: ("total_size", "{} exceeds maxMessageSize {}"),
    ERR_TOTAL_PAST: ("total_size", "{} runs past the end of the segment ({} left)"),
    ERR_PHYSICAL_OFFSET: ("physical_offset", "record says {}, it lies at {}"),
    ERR_BODY_LENGTH: ("body_length", "{} does not fit in the record"),
    ERR_BODY_CRC: ("body_crc", "stored {}, body hashes to {}"),
    ERR_TOPIC_LENGTH_END: ("topic_length", "record ends inside the topic length"),
    ERR_TOPIC_LENGTH: ("topic_length", "{} does not fit in the record"),
    ERR_PROPERTIES_LENGTH: ("properties_length", "{} does not fit in the record"),
    ERR_PARTS: ("total_size", "its parts end {} bytes before TOTALSIZE does"),
    ERR_FIXED_PART: ("total_size", "{} bytes cannot hold the {}-byte fixed part its SYSFLAG host bits imply"),
}


def record_error(code: int, *args: int) -> CorruptRecordError:
    field, template = RECORD_ERRORS[code]
    if code == ERR_MAGIC:
        args = (args[0] & 0xFFFFFFFF,)
    return CorruptRecordError(field, template.format(*args))


def check_total_size(total: int, available: int, max_message_size: int) -> None:
    """Bounds on TOTALSIZE before it is trusted: at least a minimal record, at most what is there."""
    if total < MIN_RECORD_SIZE:
        raise record_error(ERR_TOTAL_SMALL, total)
    if total > max_message_size:
        raise record_error(ERR_TOTAL_MAX, total, max_message_size)
    if total > available:
        raise record_error(ERR_TOTAL_PAST, total, available)


SIGNED_BYTE = tuple(struct.unpack(">256b", bytes(range(256))))  # the v1 TOPICLENGTH is a Java byte


def locate_parts(buf, body_at: int, body_len: int, end: int, magic: int, body_crc: int | None
                 ) -> tuple[int, int, int, int]:
    """Walk BODY, TOPIC and PROPERTIES of the record ending at `end`: each length must fit, the body must
    match `body_crc` (None: not checked; an empty body never is, as in Java), and the parts must fill the
    record exactly. Returns (topic_at, topic_len, properties_at, properties_len). The whole-record decoder
    relies on this walk, and the batch decoder in C (`_kernels.c`) makes the same checks in the same order;
    pass a memoryview to checksum the body without copying it."""
    if body_len < 0 or body_at + body_len > end:
        raise record_error(ERR_BODY_LENGTH, body_len)
    p = body_at + body_len
    if body_crc is not None and body_len > 0:
        actual = zlib.crc32(buf[body_at:p]) & BODY_CRC_MASK
        if actual != body_crc:
            raise record_error(ERR_BODY_CRC, body_crc, actual)
    if magic == MESSAGE_MAGIC_CODE:
        if p + TOPIC_LENGTH_SIZE_V1 > end:
            raise record_error(ERR_TOPIC_LENGTH_END)
        topic_len = SIGNED_BYTE[buf[p]]
        p += TOPIC_LENGTH_SIZE_V1
    else:
        if p + TOPIC_LENGTH_SIZE_V2 > end:
            raise record_error(ERR_TOPIC_LENGTH_END)
        topic_len = TOPIC_LENGTH_V2.unpack_from(buf, p)[0]
        p += TOPIC_LENGTH_SIZE_V2
    if topic_len <= 0 or p + topic_len + PROPERTIES_LENGTH.size > end:
        raise record_error(ERR_TOPIC_LENGTH, topic_len)
    topic_at = p
    p += topic_len
    props_len = PROPERTIES_LENGTH.unpack_from(buf, p)[0]
    p += PROPERTIES_LENGTH.size
    if props_len < 0 or p + props_len > end:
        raise record_error(ERR_PROPERTIES_LENGTH, props_len)
    if p + props_len != end:
        raise record_error(ERR_PARTS, end - p - props_len)
    return topic_at, topic_len, p, props_len


def _decode(cls, buf, pos: int, check_crc: bool, max_message_size: int) -> MessageRecord:
    if len(buf) - pos < RECORD_PREFIX.size:
        raise CorruptRecordError("total_size", "fewer than 8 bytes left")
    total, magic = RECORD_PREFIX.unpack_from(buf, pos)
    if magic not in (MESSAGE_MAGIC_CODE, MESSAGE_MAGIC_CODE_V2):
        raise record_error(ERR_MAGIC, magic)
    check_total_size(total, len(buf) - pos, max_message_size)
    sys_flag = struct.unpack_from(">i", buf, pos + SYS_FLAG_OFFSET)[0]
    fixed = fixed_part_struct(sys_flag)
    if total < fixed.size:
        raise record_error(ERR_FIXED_PART, total, fixed.size)
    (_, _, crc, queue_id, flag, queue_offset, phy, _, born_ts, born_addr, born_port, store_ts, store_addr,
     store_port, reconsume, prepared, body_len) = fixed.unpack_from(buf, pos)
    body_at = pos + fixed.size
    topic_at, topic_len, props_at, props_len = locate_parts(buf, body_at, body_len, pos + total, magic,
                                                            crc if check_crc else None)
    body = bytes(buf[body_at : body_at + body_len])
    topic = check_topic(bytes(buf[topic_at : topic_at + topic_len]), magic)
    props = bytes(buf[props_at : props_at + props_len])
    return cls(topic, queue_id, flag, queue_offset, phy, sys_flag, born_ts, Host(born_addr, born_port),
               store_ts, Host(store_addr, store_port), reconsume, prepared, body, props, crc, magic)


def encode_blank(remaining: int) -> bytes:
    """The 8 bytes of a BLANK record filling the `remaining` bytes at the end of a segment."""
    return RECORD_PREFIX.pack(remaining, BLANK_MAGIC_CODE)
