"""The catalog's rows on their way from a decode task to a writer task: each window's rows, built by
`catalog.catalog_window`, staged as one Arrow IPC record batch message (`StagedMessages`, in the range's
`stage.CATALOG_DATA`), and read back by the writer of each (topic, day) as runs of a message's rows
(`read_groups`), the columns the message left out (`catalog.StagedForm`) made again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from daemon.backfill import catalog
from daemon.backfill.catalog import (
    BODY_FIELD,
    FULL_FORM,
    SCHEMA,
    StagedForm,
    _int64s,
    _nulls,
    msg_id_array,
    staged_schema,
)


class StagedMessages:
    """A range's staged catalog rows (`stage.CATALOG_DATA`): each window's record batch written as an Arrow
    IPC message straight from its buffers, and where it lies, for `read_record_batch`. (`serialize()` copied
    each window's ~2.4 MB into new memory before it was written.) A message carries no schema (the reader
    knows it, `read_groups`): a stream of its own per message cost 0.047 us a row against 0.035, and read back
    0.067 against 0.044. Written with one stream writer per schema, whose schema message (written before its
    first batch) lies between messages, unread."""

    def __init__(self, path: str):
        self._sink = pa.OSFile(path, "wb")
        self._streams: dict[pa.Schema, pa.ipc.RecordBatchStreamWriter] = {}

    def write(self, rows: pa.RecordBatch) -> tuple[int, int]:
        """Write one message; its byte offset and length."""
        stream = self._streams.get(rows.schema)
        if stream is None:
            stream = self._streams[rows.schema] = pa.ipc.new_stream(self._sink, rows.schema)
            stream.write_batch(rows.slice(0, 0))  # the schema goes out with the first batch: an empty one
        at = self._sink.tell()
        stream.write_batch(rows)
        return at, self._sink.tell() - at

    def close(self) -> None:
        if self._sink.closed:
            return
        try:
            for stream in self._streams.values():
                stream.close()
        finally:
            self._sink.close()


# Messages a writer keeps read (each ~5-7 KB of Arrow's structures over the staged file): 256 ranges of 16
# windows; past them a message is read again for each group.
PARSED_MESSAGES = 4096


def read_groups(pieces: Iterable[tuple[object, bytes, int, int | None, StagedForm]], with_body: bool,
                parsed: dict | None = None) -> Iterator[tuple[pa.Table, int]]:
    """The rows of a group's pieces in order, each (key, message, first row, rows (None: all), form): a group's
    rows of one window's message (`catalog.catalog_window`), the columns its form left out made again (the
    msgIds from the offsets and the store host, null real columns); with each table, its share of its
    messages' bytes (a slice's buffers are its message's: `nbytes` counts its own, at ~1 us a column a
    piece). Consecutive pieces of one form are read as one table of about ROW_GROUP_ROWS rows at most, its
    left-out columns made once: made for each piece (a window's group, ~2,400 rows of the 16M store) they
    cost 0.05-0.08 us a row more in write_catalog. `parsed`: messages read already, by key, to which this
    adds up to PARSED_MESSAGES (a writer reads each window's message once for all the groups it writes: a
    message read again cost 10 us, a slice of one read 2.6)."""
    batches: list[pa.RecordBatch] = []
    form, rows, size = FULL_FORM, 0, 0
    for key, blob, first, count, form_ in pieces:
        if batches and (form_ != form or rows >= catalog.ROW_GROUP_ROWS):
            yield _completed(batches, with_body, form), size
            batches, rows, size = [], 0, 0
        form = form_
        message = None if parsed is None else parsed.get(key)
        if message is None:
            message = pa.ipc.read_record_batch(pa.py_buffer(blob), staged_schema(with_body, form))
            if parsed is not None and len(parsed) < PARSED_MESSAGES:
                parsed[key] = message
        whole = first == 0 and count in (None, message.num_rows)
        batches.append(message if whole else message.slice(first, count))
        rows += batches[-1].num_rows
        size += len(blob) if whole else len(blob) * batches[-1].num_rows // max(message.num_rows, 1)
    if batches:
        yield _completed(batches, with_body, form), size


# Pieces of fewer rows than this on average are copied into one batch before they are written: a group of a
# CommitLog of many topics has a few rows in each window, and the Parquet writer pays for every piece of every
# column (200 topics, ~125 rows a piece: 1.94 us a row written as pieces, 1.06 copied; medians of 5).
SMALL_PIECE_ROWS = 512


def _completed(batches: list[pa.RecordBatch], with_body: bool, form: StagedForm) -> pa.Table:
    if len(batches) > 1 and sum(b.num_rows for b in batches) < SMALL_PIECE_ROWS * len(batches):
        batches = [pa.concat_batches(batches)]
    staged = pa.Table.from_batches(batches)
    if form == FULL_FORM:
        return staged
    host, real = form
    columns = dict(zip(staged.schema.names, staged.columns, strict=True))
    n = staged.num_rows
    if host is not None:
        offsets = [_int64s(b.column("commitLogOffset")) for b in batches]
        columns["msgId"] = pa.chunked_array([msg_id_array(offsets[0] if len(offsets) == 1 else np.concatenate(offsets),
                                                          host)])
    if not real:
        columns["realTopic"] = pa.chunked_array([_nulls(n, pa.string())])
        columns["realQueueId"] = pa.chunked_array([_nulls(n, pa.int32())])
    schema = SCHEMA.append(BODY_FIELD) if with_body else SCHEMA
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)
