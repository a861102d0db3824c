"""The crash matrix: `reputd run` killed (SIGKILL) at every step of creating and rolling a ConsumeQueue file
and an IndexFile, with and without a checkpoint carrying dispatcher state, then restarted: the output must
end byte-identical to a clean rebuild, recovered from the checkpoint it had (nothing quarantined).

Random kills found a roll bug once in eight runs (issue 11); here each step is hit on purpose, through the
REPUTD_FAILPOINT test hook (daemon/ops/failpoint.py). The CommitLog is small and written once:

* phase 1, the records `reputd run` has dispatched (and checkpointed) before the kill: the first IndexFile
  nearly full, four queues below the end of their first ConsumeQueue file;
* phase 2, read by the killed run in one batch: record 133's three keys straddle the first roll of the
  IndexFile (its UNIQ_KEY ends file 1, its KEYS start file 2), each queue rolls to its second file, then
  TopicC's queue starts at queue offset 57, so its first file is created with pre-blank units.

"Without a checkpoint" is how the daemon starts after a quarantine or in its first minute: a replay
marker (offset 0, no dispatcher state), so the files alone say where to resume.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from daemon.engine.checkpoint import CHECKPOINT_FILE, Checkpoint, read_checkpoint, write_checkpoint
from indexcore.indexfile import INDEX_ENTRY_DTYPE, INDEX_HEADER, INDEX_HEADER_SIZE
from indexcore.writer import CommitLogWriter, Message
from tests.test_daemon import clean_env, events, output_files
from tests.test_retention_run import apply_rule

REPUTD = [sys.executable, "-m", "daemon.cli"]
SEGMENT = 256 * 1024
CQ_FILE = 40 * 20  # 40 units a file
PHASE_1, PHASE_2 = 130, 300  # records
LATE_QUEUE_AT, LATE_QUEUE_OFFSET = 200, 57  # TopicC's first record, and its queue offset

# an IndexFile is built under a temporary name and renamed in (`mappedfile.create_file`); a ConsumeQueue file is
# created in place (`mappedfile.create_in_place`): no sync, no rename
CREATE_STEPS = ("before_create", "after_create", "after_allocate", "after_header", "after_fsync", "after_rename")
QUEUE_CREATE_STEPS = ("before_create", "after_create", "after_allocate", "after_header")
# (fail point, what is created there); `@N`: the Nth time in the killed run
CASES = [
    *((f"index.{step}", "IndexFile roll") for step in CREATE_STEPS),
    ("index.after_straddling_key", "IndexFile roll"),
    *((f"consumequeue.{step}", "ConsumeQueue roll") for step in QUEUE_CREATE_STEPS),
    *((f"consumequeue.{step}@5", "ConsumeQueue first file, pre-blanks") for step in QUEUE_CREATE_STEPS),
]


def append(writer: CommitLogWriter, first: int, last: int) -> None:
    """Records with UNIQ_KEY and 1-3 KEYS (2, 3, 4 keys: 399 entries a file end inside record 133)."""
    for i in range(first, last):
        topic, queue = ("TopicA", "TopicB")[i % 2], i % 4
        if i >= LATE_QUEUE_AT and i % 10 == 0:
            topic, queue = "TopicC", 0
            writer.queue_offsets.setdefault((topic, queue), LATE_QUEUE_OFFSET)
        keys = " ".join(f"key-{i}-{t}" for t in range(1 + i % 3))
        writer.append(Message(topic, queue, bytes([i % 251]) * (60 + i % 40),
                              {"TAGS": f"t{i % 5}", "KEYS": keys, "UNIQ_KEY": f"{i:032X}"}))


def reputd(command: str, config: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, command, "--config", str(config), *args], env=clean_env(env),
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The CommitLog after phase 2, the output of a run over phase 1 with its checkpoint and with a replay
    marker instead, and the reference: a clean rebuild of the whole CommitLog."""
    root = tmp_path_factory.mktemp("matrix")
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 211))
    writer = CommitLogWriter(str(root / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock))
    cfg = {"store": {"storePathRootDir": str(root / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": CQ_FILE, "maxHashSlotNum": 97, "maxIndexNum": 400},
           "output": {"dir": str(root / "out")}, "metrics": {"enabled": False},
           "logging": {"level": "info", "format": "json"}}
    config = root / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    append(writer, 0, PHASE_1)
    res = reputd("run", config, "--until-caught-up")
    assert res.returncode == 0, res.stderr
    with_state = root / "phase1-with"
    shutil.copytree(root / "out", with_state)
    assert read_checkpoint(str(with_state)).dispatchers["index"] is not None
    without = root / "phase1-without"
    shutil.copytree(root / "out", without)
    write_checkpoint(str(without), Checkpoint(0, {}, 0))
    append(writer, PHASE_1, PHASE_2)
    writer.close()
    res = reputd("rebuild", config, "--out", str(root / "reference"))
    assert res.returncode == 0, res.stderr
    reference = output_files(root / "reference")
    assert len([n for n in reference if n.startswith("index/")]) >= 2
    assert {n.rsplit("/", 2)[0] for n in reference if n.startswith("consumequeue/")} >= {"consumequeue/TopicC"}
    return root, config, {"with": with_state, "without": without}, reference


def assert_as_rebuilt(out: Path, reference: dict[str, bytes], what: str) -> None:
    actual = output_files(out)
    differ = sorted(n for n in set(actual) | set(reference) if actual.get(n) != reference.get(n))
    assert not differ, f"{what}: {differ} differ from a rebuild"


def kill_and_restart(matrix, point: str, what: str, checkpoint: str, unexpected: tuple[str, ...]) -> None:
    """Kill `run` at `point` on a copy of phase 1's output, restart it: it recovers from the checkpoint (or the
    replay marker), logs none of the `unexpected` events, and ends as the reference rebuild."""
    root, config, phase1, reference = matrix
    out = root / f"{point}-{checkpoint}"
    shutil.copytree(phase1[checkpoint], out)
    killed = reputd("run", config, "--until-caught-up", "--out", str(out), env={"REPUTD_FAILPOINT": point})
    assert killed.returncode == -9, f"{point} was never reached ({what}): {killed.returncode} {killed.stderr[-500:]}"
    restart = reputd("run", config, "--until-caught-up", "--out", str(out))
    assert restart.returncode == 0, restart.stderr
    log = events(restart.stdout)
    assert [e["decision"] for e in log if e["event"] == "recovered"] == [
        "checkpoint" if checkpoint == "with" else "replay"]
    assert not [e for e in log if e["event"] in unexpected]
    assert_as_rebuilt(out, reference, f"after a kill at {point} ({what}), {checkpoint} a checkpoint")
    assert json.loads((out / CHECKPOINT_FILE).read_text())["payload"]["reputFromOffset"] > 0


@pytest.mark.parametrize("checkpoint", ["with", "without"])
@pytest.mark.parametrize(("point", "what"), CASES, ids=[c[0] for c in CASES])
def test_kill_at_every_step_of_a_creation(matrix, point, what, checkpoint):
    kill_and_restart(matrix, point, what, checkpoint, unexpected=("output_file_quarantined",))


@pytest.mark.parametrize("checkpoint", ["with", "without"])
def test_kill_while_the_writer_thread_holds_writes_in_flight(matrix, checkpoint):
    """`run`'s ConsumeQueue writer thread (daemon/engine/writebehind.py) killed as it takes the writes phase 2
    hands over, before it makes them: what the dispatch counted as written is not in the files, and the restart
    ends as a clean rebuild from the checkpoint (or the replay marker) it had."""
    kill_and_restart(matrix, "consumequeue.write_behind", "writes handed over, not made", checkpoint,
                     unexpected=("output_file_quarantined",))


# --- LMQ: a batch's new queues created in parallel --------------------------------------------------------

LMQ_PHASE_1, LMQ_PHASE_2 = 60, 140  # records
OLD_ROOMS, NEW_ROOMS = 4, 16  # the new rooms are made together, by one call (`ConsumeQueueStore._create`)
NEW_ROOM_FIRST_OFFSET = 3  # every other new room starts here: its first file is created with pre-blanks
LMQ_CASES = [f"consumequeue.{step}@{n}" for step in QUEUE_CREATE_STEPS for n in (1, 9)]


def append_lmq(writer: CommitLogWriter, first: int, last: int) -> None:
    """Records naming two LMQ rooms each: old ones in phase 1, from record LMQ_PHASE_1 on also new ones,
    all of them first met in the one batch the killed run reads."""
    for i in range(first, last):
        rooms = [f"%LMQ%old-{i % OLD_ROOMS}"]
        if i >= LMQ_PHASE_1:
            room = f"%LMQ%new-{i % NEW_ROOMS}"
            if i % NEW_ROOMS % 2:
                writer.lmq_queue_offsets.setdefault((room, 0), NEW_ROOM_FIRST_OFFSET)
            rooms.append(room)
        writer.append(Message("im-chat", i % 2, bytes([i % 251]) * (50 + i % 30),
                              {"KEYS": f"k-{i}", "UNIQ_KEY": f"{i:032X}", "INNER_MULTI_DISPATCH": ",".join(rooms)}))


@pytest.fixture(scope="module")
def lmq_matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmq-matrix")
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 211))
    writer = CommitLogWriter(str(root / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock),
                             enable_multi_dispatch=True, enable_lmq=True)
    cfg = {"store": {"storePathRootDir": str(root / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": CQ_FILE, "maxHashSlotNum": 97, "maxIndexNum": 400,
                     "enableMultiDispatch": True, "enableLmq": True},
           "output": {"dir": str(root / "out")}, "metrics": {"enabled": False},
           "logging": {"level": "info", "format": "json"}}
    config = root / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    append_lmq(writer, 0, LMQ_PHASE_1)
    assert reputd("run", config, "--until-caught-up").returncode == 0
    phase1 = {"with": root / "phase1-with", "without": root / "phase1-without"}
    shutil.copytree(root / "out", phase1["with"])
    shutil.copytree(root / "out", phase1["without"])
    write_checkpoint(str(phase1["without"]), Checkpoint(0, {}, 0))
    append_lmq(writer, LMQ_PHASE_1, LMQ_PHASE_2)
    writer.close()
    assert reputd("rebuild", config, "--out", str(root / "reference")).returncode == 0
    reference = output_files(root / "reference")
    assert len({n.split("/")[1] for n in reference if n.startswith("consumequeue/%LMQ%new-")}) == NEW_ROOMS
    return root, config, phase1, reference


@pytest.mark.parametrize("checkpoint", ["with", "without"])
@pytest.mark.parametrize("point", LMQ_CASES)
def test_kill_while_a_batch_creates_its_new_lmq_queues(lmq_matrix, point, checkpoint):
    """The kill strikes the first or the ninth of the sixteen creations of a batch: whatever mix of made, empty,
    zero and pre-blanked files that leaves, the restart ends in a clean rebuild's files."""
    root, config, phase1, reference = lmq_matrix
    out = root / f"{point}-{checkpoint}"
    shutil.copytree(phase1[checkpoint], out)
    killed = reputd("run", config, "--until-caught-up", "--out", str(out), env={"REPUTD_FAILPOINT": point})
    assert killed.returncode == -9, f"{point} was never reached: {killed.returncode} {killed.stderr[-500:]}"
    restart = reputd("run", config, "--until-caught-up", "--out", str(out))
    assert restart.returncode == 0, restart.stderr
    assert not [e for e in events(restart.stdout) if e["event"] == "output_file_quarantined"]
    actual = output_files(out)
    differ = sorted(n for n in set(actual) | set(reference) if actual.get(n) != reference.get(n))
    assert not differ, f"after a kill at {point}, {checkpoint} a checkpoint: {differ} differ from a rebuild"


# --- a restart across a retention gap -----------------------------------------------------------------------
#
# `reputd run` dispatches phase 1 and stops (cleanly, or killed while it reads phase 2 with no checkpoint after
# its start); the broker writes phase 2; retention deletes the oldest segments, the output's checkpoint among
# them; `reputd run` starts again. What "a clean run" means once the start of the CommitLog is gone: every
# retained record's unit at its own queue offset, as a broker that was running all along holds it (the
# reference dispatched everything before the deletion), and exactly the units of a rebuild of the retained
# data into an empty output; a unit of a deleted record the output never held durably is a blank unit (the
# broker's pre-blank bytes), the queue's offsets running on contiguously; the index holds each key of the
# records it dispatched once: those of phase 1 and the retained ones.

GAP_SEGMENT = 64 * 1024
GAP_PHASE_1, GAP_PHASE_2 = 300, 1500  # records: phase 1 ends in segment 1; segments 0-2 are deleted later
GAP_DELETED = 3
GAP_LATE_TOPIC_AT = 500  # TopicC's first record: inside the deleted segments, and it goes on past them
GAP_CASES = [("clean", "with"), ("clean", "without"), ("kill", "with"), ("kill", "without")]
BLANK_UNIT_BYTES = bytes(8) + b"\x7f\xff\xff\xff" + bytes(8)


def append_gap(writer: CommitLogWriter, first: int, last: int) -> None:
    for i in range(first, last):
        topic, queue = ("TopicA", "TopicB")[i % 2], i % 3
        if i >= GAP_LATE_TOPIC_AT and i % 7 == 0:
            topic, queue = "TopicC", 1
        elif GAP_PHASE_1 <= i < 600 and i % 11 == 0:
            topic, queue = "TopicD", 0  # only in the deleted segments
        writer.append(Message(topic, queue, bytes([i % 251]) * (120 + i % 50),
                              {"TAGS": f"t{i % 5}", "KEYS": f"key-{i}", "UNIQ_KEY": f"{i:032X}"}))


def _units(data: bytes) -> list[bytes]:
    return [data[p : p + 20] for p in range(0, len(data), 20)]


@pytest.fixture(scope="module")
def gap_matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("gap-matrix")
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 211))
    writer = CommitLogWriter(str(root / "store" / "commitlog"), GAP_SEGMENT, clock=lambda: next(clock))
    cfg = {"store": {"storePathRootDir": str(root / "store"), "mappedFileSizeCommitLog": GAP_SEGMENT,
                     "mappedFileSizeConsumeQueue": CQ_FILE, "maxHashSlotNum": 97, "maxIndexNum": 400,
                     "flushIntervalConsumeQueue": 600_000},  # no checkpoint in the killed run after its start
           "output": {"dir": str(root / "out")}, "metrics": {"enabled": False},
           "logging": {"level": "info", "format": "json"}}
    config = root / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    append_gap(writer, 0, GAP_PHASE_1)
    assert reputd("run", config, "--until-caught-up").returncode == 0
    x = read_checkpoint(str(root / "out")).reput_from_offset
    phase1 = {"with": root / "phase1-with", "without": root / "phase1-without"}
    shutil.copytree(root / "out", phase1["with"])
    shutil.copytree(root / "out", phase1["without"])
    write_checkpoint(str(phase1["without"]), Checkpoint(0, {}, 0))
    append_gap(writer, GAP_PHASE_1, GAP_PHASE_2)
    writer.close()
    for checkpoint, phase in phase1.items():  # killed reading phase 2: units and keys past the checkpoint
        shutil.copytree(phase, root / f"kill-{checkpoint}")
        killed = reputd("run", config, "--until-caught-up", "--out", str(root / f"kill-{checkpoint}"),
                        env={"REPUTD_FAILPOINT": "consumequeue.after_header@4"})
        assert killed.returncode == -9, killed.stderr[-500:]
    assert reputd("rebuild", config, "--out", str(root / "reference")).returncode == 0
    segments = sorted((root / "store" / "commitlog").iterdir())
    for path in segments[:GAP_DELETED]:
        path.unlink()
    m = GAP_DELETED * GAP_SEGMENT
    assert x < m < int(segments[-1].name)
    assert reputd("rebuild", config, "--out", str(root / "retained")).returncode == 0
    reference = output_files(root / "reference")
    assert "consumequeue/TopicD/0/00000000000000000000" in reference
    return root, config, phase1, x, m, reference, output_files(root / "retained")


def index_pairs(root: Path, slots: int = 97) -> Counter:
    """(key hash, CommitLog offset) of every entry the IndexFiles record, counted."""
    pairs: Counter = Counter()
    for path in sorted((root / "index").iterdir()):
        data = path.read_bytes()
        count = max(INDEX_HEADER.unpack_from(data)[5], 1)
        entries = np.frombuffer(data, dtype=INDEX_ENTRY_DTYPE, count=count, offset=INDEX_HEADER_SIZE + 4 * slots)[1:]
        pairs.update(zip(entries["key_hash"].tolist(), entries["phy_offset"].tolist(), strict=True))
    return pairs


def _phy(unit: bytes) -> int:
    return int.from_bytes(unit[:8], "big", signed=True)


@pytest.mark.parametrize(("stop", "checkpoint"), GAP_CASES, ids=[f"{s}-{c}" for s, c in GAP_CASES])
def test_restart_across_a_retention_gap_lands_units_at_their_queue_offsets(gap_matrix, stop, checkpoint):
    root, config, phase1, x, m, reference, retained = gap_matrix
    out = root / f"restart-{stop}-{checkpoint}"
    shutil.copytree(phase1[checkpoint] if stop == "clean" else root / f"kill-{checkpoint}", out)
    restart = reputd("run", config, "--until-caught-up", "--out", str(out))
    assert restart.returncode == 0, restart.stderr
    log = events(restart.stdout)
    assert not [e for e in log if e["event"] in ("logic_queue_order_maybe_wrong", "output_file_quarantined")]
    [below] = [e for e in log if e["event"] == "offset_below_oldest_segment"]
    if stop == "clean":  # what the output held is not counted as lost to retention
        assert below["skipped_bytes"] == m - x
    actual = output_files(out)
    # the run's clean-up pass deletes what the broker's rule deletes once the CommitLog starts at m (issue 28
    # §1): the same files as the rule takes from the reference, whose units there are below m too
    expected = apply_rule(root / "reference", root / f"reference-cleaned-{stop}-{checkpoint}", m,
                          yaml.safe_load(config.read_text()))
    expired = {n for n in set(reference) - set(expected) if n.startswith("consumequeue/")}
    assert not expired & set(actual)
    phase1_queues = {n.rsplit("/", 1)[0] for n in output_files(phase1["with"]) if n.startswith("consumequeue/")}
    for name, ref in reference.items():
        if not name.startswith("consumequeue/") or name in expired:
            continue
        got = actual.get(name)
        gone = [u for u in _units(ref) if x <= _phy(u) < m or u == BLANK_UNIT_BYTES or not any(u)]
        if got is None:  # a queue met only in the deleted data, or its files before its first retained unit
            assert len(gone) == len(_units(ref)), name
            assert name.rsplit("/", 1)[0] not in phase1_queues, name
            continue
        for pos, (want, have) in enumerate(zip(_units(ref), _units(got), strict=True)):
            if x <= _phy(want) < m and have != want:
                # blank, or past the end of a queue that has no retained record (the killed run made it)
                ended = not any(got[pos * 20 :]) and not any(_phy(u) >= m for u in _units(ref))
                assert have == BLANK_UNIT_BYTES or ended, f"{name} unit {pos}: a deleted record's unit, not blank"
                assert stop == "kill" or name.rsplit("/", 1)[0] in phase1_queues or any(
                    _phy(u) >= m for u in _units(got)[pos:]), name
            else:
                assert have == want, f"{name} unit {pos} ({stop}, {checkpoint} a checkpoint): {have} != {want}"
    assert not {n for n in actual if n.startswith("consumequeue/")} - set(reference)
    for name, clean in retained.items():  # a clean run over the retained data: the same units where it has one
        if name.startswith("consumequeue/"):
            for pos, unit in enumerate(_units(clean)):
                if unit != BLANK_UNIT_BYTES and any(unit):
                    assert _units(actual[name])[pos] == unit, f"{name} unit {pos}"
    pairs = index_pairs(out)
    # IndexFiles whose entries all lie below m are deleted (their names differ from the reference's: files
    # rolled elsewhere), so below x the output holds a part of the reference's keys, from m on all of them
    ref_pairs = index_pairs(root / "reference")
    assert {p for p in pairs if p[1] >= m} == {p for p in ref_pairs if p[1] >= m}
    assert {p for p in pairs if p[1] < x} <= set(ref_pairs)
    assert max(pairs.values()) == 1
    if stop == "clean":
        assert not {p for p in pairs if x <= p[1] < m}
        if checkpoint == "without":
            assert actual == output_files(root / "restart-clean-with"), "the files alone resume as a checkpoint"
    res = reputd("verify", config, "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
