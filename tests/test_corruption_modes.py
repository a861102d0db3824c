"""Corruption modes end to end: the real `reputd run` as a subprocess on a damaged store.

tests/test_reader_corruption.py checks that the reader names each kind of damage; this file checks what
the daemon does about it (docs/correctness.md "Bad input" and docs/recovery.md):

* damage to a CommitLog record, or a missing segment: under `onCorruption: stop`, `--until-caught-up`
  exits 1 once with the checkpoint at the bad offset; a running daemon stays up at the bad offset,
  degraded, logs one `corrupt_commitlog` event (file, offset, reason) and counts it once, re-reads
  every poll interval and goes on once the bytes are repaired, ending with the files of a clean
  rebuild. Under `skip-segment` it logs and counts the skipped range and dispatches everything else.
* a CommitLog directory the broker would refuse to load (a segment of the wrong size, a stray file):
  `--until-caught-up` exits 1 once, a running daemon reports `down` and waits for the directory to be
  fixed, under either policy;
* a damaged `reputd.checkpoint` is reported with its path and not trusted;
* an output file of the wrong size or with a garbage header at start-up is quarantined and rebuilt.

Never a traceback, never a crash loop. The store is small (about 2.3 segments of 256 KiB) and every
daemon's reference output is one rebuild of the undamaged store, made once for the module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemon.engine.checkpoint import CHECKPOINT_FILE, Checkpoint, write_checkpoint
from indexcore.reader import CommitLog, CommitLogReader, ReadStatus
from tests.test_daemon import SEGMENT, Store, events, output_files, stop, wait_for

MESSAGES = 1500  # about 2.3 segments: segment 1 is whole and has a written successor
BODY_AT = 88  # IPv4 hosts: BODY starts after the 88-byte fixed part
SMALL_MAX_MESSAGE_SIZE = 1024  # records here are 400-500 bytes
BLANK_UNIT_SIZE = 0x7FFFFFFF
WAIT_S = 20.0


# --- the store ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rec:
    phy: int
    size: int
    topic: str
    queue_id: int


def make_store(tmp: Path, policy: str = "stop", store_cfg: dict | None = None) -> Store:
    tmp.mkdir(parents=True, exist_ok=True)
    store = Store(tmp, reput={"onCorruption": policy}, store=dict(store_cfg or {}))
    store.append(MESSAGES)
    store.writer.flush()
    return store


def log_dir(store: Store) -> Path:
    return store.tmp / "store" / "commitlog"


def seg_file(store: Store, offset: int) -> Path:
    return log_dir(store) / f"{offset - offset % SEGMENT:020d}"


def records(store: Store) -> list[Rec]:
    """Every record of the (undamaged) store, through the public reader."""
    reader = CommitLogReader(CommitLog(str(log_dir(store)), SEGMENT))
    out: list[Rec] = []
    offset = 0
    try:
        while True:
            res = reader.read(offset)
            b = res.batch
            out += [Rec(int(b.phy_offset[i]), int(b.msg_size[i]), b.topic_of(i), int(b.queue_id[i]))
                    for i in range(len(b))]
            offset = res.next_offset
            if res.status is not ReadStatus.OK:
                assert res.status is ReadStatus.END, res.error
                return out
    finally:
        reader.close()


def victim(recs: list[Rec]) -> Rec:
    """The third record of segment 1: records before it in its segment, and a written segment after."""
    in_seg1 = [r for r in recs if r.phy // SEGMENT == 1]
    assert recs[-1].phy // SEGMENT == 2
    return in_seg1[2]


def patch(store: Store, offset: int, data: bytes) -> None:
    with open(seg_file(store, offset), "r+b") as f:
        f.seek(offset % SEGMENT)
        f.write(data)


def read_at(store: Store, offset: int, n: int) -> bytes:
    with open(seg_file(store, offset), "rb") as f:
        f.seek(offset % SEGMENT)
        return f.read(n)


def cq_phys(out: Path) -> dict[tuple[str, int], list[int]]:
    """The CommitLog offsets of the real units of every ConsumeQueue, in file order."""
    found: dict[tuple[str, int], list[int]] = {}
    for qdir in sorted((out / "consumequeue").glob("*/*")):
        data = b"".join(p.read_bytes() for p in sorted(qdir.iterdir()))
        phys = [phy for phy, size, _ in struct.iter_unpack(">qiq", data) if 0 < size < BLANK_UNIT_SIZE]
        if phys:
            found[(qdir.parent.name, int(qdir.name))] = phys
    return found


def expected_phys(recs: list[Rec], keep: Callable[[int], bool]) -> dict[tuple[str, int], list[int]]:
    found: dict[tuple[str, int], list[int]] = {}
    for r in recs:
        if keep(r.phy):
            found.setdefault((r.topic, r.queue_id), []).append(r.phy)
    return found


def checkpoint_offset(store: Store) -> int:
    return json.loads((store.out / CHECKPOINT_FILE).read_text())["payload"]["reputFromOffset"]


def named(stdout: str, name: str) -> list[dict]:
    return [e for e in events(stdout) if e["event"] == name]


def assert_clean_stderr(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr


def alive_for(proc: subprocess.Popen, seconds: float) -> None:
    """The process is still running after `seconds` (no crash, no exit)."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return
    raise AssertionError(f"reputd exited with {proc.returncode}")


@pytest.fixture(scope="module")
def caught_up(tmp_path_factory) -> Path:
    """An output directory `reputd run --until-caught-up` made from the undamaged store, checkpoint
    included (every store here is written identically, and the output holds no absolute path)."""
    store = make_store(tmp_path_factory.mktemp("reference"))
    store.writer.close()
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    return store.out


@pytest.fixture(scope="module")
def reference(caught_up) -> dict[str, bytes]:
    """The files of a clean run, which are those of a clean rebuild (tests/test_daemon.py)."""
    return output_files(caught_up)


def with_output(store: Store, caught_up: Path) -> None:
    """Give the store the output and checkpoint of a clean earlier run."""
    shutil.copytree(caught_up, store.out)


# --- damage to records and segments ---------------------------------------------------------------

@dataclass(frozen=True)
class Damage:
    """Byte surgery on the store around record `v`; `bad` is the offset the daemon must stop at."""

    reason: str  # the field at fault: the `reason` label and log field
    apply: Callable[[Store, Rec], None]
    store_cfg: dict = field(default_factory=dict)
    at_segment_start: bool = False  # the bad offset is the start of v's segment, not v

    def bad(self, v: Rec) -> int:
        return v.phy - v.phy % SEGMENT if self.at_segment_start else v.phy


def _flip_body_byte(store: Store, v: Rec) -> None:
    at = v.phy + BODY_AT + 5
    patch(store, at, bytes([read_at(store, at, 1)[0] ^ 0x5A]))


def _total_size(value: Callable[[Rec], int]) -> Callable[[Store, Rec], None]:
    return lambda store, v: patch(store, v.phy, struct.pack(">i", value(v)))


def _remove_segment(store: Store, v: Rec) -> None:
    os.unlink(seg_file(store, v.phy))


DAMAGE = {
    "body_crc": Damage("body_crc", _flip_body_byte),
    "bad_magic": Damage("magic_code", lambda store, v: patch(store, v.phy + 4, struct.pack(">I", 0x12345678))),
    "total_size_zero": Damage("total_size", _total_size(lambda v: 0)),
    "total_size_negative": Damage("total_size", _total_size(lambda v: -7)),
    "total_size_past_segment": Damage("total_size", _total_size(lambda v: SEGMENT - v.phy % SEGMENT + 1)),
    "total_size_over_max_message_size": Damage("total_size", _total_size(lambda v: SMALL_MAX_MESSAGE_SIZE + 1),
                                                store_cfg={"maxMessageSize": SMALL_MAX_MESSAGE_SIZE}),
    "physical_offset_not_position": Damage(
        "physical_offset", lambda store, v: patch(store, v.phy + 28, struct.pack(">q", v.phy + 8))),
    "zeros_to_segment_end": Damage(
        "total_size", lambda store, v: patch(store, v.phy, bytes(SEGMENT - v.phy % SEGMENT))),
    "missing_segment": Damage("layout", _remove_segment, at_segment_start=True),
}


class Snapshot:
    """The bytes of the victim's segment before the damage, to repair it in place as an operator would."""

    def __init__(self, store: Store, offset: int):
        self.path = seg_file(store, offset)
        self.data = self.path.read_bytes()
        self.scratch = store.tmp / "restore.tmp"

    def repair(self) -> None:
        if not self.path.exists():
            self.scratch.write_bytes(self.data)  # written elsewhere, then renamed in: never a short segment
            os.replace(self.scratch, self.path)
            return
        now = self.path.read_bytes()
        diff = [i for i in range(len(now)) if now[i] != self.data[i]] if len(now) == len(self.data) else []
        assert diff, "nothing to repair"
        lo, hi = diff[0], diff[-1] + 1
        with open(self.path, "r+b") as f:  # the head of the record last, so it is never seen half repaired
            f.seek(lo + 8)
            f.write(self.data[lo + 8 : hi])
            f.flush()
            f.seek(lo)
            f.write(self.data[lo : min(lo + 8, hi)])


def damaged_store(tmp: Path, case: Damage, policy: str) -> tuple[Store, list[Rec], int, Snapshot]:
    store = make_store(tmp, policy, case.store_cfg)
    recs = records(store)
    v = victim(recs)
    snapshot = Snapshot(store, v.phy)
    case.apply(store, v)
    return store, recs, case.bad(v), snapshot


def assert_one_corrupt_event(stdout: str, store: Store, bad: int, reason: str, policy: str) -> None:
    corrupt = named(stdout, "corrupt_commitlog")
    assert len(corrupt) == 1, corrupt
    e = corrupt[0]
    assert (e["file"], e["offset"], e["reason"], e["policy"]) == (str(seg_file(store, bad)), bad, reason, policy)
    assert e["level"] == "error"
    assert str(bad) in e["error"]


@pytest.mark.parametrize("case", DAMAGE.values(), ids=DAMAGE.keys())
def test_record_damage_under_both_policies(tmp_path, reference, case: Damage):
    """The same damage to three copies of the store, checked side by side (the daemons mostly wait):
    `--until-caught-up` and a live daemon under `stop`, a live daemon under `skip-segment`."""
    skip_store, recs, bad, _ = damaged_store(tmp_path / "skip", case, "skip-segment")
    live_store, _, _, snapshot = damaged_store(tmp_path / "stop", case, "stop")
    once_store, _, _, _ = damaged_store(tmp_path / "once", case, "stop")
    procs = [live_store.start(), skip_store.start()]
    try:
        check_until_caught_up_stops(once_store, recs, bad, case.reason)
        check_live_stop(live_store, procs[0], bad, snapshot, case.reason)
        check_live_skip_segment(skip_store, bad, case.reason)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        (stop_code, stop_out, stop_err), (skip_code, skip_out, skip_err) = (
            (p.wait(timeout=WAIT_S), *p.communicate()) for p in procs)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                proc.communicate()
    assert stop_code == 0, stop_err
    assert_clean_stderr(stop_err)
    assert_one_corrupt_event(stop_out, live_store, bad, case.reason, "stop")
    assert output_files(live_store.out) == reference

    assert skip_code == 0, skip_err
    assert_clean_stderr(skip_err)
    assert_one_corrupt_event(skip_out, skip_store, bad, case.reason, "skip-segment")
    next_segment = bad - bad % SEGMENT + SEGMENT
    skipped = named(skip_out, "segment_skipped")
    assert len(skipped) == 1
    assert (skipped[0]["file"], skipped[0]["skipped_from"], skipped[0]["skipped_to"], skipped[0]["skipped_bytes"]
            ) == (str(seg_file(skip_store, bad)), bad, next_segment, next_segment - bad)
    assert checkpoint_offset(skip_store) == skip_store.end
    assert cq_phys(skip_store.out) == expected_phys(recs, lambda phy: not bad <= phy < next_segment)


def check_until_caught_up_stops(store: Store, recs: list[Rec], bad: int, reason: str) -> None:
    """Everything before the damage, a checkpoint at it, exit 1 once."""
    res = store.run("--until-caught-up")
    assert res.returncode == 1, res.stderr
    assert_clean_stderr(res.stderr)
    assert_one_corrupt_event(res.stdout, store, bad, reason, "stop")
    assert checkpoint_offset(store) == bad
    assert cq_phys(store.out) == expected_phys(recs, lambda phy: phy < bad)


def check_live_stop(store: Store, proc: subprocess.Popen, bad: int, snapshot: Snapshot, reason: str) -> None:
    """Stays at the offset, degraded, reports and counts once, re-reads, goes on once repaired."""
    health = wait_for(lambda: store.health()["status"] == "degraded" and store.health(), WAIT_S, "degraded")
    assert health["reputFromOffset"] == bad
    assert health["reason"].startswith("corrupt")
    assert str(bad) in health["reason"]
    wait_for(lambda: store.health()["checkpointOffset"] == bad, WAIT_S, "checkpoint at the bad offset")
    alive_for(proc, 0.3)  # six poll intervals: still up, still stuck, still one report
    m = store.metrics()
    assert m[f"reputd_corrupt_records_total{{reason={reason}}}"] == 1
    assert m["reputd_health{state=degraded}"] == 1
    assert m["reputd_reput_offset_bytes"] == bad
    assert m["rocketmq_storage_dispatch_behind_bytes"] > 0
    assert store.health()["reputFromOffset"] == bad
    snapshot.repair()
    wait_for(lambda: store.health()["checkpointOffset"] == store.end, WAIT_S, "catch-up after the repair")
    wait_for(lambda: store.health()["status"] == "healthy", WAIT_S, "healthy after the repair")
    assert store.metrics()[f"reputd_corrupt_records_total{{reason={reason}}}"] == 1


def check_live_skip_segment(store: Store, bad: int, reason: str) -> None:
    """Logs, counts the skipped range and goes on at the next segment, healthy."""
    next_segment = bad - bad % SEGMENT + SEGMENT
    wait_for(lambda: store.health()["reputFromOffset"] == store.end, WAIT_S, "skip past the bad segment")
    m = store.metrics()
    assert m[f"reputd_corrupt_records_total{{reason={reason}}}"] == 1
    assert m["reputd_skipped_bytes_total{reason=corruption}"] == next_segment - bad
    assert store.health()["status"] == "healthy"


def test_skip_segment_until_caught_up_exits_0(tmp_path):
    """`--until-caught-up` under skip-segment treats a skipped range as handled: exit 0 at the end."""
    store, _, bad, _ = damaged_store(tmp_path, DAMAGE["body_crc"], "skip-segment")
    res = store.run("--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert_clean_stderr(res.stderr)
    assert_one_corrupt_event(res.stdout, store, bad, "body_crc", "skip-segment")
    assert [e["skipped_from"] for e in named(res.stdout, "segment_skipped")] == [bad]
    assert checkpoint_offset(store) == store.end


# --- a CommitLog directory the broker would not load ------------------------------------------------

def _truncate_older_segment(store: Store) -> Callable[[], None]:
    path = log_dir(store) / f"{SEGMENT:020d}"
    data = path.read_bytes()
    os.truncate(path, SEGMENT - 100)

    def repair() -> None:
        (store.tmp / "restore.tmp").write_bytes(data)
        os.replace(store.tmp / "restore.tmp", path)
    return repair


def _grow_segment(store: Store) -> Callable[[], None]:
    path = log_dir(store) / f"{SEGMENT:020d}"
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    return lambda: os.truncate(path, SEGMENT)


def _stray_file(store: Store) -> Callable[[], None]:
    path = log_dir(store) / "README.txt"
    path.write_text("not a segment")
    return path.unlink


LAYOUT = {"truncated_segment": _truncate_older_segment, "oversized_segment": _grow_segment,
          "stray_file": _stray_file}
LAYOUT_PATHS = {"truncated_segment": f"{SEGMENT:020d}", "oversized_segment": f"{SEGMENT:020d}",
                "stray_file": "README.txt"}


@pytest.mark.parametrize("kind", LAYOUT)
def test_commitlog_the_broker_would_not_load_is_reported_not_crash_looped(tmp_path, reference, kind: str):
    store = make_store(tmp_path)
    store.writer.close()
    repair = LAYOUT[kind](store)
    bad_path = str(log_dir(store) / LAYOUT_PATHS[kind])
    # the whole directory is refused, so the policy has nothing to skip: skip-segment here, stop below
    res = store.run("--until-caught-up", env={"REPUTD_REPUT_ON_CORRUPTION": "skip-segment"})
    assert res.returncode == 1, res.stderr
    assert_clean_stderr(res.stderr)
    failed = named(res.stdout, "recovery_failed")
    assert len(failed) == 1
    assert bad_path in failed[0]["error"]
    proc = store.start()
    try:
        # /healthz is 503 "starting" before recovery has run: wait for recovery's own verdict
        health = wait_for(lambda: store.get("/healthz")[0] == 503 and store.health()["reason"] != "starting"
                          and store.health(), WAIT_S, "down")
        assert health["status"] == "down"
        assert bad_path in health["reason"]
        assert store.metrics()["reputd_errors_total{kind=recovery}"] >= 1
        assert store.metrics()["reputd_health{state=down}"] == 1
        alive_for(proc, 0.2)
        repair()
        wait_for(lambda: store.health()["checkpointOffset"] == store.end, WAIT_S, "catch-up after the repair")
        assert store.health()["status"] == "healthy"
    finally:
        code, out, err = stop(proc)
    assert code == 0, err + out[-4000:]  # stdout: the events that decided the exit code
    assert_clean_stderr(err)
    failed = named(out, "recovery_failed")
    assert failed
    assert all(bad_path in e["error"] and e["retry_in_s"] > 0 for e in failed)
    assert output_files(store.out) == reference


def test_stray_file_appearing_while_running_is_reported_once_and_waited_out(tmp_path):
    store = make_store(tmp_path)
    proc = store.start()
    stray = log_dir(store) / "core.1234"
    try:
        wait_for(lambda: store.health()["reputFromOffset"] == store.end, WAIT_S, "catch-up")
        stray.write_bytes(b"\0" * 100)
        store.append(50)
        health = wait_for(lambda: store.get("/healthz")[0] == 503 and store.health(), WAIT_S, "down")
        assert str(stray) in health["reason"]
        alive_for(proc, 0.3)
        assert store.metrics()["reputd_errors_total{kind=commitlog}"] == 1
        stray.unlink()
        wait_for(lambda: store.health()["reputFromOffset"] == store.end, WAIT_S, "catch-up once it is gone")
        wait_for(lambda: store.health()["status"] == "healthy", WAIT_S, "healthy once it is gone")
    finally:
        code, out, err = stop(proc)
        store.writer.close()
    assert code == 0, err
    assert_clean_stderr(err)
    gone = named(out, "commitlog_unavailable")
    assert len(gone) == 1
    assert gone[0]["path"] == str(stray)
    assert_complete(store)


def assert_complete(store: Store) -> None:
    assert cq_phys(store.out) == expected_phys(records(store), lambda phy: True)


# --- reputd's checkpoint --------------------------------------------------------------------------

def _crc_mismatch(path: Path) -> None:
    doc = json.loads(path.read_text())
    doc["payload"]["reputFromOffset"] = 5
    path.write_text(json.dumps(doc))


def _past_the_end(path: Path) -> None:
    """A well-formed checkpoint (right CRC) beyond the CommitLog: from another store, say."""
    write_checkpoint(str(path.parent), Checkpoint(10 * SEGMENT, {}, 0))


CHECKPOINT_DAMAGE = {
    "garbage": (lambda p: p.write_bytes(os.urandom(64)), "checkpoint_corrupt"),
    "empty": (lambda p: p.write_bytes(b""), "checkpoint_corrupt"),
    "crc_mismatch": (_crc_mismatch, "checkpoint_corrupt"),
    "past_the_end": (_past_the_end, "checkpoint_distrusted"),
}


@pytest.mark.parametrize("kind", CHECKPOINT_DAMAGE)
def test_damaged_checkpoint_is_reported_and_not_trusted(tmp_path, caught_up, reference, kind: str):
    store = make_store(tmp_path)
    store.writer.close()
    with_output(store, caught_up)
    damage, event = CHECKPOINT_DAMAGE[kind]
    path = store.out / CHECKPOINT_FILE
    damage(path)
    proc = store.start()
    try:
        wait_for(lambda: store.health()["checkpointOffset"] == store.end, WAIT_S, "catch-up")
        m = store.metrics()
        assert m["reputd_errors_total{kind=checkpoint}"] == 1
        assert m["reputd_recoveries_total{decision=derived}"] == 1
        assert store.health()["status"] == "healthy"
    finally:
        code, out, err = stop(proc)
    assert code == 0, err
    assert_clean_stderr(err)
    reported = named(out, event)
    assert len(reported) == 1
    assert reported[0]["level"] == "error"
    if event == "checkpoint_corrupt":
        assert reported[0]["path"] == str(path)
    else:
        assert reported[0]["reput_from_offset"] == 10 * SEGMENT
    assert [e["decision"] for e in named(out, "recovered")] == ["derived"]
    assert output_files(store.out) == reference


# --- damaged output files at start-up ---------------------------------------------------------------

def _index_files(store: Store) -> list[Path]:
    files = sorted((store.out / "index").iterdir())
    assert len(files) >= 3
    return files


def _truncate(path: Path, size: int) -> Path:
    os.truncate(path, size)
    return path


def _garbage_index_header(store: Store) -> Path:
    path = _index_files(store)[1]
    with open(path, "r+b") as f:
        f.write(b"\xff" * 40)  # negative timestamps and offsets, indexCount -1
    return path


def _garbage_cq_unit(store: Store) -> Path:
    path = sorted((store.out / "consumequeue" / "TopicA" / "1").iterdir())[0]
    with open(path, "r+b") as f:
        f.write(b"\xab" * 20)  # unit 0: a negative CommitLog offset, with valid units after it
    return path


OUTPUT_DAMAGE = {
    "cq_wrong_size": lambda s: _truncate(sorted((s.out / "consumequeue" / "TopicB" / "2").iterdir())[0], 1000),
    "index_wrong_size": lambda s: _truncate(_index_files(s)[1], 1000),
    "index_garbage_header": _garbage_index_header,
    "cq_garbage_unit": _garbage_cq_unit,
}


@pytest.mark.parametrize("damage", OUTPUT_DAMAGE.values(), ids=OUTPUT_DAMAGE.keys())
def test_damaged_output_file_is_quarantined_and_rebuilt(tmp_path, caught_up, reference, damage):
    store = make_store(tmp_path)
    store.writer.close()
    with_output(store, caught_up)
    bad = damage(store)
    proc = store.start()
    try:
        wait_for(lambda: store.health()["checkpointOffset"] == store.end, WAIT_S, "catch-up")
        m = store.metrics()
        assert m["reputd_errors_total{kind=recovery}"] >= 1
        assert m["reputd_recoveries_total{decision=replay}"] == 1
        assert store.health()["status"] == "healthy"
    finally:
        code, out, err = stop(proc)
    assert code == 0, err
    assert_clean_stderr(err)
    moved = named(out, "output_file_quarantined")
    assert moved, "nothing was quarantined"
    assert moved[0]["path"] == str(bad)
    assert str(bad) in moved[0]["moved"] or str(bad.parent) in moved[0]["moved"]
    quarantined = [p for p in (store.out / "quarantine").rglob("*") if p.is_file()]
    assert bad.name in {p.name for p in quarantined}
    assert named(out, "replay_marker_written")[0]["reput_from_offset"] == 0
    assert output_files(store.out) == reference
