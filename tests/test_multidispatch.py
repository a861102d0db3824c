"""Multi-dispatch (LMQ): the rules of indexcore/multidispatch.py, the kernel that applies them, and what a
rebuild and `reputd run` write.

The facts come from a real 4.9.3 store (`../shared/conformance-next/lmq/NOTES.md`, facts 1-15); the
conformance tests compare that store byte for byte. Here each fact is checked on CommitLogs written for it:
the kernel against the record-by-record rules (`multi_dispatch_targets`), a rebuild against a model that
puts unit after unit into per-queue models as the broker's sequential dispatch does (the ConsumeQueue model
of test_consumequeue.py), and the daemon's crash recovery on an LMQ store.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import structlog
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import daemon.commands.verify
import daemon.engine.dispatchers
import daemon.engine.flusher
import daemon.engine.rebuild
import daemon.engine.reput
from daemon.commands.query import query_queue
from daemon.config import load_config
from daemon.engine.checkpoint import read_checkpoint
from daemon.engine.rebuild import (
    REBUILD_BATCH_BYTES,
    REBUILD_MAX_BATCH_BYTES,
    THIN_BATCH_QUEUES,
    THIN_BATCH_UNITS_PER_QUEUE,
    RebuildFailed,
    make_reader,
    rebuild,
    widen_thin_batches,
)
from indexcore import _kernels
from indexcore.commitlog import (
    SCHEDULE_TOPIC,
    TRANSACTION_COMMIT_TYPE,
    TRANSACTION_NOT_TYPE,
    TRANSACTION_PREPARED_TYPE,
    TRANSACTION_ROLLBACK_TYPE,
    Host,
    MessageRecord,
    body_crc32,
    parse_properties,
)
from indexcore.consumequeue import CQ_UNIT_SIZE, pack_units
from indexcore.errors import CORRUPT_RECORD_FIELDS, CorruptRecordError
from indexcore.javahash import java_string_hash
from indexcore.multidispatch import (
    MULTI_DISPATCH_FIELD,
    MULTI_QUEUE_OFFSET_FIELD,
    PROPERTY_INNER_MULTI_DISPATCH,
    PROPERTY_INNER_MULTI_QUEUE_OFFSET,
    check_queue_name,
    java_is_blank,
    java_split,
    multi_dispatch_flags,
    multi_dispatch_targets,
)
from indexcore.queuefiles import ConsumeQueue
from indexcore.queuestore import ConsumeQueueStore, consume_queue_units
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus, Stop, decode_segment
from indexcore.verify import CQ_UNIT_WRONG
from indexcore.writer import CommitLogWriter, Message
from tests import stress
from tests.conformance import discover, files_under
from tests.test_consumequeue import CQModel, chunks, dir_bytes, make_events, model_bytes
from tests.test_daemon import REPUTD, Store, clean_env, events, output_files, wait_for

SEGMENT = 64 * 1024
CQ_FILE = 200  # ten units a file: rolls, pre-blanks and appends across files everywhere
MD = PROPERTY_INNER_MULTI_DISPATCH
MQO = PROPERTY_INNER_MULTI_QUEUE_OFFSET
TS = 1_795_457_155_000
LMQ_STORES = [s for s in discover() if s.store_settings().get("enableMultiDispatch")]


def lmq_config(tmp: Path, *, lmq: bool = True, batch_bytes: int | None = None, **store) -> Path:
    cfg = {"store": {"storePathRootDir": str(tmp / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": CQ_FILE, "maxHashSlotNum": 97, "maxIndexNum": 400,
                     "enableMultiDispatch": True, "enableLmq": lmq, **store},
           "output": {"dir": str(tmp / "out")}, "logging": {"level": "warning", "format": "json"},
           "metrics": {"enabled": False}}
    if batch_bytes:
        cfg["reput"] = {"batchBytes": batch_bytes}
    path = tmp / "reputd.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return path


def writer(tmp: Path, *, multi: bool = True, lmq: bool = True) -> CommitLogWriter:
    clock = iter(range(TS, TS + 10**9, 7))
    return CommitLogWriter(str(tmp / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock),
                           enable_multi_dispatch=multi, enable_lmq=lmq)


def quiet_rebuild(config_path: Path, **overrides):
    config = load_config(config_path, {}, {k: str(v) for k, v in overrides.items()})
    with structlog.testing.capture_logs() as logs:
        summary = rebuild(config)
    return config, summary, logs


def queue_units(out: Path, topic: str, queue_id: int) -> list[tuple[int, int, int]]:
    store = ConsumeQueueStore(str(out), CQ_FILE, readonly=True)
    cq = store.queue(topic, queue_id)
    units = []
    q = cq.min_offset
    while q < cq.max_offset:
        got = cq.read_units(q)
        units += got
        q += len(got)
    store.close()
    return units


def record_at(tmp: Path, offset: int) -> MessageRecord:
    return CommitLog(str(tmp / "store" / "commitlog"), SEGMENT).read_record(offset)


# --- the rules, record by record ----------------------------------------------------------------------

def test_kernel_constants_follow_the_python_side() -> None:
    assert _kernels.CQ_UNIT_SIZE == CQ_UNIT_SIZE
    assert _kernels.ERR_MULTI_NO_PROPERTIES == _kernels.ERR_FIXED_PART + 1
    assert _kernels.ERR_MULTI_QUEUE_OFFSET == _kernels.ERR_FIXED_PART + 2
    assert multi_dispatch_flags(False, True) == 0


@pytest.mark.parametrize(("text", "pieces"), [
    ("a,b", ["a", "b"]), ("a,b,", ["a", "b"]), ("a,,", ["a"]), (",a", ["", "a"]), ("a,,b", ["a", "", "b"]),
    (",", []), (",,,", []), ("a", ["a"]),
])
def test_java_split_drops_trailing_empty_strings(text: str, pieces: list[str]) -> None:
    """Fact 5: String.split(",") as Java splits (Python's str.split keeps the trailing pieces)."""
    assert java_split(text) == pieces


@pytest.mark.parametrize(("text", "blank"), [
    (None, True), ("", True), (" \t\n", True), ("\u3000\u2003\u1680", True), ("\x1c\x1f", True),
    ("\u00a0", False), ("\u2007", False), ("\u202f", False), ("\ufffd", False), (" x ", False),
])
def test_blank_is_java_whitespace_only(text, blank: bool) -> None:
    """StringUtils.isBlank over Character.isWhitespace: no-break spaces are not whitespace to Java."""
    assert java_is_blank(text) is blank


NAMES = ["%LMQ%a", "%LMQ%b", "%LMQ%房间", "plain", "%LMQ%", " %LMQ%c", "", " ", "\u3000"]
OFFSETS = ["0", "1", "7", "+3", "-0", "0012", "12a", "", " 1", "-4", "1" * 20, "\u0661", "9223372036854775807"]


@st.composite
def md_properties(draw) -> bytes:
    """A property string around INNER_MULTI_DISPATCH / INNER_MULTI_QUEUE_OFFSET: lists of names and offsets
    of equal or other lengths, with trailing commas, blanks, repeated properties; sometimes none at all."""
    if draw(st.integers(0, 12)) == 0:
        return b""
    n = draw(st.integers(0, 4))
    names = ",".join(draw(st.lists(st.sampled_from(NAMES), min_size=n, max_size=n)))
    m = n if draw(st.booleans()) else draw(st.integers(0, 4))
    offsets = ",".join(draw(st.lists(st.sampled_from(OFFSETS[:6] if draw(st.booleans()) else OFFSETS),
                                     min_size=m, max_size=m)))
    names += "," * draw(st.integers(0, 2))
    offsets += "," * draw(st.integers(0, 2))
    pairs = [("KEYS", "k")]
    if draw(st.integers(0, 5)):
        pairs.append((MD, names))
    if draw(st.integers(0, 5)):
        pairs.append((MQO, offsets))
    if draw(st.integers(0, 8)) == 0:
        pairs.append((MD, draw(st.sampled_from(["%LMQ%z", " "]))))  # a second one: the last one wins
    raw = b"\x02".join(f"{k}\x01{v}".encode() for k, v in pairs)
    return raw if raw else b"\x02"


def raw_record(pos: int, properties: bytes, *, topic: str = "T", queue_id: int = 2, sys_flag: int = 0,
               store_timestamp: int = TS) -> MessageRecord:
    body = b"body"
    return MessageRecord(topic=topic, queue_id=queue_id, flag=0, queue_offset=0, physical_offset=pos,
                         sys_flag=sys_flag, born_timestamp=TS, born_host=Host.parse("192.0.2.9:1"),
                         store_timestamp=store_timestamp, store_host=Host.parse("192.0.2.1:10911"), reconsume_times=0,
                         prepared_transaction_offset=0, body=body, properties=properties, body_crc=body_crc32(body))


def segment_of(records: list[MessageRecord], size: int = SEGMENT) -> bytes:
    buf = bytearray(size)
    for r in records:
        raw = r.encode()
        buf[r.physical_offset : r.physical_offset + len(raw)] = raw
    return bytes(buf)


def laid_out(specs: list[tuple[bytes, int, int]]) -> list[MessageRecord]:
    out, pos = [], 0
    for props, sys_flag, queue_id in specs:
        r = raw_record(pos, props, sys_flag=sys_flag, queue_id=queue_id)
        out.append(r)
        pos += r.total_size
    return out


def reference(records: list[MessageRecord], enable_lmq: bool):
    """Record by record: (targets of each dispatched record, rows with mismatched counts, error or None)."""
    targets, mismatch = [], []
    for i, r in enumerate(records):
        props = parse_properties(r.properties) if r.properties else None
        try:
            got = multi_dispatch_targets(props, r.sys_flag, r.queue_id, enable_lmq=enable_lmq)
            for t in got or []:
                check_queue_name(t.topic.encode())
        except CorruptRecordError as e:
            return targets, mismatch, (i, e.field)
        if got is None:
            mismatch.append(i)
        targets += [(i, *t) for t in got or []]
    return targets, mismatch, None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(md_properties(), st.sampled_from([0, 4, 8, 12]), st.integers(0, 5)), min_size=1,
                max_size=12), st.booleans())
def test_kernel_applies_the_rules_record_by_record(specs, enable_lmq: bool) -> None:
    """The kernel's targets, count mismatches and errors equal `multi_dispatch_targets` applied to every
    record in order (the rules of ConsumeQueue.multiDispatchLmqQueue and checkMultiDispatchQueue)."""
    records = laid_out(specs)
    image = segment_of(records)
    res = decode_segment(image, 0, segment_offset=0, segment_size=SEGMENT, max_bytes=SEGMENT,
                         multi_flags=multi_dispatch_flags(True, enable_lmq))
    targets, mismatch, error = reference(records, enable_lmq)
    b = res.batch
    got = [(o, b.topics[t], q, off) for o, t, q, off in zip(b.multi_owner.tolist(), b.multi_topic_id.tolist(),
                                                              b.multi_queue_id.tolist(),
                                                              b.multi_queue_offset.tolist(), strict=True)]
    assert got == targets
    assert b.multi_count_mismatch.tolist() == mismatch
    if error is None:
        assert res.stop is Stop.END, res.error
        assert len(b) == len(records)
    else:
        assert res.stop is Stop.ERROR
        assert (len(b), res.error.field) == error
        assert res.error.offset == records[error[0]].physical_offset
    plain = decode_segment(image, 0, segment_offset=0, segment_size=SEGMENT, max_bytes=SEGMENT)
    assert len(plain.batch.multi_owner) == 0  # off: nothing extracted, nothing refused
    assert plain.stop is Stop.END


# --- units written: a model of the broker's sequential dispatch ----------------------------------------

def model_of(records: list[MessageRecord], enable_lmq: bool, file_size: int, delay=None) -> dict[str, bytes]:
    """Every ConsumeQueue file as the 4.9.3 reput leaves it: record by record, its own unit, then one per
    target, each through the queue's put (CQModel, from test_consumequeue.py)."""
    from indexcore.dispatch import DelayLevelTable, delay_tags_code, parse_java_int

    queues: dict[tuple[str, int], CQModel] = {}

    def put(topic: str, queue_id: int, offset: int, r: MessageRecord, tags_code: int) -> None:
        model = queues.setdefault((topic, queue_id), CQModel(file_size))
        model.put(offset, r.physical_offset, r.total_size, tags_code)

    for r in records:
        if r.sys_flag & 0xC not in (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT_TYPE):
            continue
        props = parse_properties(r.properties) if r.properties else None
        tags = (props or {}).get("TAGS")
        tags_code = java_string_hash(tags) if tags else 0
        if r.topic == SCHEDULE_TOPIC and (props or {}).get("DELAY"):
            code = delay_tags_code(parse_java_int(props["DELAY"]), r.store_timestamp, delay or DelayLevelTable())
            tags_code = tags_code if code is None else code
        put(r.topic, r.queue_id, r.queue_offset, r, tags_code)
        for t in multi_dispatch_targets(props, r.sys_flag, r.queue_id, enable_lmq=enable_lmq) or []:
            put(t.topic, t.queue_id, t.queue_offset, r, tags_code)
    return {f"{t}/{q}/{name}": data for (t, q), m in queues.items() for name, data in model_bytes(m).items()}


def lmq_workload(rng: random.Random, n: int, *, resets: bool = True) -> list[Message]:
    """Messages as an LMQ broker sees them: 1-3 rooms each (sometimes a plain target, a repeated name, a
    trailing comma), transactions, delays, retries; the writer assigns the offsets as the broker does."""
    out = []
    for i in range(n):
        names = [f"%LMQ%room-{rng.randint(1, 16)}" for _ in range(rng.randint(0, 3))]
        r = rng.random()
        if r < 0.05:
            names.append("mirror")
        elif r < 0.1 and names:
            names.append(names[0])
        value = ",".join(names) + ("," if rng.random() < 0.05 else "")
        props = {"TAGS": f"t{i % 3}", "KEYS": f"k{i}"}
        if names:
            props[MD] = value
        sys_flag = rng.choice([0] * 12 + [TRANSACTION_PREPARED_TYPE, TRANSACTION_COMMIT_TYPE,
                                          TRANSACTION_ROLLBACK_TYPE])
        if rng.random() < 0.05:
            props["DELAY"] = str(rng.randint(1, 18))
        topic = rng.choice(["im-chat", "im-chat", "TopicTest", "%RETRY%cg", "RMQ_SYS_TRANS_HALF_TOPIC"])
        out.append(Message(topic, rng.randrange(4), bytes(rng.randrange(60)), props, sys_flag=sys_flag))
        if resets and rng.random() < 0.01:
            out.append(None)  # a broker restart: 4.9.3 forgets its LMQ offsets (fact 13)
    return out


def write_workload(tmp: Path, messages: list[Message | None], *, lmq: bool = True,
                   first_offsets: dict[str, int] | None = None) -> list[MessageRecord]:
    """The messages through a multi-dispatch writer; `first_offsets` starts some LMQs past offset 0 (their
    first file then begins with pre-blank units)."""
    w = writer(tmp, lmq=lmq)
    for name, offset in (first_offsets or {}).items():
        w.lmq_queue_offsets[(name, 0)] = offset
    for m in messages:
        if m is None:
            w.lmq_queue_offsets.clear()
        else:
            w.append(m)
    w.close()
    log = CommitLog(str(tmp / "store" / "commitlog"), SEGMENT)
    reader = CommitLogReader(log)
    records, offset = [], 0
    while True:
        res = reader.read(offset)
        records += [log.read_record(int(p)) for p in res.batch.phy_offset]
        offset = res.next_offset
        if res.status is not ReadStatus.OK:
            break
    reader.close()
    return records


@pytest.mark.parametrize("seed", range(stress.scale(6, 60)))
def test_rebuild_equals_the_brokers_sequential_dispatch(tmp_path: Path, seed: int) -> None:
    """Random LMQ workloads, offsets reset by restarts included, rebuilt in batches of random size with few
    descriptors: every ConsumeQueue file equals the model's, and so does a second rebuild into the first."""
    rng = random.Random(seed)
    lmq = seed % 4 != 3
    first = {f"%LMQ%room-{k}": rng.randrange(1, 40) for k in range(1, 17) if rng.random() < 0.3}
    records = write_workload(tmp_path, lmq_workload(rng, rng.randint(50, 400)), lmq=lmq, first_offsets=first)
    expected = model_of(records, lmq, CQ_FILE)
    config = lmq_config(tmp_path, lmq=lmq, batch_bytes=rng.choice([300, 2000, 1 << 20]))
    cfg, _, _ = quiet_rebuild(config)
    out = Path(cfg.output.dir)
    assert files_under(out / "consumequeue") == expected
    quiet_rebuild(config)  # everything already built: nothing changes
    assert files_under(out / "consumequeue") == expected


def thin_lmq_messages(seed: int) -> list[Message]:
    """3,000 messages, each also sent to 3 of 300 LMQ queues: batches of a few KB spread thin over them."""
    rng = random.Random(seed)
    return [Message("im-chat", i % 4, b"x", {MD: ",".join(f"%LMQ%r{rng.randrange(300)}" for _ in range(3))})
            for i in range(3000)]


def test_batches_spread_thin_over_many_queues_grow_and_write_the_same_files(tmp_path: Path, monkeypatch) -> None:
    """Batches that put a unit or two into each of many queues make the rebuild read more per batch, up to
    its maximum; the files are the broker's sequential dispatch all the same, and `verify`, reading the same
    way, finds them consistent and a damaged unit where it is."""
    messages = thin_lmq_messages(7)
    records = write_workload(tmp_path, messages)
    readers = []

    def spied_reader(*args, **kwargs):
        readers.append(make_reader(*args, **kwargs))
        return readers[-1]

    for module in (daemon.engine.rebuild, daemon.commands.verify):
        monkeypatch.setattr(module, "make_reader", spied_reader)
        monkeypatch.setattr(module, "REBUILD_BATCH_BYTES", 2000)
    monkeypatch.setattr(daemon.engine.rebuild, "REBUILD_MAX_BATCH_BYTES", 64_000)
    monkeypatch.setattr(daemon.engine.rebuild, "THIN_BATCH_QUEUES", 8)
    cfg, summary, _ = quiet_rebuild(lmq_config(tmp_path, batch_bytes=2000))
    assert summary.messages == len(messages)
    assert readers[-1].batch_bytes == 64_000
    queues = Path(cfg.output.dir) / "consumequeue"
    assert files_under(queues) == model_of(records, True, CQ_FILE)

    # `verify` reads in growing batches too, and still finds every difference where it is
    report = daemon.commands.verify.verify(cfg)
    assert readers[-1].batch_bytes == 64_000
    assert report.findings == []
    assert report.messages == len(messages)
    damaged = queues / "%LMQ%r7" / "0" / "00000000000000000000"
    data = bytearray(damaged.read_bytes())
    data[CQ_UNIT_SIZE + 12 : CQ_UNIT_SIZE + 20] = (12345).to_bytes(8, "big")  # unit 1's tags_code
    damaged.write_bytes(bytes(data))
    report = daemon.commands.verify.verify(cfg)
    assert [(f.kind, f.file, f.position) for f in report.findings] == [
        (CQ_UNIT_WRONG, str(damaged.relative_to(cfg.output.dir)), CQ_UNIT_SIZE)]


@pytest.mark.parametrize("creations", [40, 333, 700])
def test_a_rebuild_killed_while_it_gathers_appends_then_run_again_writes_the_same_files(tmp_path: Path,
                                                                                      creations: int) -> None:
    """A rebuild gathers each queue's small appends over several batches before writing them; killed at the
    Nth ConsumeQueue file it creates (some queues then have units written, others only gathered, and lost),
    then run again, it writes the broker's files all the same."""
    records = write_workload(tmp_path, thin_lmq_messages(11))
    config = lmq_config(tmp_path)
    small_batches = ("import sys, daemon.engine.rebuild as r; "
                     "r.REBUILD_BATCH_BYTES = r.REBUILD_MAX_BATCH_BYTES = 3000; "
                     "from daemon.cli import main; sys.exit(main(sys.argv[1:]))")
    killed = subprocess.run([REPUTD[0], "-c", small_batches, "rebuild", "--config", str(config)],
                            env=clean_env({"REPUTD_FAILPOINT": f"consumequeue.after_header@{creations}"}),
                            capture_output=True, text=True, timeout=120, check=False)
    assert killed.returncode == -9, killed.stderr[-800:]
    queues = tmp_path / "out" / "consumequeue"
    assert 0 < len(files_under(queues)) < len(model_of(records, True, CQ_FILE))
    again = subprocess.run([*REPUTD, "rebuild", "--config", str(config)], env=clean_env(), capture_output=True,
                           text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr[-800:]
    assert files_under(queues) == model_of(records, True, CQ_FILE)


def test_run_behind_the_writer_grows_thin_batches_and_shrinks_them_when_caught_up(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """`run` catching up on a store whose batches spread thin reads more per batch as `rebuild` does, back to
    the configured size once it has caught up; the files are the broker's sequential dispatch."""
    records = write_workload(tmp_path, thin_lmq_messages(8))
    sizes, readers = [], []
    read = CommitLogReader.read

    def spied_read(self, offset, **kwargs):
        sizes.append(self.batch_bytes)
        readers.append(self)
        return read(self, offset, **kwargs)

    monkeypatch.setattr(CommitLogReader, "read", spied_read)
    monkeypatch.setattr(daemon.engine.reput, "RUN_MAX_BATCH_BYTES", 64_000)
    monkeypatch.setattr(daemon.engine.rebuild, "REBUILD_MAX_BATCH_BYTES", 1 << 30)  # not the limit `run` goes by
    monkeypatch.setattr(daemon.engine.rebuild, "THIN_BATCH_QUEUES", 8)
    config = load_config(lmq_config(tmp_path, batch_bytes=2000), env={})
    service = daemon.engine.reput.ReputService(config, until_caught_up=True)
    with structlog.testing.capture_logs():
        assert service.run() == 0
    assert sizes[0] == 2000
    assert max(sizes) == 64_000
    assert len(set(readers)) == 1
    assert readers[0].batch_bytes == 2000
    assert files_under(Path(config.output.dir) / "consumequeue") == model_of(records, True, CQ_FILE)


@pytest.mark.parametrize("rooms", [20, 300])
def test_run_stopping_with_many_queue_files_to_flush_syncs_their_file_system_once(tmp_path: Path, monkeypatch,
                                                                                  rooms: int) -> None:
    """`run`'s last flush, as it stops, syncs the file system whole (one syncfs) once it has at least
    SYNCFS_MIN_FILES files to sync, as a rebuild's does; with fewer, each file and new directory on its own.
    Either way it checkpoints the end, and closing the queues afterwards does not sync them again."""
    messages = [Message("im-chat", 0, b"x", {MD: f"%LMQ%r{i % rooms}"}) for i in range(600)]
    records = write_workload(tmp_path, messages)
    syncfs, closing, synced_closing = [], [], []
    real_syncfs, real_fdatasync = daemon.engine.flusher._kernels.syncfs, os.fdatasync
    real_close = daemon.engine.dispatchers.ConsumeQueueDispatcher.close

    def spied_close(self):
        closing.append(True)
        real_close(self)

    monkeypatch.setattr(daemon.engine.flusher._kernels, "syncfs", lambda fd: (syncfs.append(fd), real_syncfs(fd)))
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced_closing.append(fd) if closing else None,
                                                     real_fdatasync(fd)))
    monkeypatch.setattr(daemon.engine.dispatchers.ConsumeQueueDispatcher, "close", spied_close)
    config = load_config(lmq_config(tmp_path), env={})
    with structlog.testing.capture_logs():
        assert daemon.engine.reput.ReputService(config, until_caught_up=True).run() == 0
    assert len(syncfs) == (1 if rooms + 1 >= daemon.engine.flusher.SYNCFS_MIN_FILES else 0)
    assert synced_closing == []  # the last flush synced every queue: closing them syncs none again
    assert read_checkpoint(config.output.dir).reput_from_offset == records[-1].physical_offset + records[-1].total_size
    assert files_under(Path(config.output.dir) / "consumequeue") == model_of(records, True, CQ_FILE)


@pytest.mark.parametrize(("queues", "units", "grows"), [
    (THIN_BATCH_QUEUES, THIN_BATCH_QUEUES * THIN_BATCH_UNITS_PER_QUEUE - 1, True),  # thin, as 100,000 LMQ queues
    (THIN_BATCH_QUEUES - 1, THIN_BATCH_QUEUES - 1, False),  # few queues, however thin (1,000 LMQ queues)
    (THIN_BATCH_QUEUES, THIN_BATCH_QUEUES * THIN_BATCH_UNITS_PER_QUEUE, False),  # many queues, not thin
])
def test_only_a_thin_batch_makes_the_next_ones_larger(queues: int, units: int, grows: bool) -> None:
    reader = SimpleNamespace(batch_bytes=REBUILD_BATCH_BYTES)
    widen_thin_batches(reader, (queues, units))
    assert reader.batch_bytes == (2 * REBUILD_BATCH_BYTES if grows else REBUILD_BATCH_BYTES)
    reader.batch_bytes = REBUILD_MAX_BATCH_BYTES - 1
    widen_thin_batches(reader, (queues, units))
    assert reader.batch_bytes == (REBUILD_MAX_BATCH_BYTES if grows else REBUILD_MAX_BATCH_BYTES - 1)


@pytest.mark.parametrize("seed", range(60))
def test_put_of_a_whole_streak_is_the_unit_by_unit_put(tmp_path: Path, seed: int) -> None:
    """`put_packed(one_streak=True)`, the path most runs of a batch take, against the unit-by-unit model,
    on the model tests' events (holes, stale offsets, restarts at 0, replays) cut into random runs."""
    rng = random.Random(seed)
    model, cq = CQModel(CQ_FILE), ConsumeQueue(str(tmp_path / "q"), "T", 0, CQ_FILE)
    for piece in chunks(rng, make_events(rng)):
        qo, phy, size, tags = (np.array(c, dtype=np.int64) for c in zip(*piece, strict=True))
        ends = phy + size
        streak = bool(np.all(np.diff(qo) == 1) and np.all(np.diff(ends) > 0))
        cq.put_packed(qo, pack_units(phy, size.astype(np.int32), tags), ends, streak)
        for unit in piece:
            model.put(*unit)
    cq.close()
    assert dir_bytes(tmp_path / "q") == model_bytes(model)


def test_a_queue_file_is_read_up_to_its_written_data(tmp_path: Path) -> None:
    """Loading reads the data regions of a sparse queue file only: the units read, and zeros past them, are
    the file's bytes, whatever lies where (a written start, a hole, data again, written zeros)."""
    from indexcore.consumequeue import _read_units

    size = 300_000 * CQ_UNIT_SIZE
    path = tmp_path / f"{0:020d}"
    rng = random.Random(5)
    with open(path, "wb") as f:
        f.truncate(size)
    with open(path, "r+b") as f:
        for at, data in ((0, rng.randbytes(4100)), (1 << 20, rng.randbytes(60)), (3 << 20, bytes(8192))):
            f.seek(at)
            f.write(data)
    units = _read_units(str(path)).tobytes()
    whole = path.read_bytes()
    assert len(units) <= size
    assert whole[: len(units)] == units
    assert not any(whole[len(units):])
    assert len(units) < size  # the file's tail is a hole and was not read


def test_few_descriptors_for_many_queues_write_the_same_files(tmp_path: Path) -> None:
    """300 LMQ queues written through 2 descriptors (each queue reopened at every batch: appends not gathered)
    or through many."""
    w = writer(tmp_path)
    for i in range(900):
        w.append(Message("im-chat", i % 4, b"x", {MD: ",".join(f"%LMQ%r{(i * 7 + j) % 300}" for j in range(3))}))
    w.close()
    config = lmq_config(tmp_path, batch_bytes=4000)
    outs = []
    for limit in (2, 4096):
        cfg = load_config(config, {}, {"output.dir": str(tmp_path / f"out-{limit}")})
        from daemon.engine.dispatchers import ConsumeQueueDispatcher

        d = ConsumeQueueDispatcher(cfg.store, cfg.output.dir)
        d.queues.open_files.limit = limit
        d.gather_appends(0)
        log = CommitLog(str(tmp_path / "store" / "commitlog"), SEGMENT)
        reader = CommitLogReader(log, batch_bytes=4000, multi_flags=multi_dispatch_flags(True, True))
        offset = 0
        before = len(os.listdir("/proc/self/fd"))
        while True:
            res = reader.read(offset)
            d.dispatch(res.batch)
            assert len(d.queues.open_files) <= limit
            assert len(os.listdir("/proc/self/fd")) <= before + limit + 2  # none kept beside the set
            offset = res.next_offset
            if res.status is not ReadStatus.OK:
                break
        reader.close()
        d.flush()
        d.close()
        outs.append(files_under(tmp_path / f"out-{limit}" / "consumequeue"))
    assert len([k for k in outs[0] if k.startswith("%LMQ%")]) == 300  # 9 units each: one 10-unit file
    assert outs[0] == outs[1]


def test_thousands_of_new_queues_in_one_batch_under_a_small_descriptor_limit(tmp_path: Path) -> None:
    """2,000 LMQs first met in the same batch, created by one call, with RLIMIT_NOFILE at 256: the rebuild
    keeps within it (the created files' descriptors are closed at once, and written through the bounded set)
    and writes every queue."""
    import resource

    w = writer(tmp_path)
    appended = [w.append(Message("im-chat", i % 4, b"x", {MD: f"%LMQ%r{i}"})) for i in range(2000)]
    w.close()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    res = subprocess.run([*REPUTD, "rebuild", "--config", str(lmq_config(tmp_path)), "--json"], capture_output=True,
                         text=True, env=clean_env(), timeout=300, check=False, preexec_fn=limit)
    assert res.returncode == 0, res.stderr
    assert len(os.listdir(tmp_path / "out" / "consumequeue")) == 2001
    for i in (0, 999, 1999):
        assert queue_units(tmp_path / "out", f"%LMQ%r{i}", 0) == [(appended[i].phy_offset, appended[i].msg_size, 0)]


# --- the facts of NOTES.md, one by one --------------------------------------------------------------

def test_lmq_units_go_to_queue_0_and_plain_names_to_the_records_queue(tmp_path: Path) -> None:
    """Facts 1, 2, 4: `%LMQ%` names -> queue 0, other names -> the record's queue id, sharing the real
    topic's offsets; the unit is the record's own (offset, size, tagsCode) at the property's offset."""
    w = writer(tmp_path)
    first = w.append(Message("TopicTest", 2, b"a", {"TAGS": "x"}))
    second = w.append(Message("im-chat", 2, b"b", {"TAGS": "y", MD: "%LMQ%r1,TopicTest,im-mirror"}))
    third = w.append(Message("TopicTest", 2, b"c", {"KEYS": "k"}))
    w.close()
    assert record_at(tmp_path, second.phy_offset).property_map()[MQO] == "0,1,0"
    assert record_at(tmp_path, third.phy_offset).queue_offset == 2  # after the multi-dispatch unit at 1
    _, _, _ = quiet_rebuild(lmq_config(tmp_path))
    out = tmp_path / "out"
    unit = (second.phy_offset, second.msg_size, java_string_hash("y"))
    assert queue_units(out, "%LMQ%r1", 0) == [unit]
    assert queue_units(out, "im-mirror", 2) == [unit]
    assert queue_units(out, "TopicTest", 2) == [(first.phy_offset, first.msg_size, java_string_hash("x")), unit,
                                                (third.phy_offset, third.msg_size, 0)]
    assert queue_units(out, "im-chat", 2) == [unit]
    assert not (out / "consumequeue" / "%LMQ%r1" / "2").exists()


def test_lmq_names_with_dots_are_queues_like_any_other(tmp_path: Path) -> None:
    """A broker accepts any `%LMQ%` name its clients send; names such as `%LMQ%v2..double.dot` or `%LMQ%a.b.c`
    (written by a real 4.9.3 store: ConformanceWriter's second workload) get their directory and units."""
    names = ["%LMQ%v2..double.dot", "%LMQ%a.b.c", "%LMQ%-lead-dash", "%LMQ%p%q", "%LMQ%..x"]
    w = writer(tmp_path)
    m = w.append(Message("mqtt_parent-v2", 1, b"a", {"TAGS": "t", MD: ",".join(names)}))
    w.close()
    _, summary, _ = quiet_rebuild(lmq_config(tmp_path))
    assert summary.messages == 1
    unit = (m.phy_offset, m.msg_size, java_string_hash("t"))
    for name in names:
        assert queue_units(tmp_path / "out", name, 0) == [unit], name
    assert sorted(os.listdir(tmp_path / "out" / "consumequeue")) == sorted([*names, "mqtt_parent-v2"])


def test_without_enable_lmq_every_name_takes_the_records_queue(tmp_path: Path) -> None:
    """MultiDispatch.queueKey and multiDispatchLmqQueue use queue 0 only when enableLmq is set."""
    w = writer(tmp_path, lmq=False)
    m = w.append(Message("im-chat", 3, b"b", {MD: "%LMQ%r1"}))
    w.close()
    quiet_rebuild(lmq_config(tmp_path, lmq=False))
    assert queue_units(tmp_path / "out", "%LMQ%r1", 3) == [(m.phy_offset, m.msg_size, 0)]
    assert not (tmp_path / "out" / "consumequeue" / "%LMQ%r1" / "0").exists()


def test_trailing_comma_and_repeated_name(tmp_path: Path) -> None:
    """Fact 5: `a,b,` is two targets. Fact 6: `X,X` gets the same offset twice, one unit (the second is not
    past the queue's maxPhysicOffset) and the counter moves on by one."""
    w = writer(tmp_path)
    a = w.append(Message("im-chat", 0, b"a", {MD: "%LMQ%r1,%LMQ%r2,"}))
    b = w.append(Message("im-chat", 0, b"b", {MD: "%LMQ%r2,%LMQ%r2"}))
    c = w.append(Message("im-chat", 0, b"c", {MD: "%LMQ%r2"}))
    w.close()
    assert [record_at(tmp_path, x.phy_offset).property_map()[MQO] for x in (a, b, c)] == ["0,0", "1,1", "2"]
    quiet_rebuild(lmq_config(tmp_path))
    assert [u[0] for u in queue_units(tmp_path / "out", "%LMQ%r2", 0)] == [a.phy_offset, b.phy_offset, c.phy_offset]
    assert [u[0] for u in queue_units(tmp_path / "out", "%LMQ%r1", 0)] == [a.phy_offset]


def test_prepared_and_rollback_get_offsets_but_no_unit(tmp_path: Path) -> None:
    """Fact 7: PREPARED and ROLLBACK records carry INNER_MULTI_QUEUE_OFFSET, get no unit and do not move
    the counter; COMMIT gets fresh offsets. Fact 8: a half message (sysFlag 0) is multi-dispatched."""
    w = writer(tmp_path)
    prepared = w.append(Message("im-chat", 0, b"p", {MD: "%LMQ%r1"}, sys_flag=TRANSACTION_PREPARED_TYPE))
    rollback = w.append(Message("im-chat", 0, b"r", {MD: "%LMQ%r1"}, sys_flag=TRANSACTION_ROLLBACK_TYPE))
    half = w.append(Message("RMQ_SYS_TRANS_HALF_TOPIC", 0, b"h", {MD: "%LMQ%r1"}))
    commit = w.append(Message("im-chat", 0, b"c", {MD: "%LMQ%r1"}, sys_flag=TRANSACTION_COMMIT_TYPE))
    w.close()
    offsets = [record_at(tmp_path, x.phy_offset).property_map()[MQO] for x in (prepared, rollback, half, commit)]
    assert offsets == ["0", "0", "0", "1"]
    quiet_rebuild(lmq_config(tmp_path))
    assert [u[0] for u in queue_units(tmp_path / "out", "%LMQ%r1", 0)] == [half.phy_offset, commit.phy_offset]


def test_delayed_and_retry_messages(tmp_path: Path) -> None:
    """Fact 9: a delayed message (stored under SCHEDULE_TOPIC_XXXX) is multi-dispatched with the delivery
    time as tagsCode. Fact 10: a retry-topic message carrying the property is dispatched again."""
    w = writer(tmp_path)
    delayed = w.append(Message("im-chat", 1, b"d", {MD: "%LMQ%r1", "DELAY": "18", "TAGS": "t"}))
    retry = w.append(Message("%RETRY%cg-lmq", 0, b"r", {MD: "%LMQ%r1", "TAGS": "t"}))
    w.close()
    quiet_rebuild(lmq_config(tmp_path))
    units = queue_units(tmp_path / "out", "%LMQ%r1", 0)
    assert units == [(delayed.phy_offset, delayed.msg_size, delayed.store_timestamp + 2 * 3600 * 1000),
                     (retry.phy_offset, retry.msg_size, java_string_hash("t"))]
    assert queue_units(tmp_path / "out", SCHEDULE_TOPIC, 17)[0] == units[0]


def test_index_files_do_not_depend_on_multi_dispatch(tmp_path: Path) -> None:
    """Fact 11: IndexService keys on the stored topic only; the IndexFiles are the same with it off."""
    write_workload(tmp_path, lmq_workload(random.Random(3), 300))
    quiet_rebuild(lmq_config(tmp_path))
    quiet_rebuild(lmq_config(tmp_path, enableMultiDispatch=False), **{"output.dir": tmp_path / "off"})
    assert list(files_under(tmp_path / "out" / "index").values()) == list(files_under(tmp_path / "off" /
                                                                                      "index").values())
    on, off = files_under(tmp_path / "out" / "consumequeue"), files_under(tmp_path / "off" / "consumequeue")
    assert any(k.startswith("%LMQ%") for k in on)
    assert not any(k.startswith("%LMQ%") for k in off)


def test_the_writer_keeps_lmq_offsets_in_their_own_table(tmp_path: Path) -> None:
    """Fact 12: LMQ offsets live in lmqTopicQueueTable (`<name>-0`), plain targets in topicQueueTable; a
    writer reopened on the log finds both again."""
    w = writer(tmp_path)
    w.append(Message("im-chat", 1, b"a", {MD: "%LMQ%r1,mirror,%LMQ%r1"}))
    assert w.lmq_queue_offsets == {("%LMQ%r1", 0): 1}
    assert w.queue_offsets == {("im-chat", 1): 1, ("mirror", 1): 1}
    w.close()
    again = writer(tmp_path)
    assert again.lmq_queue_offsets == {("%LMQ%r1", 0): 1}
    assert again.queue_offsets == {("im-chat", 1): 1, ("mirror", 1): 1}
    again.close()


def test_offsets_restarting_at_0_are_put_as_the_broker_puts_them(tmp_path: Path) -> None:
    """Fact 13 (4.9.3 after a restart): offset 0 is appended wherever the queue ends, 1, 2, ... behind its
    end are skipped as built already; a new queue gets 0, 1, 2."""
    w = writer(tmp_path)
    before = [w.append(Message("im-chat", 0, b"x", {MD: "%LMQ%busy"})) for _ in range(25)]
    w.lmq_queue_offsets.clear()
    probes = [w.append(Message("im-chat", 0, b"p", {MD: "%LMQ%busy,%LMQ%new"})) for _ in range(3)]
    w.close()
    assert [record_at(tmp_path, p.phy_offset).property_map()[MQO] for p in probes] == ["0,0", "1,1", "2,2"]
    quiet_rebuild(lmq_config(tmp_path))
    busy = queue_units(tmp_path / "out", "%LMQ%busy", 0)
    assert [u[0] for u in busy] == [m.phy_offset for m in before] + [probes[0].phy_offset]
    assert [u[0] for u in queue_units(tmp_path / "out", "%LMQ%new", 0)] == [p.phy_offset for p in probes]


@pytest.mark.skipif(not LMQ_STORES, reason="no LMQ conformance store (../shared/conformance-next/lmq)")
def test_restart_probe_of_the_conformance_store(tmp_path: Path) -> None:
    """Fact 13 on the broker's own data: the manifest's restart probe (three puts after a reopen) appended to
    a copy of the LMQ store, rebuilt: the busiest LMQ and the new one end as the broker reported them."""
    store = LMQ_STORES[0]
    probe = store.manifest["restart_probe"]
    config = store.make_workspace(tmp_path)
    w = CommitLogWriter(str(tmp_path / "store" / "commitlog"), store.store_settings()["mappedFileSizeCommitLog"])
    puts = []
    for put in probe["puts"]:  # the offsets as the restarted broker stored them: no multi-dispatch writer
        props = dict(p.split("\x01", 1) for p in put["properties_string"].split("\x02"))
        puts.append(w.append(Message("im-chat", 0, b"probe", props)))
    w.close()
    cfg, _, _ = quiet_rebuild(config)
    queues = ConsumeQueueStore(cfg.output.dir, cfg.store.mapped_file_size_consume_queue, readonly=True)
    busy, fresh = queues.queue(probe["busiest_lmq"], 0), queues.queue("%LMQ%probe-new", 0)
    assert (busy.min_offset, busy.max_offset) == (probe["busiest_after"]["min_offset_in_queue"],
                                                  probe["busiest_after"]["max_offset_in_queue"])
    assert busy.max_physic_offset == puts[0].phy_offset + puts[0].msg_size
    for e in probe["busiest_cq_tail"]:
        units = busy.read_units(e["offset"])
        if e["commitlog_offset"] is None:
            assert units == []
        elif e["offset"] == probe["busiest_max_offset_before"]:
            assert units[0][:2] == (puts[0].phy_offset, puts[0].msg_size)  # the probe, wherever the queue ended
        else:
            assert units[0] == (e["commitlog_offset"], e["size"], e["tags_code"])
    assert [u[0] for u in fresh.read_units(0)] == [p.phy_offset for p in puts]
    assert fresh.max_offset == probe["fresh_after"]["max_offset_in_queue"]
    queues.close()


def test_names_and_offsets_of_different_counts_give_no_extra_unit(tmp_path: Path) -> None:
    """multiDispatchLmqQueue logs `[bug] queues.length!=queueOffsets.length` and returns: the record's own
    unit only. The daemon logs it too."""
    w = writer(tmp_path, multi=False)
    m = w.append(Message("im-chat", 0, b"a", {MD: "%LMQ%r1,%LMQ%r2", MQO: "0"}))
    w.close()
    _, _, logs = quiet_rebuild(lmq_config(tmp_path))
    assert queue_units(tmp_path / "out", "im-chat", 0) == [(m.phy_offset, m.msg_size, 0)]
    assert not (tmp_path / "out" / "consumequeue" / "%LMQ%r1").exists()
    warned = [e for e in logs if e["event"] == "multi_dispatch_count_mismatch"]
    assert [e["commit_log_offset"] for e in warned] == [m.phy_offset]


# --- where the broker stops: typed errors ------------------------------------------------------------

def cli(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, *args, "--config", str(config)], capture_output=True, text=True,
                          env=clean_env(), timeout=120, check=False)


@pytest.mark.parametrize(("props", "field"), [
    (b"", "properties"),  # fact 15: 4.9.3 dereferences the missing property map and retries forever
    (b"INNER_MULTI_DISPATCH\x01%LMQ%r1,%LMQ%r2\x02INNER_MULTI_QUEUE_OFFSET\x013,x", MULTI_QUEUE_OFFSET_FIELD),
    (b"INNER_MULTI_DISPATCH\x01%LMQ%r1\x02INNER_MULTI_QUEUE_OFFSET\x01-2", MULTI_QUEUE_OFFSET_FIELD),
    (b"INNER_MULTI_DISPATCH\x01%LMQ%r1\x02INNER_MULTI_QUEUE_OFFSET\x0199999999999999999999", MULTI_QUEUE_OFFSET_FIELD),
    (b"INNER_MULTI_DISPATCH\x01%LMQ%../../x\x02INNER_MULTI_QUEUE_OFFSET\x010", MULTI_DISPATCH_FIELD),
    (b"INNER_MULTI_DISPATCH\x01%LMQ%r1,,%LMQ%r2\x02INNER_MULTI_QUEUE_OFFSET\x010,0,0", MULTI_DISPATCH_FIELD),
])
def test_records_the_broker_cannot_dispatch_stop_the_rebuild(tmp_path: Path, props: bytes, field: str) -> None:
    """rebuild dispatches everything before, then exits 1 with one line naming the file, the offset and the
    field; nothing is written outside the output. With multi-dispatch off the same records are ordinary."""
    good = raw_record(0, b"INNER_MULTI_DISPATCH\x01%LMQ%r1\x02INNER_MULTI_QUEUE_OFFSET\x010")
    bad = raw_record(good.total_size, props)
    after = raw_record(good.total_size + bad.total_size, b"KEYS\x01k")  # not the last record: see below
    log = tmp_path / "store" / "commitlog"
    log.mkdir(parents=True)
    (log / f"{0:020d}").write_bytes(segment_of([good, bad, after]))
    config = lmq_config(tmp_path)
    res = cli(config, "rebuild")
    assert res.returncode == 1, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("reputd:")]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert f"{log / f'{0:020d}'} @ offset {good.total_size}: field {field}:" in lines[0]
    assert queue_units(tmp_path / "out", "%LMQ%r1", 0) == [(0, good.total_size, 0)]
    assert sorted(os.listdir(tmp_path / "out" / "consumequeue")) == ["%LMQ%r1", "T"]
    assert sorted(os.listdir(tmp_path)) == ["out", "reputd.yaml", "store"]
    off = lmq_config(tmp_path, enableMultiDispatch=False)
    res = cli(off, "rebuild", "--out", str(tmp_path / "off"))
    assert res.returncode == 0, res.stderr


def test_a_record_without_properties_at_the_end_is_waited_for(tmp_path: Path) -> None:
    """Its last byte is the zero of an empty PROPERTIESLENGTH, so at the very end of the written data it
    cannot be told from a record still being copied in: not dispatched, not an error yet (docs/correctness.md)."""
    log = tmp_path / "store" / "commitlog"
    log.mkdir(parents=True)
    first = raw_record(0, b"KEYS\x01k")
    (log / f"{0:020d}").write_bytes(segment_of([first, raw_record(first.total_size, b"")]))
    res = cli(lmq_config(tmp_path), "rebuild", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.splitlines()[-1])
    assert (summary["messages"], summary["endOffset"]) == (1, first.total_size)
    assert "field properties" in summary["pendingTail"]


def test_the_error_leaves_the_library_typed(tmp_path: Path) -> None:
    log = tmp_path / "store" / "commitlog"
    log.mkdir(parents=True)
    bad = raw_record(0, b"")
    (log / f"{0:020d}").write_bytes(segment_of([bad, raw_record(bad.total_size, b"KEYS\x01k")]))
    config = load_config(lmq_config(tmp_path), {})
    with structlog.testing.capture_logs(), pytest.raises(RebuildFailed) as info:
        rebuild(config)
    assert isinstance(info.value.cause, CorruptRecordError)
    assert (info.value.cause.field, info.value.cause.offset) == ("properties", 0)


# --- queries and inspect --------------------------------------------------------------------------------

def test_query_queue_and_inspect_show_lmq_messages(tmp_path: Path) -> None:
    w = writer(tmp_path)
    msgs = [w.append(Message("im-chat", i % 2, b"m", {MD: "%LMQ%room,%LMQ%other", "KEYS": f"k{i}"}))
            for i in range(5)]
    w.close()
    config = lmq_config(tmp_path)
    assert cli(config, "rebuild").returncode == 0
    res = cli(config, "query", "queue", "%LMQ%room", "0", "1", "--json")
    assert res.returncode == 0, res.stderr
    *got, _result = [json.loads(line) for line in res.stdout.splitlines()]
    assert [m["commitLogOffset"] for m in got] == [m.phy_offset for m in msgs[1:]]
    assert [m["queueOffset"] for m in got] == [0, 1, 1, 2]  # the record's own queue offset (fact 2)
    assert got[0]["properties"][MQO] == "1,1"
    result = query_queue(load_config(config, {}), "%LMQ%room", 0, 5)
    assert result.status == "OFFSET_OVERFLOW_ONE"
    seg = tmp_path / "store" / "commitlog" / f"{0:020d}"
    res = cli(config, "inspect", str(seg), "--json", "--limit", "2")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()][1:]
    assert rows[1]["properties"] == {MD: "%LMQ%room,%LMQ%other", "KEYS": "k1", MQO: "1,1"}
    cq = tmp_path / "out" / "consumequeue" / "%LMQ%room" / "0" / f"{0:020d}"
    res = cli(config, "inspect", str(cq), "--json")
    header, *units = [json.loads(line) for line in res.stdout.splitlines()]
    assert (header["topic"], header["queueId"], len(units)) == ("%LMQ%room", 0, 5)


# --- the batch rule shared by rebuild, run, backfill and verify -------------------------------------------

def test_consume_queue_units_orders_each_queue_as_the_broker_puts(tmp_path: Path) -> None:
    """A record's own unit comes before its targets, records in CommitLog order, whatever the queue."""
    w = writer(tmp_path)
    a = w.append(Message("TopicTest", 1, b"a", {MD: "TopicTest,%LMQ%r"}))
    b = w.append(Message("im-chat", 1, b"b", {MD: "TopicTest"}))
    w.close()
    reader = CommitLogReader(CommitLog(str(tmp_path / "store" / "commitlog"), SEGMENT),
                             multi_flags=multi_dispatch_flags(True, True))
    groups = list(consume_queue_units(reader.read(0).batch))
    reader.close()
    runs = {(g.topic, g.queue_id): (g.units["commit_log_offset"].tolist(), g.queue_offset.tolist(), g.one_streak)
            for g in groups}
    assert runs == {("TopicTest", 1): ([a.phy_offset, a.phy_offset, b.phy_offset], [0, 0, 1], False),
                    ("%LMQ%r", 0): ([a.phy_offset], [0], True), ("im-chat", 1): ([b.phy_offset], [0], True)}
    for g in groups:
        assert np.array_equal(g.ends, g.units["commit_log_offset"] + g.units["msg_size"])


@pytest.mark.parametrize("seed", range(12))
def test_grouping_by_counting_equals_grouping_by_sorting(tmp_path: Path, seed: int, monkeypatch) -> None:
    """consume_queue_units' two ways, the C counting sort and the numpy stable sort (for batches with too
    many queue keys), give the same groups, units and streak flags; each way's flat arrays
    (consume_queue_units_flat) hold every unit once, group after group in the order of their queue keys."""
    import indexcore.queuestore as cq

    rng = random.Random(seed)
    write_workload(tmp_path, lmq_workload(rng, rng.randint(20, 300)), lmq=seed % 3 != 0)
    reader = CommitLogReader(CommitLog(str(tmp_path / "store" / "commitlog"), SEGMENT),
                             multi_flags=multi_dispatch_flags(True, seed % 3 != 0),
                             batch_bytes=rng.choice([500, 1 << 20]))
    offset = 0

    def flat(groups):
        return [(g.topic, g.queue_id, g.queue_offset.tolist(), g.units.tobytes(), g.ends.tolist(), g.one_streak)
                for g in sorted(groups, key=lambda g: (g.topic, g.queue_id))]

    def whole(f):
        assert f.bounds[0] == 0
        assert f.bounds[-1] == len(f.units) == len(f.queue_offset) == len(f.ends)
        assert (np.diff(f.bounds) > 0).all()
        keys = list(zip(f.topic_index.tolist(), f.queue_id.tolist(), strict=True))
        assert keys == sorted(set(keys))

    while True:
        res = reader.read(offset)
        counted = flat(consume_queue_units(res.batch))
        whole(cq.consume_queue_units_flat(res.batch))
        with monkeypatch.context() as m:
            m.setattr(cq, "MAX_QUEUE_KEYS", 0)
            assert flat(consume_queue_units(res.batch)) == counted
            whole(cq.consume_queue_units_flat(res.batch))
        offset = res.next_offset
        if res.status is not ReadStatus.OK:
            break
    reader.close()


# --- the live daemon: recovery takes LMQ queues in ---------------------------------------------------------

class LmqStore(Store):
    """test_daemon's Store with multi-dispatch on, each message naming 0-3 of eight LMQ rooms."""

    def __init__(self, tmp: Path):
        super().__init__(tmp, store={"enableMultiDispatch": True, "enableLmq": True},
                         metrics={"enabled": False})
        self.writer.close()
        self.writer = CommitLogWriter(str(tmp / "store" / "commitlog"), self.writer.segment_size,
                                      clock=self.writer.clock, enable_multi_dispatch=True, enable_lmq=True)
        self.rng = random.Random(11)

    def append(self, n: int, body_size: int = 200) -> None:
        for _ in range(n):
            i = self.count
            names = ",".join(f"%LMQ%room-{self.rng.randrange(8)}" for _ in range(self.rng.randint(0, 3)))
            props = {"TAGS": f"Tag{i % 3}", "KEYS": f"order-{i}", "UNIQ_KEY": f"{i:032X}", MD: names}
            self.writer.append(Message("TopicA", i % 4, bytes([i % 251]) * (body_size + i % 50), props))
            self.count += 1


def test_kill9_of_an_lmq_daemon_then_restart_is_byte_identical(tmp_path: Path) -> None:
    """LMQ queues take part in recovery like any other: after `kill -9` at random moments while a writer
    appends, a restart (checkpoint truncation, resume offset) ends in the files of a clean rebuild."""
    store = LmqStore(tmp_path)
    rng = random.Random(20261123)
    store.append(200)
    decisions = []
    for _ in range(stress.scale(4, 40)):
        proc = store.start()
        time.sleep(rng.uniform(0.3, 1.2))
        store.append(rng.randint(20, 400))
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=20)
        decisions += [e["decision"] for e in events(out) if e["event"] == "recovered"]
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    decisions += [e["decision"] for e in events(res.stdout) if e["event"] == "recovered"]
    assert "checkpoint" in decisions, decisions
    expected = output_files(store.rebuild())
    assert output_files(store.out) == expected
    assert any(name.startswith("consumequeue/%LMQ%room-") for name in expected)
    store.writer.close()


def test_a_damaged_lmq_queue_is_quarantined_and_rebuilt(tmp_path: Path) -> None:
    store = LmqStore(tmp_path)
    store.append(300)
    assert store.run("--until-caught-up").returncode == 0
    cq_file = sorted((store.out / "consumequeue" / "%LMQ%room-3" / "0").iterdir())[0]
    with open(cq_file, "r+b") as f:
        f.truncate(100)
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    moved = [e for e in events(res.stdout) if e["event"] == "output_file_quarantined"]
    assert [Path(e["path"]) for e in moved] == [cq_file]
    assert output_files(store.out) == output_files(store.rebuild())
    store.writer.close()


def test_live_follow_writes_lmq_queues_as_they_come(tmp_path: Path) -> None:
    """While following, new LMQ queues appear as their first message is dispatched; SIGTERM leaves the
    files of a rebuild."""
    store = LmqStore(tmp_path)
    store.append(50)
    proc = store.start()
    try:
        for _ in range(5):
            store.append(60)
            store.writer.flush()
            wait_for((store.out / "reputd.checkpoint").exists, what="a checkpoint")
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert output_files(store.out) == output_files(store.rebuild())
    store.writer.close()


def test_hostile_lmq_name_in_a_prepared_record_is_never_dispatched(tmp_path: Path) -> None:
    """A PREPARED record gets no unit, so its names never become directories and are not checked."""
    good = raw_record(0, b"KEYS\x01k")
    prepared = raw_record(good.total_size, b"INNER_MULTI_DISPATCH\x01../../x\x02INNER_MULTI_QUEUE_OFFSET\x010",
                          sys_flag=TRANSACTION_PREPARED_TYPE)
    log = tmp_path / "store" / "commitlog"
    log.mkdir(parents=True)
    (log / f"{0:020d}").write_bytes(segment_of([good, prepared]))
    res = cli(lmq_config(tmp_path), "rebuild")
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(tmp_path / "out" / "consumequeue")) == ["T"]
    shutil.rmtree(tmp_path / "out")


def test_multi_dispatch_fields_are_declared_corruption_reasons():
    """Metrics label corruption by declared field names only: a hostile LMQ name must count, not crash."""
    assert {MULTI_DISPATCH_FIELD, MULTI_QUEUE_OFFSET_FIELD} <= set(CORRUPT_RECORD_FIELDS)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30), st.lists(st.integers(0, 40), max_size=30))
def test_a_flush_plans_candidates_are_the_union_of_the_unsynced_and_the_touched(unsynced, touched):
    """The ConsumeQueue flush plan's candidates (`dispatchers._union`, not `np.union1d`, whose `np.unique` imports
    numpy.ma): sorted, each slot once, as `np.union1d` gives them, empty inputs included."""
    a = np.unique(np.array(unsynced, dtype=np.int64))  # the plan's `_unsynced`: sorted, distinct
    b = np.unique(np.array(touched, dtype=np.int64))  # `take_touched`: sorted, distinct
    got = daemon.engine.dispatchers._union(a, b)
    assert got.dtype == np.int64
    assert got.tolist() == np.union1d(a, b).tolist()
