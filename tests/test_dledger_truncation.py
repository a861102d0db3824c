"""After a DLedger leader change cuts entries `reputd run` already dispatched, the output is repaired exactly: it
equals a clean `reputd rebuild` of the new log, and no unit or key of a cut entry is left (daemon/dledgerfence.py).

The logs are the real 4.9.3 DLedger store in shared/ (`dledger`, 3,015 entries of term 0), followed to its end by
`reputd run`, then changed as a node that led and then follows a new leader sees its log changed
(DLedgerMmapFileStore.truncate): cut after entry k and, for most cases, continued with a new leader's entries of
term 1 (other messages, queue offsets going on from the entries kept), written by indexcore/dledgerwriter.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from daemon.config import load_config
from daemon.engine.checkpoint import Checkpoint, read_checkpoint
from daemon.engine.checkpoint import write_checkpoint as engine_write_checkpoint
from daemon.engine.dledgerfence import DLedgerLogView, repair_truncation
from daemon.ops.metrics import ReputMetrics
from indexcore.commitlog import TRANSACTION_COMMIT_TYPE, TRANSACTION_NOT_TYPE, MessageRecord, transaction_type
from indexcore.dledger import ENTRY_HEADER_SIZE
from indexcore.dledgerwriter import DLedgerLogWriter, write_checkpoint
from indexcore.writer import CommitLogWriter, Message
from tests.conformance import conformance_roots
from tests.test_daemon import clean_env, free_port

SEGMENT = 65536
SETTINGS = {"mappedFileSizeCommitLog": SEGMENT, "mappedFileSizeConsumeQueue": 1280, "maxHashSlotNum": 97,
            "maxIndexNum": 400, "enableDLegerCommitLog": True, "dLegerSelfId": "n0", "dLegerGroup": "broker-a",
            "dLegerPeers": "n0-127.0.0.1:40911;n1-127.0.0.1:40912;n2-127.0.0.1:40913"}
REPUTD = [sys.executable, "-m", "daemon.cli"]


def _dledger_store() -> Path | None:
    for root in conformance_roots():
        if (root / "dledger" / "store" / "dledger-n0" / "data").is_dir():
            return root / "dledger" / "store"
    return None


STORE = _dledger_store()
pytestmark = pytest.mark.skipif(STORE is None, reason="the shared dledger conformance store is not on this machine")


def config(path: Path, root: Path, out: Path, **extra) -> Path:
    path.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **SETTINGS}, "output": {"dir": str(out)},
                                    "logging": {"level": "info", "format": "json"}, **extra}))
    return path


def reputd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, *args], capture_output=True, text=True, env=clean_env(), timeout=300, check=False)


def output_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for sub in ("consumequeue", "index")
            for p in sorted((out / sub).rglob("*")) if p.is_file()}


def reput_from_offset(port: int) -> int | None:
    """What /healthz says the loop has dispatched (the checkpoint follows at the next complete flush)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return json.loads(r.read()).get("reputFromOffset")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def events(stderr: str, name: str) -> list[dict]:
    found = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc.get("event") == name:
                found.append(doc)
    return found


def entries(root: Path) -> list[tuple[int, int, int, bytes]]:
    """Every entry of the log: (index, term, pos, message bytes)."""
    view = DLedgerLogView(load_config(str(config(root.parent / "view.yaml", root, root.parent / "unused"))).store)
    out, i = [], 0
    while (e := view.by_index(i)) is not None:
        with open(os.path.join(view.data, f"{e.pos - e.pos % SEGMENT:020d}"), "rb") as f:
            out.append((e.index, e.term, e.pos, os.pread(f.fileno(), e.size - ENTRY_HEADER_SIZE,
                                                         e.pos % SEGMENT + ENTRY_HEADER_SIZE)))
        i += 1
    return out


def new_leader(root: Path, keep: int, new: int, *, term: int = 1, committed: int | None = None,
               body_size: int = 200) -> int:
    """Cut the log of `root` after its first `keep` entries and append `new` entries of `term` (messages a new
    leader took: queue offsets go on from the entries kept); the checkpoint's committedIndex becomes
    `committed` (default: the last entry). Returns the new log's end."""
    old = entries(root)
    kept = old[:keep]
    next_offset: dict[tuple[str, int], int] = {}
    last_ts = 0
    for _, _, _, body in kept:
        rec = MessageRecord.decode(body, check_crc=False)
        last_ts = max(last_ts, rec.store_timestamp)
        if transaction_type(rec.sys_flag) in (TRANSACTION_NOT_TYPE, TRANSACTION_COMMIT_TYPE):
            next_offset[(rec.topic, rec.queue_id)] = rec.queue_offset + 1
    writer = DLedgerLogWriter(str(root / "dledger-n0"), SEGMENT)
    writer.next_index = len(old)
    cut = old[keep][2] if keep < len(old) else None
    if cut is not None:
        writer.truncate_to(keep, cut)
    else:
        writer.pos = old[-1][2] + ENTRY_HEADER_SIZE + len(old[-1][3])
    scratch = root.parent / f"scratch-{keep}-{new}"
    ticks = iter(range(last_ts + 1000, last_ts + 1000 + 10 * new + 10, 10))
    plain = CommitLogWriter(str(scratch), SEGMENT, clock=lambda: next(ticks))
    plain.queue_offsets.update(next_offset)
    for i in range(new):
        topic = ("TopicTest", "order-events_v2", "NewLeaderTopic")[i % 3]
        r = plain.append(Message(topic, i % 4, bytes([i % 251]) * (body_size + i % 97),
                                 {"KEYS": f"leader2-{i} HOTKEY", "TAGS": "TagA", "UNIQ_KEY": f"L2{i:030X}"}))
        with open(scratch / f"{r.phy_offset - r.phy_offset % SEGMENT:020d}", "rb") as f:
            writer.append(os.pread(f.fileno(), r.msg_size, r.phy_offset % SEGMENT), term)
    plain.close()
    last = writer.next_index - 1
    write_checkpoint(str(root / "dledger-n0"), last if committed is None else committed, last)
    return writer.pos


@pytest.fixture
def followed(tmp_path):
    """A copy of the real DLedger store, and the output of a `reputd run` that followed it to its end."""
    root = tmp_path / "store"
    shutil.copytree(STORE / "dledger-n0", root / "dledger-n0")
    out = tmp_path / "out"
    cfg = config(tmp_path / "reputd.yaml", root, out)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    return root, out, cfg


def clean_rebuild(tmp_path: Path, root: Path) -> dict[str, bytes]:
    out = tmp_path / "clean"
    res = reputd("rebuild", "--config", str(config(tmp_path / "clean.yaml", root, out)))
    assert res.returncode == 0, res.stderr[-2000:]
    return output_files(out)


@pytest.mark.parametrize(("keep", "new"), [(2990, 60), (3014, 1), (2500, 30), (0, 40)],
                         ids=["tail-rewritten-longer", "last-entry-replaced", "many-cut-fewer-new", "all-replaced"])
def test_run_after_a_new_leader_cut_equals_a_clean_rebuild_of_the_new_log(tmp_path, followed, keep, new):
    root, out, cfg = followed
    dispatched = read_checkpoint(str(out)).reput_from_offset
    end = new_leader(root, keep, new)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    repaired = events(res.stdout, "dledger_truncation_repaired")
    assert len(repaired) == 1, res.stdout[-3000:]
    assert repaired[0]["dispatched_entry"] == 3014
    assert repaired[0]["shared_entry"] == (keep - 1 if keep else None)
    assert repaired[0]["old_reput_from_offset"] == dispatched
    assert read_checkpoint(str(out)).reput_from_offset == end
    assert output_files(out) == clean_rebuild(tmp_path, root)


def test_a_log_cut_shorter_keeps_no_unit_or_key_of_the_cut_entries(tmp_path, followed):
    """The new leader has not written past the cut yet: the log ends earlier than what was dispatched."""
    root, out, cfg = followed
    end = new_leader(root, 2800, 0, committed=2799)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(events(res.stdout, "dledger_truncation_repaired")) == 1
    assert read_checkpoint(str(out)).reput_from_offset == end
    assert output_files(out) == clean_rebuild(tmp_path, root)


def test_a_term_change_without_a_cut_is_not_a_truncation(tmp_path, followed):
    """A new leader that kept every entry appends in a higher term: nothing is repaired, all is dispatched."""
    root, out, cfg = followed
    new_leader(root, 3015, 25, term=3)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    assert events(res.stdout, "dledger_truncation_repaired") == []
    assert output_files(out) == clean_rebuild(tmp_path, root)
    state = read_checkpoint(str(out)).dispatchers["dledger"]
    assert state["terms"] == [[0, 0], [3, 3015]]
    assert (state["index"], state["term"]) == (3039, 3)


def test_the_repair_is_counted_and_a_second_start_finds_nothing(tmp_path, followed):
    root, _, cfg = followed
    new_leader(root, 2990, 10)
    metrics = ReputMetrics(lambda: None)
    repair = repair_truncation(load_config(str(cfg)), metrics=metrics)
    assert repair is not None
    assert repair.shared.index == 2989
    assert metrics.registry.get_sample_value("reputd_dledger_truncations_total") == 1
    assert metrics.registry.get_sample_value("reputd_dledger_truncated_bytes_total") == \
        repair.old_offset - repair.reput_from_offset
    assert repair_truncation(load_config(str(cfg)), metrics=metrics) is None  # the checkpoint is at the cut now


def test_a_running_follower_sees_the_cut_at_the_head_and_repairs_it(tmp_path, followed):
    """`reputd run` caught up and idle: the log is cut under it and a new leader writes; the loop ends the
    session at the head (`dledger_truncation_found`), the next session repairs, and the files end as a clean
    rebuild of the new log."""
    root, out, _ = followed
    port = free_port()
    cfg = config(tmp_path / "live.yaml", root, out, metrics={"port": port})
    log = tmp_path / "run.log"
    with log.open("w") as err:
        proc = subprocess.Popen([*REPUTD, "run", "--config", str(cfg)], stdout=err, stderr=subprocess.STDOUT,
                                env=clean_env())
    try:
        deadline = time.monotonic() + 60
        while not events(log.read_text(), "caught_up"):
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "reputd run never caught up"
            time.sleep(0.05)
        end = new_leader(root, 2950, 80)
        deadline = time.monotonic() + 60
        while reput_from_offset(port) != end or not events(log.read_text(), "dledger_truncation_repaired"):
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-2000:]
    text = log.read_text()
    assert len(events(text, "dledger_truncation_found")) == 1
    assert events(text, "dledger_truncation_repaired")[0]["shared_entry"] == 2949
    assert output_files(out) == clean_rebuild(tmp_path, root)


# --- starts without fence state: a replay marker, or no checkpoint (the output files are checked) ---------------

@pytest.mark.parametrize("marker", ["below-the-cut", "above-the-cut", "no-checkpoint"])
def test_a_cut_made_under_a_replay_marker_is_repaired_from_the_output_files(tmp_path, followed, marker):
    """The output stopped under a replay marker (a derived start's first minute, a quarantine) or with no
    checkpoint at all holds no fence; a new leader then cuts entries it holds: the start finds them from the
    files, and the result is a clean rebuild of the new log."""
    root, out, cfg = followed
    positions = [pos for _, _, pos, _ in entries(root)]
    if marker == "no-checkpoint":
        (out / "reputd.checkpoint").unlink()
    else:
        at = positions[2800] if marker == "below-the-cut" else positions[3005]
        engine_write_checkpoint(str(out), Checkpoint(at, {}, 0))
    end = new_leader(root, 2990, 60)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    repaired = events(res.stdout, "dledger_truncation_repaired")
    assert len(repaired) == 1, res.stdout[-3000:]
    assert repaired[0]["found_by"] == "output files"
    assert repaired[0]["dispatched_pos"] == positions[3014]
    assert read_checkpoint(str(out)).reput_from_offset == end
    assert output_files(out) == clean_rebuild(tmp_path, root)


def test_a_replay_marker_over_an_unchanged_log_repairs_nothing(tmp_path, followed):
    root, out, cfg = followed
    engine_write_checkpoint(str(out), Checkpoint(entries(root)[2800][2], {}, 0))
    new_leader(root, 3015, 10, term=2)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    assert events(res.stdout, "dledger_truncation_repaired") == []
    assert output_files(out) == clean_rebuild(tmp_path, root)


# --- plug-in dispatchers across a repair ---------------------------------------------------------------------

def _with_plugins(cfg: Path, tmp_path: Path) -> tuple[Path, Path]:
    doc = yaml.safe_load(cfg.read_text())
    cuttable, forgetful = tmp_path / "cuttable.txt", tmp_path / "forgetful.txt"
    doc["dispatchers"] = ["consumequeue", "index",
                          {"name": "tests.plugins.cuttable:CuttableDispatcher", "options": {"path": str(cuttable)}},
                          {"name": "tests.plugins.cuttable:ForgetfulDispatcher", "options": {"path": str(forgetful)}}]
    cfg.write_text(yaml.safe_dump(doc))
    return cuttable, forgetful


def test_a_plugin_with_recover_is_cut_back_and_one_without_is_named(tmp_path):
    """The repair keeps the plug-ins' checkpoint states, so recovery calls `recover(cut, state)` as after any
    crash: the plug-in ends holding the records of the new log, each once. One without `recover` is named in
    `dledger_truncation_plugin_not_cut` and sees the new entries from the cut."""
    root = tmp_path / "store"
    shutil.copytree(STORE / "dledger-n0", root / "dledger-n0")
    out = tmp_path / "out"
    cfg = config(tmp_path / "reputd.yaml", root, out)
    cuttable, forgetful = _with_plugins(cfg, tmp_path)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "cuttable" in read_checkpoint(str(out)).dispatchers
    new_leader(root, 2990, 60)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    repaired = events(res.stdout, "dledger_truncation_repaired")
    assert len(repaired) == 1
    new_log = [pos + ENTRY_HEADER_SIZE for _, _, pos, _ in entries(root)]
    assert [int(x) for x in cuttable.read_text().split()] == new_log
    not_cut = events(res.stdout, "dledger_truncation_plugin_not_cut")
    assert [e["dispatcher"] for e in not_cut] == ["forgetful"]
    assert not_cut[0]["reput_from_offset"] == repaired[0]["reput_from_offset"]
    # it was given every new entry from the cut (it also still holds the cut ones, as the event says)
    assert [int(x) for x in forgetful.read_text().split()][-60:] == new_log[-60:]
    assert output_files(out) == clean_rebuild(tmp_path, root)


@pytest.mark.parametrize("damaged", ["cut-queue", "other-queue", "index"])
def test_a_cut_and_a_damaged_output_file_at_the_same_start_equal_a_clean_rebuild(tmp_path, followed, damaged):
    """The repair's checkpoint is replaced by the quarantine's replay marker when a damaged output file is
    moved at the same start: the entries the new leader cut must still leave no unit or key behind."""
    root, out, cfg = followed
    new_leader(root, 2990, 60)
    if damaged == "index":
        victim = sorted((out / "index").iterdir())[0]
    else:
        queues = sorted(d for d in (out / "consumequeue").glob("*/*") if d.is_dir())
        cut_topic = "TopicTest" if damaged == "cut-queue" else None
        queue = next(q for q in queues if (q.parent.name == cut_topic) == (cut_topic is not None))
        victim = sorted(queue.iterdir())[0]
    with open(victim, "r+b") as f:
        f.truncate(100)
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    assert [e["path"] for e in events(res.stdout, "output_file_quarantined")] == [str(victim)]
    assert events(res.stdout, "dledger_truncation_repaired"), res.stdout[-3000:]
    assert output_files(out) == clean_rebuild(tmp_path, root)


@pytest.mark.parametrize("command", ["run", "rebuild"])
def test_a_cut_and_a_queue_deleted_from_the_output_at_the_same_start_equal_a_clean_rebuild(tmp_path, followed,
                                                                                           command):
    """An operator deleted a queue from the output, and a new leader cut entries, before the same start: the
    repair's checkpoint still counts the deleted queue, so recovery reads it again from the first offset."""
    root, out, cfg = followed
    new_leader(root, 2990, 60)
    shutil.rmtree(out / "consumequeue" / "TopicTest" / "1")
    args = ["--until-caught-up"] if command == "run" else []
    res = reputd(command, "--config", str(cfg), *args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert events(res.stdout + res.stderr, "dledger_truncation_repaired"), res.stdout[-3000:]
    assert output_files(out) == clean_rebuild(tmp_path, root)


def test_a_queue_deleted_from_a_followed_output_is_read_again_past_the_fence(tmp_path, followed):
    """No cut: the checkpoint counts a queue the output lacks, so `run` reads the log again from its first offset;
    the fence passes over the entries it already dispatched instead of failing the batch."""
    root, out, cfg = followed
    shutil.rmtree(out / "consumequeue" / "TopicTest" / "1")
    res = reputd("run", "--config", str(cfg), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    assert events(res.stdout, "queues_missing")
    assert not events(res.stdout, "dispatch_failed")
    assert output_files(out) == clean_rebuild(tmp_path, root)


@pytest.mark.parametrize("command", ["run", "rebuild"])
def test_a_restart_across_a_retention_gap_reads_on_from_the_first_entry(tmp_path, followed, command):
    """reputd stopped; the log grew and retention deleted every data file up to past the last entry dispatched:
    the next start reads on from the log's first entry (the fence takes the gap as retention, not as a cut),
    and the output is consistent with the log."""
    root, out, cfg = followed
    new_leader(root, 3015, 400, term=0)
    data = root / "dledger-n0" / "data"
    for f in sorted(data.iterdir())[:26]:
        f.unlink()
    res = reputd(command, "--config", str(cfg), *(["--until-caught-up"] if command == "run" else []))
    assert res.returncode == 0, res.stderr[-2000:]
    logged = res.stdout + res.stderr
    assert events(logged, "offset_below_oldest_segment")
    assert not events(logged, "dispatch_failed")
    assert not events(logged, "dledger_truncation_repaired")
    first = DLedgerLogView(load_config(str(cfg)).store).first_offset()
    assert read_checkpoint(str(out)).reput_from_offset > first
    check = reputd("verify", "--config", str(cfg))
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    assert "consistent" in check.stdout
