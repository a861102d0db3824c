"""indexcore: RocketMQ 4.9.3 store formats, byte-exact, with no runtime machinery.

One module per on-disk format, each opening with its byte layout:
    commitlog      CommitLog records: layout constants, MessageRecord, properties, topics
    consumequeue   ConsumeQueue units, their placement in a queue's files, reading and scanning them
    indexfile      IndexFile header, slots and entries (IndexFile)
    checkpoint     the broker's 4096-byte StoreCheckpoint
    msgid          offset message ids

and the logic around them:
    queuefiles     ConsumeQueue: one queue's files (put, read, flush)
    queuerecovery  a queue's files put back to a consistent state (load, torn unit, truncate, retention)
    queuestore     ConsumeQueueStore: every queue of an output; a batch's units grouped by queue
    reader         CommitLog, CommitLogReader: batches from any offset; torn tail vs corruption
    readresult     what a read returns (ReadResult) and how a decoded window becomes it
    dispatch       DispatchBatch (columnar dispatch requests) and the dispatch rules
    indexservice   IndexService: rolling, naming, loading and querying IndexFiles
    indexbuild     IndexService's puts (build_index) and key queries (query_offset)
    indexresults   what IndexService hands back: query results, put statistics, resume point, truncation
    retention      which ConsumeQueue files and IndexFiles the broker deletes once the CommitLog shrinks
    javahash       Java String.hashCode over UTF-16, scalar and vectorised
    writer         CommitLogWriter: appends as the broker lays records out
    verify         existing ConsumeQueue and IndexFile files compared with what the dispatch rules write:
                   the findings; queuecheck and indexcheck (with indexcompare, indeximage) the two checks
    mappedfile     the pre-allocated, mapped file lifecycle shared by the formats
    errors         CorruptRecordError, StoreLayoutError
"""

import importlib

# name -> module; imported on first use, so that `import indexcore.commitlog` (a query, the config)
# does not load every format and numpy with it
_EXPORTS = {
    "CommitLog": "reader",
    "CommitLogReader": "reader",
    "CommitLogWriter": "writer",
    "ConsumeQueue": "queuefiles",
    "ConsumeQueueStore": "queuestore",
    "CorruptRecordError": "errors",
    "DispatchBatch": "dispatch",
    "IndexFile": "indexfile",
    "IndexService": "indexservice",
    "Message": "writer",
    "ReadResult": "reader",
    "ReadStatus": "reader",
    "StoreError": "errors",
    "StoreLayoutError": "errors",
}

__all__ = [
    "CommitLog", "CommitLogReader", "CommitLogWriter", "ConsumeQueue", "ConsumeQueueStore", "CorruptRecordError",
    "DispatchBatch", "IndexFile", "IndexService", "Message", "ReadResult", "ReadStatus", "StoreError",
    "StoreLayoutError",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'indexcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"indexcore.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
