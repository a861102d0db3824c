"""Typed errors of the store formats.

Expected outcomes (end of written data, a full IndexFile) are return values; these exceptions are for
broken invariants, and each names the file, the offset and the field at fault so an operator can look.
"""

from __future__ import annotations

# Every field a CorruptRecordError can name (its `field`): the CommitLog record fields a reader checks, and
# `properties.DELAY` for a delay level that is not a number, and the two LMQ multi-dispatch properties
# (`indexcore.multidispatch`), and the DLedger entry header's. Metrics count corruption by these names.
CORRUPT_RECORD_FIELDS = (
    "total_size", "magic_code", "body_crc", "body_length", "physical_offset", "topic_length", "topic",
    "properties_length", "properties", "properties.DELAY", "properties.INNER_MULTI_DISPATCH",
    "properties.INNER_MULTI_QUEUE_OFFSET",
    # a DLedger entry header (indexcore/dledger.py ENTRY_FIELDS)
    "entry.magic", "entry.size", "entry.pos", "entry.body_length",
)


class StoreError(Exception):
    """Base of every error raised by indexcore."""


class CorruptRecordError(StoreError):
    """A CommitLog record that can never become valid: bad magic, CRC mismatch, impossible size..."""

    def __init__(self, field: str, detail: str, *, path: str | None = None, offset: int | None = None):
        self.field = field
        self.detail = detail
        self.path = path
        self.offset = offset
        super().__init__(str(self))

    def located(self, path: str, offset: int) -> CorruptRecordError:
        """The same error, placed at an absolute CommitLog offset inside a segment file."""
        return CorruptRecordError(self.field, self.detail, path=path, offset=offset)

    def __str__(self) -> str:
        where = f"{self.path or '<buffer>'} @ offset {self.offset if self.offset is not None else '?'}"
        return f"corrupt record in {where}: field {self.field}: {self.detail}"

    def __reduce__(self):
        return (_rebuild_corrupt, (self.field, self.detail, self.path, self.offset))


def _rebuild_corrupt(field, detail, path, offset):
    return CorruptRecordError(field, detail, path=path, offset=offset)


class StoreLayoutError(StoreError):
    """A store directory or file that does not have the shape the broker gives it."""

    def __init__(self, path: str, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")

    def __reduce__(self):
        return (StoreLayoutError, (self.path, self.detail))


class CorruptEntryError(StoreLayoutError):
    """An entry of an output file (an IndexFile's header, slot or entry, a ConsumeQueue unit) that no
    writer can have left: a prev_index cycle, a link past indexCount, a unit pointing at no record. It
    names the file, the entry (`entry`: "entry 7", "slot 12", "header", "unit at queue offset 40") and the
    field, so a reader reports damage instead of looping or answering wrong. A StoreLayoutError, so every
    caller that reports one already reports this."""

    def __init__(self, path: str, entry: str, field: str, detail: str):
        self.entry = entry
        self.field = field
        super().__init__(path, f"{entry}: field {field}: {detail}")
        self.detail = detail

    def __reduce__(self):
        return (CorruptEntryError, (self.path, self.entry, self.field, self.detail))


class SizeMismatchError(StoreLayoutError):
    """A file whose size is not the one the configured store settings give it: most often settings that
    differ from the broker's (`mappedFileSizeCommitLog`, `mappedFileSizeConsumeQueue`, `maxHashSlotNum`
    and `maxIndexNum` are not stored in the files), so callers report it as a configuration error."""

    def __reduce__(self):
        return (SizeMismatchError, (self.path, self.detail))
