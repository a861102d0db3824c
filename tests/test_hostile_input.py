"""Hostile input: topics that would be unsafe as directory names, and malformed property strings.

A topic becomes `consumequeue/{topic}/`, so `/`, `\\`, `..`, NUL, control characters and (in a v1 record)
more than 127 bytes make a record corrupt (docs/correctness.md "Bad input"). Property strings are parsed as the broker
parses them: segments without a separator or with an empty name or value are skipped, invalid UTF-8 is
replaced; a length field that does not fit its record is corruption.

Checked three ways: through the library (`MessageRecord.decode`, `decode_segment`, `CommitLogReader`), where
the only exception is a `CorruptRecordError` naming the field and the offset; through `reputd rebuild`
(exit 1, one line naming the file, the offset and the field, no traceback); and through `reputd run
--until-caught-up`. In every case nothing is written outside the output directory: the tree around it is
snapshotted before and after, and the output holds only `consumequeue/`, `index/` and the checkpoint.

Records are laid out here with `struct`, straight from STORE_FORMAT.md §3.2, not with indexcore's encoder.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from daemon.ops.outlock import LOCK_FILE
from indexcore.commitlog import MessageRecord
from indexcore.errors import CorruptRecordError, StoreError
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus, Stop, decode_segment

SEGMENT = 64 * 1024
V1, V2, BLANK = -626843481, -626843477, -875286124
FIXED = struct.Struct(">iiiiiqqiq4siq4siiqi")  # §3.2, IPv4 hosts, up to and including BODYLENGTH
BORN = (bytes([192, 0, 2, 100]), 50000)
STORE_HOST = (bytes([192, 0, 2, 1]), 10911)
TS = 1_700_000_000_000
REPUTD = [sys.executable, "-m", "daemon.cli"]
ALLOWED_OUTPUT = {"consumequeue", "index", "reputd.checkpoint", "reputd.checkpoint.tmp", LOCK_FILE}
# the fields a CorruptRecordError names (indexcore/commitlog.py, indexcore/reader.py)
DOCUMENTED_FIELDS = {"total_size", "magic_code", "body_crc", "body_length", "topic_length", "topic",
                     "properties_length", "physical_offset", "properties.DELAY", "properties",
                     "properties.INNER_MULTI_DISPATCH", "properties.INNER_MULTI_QUEUE_OFFSET"}


# --- records laid out by hand ---------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """One record: what to encode, and byte surgery on the encoded record (lengths that lie)."""

    topic: bytes = b"TopicA"
    properties: bytes = b"KEYS\x01k1 k2\x02TAGS\x01TagA"
    body: bytes = b"hello world"
    magic: int = V1
    queue_id: int = 0
    tamper: Callable[[bytearray], None] | None = None

    def encode(self, phy: int, queue_offset: int) -> bytes:
        t = 2 if self.magic == V2 else 1
        total = 74 + 8 + 8 + t + len(self.body) + len(self.topic) + len(self.properties)
        head = FIXED.pack(total, self.magic, zlib.crc32(self.body) & 0x7FFFFFFF, self.queue_id, 0, queue_offset,
                          phy, 0, TS, *BORN, TS, *STORE_HOST, 0, 0, len(self.body))
        topic_len = struct.pack(">h", len(self.topic)) if t == 2 else bytes([len(self.topic) & 0xFF])
        out = bytearray(head + self.body + topic_len + self.topic + struct.pack(">h", len(self.properties))
                        + self.properties)
        assert len(out) == total
        if self.tamper is not None:
            self.tamper(out)
        return bytes(out)


GOOD = Spec()


def body_length(rec: bytearray, value: int) -> None:
    struct.pack_into(">i", rec, FIXED.size - 4, value)


def properties_length(rec: bytearray, value: int) -> None:
    props = struct.unpack_from(">h", rec, len(rec) - 2)[0]  # records whose properties are empty
    assert props == 0
    struct.pack_into(">h", rec, len(rec) - 2, value)


def topic_length_v2(rec: bytearray, value: int) -> None:
    body = struct.unpack_from(">i", rec, FIXED.size - 4)[0]
    struct.pack_into(">h", rec, FIXED.size + body, value)


def write_log(directory: Path, segments: list[list[Spec]]) -> list[list[int]]:
    """Segments of records then a BLANK (the last one: records then zeros); the offsets of each record."""
    directory.mkdir(parents=True, exist_ok=True)
    queue_offsets: dict[tuple[bytes, int], int] = {}
    offsets = []
    for k, specs in enumerate(segments):
        buf = bytearray(SEGMENT)
        pos, at = 0, []
        for spec in specs:
            q = queue_offsets.get((spec.topic, spec.queue_id), 0)
            queue_offsets[(spec.topic, spec.queue_id)] = q + 1
            data = spec.encode(k * SEGMENT + pos, q)
            buf[pos : pos + len(data)] = data
            at.append(k * SEGMENT + pos)
            pos += len(data)
        if k < len(segments) - 1:
            struct.pack_into(">ii", buf, pos, SEGMENT - pos, BLANK)
        (directory / f"{k * SEGMENT:020d}").write_bytes(bytes(buf))
        offsets.append(at)
    return offsets


# --- a workspace: store, config, output ----------------------------------------------------------

class Workspace:
    def __init__(self, root: Path, policy: str = "stop", **store):
        self.root = root
        self.log = root / "store" / "commitlog"
        self.out = root / "out"
        self.config = root / "reputd.yaml"
        cfg = {"store": {"storePathRootDir": str(root / "store"), "mappedFileSizeCommitLog": SEGMENT,
                         "mappedFileSizeConsumeQueue": 2000, "maxHashSlotNum": 97, "maxIndexNum": 400, **store},
               "output": {"dir": str(self.out)}, "reput": {"onCorruption": policy, "pollIntervalMs": 50},
               "metrics": {"enabled": False}, "logging": {"format": "json"}}
        self.config.write_text(yaml.safe_dump(cfg))

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REPUTD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        return subprocess.run([*REPUTD, *args, "--config", str(self.config)], env=env, capture_output=True,
                              text=True, timeout=120, check=False)

    def snapshot(self) -> dict[str, str]:
        """Every path around the output directory (the output itself excluded), with a digest of files."""
        snap = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            if Path(dirpath) == self.root and "out" in dirnames:
                dirnames.remove("out")
            for name in dirnames:
                snap[os.path.join(dirpath, name)] = "dir"
            for name in filenames:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    snap[path] = hashlib.sha256(f.read()).hexdigest()
        return snap

    def assert_output_contained(self) -> None:
        """The output holds the broker's two directories (and the checkpoint) and nothing else; every
        ConsumeQueue sits at consumequeue/{topic}/{queueId}/ with a plain topic name."""
        if not self.out.exists():
            return
        assert set(os.listdir(self.out)) <= ALLOWED_OUTPUT, os.listdir(self.out)
        for dirpath, _, filenames in os.walk(self.out):
            for name in filenames:
                path = Path(dirpath, name)
                assert not path.is_symlink()
                assert path.resolve().is_relative_to(self.out.resolve())
        cq = self.out / "consumequeue"
        if cq.exists():
            for topic in os.listdir(cq):
                assert topic not in (".", "..")
                assert not any(c in topic for c in "/\\\0")
                for p in (cq / topic).glob("*/*"):
                    assert p.parent.parent.parent == cq
                    assert p.parent.name.isdigit()


def run_contained(ws: Workspace, *args: str) -> subprocess.CompletedProcess:
    before = ws.snapshot()
    res = ws.cli(*args)
    assert ws.snapshot() == before, "something was written outside the output directory"
    ws.assert_output_contained()
    assert "Traceback" not in res.stderr, res.stderr
    return res


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def one_line_error(stderr: str) -> str:
    """The one line that is not a JSON log event (rebuild logs its events to stderr) nor the note that the
    output directory was created."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(("{", "reputd: note: "))]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("reputd: error: "), stderr
    return lines[0]


# --- the cases -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    spec: Spec
    field: str  # CorruptRecordError.field
    marks: tuple = field(default=())


HOSTILE_TOPICS = {
    "slash": Case(Spec(topic=b"a/b"), "topic"),
    "dotdot_prefix": Case(Spec(topic=b"../x"), "topic"),
    "escape_two_levels": Case(Spec(topic=b"../../escaped"), "topic"),
    "dotdot": Case(Spec(topic=b".."), "topic"),
    "dot": Case(Spec(topic=b"."), "topic"),
    "absolute": Case(Spec(topic=b"/tmp/abs"), "topic"),
    "backslash": Case(Spec(topic=b"a\\b"), "topic"),
    "nul": Case(Spec(topic=b"a\x00b"), "topic"),
    "bell": Case(Spec(topic=b"a\x07b"), "topic"),
    "newline": Case(Spec(topic=b"a\nb"), "topic"),
    "escape_sequence": Case(Spec(topic=b"\x1b[31mred"), "topic"),
    "delete": Case(Spec(topic=b"a\x7f"), "topic"),
    "invalid_utf8": Case(Spec(topic=b"T\xff\xfe"), "topic"),
    "empty": Case(Spec(topic=b""), "topic_length"),
    "v1_128_bytes": Case(Spec(topic=b"T" * 128), "topic_length"),
    "v1_255_bytes": Case(Spec(topic=b"T" * 255), "topic_length"),
    "v2_dotdot": Case(Spec(topic=b"../" * 50 + b"x", magic=V2), "topic"),
    "v2_slash": Case(Spec(topic=b"T" * 200 + b"/x", magic=V2), "topic"),
    "v2_over_name_max": Case(Spec(topic=b"L" * 300, magic=V2), "topic"),
    "c1_control": Case(Spec(topic="a\u0085b".encode()), "topic"),
}

BAD_LENGTHS = {
    "properties_length_past_record": Case(Spec(properties=b"", tamper=lambda r: properties_length(r, 32767)),
                                          "properties_length"),
    "properties_length_negative": Case(Spec(properties=b"", tamper=lambda r: properties_length(r, -1)),
                                       "properties_length"),
    "body_length_huge": Case(Spec(tamper=lambda r: body_length(r, 0x7FFFFFFF)), "body_length"),
    "body_length_negative": Case(Spec(tamper=lambda r: body_length(r, -5)), "body_length"),
    "body_length_short": Case(Spec(tamper=lambda r: body_length(r, 3)), "body_crc"),  # 3 bytes, other CRC
    "v2_topic_length_huge": Case(Spec(magic=V2, tamper=lambda r: topic_length_v2(r, 32767)), "topic_length"),
    "v2_topic_length_negative": Case(Spec(magic=V2, tamper=lambda r: topic_length_v2(r, -2)), "topic_length"),
    "delay_not_a_number": Case(Spec(topic=b"SCHEDULE_TOPIC_XXXX", properties=b"DELAY\x01soon"),
                               "properties.DELAY"),
}

CORRUPT = {**HOSTILE_TOPICS, **BAD_LENGTHS}


def params(cases: dict[str, Case]) -> list:
    return [pytest.param(c, id=name, marks=c.marks) for name, c in cases.items()]


def assert_documented(error: BaseException, case: Case, offset: int, path: str | None = None) -> None:
    assert isinstance(error, CorruptRecordError), repr(error)
    assert error.field in DOCUMENTED_FIELDS
    assert error.field == case.field, error
    assert error.offset == offset
    if path is not None:
        assert error.path == path
        assert path in str(error)
        assert f"offset {offset}" in str(error)


# --- library ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", params(CORRUPT))
def test_library_refuses_with_a_typed_error(tmp_path, case: Case):
    data = case.spec.encode(0, 0)
    if case.field != "properties.DELAY":  # DELAY is a dispatch rule, not part of the record's shape
        with pytest.raises(StoreError) as info:
            MessageRecord.decode(data)
        assert_documented(info.value, case, 0)
    # inside a segment, after a good record: the good one is returned, then the error at the bad one
    ((at, first, _),) = write_log(tmp_path, [[GOOD, case.spec, GOOD]])
    buf = (tmp_path / f"{0:020d}").read_bytes()
    res = decode_segment(buf, 0, segment_offset=0, segment_size=SEGMENT, max_bytes=SEGMENT)
    assert res.stop is Stop.ERROR
    assert res.position == first
    assert res.batch.phy_offset.tolist() == [at]
    assert_documented(res.error, case, first)
    reader = CommitLogReader(CommitLog(str(tmp_path), SEGMENT))
    try:
        read = reader.read(0)
    finally:
        reader.close()
    assert read.status is ReadStatus.CORRUPT
    assert_documented(read.error, case, first, str(tmp_path / f"{0:020d}"))


# --- the command line -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", params(CORRUPT))
def test_rebuild_stops_with_one_line_and_writes_nothing_outside(tmp_path, case: Case):
    ws = Workspace(tmp_path)
    (offsets,) = write_log(ws.log, [[GOOD, Spec(queue_id=1), case.spec, GOOD]])
    bad = offsets[2]
    res = run_contained(ws, "rebuild")
    assert res.returncode == 1, res.stdout + res.stderr
    line = one_line_error(res.stderr)
    assert str(ws.log / f"{0:020d}") in line
    assert f"offset {bad}" in line
    assert f"field {case.field}" in line
    # the records before it were dispatched
    units = (ws.out / "consumequeue" / "TopicA").glob("*/*")
    assert sum(1 for u in units) == 2


def test_run_skips_every_hostile_record_and_writes_nothing_outside(tmp_path):
    """All the cases in one store, one per segment, through `reputd run` under skip-segment: one
    `corrupt_commitlog` event per case with the file, the offset and the field, exit 0."""
    ws = Workspace(tmp_path, policy="skip-segment")
    names = [n for n, c in CORRUPT.items() if not c.marks]  # the known failures have their own tests
    offsets = write_log(ws.log, [[GOOD, CORRUPT[n].spec, GOOD] for n in names] + [[GOOD]])
    res = run_contained(ws, "run", "--until-caught-up")
    assert res.returncode == 0, res.stderr
    corrupt = {e["offset"]: e for e in events(res.stdout) if e["event"] == "corrupt_commitlog"}
    for k, name in enumerate(names):
        bad = offsets[k][1]
        e = corrupt.get(bad)
        assert e is not None, f"{name}: no corrupt_commitlog at {bad}"
        assert e["file"] == str(ws.log / f"{k * SEGMENT:020d}")
        assert e["reason"] == CORRUPT[name].field, name
    cq = ws.out / "consumequeue"
    assert sorted(os.listdir(cq)) == ["TopicA"]


@pytest.mark.parametrize("case", params(HOSTILE_TOPICS))
def test_run_stops_at_a_hostile_topic(tmp_path, case: Case):
    ws = Workspace(tmp_path)
    offsets = write_log(ws.log, [[GOOD, case.spec, GOOD], [GOOD]])
    bad = offsets[0][1]
    res = run_contained(ws, "run", "--until-caught-up")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr
    corrupt = [e for e in events(res.stdout) if e["event"] == "corrupt_commitlog"]
    assert len(corrupt) == 1
    assert (corrupt[0]["file"], corrupt[0]["offset"], corrupt[0]["reason"]) == (
        str(ws.log / f"{0:020d}"), bad, case.field)


# --- properties the broker accepts ------------------------------------------------------------------

ODD_PROPERTIES = {
    # raw PROPERTIES -> (KEYS, UNIQ_KEY, TAGS) as the dispatch path must see them (§4.2, §6.1)
    "no_separator": (b"KEYS", (None, None, None)),
    "empty_value": (b"KEYS\x01", (None, None, None)),
    "empty_name": (b"\x01k1", (None, None, None)),
    "only_separators": (b"\x02\x02\x01\x02", (None, None, None)),
    "value_with_name_separator": (b"KEYS\x01a\x01b", ("a\x01b", None, None)),
    "trailing_separator": (b"KEYS\x01k\x02", ("k", None, None)),
    "last_wins": (b"TAGS\x01a\x02TAGS\x01b", (None, None, "b")),
    "invalid_utf8_value": (b"KEYS\x01\xff\xfek", ("\ufffd\ufffdk", None, None)),
    "truncated_utf8_tag": (b"TAGS\x01\xe8\xae", (None, None, "\ufffd")),
    "surrogate_uniq_key": (b"UNIQ_KEY\x01\xed\xa0\x80", (None, "\ufffd\ufffd\ufffd", None)),
    "invalid_utf8_name": (b"\xffKEYS\x01x\x02KEYS\x01y", ("y", None, None)),
    "nul_in_keys": (b"KEYS\x01a\x00b c", ("a\x00b c", None, None)),
    "long_unseparated": (b"K" * 30000, (None, None, None)),
    "many_empty_segments": (b"\x02" * 20000 + b"KEYS\x01z", ("z", None, None)),
}


@pytest.mark.parametrize(("raw", "expected"), ODD_PROPERTIES.values(), ids=ODD_PROPERTIES.keys())
def test_odd_properties_are_read_as_the_broker_reads_them(tmp_path, raw: bytes, expected):
    spec = Spec(properties=raw)
    rec = MessageRecord.decode(spec.encode(0, 0))
    assert rec.properties == raw
    write_log(tmp_path, [[spec, GOOD]])
    buf = (tmp_path / f"{0:020d}").read_bytes()
    res = decode_segment(buf, 0, segment_offset=0, segment_size=SEGMENT, max_bytes=SEGMENT)
    assert res.stop is Stop.END, res.error
    assert len(res.batch) == 2
    assert (res.batch.keys[0], res.batch.uniq_key[0]) == expected[:2]


def test_odd_properties_rebuild_and_query(tmp_path):
    """Every odd property string in one CommitLog: rebuild exits 0 and writes inside the output only;
    a key with invalid UTF-8 is indexed, and found, under its replacement characters."""
    ws = Workspace(tmp_path)
    write_log(ws.log, [[Spec(properties=raw, queue_id=i % 4) for i, (raw, _) in enumerate(ODD_PROPERTIES.values())]])
    res = run_contained(ws, "rebuild", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1])["messages"] == len(ODD_PROPERTIES)
    found = ws.cli("query", "key", "TopicA", "\ufffd\ufffdk", "--json")
    assert found.returncode == 0, found.stderr
    assert len(found.stdout.splitlines()) == 1


# --- LMQ queue names: with multi-dispatch on, each name of INNER_MULTI_DISPATCH becomes a directory too ------

MULTI_DISPATCH = {"enableMultiDispatch": True, "enableLmq": True}
MULTI_FIELD = "properties.INNER_MULTI_DISPATCH"
# every hostile topic above whose bytes can stand in a property value (no \x01/\x02/, separators), as an
# LMQ name and as a plain one; and names that only a property can hold
HOSTILE_NAMES = {
    **{f"lmq_{name}": b"%LMQ%" + case.spec.topic for name, case in HOSTILE_TOPICS.items()
       # %LMQ%. and %LMQ%.. are ordinary names: only "." and ".." as a whole name are a directory's own entries
       if case.field == "topic" and not set(case.spec.topic) & {1, 2, 0x2C} and name not in ("dot", "dotdot")},
    **{f"plain_{name}": case.spec.topic for name, case in HOSTILE_TOPICS.items()
       if case.field == "topic" and not set(case.spec.topic) & {1, 2, 0x2C} and case.spec.topic},
    "empty_first": b",%LMQ%ok",
    "empty_middle": b"%LMQ%ok,,%LMQ%ok2",
    "lmq_over_name_max": b"%LMQ%" + b"L" * 251,
    "lmq_invalid_utf8": b"%LMQ%\xc3\x28",
}


def lmq_spec(names: bytes) -> Spec:
    count = len([p for p in names.rstrip(b",").split(b",")])
    offsets = b",".join(b"0" for _ in range(count))
    return Spec(properties=b"INNER_MULTI_DISPATCH\x01" + names + b"\x02INNER_MULTI_QUEUE_OFFSET\x01" + offsets)


@pytest.mark.parametrize("names", HOSTILE_NAMES.values(), ids=HOSTILE_NAMES.keys())
def test_hostile_lmq_names_stop_the_rebuild_and_write_nothing_outside(tmp_path, names: bytes):
    """The name is refused as a topic would be: rebuild exits 1 with one line naming the file, the record's
    offset and the field, after dispatching the records before it; nothing lands outside the output."""
    ws = Workspace(tmp_path, **MULTI_DISPATCH)
    (offsets,) = write_log(ws.log, [[GOOD, lmq_spec(b"%LMQ%fine"), lmq_spec(names), GOOD]])
    res = run_contained(ws, "rebuild")
    assert res.returncode == 1, res.stdout + res.stderr
    line = one_line_error(res.stderr)
    assert f"{ws.log / f'{0:020d}'} @ offset {offsets[2]}: field {MULTI_FIELD}:" in line
    assert sorted(os.listdir(ws.out / "consumequeue")) == ["%LMQ%fine", "TopicA"]
    # the library: a typed error at the record, the records before it in the batch
    buf = (ws.log / f"{0:020d}").read_bytes()
    got = decode_segment(buf, 0, segment_offset=0, segment_size=SEGMENT, max_bytes=SEGMENT, multi_flags=3)
    assert (got.stop, len(got.batch), got.error.field, got.error.offset) == (Stop.ERROR, 2, MULTI_FIELD, offsets[2])
    # without multi-dispatch the name is only a property value
    (tmp_path / "plain").mkdir()
    plain = Workspace(tmp_path / "plain")
    write_log(plain.log, [[GOOD, lmq_spec(names), GOOD]])
    assert run_contained(plain, "rebuild").returncode == 0


def test_run_stops_at_a_hostile_lmq_name(tmp_path):
    ws = Workspace(tmp_path, **MULTI_DISPATCH)
    offsets = write_log(ws.log, [[GOOD, lmq_spec(b"%LMQ%../../escaped"), GOOD], [GOOD]])
    res = run_contained(ws, "run", "--until-caught-up")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr
    corrupt = [e for e in events(res.stdout) if e["event"] == "corrupt_commitlog"]
    assert [(e["file"], e["offset"], e["reason"]) for e in corrupt] == [
        (str(ws.log / f"{0:020d}"), offsets[0][1], MULTI_FIELD)]
    assert not (tmp_path / "escaped").exists()
