"""indexcore: RocketMQ 4.9.3 store formats, byte-exact, with no runtime machinery.

One module per on-disk format, each opening with its byte layout:
    commitlog      CommitLog records: layout constants, MessageRecord, properties, topics
    consumequeue   ConsumeQueue units and queues (ConsumeQueue, ConsumeQueueStore)
    indexfile      IndexFile header, slots and entries (IndexFile)
    checkpoint     the broker's 4096-byte StoreCheckpoint
    msgid          offset message ids

and the logic around them:
    reader         CommitLog, CommitLogReader: batches from any offset; torn tail vs corruption
    dispatch       DispatchBatch (columnar dispatch requests) and the dispatch rules
    indexservice   IndexService: rolling, naming, loading and querying IndexFiles
    javahash       Java String.hashCode over UTF-16, scalar and vectorised
    writer         CommitLogWriter: appends as the broker lays records out
    verify         existing ConsumeQueue and IndexFile files compared with what the dispatch rules write
    mappedfile     the pre-allocated, mapped file lifecycle shared by the formats
    errors         CorruptRecordError, StoreLayoutError
"""

from indexcore.consumequeue import ConsumeQueue, ConsumeQueueStore
from indexcore.dispatch import DispatchBatch
from indexcore.errors import CorruptRecordError, StoreError, StoreLayoutError
from indexcore.indexfile import IndexFile
from indexcore.indexservice import IndexService
from indexcore.reader import CommitLog, CommitLogReader, ReadResult, ReadStatus
from indexcore.writer import CommitLogWriter, Message

__all__ = [
    "CommitLog",
    "CommitLogReader",
    "CommitLogWriter",
    "ConsumeQueue",
    "ConsumeQueueStore",
    "CorruptRecordError",
    "DispatchBatch",
    "IndexFile",
    "IndexService",
    "Message",
    "ReadResult",
    "ReadStatus",
    "StoreError",
    "StoreLayoutError",
]
