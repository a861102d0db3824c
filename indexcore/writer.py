"""Appending to a CommitLog exactly as the broker's `DefaultAppendMessageCallback` lays records out.

Used by tests, demos and `reputd produce`: it assigns PHYSICALOFFSET and per-queue QUEUEOFFSETs,
stamps STORETIMESTAMP and BODYCRC, moves delayed messages to `SCHEDULE_TOPIC_XXXX` as 4.9.3's
`asyncPutMessage` does, and ends a segment with a BLANK record when a message plus the 8-byte blank
would not fit. With multi-dispatch on it adds INNER_MULTI_QUEUE_OFFSET to a message that names queues in
INNER_MULTI_DISPATCH, from the offset tables the broker keeps (`MultiDispatch.wrapMultiDispatch`). It
can also write what a 5.x broker writes: a trailing property separator, the `__CRC32#` property, and v2
records for topics over 127 bytes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from indexcore.commitlog import (
    BORNHOST_V6_FLAG,
    CRC32_RESERVED_LENGTH,
    DEFAULT_MAX_MESSAGE_SIZE,
    END_FILE_MIN_BLANK_LENGTH,
    MAX_TOPIC_LENGTH_V1,
    MESSAGE_MAGIC_CODE,
    MESSAGE_MAGIC_CODE_V2,
    PROPERTY_CRC32,
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    PROPERTY_SEPARATOR,
    SCHEDULE_TOPIC,
    STOREHOSTADDRESS_V6_FLAG,
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_NOT_TYPE,
    Host,
    MessageRecord,
    body_crc32,
    encode_blank,
    encode_crc32_property,
    encode_properties,
    transaction_type,
)
from indexcore.dispatch import DelayLevelTable, parse_java_int
from indexcore.mappedfile import MappedFile, is_temporary, offset_to_file_name
from indexcore.msgid import create_offset_msg_id
from indexcore.multidispatch import (
    LMQ_PREFIX,
    LMQ_QUEUE_ID,
    MULTI_DISPATCH_QUEUE_SPLITTER,
    PROPERTY_INNER_MULTI_DISPATCH,
    PROPERTY_INNER_MULTI_QUEUE_OFFSET,
    java_is_blank,
    java_split,
    multi_dispatch_flags,
)
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus

DEFAULT_STORE_HOST = Host(bytes([192, 0, 2, 1]), 10911)
DEFAULT_BORN_HOST = Host(bytes([192, 0, 2, 100]), 50000)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Message:
    """What a producer hands the broker; the writer fills in everything the broker decides."""

    topic: str
    queue_id: int
    body: bytes = b""
    properties: Mapping[str, str] = field(default_factory=dict)
    flag: int = 0
    sys_flag: int = 0
    born_timestamp: int | None = None
    born_host: Host = DEFAULT_BORN_HOST
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0


@dataclass(frozen=True, slots=True)
class AppendResult:
    phy_offset: int
    msg_size: int
    queue_offset: int
    store_timestamp: int
    msg_id: str
    topic: str
    queue_id: int


class CommitLogWriter:
    """Appends messages to a directory of CommitLog segments; reopens an existing log where it ends."""

    def __init__(self, directory: str, segment_size: int, *, clock: Callable[[], int] = wall_clock_ms,
                 store_host: Host = DEFAULT_STORE_HOST, delay_table: DelayLevelTable | None = None,
                 trailing_separator: bool = False, append_crc_property: bool = False, allow_v2: bool = False,
                 max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE, enable_multi_dispatch: bool = False,
                 enable_lmq: bool = False):
        self.directory = directory
        self.segment_size = segment_size
        self.clock = clock
        self.store_host = store_host
        self.delay_table = delay_table or DelayLevelTable()
        self.trailing_separator = trailing_separator
        self.append_crc_property = append_crc_property
        self.allow_v2 = allow_v2
        self.max_message_size = max_message_size
        self.enable_multi_dispatch = enable_multi_dispatch
        self.enable_lmq = enable_lmq
        self.queue_offsets: dict[tuple[str, int], int] = {}
        self.lmq_queue_offsets: dict[tuple[str, int], int] = {}  # CommitLog.lmqTopicQueueTable
        self._file: MappedFile | None = None
        self._file_start = 0
        self._pos = 0
        os.makedirs(directory, exist_ok=True)
        self._remove_stale_temporaries()
        self._recover()

    @property
    def max_offset(self) -> int:
        """The offset the next record will be written at (unless it rolls)."""
        return self._file_start + self._pos

    def _recover(self) -> None:
        """Find the end of the written data and the next queue offset of every queue."""
        log = CommitLog(self.directory, self.segment_size)
        if not log.segments:
            return
        reader = CommitLogReader(log, max_message_size=self.max_message_size,
                                 multi_flags=multi_dispatch_flags(self.enable_multi_dispatch, self.enable_lmq))
        offset = log.min_offset
        while True:
            res = reader.read(offset)
            b = res.batch
            mask = b.consume_queue_mask()
            for i in mask.nonzero()[0].tolist():
                self.queue_offsets[(b.topic_of(i), int(b.queue_id[i]))] = int(b.queue_offset[i]) + 1
            for t, q, o in zip(b.multi_topic_id.tolist(), b.multi_queue_id.tolist(), b.multi_queue_offset.tolist(),
                               strict=True):
                self._multi_table(b.topics[t])[(b.topics[t], q)] = o + 1
            offset = res.next_offset
            if res.status is not ReadStatus.OK:
                break
        reader.close()
        if res.status is ReadStatus.CORRUPT:
            raise res.error
        start = log.segment_start(offset)
        self._open(start)
        self._pos = offset - start
        torn_end = min(self.segment_size, self._pos + self.max_message_size + END_FILE_MIN_BLANK_LENGTH)
        self._file.write(self._pos, bytes(torn_end - self._pos))

    def _remove_stale_temporaries(self) -> None:
        """A segment a kill left half created beside the directory (`_open`) held nothing yet."""
        parent, prefix = os.path.split(os.path.abspath(self.directory))
        for name in os.listdir(parent):
            if name.startswith(f".{prefix}.") and is_temporary(name):
                os.unlink(os.path.join(parent, name))

    def _open(self, start: int) -> None:
        """Map the segment starting at `start`, creating it unless it exists (a broker pre-allocates). A new
        segment is built beside the CommitLog directory and renamed in complete: a daemon following the
        directory never sees a name the broker would not write."""
        if self._file is not None:
            self._file.flush()
            self._file.close()
        path = os.path.join(self.directory, offset_to_file_name(start))
        self._file = MappedFile(path, self.segment_size, create=not os.path.exists(path),
                                temp_dir=os.path.dirname(os.path.abspath(self.directory)))
        self._file_start = start
        self._pos = 0

    def _queue_offset(self, topic: str, queue_id: int, sys_flag: int) -> int:
        if transaction_type(sys_flag) in (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT_TYPE):
            return self.queue_offsets.get((topic, queue_id), 0)
        return 0

    def _delayed(self, msg: Message) -> tuple[str, int, dict[str, str]]:
        """4.9.3 `asyncPutMessage`: a DELAY level > 0 on a NOT/COMMIT message moves it to the schedule topic."""
        props = dict(msg.properties)
        level = parse_java_int(props.get(PROPERTY_DELAY_TIME_LEVEL, "")) or 0
        if level > 0 and transaction_type(msg.sys_flag) in (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT_TYPE):
            level = min(level, self.delay_table.max_level)
            props[PROPERTY_DELAY_TIME_LEVEL] = str(level)
            props[PROPERTY_REAL_TOPIC] = msg.topic
            props[PROPERTY_REAL_QUEUE_ID] = str(msg.queue_id)
            return SCHEDULE_TOPIC, level - 1, props
        return msg.topic, msg.queue_id, props

    def _multi_table(self, name: str) -> dict[tuple[str, int], int]:
        return self.lmq_queue_offsets if self.enable_lmq and name.startswith(LMQ_PREFIX) else self.queue_offsets

    def _multi_targets(self, props: dict[str, str], queue_id: int) -> list[tuple[tuple[str, int], int]]:
        """`wrapMultiDispatch`: each named queue's next offset, written to INNER_MULTI_QUEUE_OFFSET."""
        names = props.get(PROPERTY_INNER_MULTI_DISPATCH)
        if not self.enable_multi_dispatch or java_is_blank(names):
            return []
        keys = [(n, LMQ_QUEUE_ID if self.enable_lmq and n.startswith(LMQ_PREFIX) else queue_id)
                for n in java_split(names)]
        offsets = [self._multi_table(n).get((n, q), 0) for n, q in keys]
        props[PROPERTY_INNER_MULTI_QUEUE_OFFSET] = MULTI_DISPATCH_QUEUE_SPLITTER.join(map(str, offsets))
        return [(k, o) for k, o in zip(keys, offsets, strict=True)]

    def append(self, msg: Message) -> AppendResult:
        topic, queue_id, props = self._delayed(msg)
        targets = self._multi_targets(props, queue_id)
        props.pop(PROPERTY_CRC32, None)
        properties = encode_properties(props, trailing_separator=self.trailing_separator)
        if self.append_crc_property:
            if properties and not properties.endswith(PROPERTY_SEPARATOR):
                properties += PROPERTY_SEPARATOR
            properties += encode_crc32_property(0)
        topic_bytes = topic.encode("utf-8")
        magic = MESSAGE_MAGIC_CODE
        if len(topic_bytes) > MAX_TOPIC_LENGTH_V1:
            if not self.allow_v2:
                raise ValueError(f"topic of {len(topic_bytes)} bytes is over {MAX_TOPIC_LENGTH_V1} (4.9.3 rejects it)")
            magic = MESSAGE_MAGIC_CODE_V2
        record = self._new_record(msg, topic, queue_id, properties, magic)
        sys_flag, queue_offset, store_ts = record.sys_flag, record.queue_offset, record.store_timestamp
        size = record.total_size
        if size > self.max_message_size:
            raise ValueError(f"message of {size} bytes exceeds maxMessageSize {self.max_message_size}")
        if size + END_FILE_MIN_BLANK_LENGTH > self.segment_size:
            raise ValueError(f"message of {size} bytes plus an {END_FILE_MIN_BLANK_LENGTH}-byte BLANK does not fit "
                             f"a {self.segment_size}-byte segment")
        if self._file is None:
            self._open(0)
        if size + END_FILE_MIN_BLANK_LENGTH > self.segment_size - self._pos:
            self._file.write(self._pos, encode_blank(self.segment_size - self._pos))
            self._open(self._file_start + self.segment_size)
        phy = self._file_start + self._pos
        data = bytearray(dataclasses.replace(record, physical_offset=phy).encode())
        if self.append_crc_property:
            crc = body_crc32(bytes(data[: size - CRC32_RESERVED_LENGTH]))
            data[size - CRC32_RESERVED_LENGTH :] = encode_crc32_property(crc)
        self._file.write(self._pos, bytes(data))
        self._pos += size
        if transaction_type(sys_flag) in (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT_TYPE):
            self.queue_offsets[(topic, queue_id)] = queue_offset + 1
            for key, offset in targets:  # `updateMultiQueueOffset`: a repeated name moves on by one
                self._multi_table(key[0])[key] = offset + 1
        return AppendResult(phy, size, queue_offset, store_ts, create_offset_msg_id(self.store_host, phy),
                            topic, queue_id)

    def _new_record(self, msg: Message, topic: str, queue_id: int, properties: str, magic: int) -> MessageRecord:
        """The record as the store fills it in at append (host flags, queue offset, store time), its
        PHYSICALOFFSET left 0 for the caller, which knows where it goes."""
        sys_flag = msg.sys_flag & ~(BORNHOST_V6_FLAG | STOREHOSTADDRESS_V6_FLAG)
        sys_flag |= BORNHOST_V6_FLAG if msg.born_host.is_v6 else 0
        sys_flag |= STOREHOSTADDRESS_V6_FLAG if self.store_host.is_v6 else 0
        queue_offset = self._queue_offset(topic, queue_id, sys_flag)
        store_ts = self.clock()
        return MessageRecord(
            topic=topic, queue_id=queue_id, flag=msg.flag, queue_offset=queue_offset, physical_offset=0,
            sys_flag=sys_flag, born_timestamp=msg.born_timestamp if msg.born_timestamp is not None else store_ts,
            born_host=msg.born_host, store_timestamp=store_ts, store_host=self.store_host,
            reconsume_times=msg.reconsume_times, prepared_transaction_offset=msg.prepared_transaction_offset,
            body=msg.body, properties=properties, body_crc=body_crc32(msg.body), magic=magic,
        )

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None

    def __enter__(self) -> CommitLogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

