"""The crash matrix in DLedger CommitLog mode: `reputd run` following a DLedger log killed (SIGKILL) at every step
of creating and rolling a ConsumeQueue file and an IndexFile, with and without a checkpoint carrying dispatcher
state (the DLedger fence's among them), and while it repairs a truncation by a new leader; restarted, the output
ends byte-identical to a clean rebuild of the log.

The log holds the records of tests/test_crash_matrix.py (the same rolls at the same records), each in a DLedger
entry (indexcore/dledgerwriter.py, checked against the real store's bytes in tests/test_dledger_writer.py), in a
one-node group.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from daemon.engine.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from indexcore.commitlog import MessageRecord
from indexcore.dledgerwriter import DLedgerLogWriter, commitlog_records
from indexcore.dledgerwriter import write_checkpoint as write_dledger_checkpoint
from indexcore.writer import CommitLogWriter, Message
from tests.test_crash_matrix import (
    CASES,
    CQ_FILE,
    PHASE_1,
    PHASE_2,
    SEGMENT,
    append,
    assert_as_rebuilt,
    kill_and_restart,
    reputd,
)
from tests.test_daemon import output_files

DLEDGER = {"enableDLegerCommitLog": True, "dLegerSelfId": "n0", "dLegerGroup": "broker-a",
           "dLegerPeers": "n0-127.0.0.1:40911"}


def extend(home: Path, writer: DLedgerLogWriter, plain: Path, start: int, term: int = 0) -> int:
    """Copy the plain CommitLog's records from `start` into the DLedger log; the checkpoint commits them all."""
    end = start
    for record in commitlog_records(str(plain), SEGMENT, start):
        writer.append(record, term)
        end = int.from_bytes(record[28:36], "big") + len(record)
    write_dledger_checkpoint(str(home), writer.next_index - 1, writer.next_index - 1)
    return end


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """As test_crash_matrix's: phase 1 followed by `reputd run` (with its checkpoint, and with a replay marker
    instead), phase 2 appended, the reference a clean rebuild of the whole log."""
    root = tmp_path_factory.mktemp("dledger-matrix")
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 211))
    plain_writer = CommitLogWriter(str(root / "plain"), SEGMENT, clock=lambda: next(clock))
    append(plain_writer, 0, PHASE_1)
    phase1_end = plain_writer.max_offset
    append(plain_writer, PHASE_1, PHASE_2)
    plain_writer.close()
    home = root / "store" / "dledger-n0"
    writer = DLedgerLogWriter(str(home), SEGMENT)
    extend(home, writer, root / "plain", 0)
    cfg = {"store": {"storePathRootDir": str(root / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": CQ_FILE, "maxHashSlotNum": 97, "maxIndexNum": 400, **DLEDGER},
           "output": {"dir": str(root / "out")}, "metrics": {"enabled": False},
           "logging": {"level": "info", "format": "json"}}
    config = root / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    # phase 1 alone first: the same log cut after it, then phase 2 appended
    full = {p.name: p.read_bytes() for p in (home / "data").iterdir()}
    shutil.rmtree(home)
    writer = DLedgerLogWriter(str(home), SEGMENT)
    for record in commitlog_records(str(root / "plain"), SEGMENT, 0, phase1_end):
        writer.append(record, 0)
    write_dledger_checkpoint(str(home), writer.next_index - 1, writer.next_index - 1)
    res = reputd("run", config, "--until-caught-up")
    assert res.returncode == 0, res.stderr
    with_state = root / "phase1-with"
    shutil.copytree(root / "out", with_state)
    assert read_checkpoint(str(with_state)).dispatchers["dledger"]["index"] == PHASE_1 - 1
    without = root / "phase1-without"
    shutil.copytree(root / "out", without)
    write_checkpoint(str(without), Checkpoint(0, {}, 0))
    extend(home, writer, root / "plain", phase1_end)
    assert {p.name: p.read_bytes() for p in (home / "data").iterdir()} == full
    res = reputd("rebuild", config, "--out", str(root / "reference"))
    assert res.returncode == 0, res.stderr
    reference = output_files(root / "reference")
    assert len([n for n in reference if n.startswith("index/")]) >= 2
    return root, config, {"with": with_state, "without": without}, reference


@pytest.mark.parametrize("checkpoint", ["with", "without"])
@pytest.mark.parametrize(("point", "what"), CASES, ids=[c[0] for c in CASES])
def test_kill_at_every_step_of_a_creation(matrix, point, what, checkpoint):
    kill_and_restart(matrix, point, what, checkpoint,
                     unexpected=("output_file_quarantined", "dledger_truncation_repaired"))


def new_leader_records(scratch: Path, kept: list[bytes], count: int) -> list[bytes]:
    """`count` messages a new leader takes after the entries `kept`: each queue's offsets go on from them."""
    next_offset, last_ts = {}, 0
    for body in kept:
        rec = MessageRecord.decode(body, check_crc=False)
        last_ts = max(last_ts, rec.store_timestamp)
        next_offset[(rec.topic, rec.queue_id)] = rec.queue_offset + 1
    clock = iter(range(last_ts + 1000, last_ts + 1000 + 7 * count + 7, 7))
    plain = CommitLogWriter(str(scratch), SEGMENT, clock=lambda: next(clock))
    plain.queue_offsets.update(next_offset)
    for i in range(count):
        plain.append(Message(("TopicA", "TopicB", "TopicL2")[i % 3], i % 4, bytes([i % 13]) * (90 + i % 50),
                             {"TAGS": "t2", "KEYS": f"l2-{i} key-{i}-0", "UNIQ_KEY": f"L2{i:030X}"}))
    plain.close()
    return list(commitlog_records(str(scratch), SEGMENT))


@pytest.mark.parametrize("point", ["dledger.after_repair_checkpoint", "index.after_create@1",
                                   "consumequeue.after_header@2"])
def test_kill_while_repairing_a_truncation(matrix, tmp_path, point):
    """The whole log followed, then a new leader cuts the last 120 entries and writes 150 others in term 1;
    the run that repairs it is killed (after the repair's checkpoint, or re-creating files after the cut):
    the restart ends as a clean rebuild of the new log."""
    root, config, _, _ = matrix
    store = tmp_path / "store"
    shutil.copytree(root / "store", store)
    out = tmp_path / "out"
    cfg = yaml.safe_load(config.read_text())
    cfg["store"]["storePathRootDir"] = str(store)
    cfg["output"]["dir"] = str(out)
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert reputd("run", config, "--until-caught-up").returncode == 0
    home = store / "dledger-n0"
    writer = DLedgerLogWriter(str(home), SEGMENT)
    records = list(commitlog_records(str(root / "plain"), SEGMENT))
    keep = len(records) - 120
    for record in records[:keep]:  # the same entries laid out again (the same bytes), to where entry `keep` goes
        writer.append(record, 0)
    writer.truncate_to(keep, writer.pos)
    for record in new_leader_records(tmp_path / "leader2", records[:keep], 150):
        writer.append(record, 1)
    write_dledger_checkpoint(str(home), writer.next_index - 1, writer.next_index - 1)
    killed = reputd("run", config, "--until-caught-up", env={"REPUTD_FAILPOINT": point})
    assert killed.returncode == -9, f"{point} was never reached: {killed.returncode} {killed.stderr[-500:]}"
    restart = reputd("run", config, "--until-caught-up")
    assert restart.returncode == 0, restart.stderr
    assert reputd("rebuild", config, "--out", str(tmp_path / "clean")).returncode == 0
    assert_as_rebuilt(out, output_files(tmp_path / "clean"), f"after a kill at {point} during the repair")
