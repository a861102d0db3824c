"""The DLedger on-disk format: a RocketMQ 4.9.3 CommitLog kept as a DLedger (Raft) log (DLedger 0.2.3).

With `enableDLegerCommitLog=true` the broker's CommitLog is `<storePathRootDir>/dledger-<selfId>/data/`
(DLedgerConfig.getDataStorePath; there is no `commitlog/`): files of `mappedFileSizeCommitLog` bytes named
by their 20-digit start offset, each holding DLedger entries back to back. All integers are big-endian
(DLedgerEntryCoder):

    offset  size  field
    0       4     magic      1 (DLedgerMmapFileStore.MAGIC_1)
    4       4     size       the whole entry: 48 + bodyLen
    8       8     index      0, 1, 2, ... without gaps
    16      8     term       the leader's term, never decreasing
    24      8     pos        the entry's own absolute offset
    32      4     channel    0 (reserved in 0.2.3)
    36      4     chainCrc   0 (never set in 0.2.3)
    40      4     bodyCrc    0 (never set in 0.2.3)
    44      4     bodyLen
    48      ...   body       one ordinary CommitLog message (commitlog.py), TOTALSIZE = bodyLen

Every store offset the broker hands out (ConsumeQueue phyOffset, IndexFile phyOffset, PHYSICALOFFSET,
msgIds) is the entry's pos + 48; reput offsets are entry positions, and the next one is pos + 48 +
TOTALSIZE. An entry moves to the next file when `size + 8 > bytes left`; the rest of the file is the
DLedger BLANK `int -1, int bytes left` (magic first: the reverse of the CommitLog BLANK).

The store dispatches only committed entries (DLedgerCommitLog.getMaxOffset = committedPos):
`dledger-<selfId>/checkpoint` holds `committedIndex` and `endIndex` as Java properties, and committedPos is
the end (pos + size) of the committed entry, which DLedger finds through its index file `index/`: one
32-byte unit per entry at byte 32 * index (`magic i32, pos i64, size i32, index i64, term i64`).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import NamedTuple

from indexcore import _kernels
from indexcore.errors import CorruptRecordError, StoreLayoutError
from indexcore.mappedfile import list_queue_files, offset_to_file_name

# --- layout ---------------------------------------------------------------------------------------------
ENTRY_MAGIC = 1  # DLedgerMmapFileStore.MAGIC_1 = CURRENT_MAGIC
ENTRY_HEADER = struct.Struct(">iiqqqiiii")  # magic, size, index, term, pos, channel, chainCrc, bodyCrc, bodyLen
ENTRY_HEADER_SIZE = 48  # DLedgerEntry.BODY_OFFSET: every store offset is entry pos + this
MAGIC_OFFSET = 0
SIZE_OFFSET = 4
INDEX_OFFSET = 8
TERM_OFFSET = 16
POS_OFFSET = 24
CHANNEL_OFFSET = 32
CHAIN_CRC_OFFSET = 36
BODY_CRC_OFFSET = 40
BODY_LENGTH_OFFSET = 44
BLANK_MAGIC = -1  # MmapFileList.BLANK_MAGIC_CODE
BLANK = struct.Struct(">ii")  # int -1, int bytes left
MIN_BLANK_LENGTH = 8  # MmapFileList.MIN_BLANK_LEN: an entry moves on when size + 8 > bytes left
INDEX_UNIT = struct.Struct(">iqiqq")  # magic, pos, size, index, term
INDEX_UNIT_SIZE = 32  # DLedgerMmapFileStore.INDEX_UNIT_SIZE
INDEX_FILE_SIZE = INDEX_UNIT_SIZE * 5 * 1024 * 1024  # DLedgerConfig.mappedFileSizeForEntryIndex, 4.9.3 keeps it
CHECKPOINT_FILE = "checkpoint"
CHECKPOINT_BAK_SUFFIX = ".bak"  # IOUtils.string2File keeps the previous content there
COMMITTED_INDEX_KEY = "committedIndex"
END_INDEX_KEY = "endIndex"
DATA_DIR = "data"
INDEX_DIR = "index"
HOME_PREFIX = "dledger-"

assert ENTRY_HEADER.size == ENTRY_HEADER_SIZE == _kernels.DLEDGER_HEADER_SIZE
assert INDEX_UNIT.size == INDEX_UNIT_SIZE

DLEDGER_ENTRIES = _kernels.DLEDGER_ENTRIES  # the decode flag: records sit in DLedger entries


def home_dir(store_path_root_dir: str, self_id: str) -> str:
    """`DLedgerConfig.getDefaultPath`: `<storeBaseDir>/dledger-<selfId>` (DLedgerCommitLog sets storeBaseDir to
    storePathRootDir)."""
    return os.path.join(store_path_root_dir, HOME_PREFIX + self_id)


def data_dir(store_path_root_dir: str, self_id: str) -> str:
    return os.path.join(home_dir(store_path_root_dir, self_id), DATA_DIR)


def index_dir(store_path_root_dir: str, self_id: str) -> str:
    return os.path.join(home_dir(store_path_root_dir, self_id), INDEX_DIR)


# --- errors ---------------------------------------------------------------------------------------------

class CorruptEntryHeaderError(CorruptRecordError):
    """A DLedger entry header that no DLedger writer leaves: one line naming the data file, the entry's
    offset and the header field."""

    def located(self, path: str, offset: int) -> CorruptEntryHeaderError:
        return CorruptEntryHeaderError(self.field, self.detail, path=path, offset=offset)

    def __str__(self) -> str:
        where = f"{self.path or '<buffer>'} @ {self.offset if self.offset is not None else '?'}"
        return f"{where}: {self.detail}"

    def __reduce__(self):
        return (_rebuild_entry_error, (self.field, self.detail, self.path, self.offset))


def _rebuild_entry_error(field, detail, path, offset):
    return CorruptEntryHeaderError(field, detail, path=path, offset=offset)


# the fields a CorruptEntryHeaderError names (errors.CORRUPT_RECORD_FIELDS lists them for the metrics)
ENTRY_FIELDS = ("entry.magic", "entry.size", "entry.pos", "entry.body_length")

# the kernel's codes for a bad entry header (`_kernels.c`, DLEDGER_ENTRIES), field and message
ENTRY_ERRORS = {
    _kernels.ERR_ENTRY_NO_BLANK: ("entry.size", "data file ends without a DLedger BLANK (fewer than 8 bytes left)"),
    _kernels.ERR_ENTRY_BLANK_SIZE: ("entry.size", "DLedger BLANK declares {} bytes left, {} are left"),
    _kernels.ERR_ENTRY_MAGIC: ("entry.magic", "entry magic field {} is not 1 (nor the BLANK -1)"),
    _kernels.ERR_ENTRY_SIZE: ("entry.size", "entry size field {} is not a possible entry size ({} bytes left)"),
    _kernels.ERR_ENTRY_POS: ("entry.pos", "entry pos field {} does not match the entry's offset {}"),
    _kernels.ERR_ENTRY_BODY_LENGTH: ("entry.body_length", "entry bodyLen field {} is not size - 48 = {}"),
    _kernels.ERR_ENTRY_TOTAL_SIZE: ("entry.body_length",
                                    "the message's TOTALSIZE {} is not the entry's bodyLen {}"),
}


def entry_error(code: int, *args: int) -> CorruptEntryHeaderError:
    field, template = ENTRY_ERRORS[code]
    return CorruptEntryHeaderError(field, template.format(*args))


# --- entries --------------------------------------------------------------------------------------------

class EntryHeader(NamedTuple):
    magic: int
    size: int
    index: int
    term: int
    pos: int
    channel: int
    chain_crc: int
    body_crc: int
    body_length: int

    @property
    def message_offset(self) -> int:
        """The store offset of the message inside: what ConsumeQueue, IndexFile and msgId hold."""
        return self.pos + ENTRY_HEADER_SIZE

    @property
    def end(self) -> int:
        return self.pos + self.size


def decode_entry_header(buf, at: int, offset: int, *, path: str | None = None,
                        bytes_left: int | None = None) -> EntryHeader:
    """The entry header at `at` of `buf`, which lies at absolute `offset`, checked as DLedger's recovery
    checks it (magic 1, pos = its offset, size = bodyLen + 48, room in the file); CorruptEntryHeaderError
    otherwise. A DLedger BLANK is not an entry: callers look for it first (`is_blank`)."""
    left = len(buf) - at if bytes_left is None else bytes_left
    if min(left, len(buf) - at) < ENTRY_HEADER_SIZE:  # the room in the file, or what a short read holds
        left = min(left, len(buf) - at)
        raise CorruptEntryHeaderError("entry.size", f"only {left} bytes left, an entry header is {ENTRY_HEADER_SIZE}",
                                      path=path, offset=offset)
    h = EntryHeader._make(ENTRY_HEADER.unpack_from(buf, at))
    if h.magic != ENTRY_MAGIC:
        raise entry_error(_kernels.ERR_ENTRY_MAGIC, h.magic).located(path, offset)
    if not ENTRY_HEADER_SIZE < h.size <= left:
        raise entry_error(_kernels.ERR_ENTRY_SIZE, h.size, left).located(path, offset)
    if h.pos != offset:
        raise entry_error(_kernels.ERR_ENTRY_POS, h.pos, offset).located(path, offset)
    if h.body_length != h.size - ENTRY_HEADER_SIZE:
        raise entry_error(_kernels.ERR_ENTRY_BODY_LENGTH, h.body_length, h.size - ENTRY_HEADER_SIZE).located(
            path, offset)
    return h


def is_blank(buf, at: int) -> bool:
    return len(buf) - at >= BLANK.size and BLANK.unpack_from(buf, at)[0] == BLANK_MAGIC


def is_unwritten(buf, at: int) -> bool:
    return len(buf) - at < BLANK.size or BLANK.unpack_from(buf, at) == (0, 0)


def encode_entry(index: int, term: int, pos: int, body: bytes) -> bytes:
    """A DLedger entry as DLedgerEntryCoder.encode writes it in 0.2.3 (channel and both CRCs 0)."""
    size = ENTRY_HEADER_SIZE + len(body)
    return ENTRY_HEADER.pack(ENTRY_MAGIC, size, index, term, pos, 0, 0, 0, len(body)) + body


def encode_blank(bytes_left: int) -> bytes:
    return BLANK.pack(BLANK_MAGIC, bytes_left)


def encode_index_unit(header: EntryHeader) -> bytes:
    return INDEX_UNIT.pack(ENTRY_MAGIC, header.pos, header.size, header.index, header.term)


# --- checkpoint and the committed position ---------------------------------------------------------------

def parse_properties(text: str) -> dict[str, str]:
    """The `key=value` lines of IOUtils.properties2String, read as java.util.Properties reads them (comments
    `#`/`!`, `=` or `:` separators, surrounding blanks)."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
        key, value = (line[:cut], line[cut + 1 :]) if cut >= 0 else (line, "")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True, slots=True)
class Checkpoint:
    committed_index: int  # -1: none
    end_index: int  # -1: none
    path: str  # the file it was read from (checkpoint, or checkpoint.bak when checkpoint is unreadable)


def read_checkpoint(home: str) -> Checkpoint | None:
    """`committedIndex`/`endIndex` from `<home>/checkpoint`, or from `checkpoint.bak` when the checkpoint is
    missing or has no committedIndex: IOUtils.string2File deletes the checkpoint before renaming the new one
    in, and keeps the previous content in the .bak, which is an older, so lower, committed index (DLedger
    0.2.3 itself reads only `checkpoint` and, without it, dispatches nothing until the next commit).
    None when neither holds a committedIndex."""
    for name in (CHECKPOINT_FILE, CHECKPOINT_FILE + CHECKPOINT_BAK_SUFFIX):
        path = os.path.join(home, name)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                props = parse_properties(f.read())
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StoreLayoutError(path, f"cannot read the DLedger checkpoint: {e.strerror}") from None
        raw = props.get(COMMITTED_INDEX_KEY, "")
        if not raw:
            continue
        try:
            committed = int(raw)
            end = int(props.get(END_INDEX_KEY) or -1)
        except ValueError:
            raise StoreLayoutError(path, f"{COMMITTED_INDEX_KEY}={raw!r} / {END_INDEX_KEY}="
                                         f"{props.get(END_INDEX_KEY)!r} is not a number") from None
        return Checkpoint(committed, end, path)
    return None


def data_files(directory: str, segment_size: int) -> list[tuple[int, str]]:
    """The data files (start, path), each exactly `segment_size` bytes as MmapFileList.load requires."""
    if not os.path.isdir(directory):
        raise StoreLayoutError(directory, "DLedger data directory does not exist or is not a directory")
    return sorted(list_queue_files(directory))


def _entries_of(path: str, start: int, size: int, at: int = 0):
    """Walk one data file's entry headers from in-file position `at` (mapped, not read whole): yields
    EntryHeader until its BLANK or unwritten space."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            length = min(len(data), size)
            while at + BLANK.size <= length and not is_blank(data, at) and not is_unwritten(data, at):
                h = decode_entry_header(data, at, start + at, path=path, bytes_left=length - at)
                yield h
                at += h.size


def first_entry(path: str, start: int, segment_size: int) -> EntryHeader | None:
    with open(path, "rb") as f:
        head = f.read(ENTRY_HEADER_SIZE)
    if len(head) < ENTRY_HEADER_SIZE or is_blank(head, 0) or is_unwritten(head, 0):
        return None
    return decode_entry_header(head, 0, start, path=path, bytes_left=segment_size)


def entry_from_index(files: list[tuple[int, str]], index_path: str, index: int,
                     segment_size: int) -> EntryHeader | None:
    """The header of entry `index` through its unit in the index directory `index_path`, when the unit is there
    and agrees with the entry's header in the data; else None."""
    at = index * INDEX_UNIT_SIZE  # index files roll every INDEX_FILE_SIZE bytes, named by their start
    try:
        with open(os.path.join(index_path, offset_to_file_name(at - at % INDEX_FILE_SIZE)), "rb") as f:
            unit = os.pread(f.fileno(), INDEX_UNIT_SIZE, at % INDEX_FILE_SIZE)
    except OSError:
        return None
    if len(unit) < INDEX_UNIT_SIZE:
        return None
    magic, pos, size, idx, _term = INDEX_UNIT.unpack(unit)
    start = pos - pos % segment_size
    path = dict(files).get(start)
    if magic != ENTRY_MAGIC or idx != index or path is None:
        return None
    with open(path, "rb") as f:
        head = os.pread(f.fileno(), ENTRY_HEADER_SIZE, pos - start)
    try:
        h = decode_entry_header(head, 0, pos, path=path, bytes_left=segment_size - (pos - start))
    except CorruptRecordError:
        return None
    return h if h.index == index and h.size == size else None


def _entry_by_index(files: list[tuple[int, str]], index_path: str | None, index: int,
                    segment_size: int, hint: EntryHeader | None = None) -> EntryHeader | None:
    """The header of entry `index`: through its unit in the index directory `index_path` when it is there and
    agrees with the data (`entry_from_index`), else by a walk of the one data file that holds it (files start
    with increasing entry indexes)."""
    if index_path is not None:
        h = entry_from_index(files, index_path, index, segment_size)
        if h is not None:
            return h
    holder, at = None, 0
    for start, path in files:
        try:
            first = first_entry(path, start, segment_size)
        except CorruptRecordError:
            continue  # a file whose first entry is damaged holds no answer we can find; the reader reports it
        if first is None or first.index > index:
            break
        holder = (start, path)
    if holder is None:
        return None
    if hint is not None and hint.index <= index and holder[0] <= hint.pos < holder[0] + segment_size:
        with open(holder[1], "rb") as f:  # an earlier answer in the same file, still there (not truncated)
            head = os.pread(f.fileno(), ENTRY_HEADER_SIZE, hint.pos - holder[0])
        if len(head) == ENTRY_HEADER_SIZE and EntryHeader._make(ENTRY_HEADER.unpack(head)) == hint:
            at = hint.pos - holder[0]  # walk on from it, not from the file's start
    for h in _entries_of(holder[1], holder[0], segment_size, at):
        if h.index == index:
            return h
        if h.index > index:
            break
    return None


def last_entry(files: list[tuple[int, str]], segment_size: int) -> EntryHeader | None:
    """The last entry written (ledgerEndIndex's), walking back from the newest file that holds one."""
    for start, path in reversed(files):
        last = None
        for last in _entries_of(path, start, segment_size):  # noqa: B007 - the last one is wanted
            pass
        if last is not None:
            return last
    return None


@dataclass(frozen=True, slots=True)
class CommittedPosition:
    """Where the store stops dispatching: `position` = pos + size of entry `committed_index`, or, with no
    committed entry, the first data file's start (DLedgerCommitLog.getMaxOffset)."""

    position: int
    committed_index: int  # -1: no committed entry
    end_index: int  # the last entry in the data (-1: none)
    source: str  # the checkpoint file read, or why there is none
    entry: EntryHeader | None = None  # the committed entry's header


def committed_position(store_path_root_dir: str, self_id: str, segment_size: int,
                       hint: CommittedPosition | None = None) -> CommittedPosition:
    """The committed position as DLedger recovers it (DLedgerMmapFileStore.recover, updateCommittedIndex):
    committedIndex from the checkpoint, capped at the last entry written, then committedPos = pos + size of
    that entry, looked up in the index file when present and consistent, else in the data (from `hint`, an
    earlier answer, when it lies in the same file: a follower walks only what was committed since)."""
    home = home_dir(store_path_root_dir, self_id)
    files = data_files(data_dir(store_path_root_dir, self_id), segment_size)
    floor = files[0][0] if files else 0
    ckpt = read_checkpoint(home)
    if ckpt is None or ckpt.committed_index < 0 or not files:
        why = "no committedIndex in checkpoint or checkpoint.bak" if ckpt is None else ckpt.path
        return CommittedPosition(floor, -1, -1, why)
    index_path = os.path.join(home, INDEX_DIR)
    h = _entry_by_index(files, index_path if os.path.isdir(index_path) else None, ckpt.committed_index,
                        segment_size, hint.entry if hint is not None else None)
    if h is not None:
        return CommittedPosition(h.end, h.index, max(ckpt.end_index, h.index), ckpt.path, h)
    last = last_entry(files, segment_size)
    if last is None or ckpt.committed_index < last.index:  # older than the oldest data file: none is kept
        return CommittedPosition(floor, -1, -1 if last is None else last.index, ckpt.path)
    # past the last entry written (a follower behind its leader): updateCommittedIndex caps it at ledgerEndIndex
    return CommittedPosition(last.end, last.index, last.index, ckpt.path, last)

__all__ = [
    "BLANK", "BLANK_MAGIC", "CHECKPOINT_FILE", "COMMITTED_INDEX_KEY", "DATA_DIR", "DLEDGER_ENTRIES", "END_INDEX_KEY",
    "ENTRY_ERRORS", "ENTRY_FIELDS", "ENTRY_HEADER", "ENTRY_HEADER_SIZE", "ENTRY_MAGIC", "INDEX_DIR", "INDEX_FILE_SIZE",
    "INDEX_UNIT", "INDEX_UNIT_SIZE", "MIN_BLANK_LENGTH", "Checkpoint", "CommittedPosition", "CorruptEntryHeaderError",
    "EntryHeader", "committed_position", "data_dir", "data_files", "decode_entry_header", "encode_blank",
    "encode_entry", "encode_index_unit", "entry_error", "entry_from_index", "home_dir", "index_dir", "is_blank",
    "is_unwritten", "last_entry", "read_checkpoint",
]
