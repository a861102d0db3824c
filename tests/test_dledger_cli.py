"""DLedger CommitLog mode through the real CLI, on a copy of the real 4.9.3 DLedger store (`dledger`): the
commands an operator runs, their exit codes and the lines they print."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conformance import discover, files_under

STORE = next((s for s in discover() if s.is_dledger), None)
pytestmark = pytest.mark.skipif(STORE is None, reason="no DLedger conformance store (shared/conformance*/dledger)")
REPUTD = [sys.executable, "-m", "daemon.cli"]


def reputd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    return subprocess.run([*REPUTD, *args], capture_output=True, text=True, timeout=300,
                          env={**clean, "REPUTD_METRICS_ENABLED": "false", **(env or {})}, check=False)


@pytest.fixture
def workspace(tmp_path) -> tuple[Path, Path]:
    config = STORE.make_workspace(tmp_path)
    return tmp_path / "store", config


@pytest.fixture
def whole_store(tmp_path) -> tuple[Path, Path]:
    """The broker's whole store (its consumequeue/, index/ and checkpoint too) and a config for it."""
    root = tmp_path / "store"
    shutil.copytree(STORE.store, root)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **STORE.store_settings()},
                                      "logging": {"level": "warning"}}))
    return root, config


def test_a_dledger_store_read_without_the_dledger_settings_names_them(tmp_path):
    """An operator who points reputd at a DLedger broker's store with only --store is told which settings
    read it, not only that commitlog/ is missing: a configuration error (exit 2), in `rebuild` and in `run`
    (which no waiting would help: its log's `config_mismatch` and the same line on stderr)."""
    root = tmp_path / "store"
    shutil.copytree(STORE.store / "dledger-n0", root / "dledger-n0")
    rebuild = reputd("rebuild", "--store", str(root), "--out", str(tmp_path / "out"))
    assert rebuild.returncode == 2, rebuild.stderr
    assert "has no commitlog/ directory" in rebuild.stderr
    assert ("it has dledger-n0/data, a DLedger CommitLog: set store.enableDLegerCommitLog: true and "
            "store.dLegerSelfId: n0") in rebuild.stderr
    assert not (tmp_path / "out").exists()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}, "REPUTD_METRICS_ENABLED": "false"}
    run = subprocess.run([*REPUTD, "run", "--store", str(root), "--out", str(tmp_path / "run-out")],
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert run.returncode == 2, run.stderr
    line = run.stderr.splitlines()[-1]
    assert line.startswith("reputd: config error: "), run.stderr
    assert "store.dLegerSelfId: n0" in line
    event = next(json.loads(x) for x in run.stdout.splitlines() if '"config_mismatch"' in x)
    assert "store.enableDLegerCommitLog: true and store.dLegerSelfId: n0" in event["error"]
    assert event["exit_code"] == 2
    assert not (tmp_path / "run-out").exists()


def test_rebuild_writes_the_brokers_files(workspace):
    root, config = workspace
    res = reputd("rebuild", "--config", str(config))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("rebuilt 3,015 messages, 1,591,901 bytes [0, 1591901)")
    assert files_under(root / "consumequeue") == files_under(STORE.store / "consumequeue")
    assert list(files_under(root / "index").values()) == list(files_under(STORE.store / "index").values())


def test_run_on_the_brokers_own_files_resumes_at_an_entry(whole_store):
    """`run` on the broker's store without a reputd checkpoint resumes where the files end, at the last indexed
    message's entry (its store offset, pos + 48, is not a reput offset): not "corrupt" 48 bytes into the entry
    (what it said before), and the files stay the broker's."""
    root, config = whole_store
    res = reputd("run", "--until-caught-up", "--config", str(config))
    assert res.returncode == 0, res.stderr
    assert "caught up: dispatched 1 messages, 298 bytes [1591603, 1591901)" in res.stderr
    assert files_under(root / "consumequeue") == files_under(STORE.store / "consumequeue")
    assert list(files_under(root / "index").values()) == list(files_under(STORE.store / "index").values())
    assert reputd("verify", "--config", str(config)).returncode == 0


def test_queries_answer_as_the_broker(workspace):
    """Both msgId kinds (the offset msgId names entry pos + 48), a key, a queue: the broker's messages."""
    _, config = workspace
    assert reputd("rebuild", "--config", str(config)).returncode == 0
    m = next(m for m in STORE.manifest["messages"]
             if m["kind"] == "normal" and m["uniq_key"] and m["dledger_index"] > 1000)
    for msg_id in (m["msg_id"], m["uniq_key"]):
        res = reputd("query", "msgid", msg_id, "--config", str(config), "--json")
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout.splitlines()[0])
        assert (got["commitLogOffset"], got["msgId"], got["queueOffset"]) == (
            m["dledger_pos"] + 48, m["msg_id"], m["queue_offset"])
    g = next(g for g in STORE.manifest["get_message"] if g["status"] == "FOUND" and len(g["phy_offsets"] or []) > 1)
    res = reputd("query", "queue", g["topic"], str(g["queue_id"]), str(g["offset"]), "--count",
                 str(g["max_msg_nums"]), "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["commitLogOffset"] for r in rows if "commitLogOffset" in r] == g["phy_offsets"]


def test_an_offset_msgid_at_an_entry_position_is_no_message(workspace):
    """An offset msgId naming the entry's own position (not pos + 48) names no message: not found, exit 1."""
    _, config = workspace
    assert reputd("rebuild", "--config", str(config)).returncode == 0
    res = reputd("query", "msgid", "C000020100002A9F0000000000000000", "--config", str(config))
    assert res.returncode == 1
    assert "CommitLog offset 0): no message at that offset" in res.stderr


def test_inspect_decodes_entries_index_units_and_the_checkpoint(workspace):
    root, config = workspace
    data = root / "dledger-n0" / "data" / f"{0:020d}"
    res = reputd("inspect", str(data), "--config", str(config), "--limit", "1")
    assert res.returncode == 0, res.stderr
    assert "kind: dledger-data" in res.stdout
    assert "committedPosition: 1591901" in res.stdout
    assert "entryPos=0 entryIndex=0 entryTerm=0 entrySize=279 committed=True commitLogOffset=48 size=231" in res.stdout
    res = reputd("inspect", str(data), "--config", str(config))
    assert res.stderr.splitlines() == ["stoppedAt: 65297", "stop: DLedger BLANK (int -1, int bytes left)"]
    res = reputd("inspect", str(root / "dledger-n0" / "index" / f"{0:020d}"), "--config", str(config), "--limit", "2")
    assert "unitOffset=32 magic=1 entryPos=279 entrySize=272 entryIndex=1 entryTerm=0" in res.stdout
    res = reputd("inspect", str(root / "dledger-n0" / "checkpoint"), "--config", str(config))
    assert "committedIndex: 3014\nendIndex: 3014" in res.stdout


def test_a_corrupt_entry_header_stops_rebuild_with_one_line(workspace):
    """A torn or damaged entry header: exit 1, one line naming the data file, the entry's offset and the field;
    everything before it is dispatched."""
    root, config = workspace
    m = next(m for m in STORE.manifest["messages"] if m["dledger_pos"] > 70000)
    path = STORE.segment_path(root, m["phy_offset"])
    with open(path, "r+b") as f:
        f.seek(m["dledger_pos"] % 65536 + 24)
        f.write(struct.pack(">q", 0))
    res = reputd("rebuild", "--config", str(config))
    assert res.returncode == 1
    pos = m["dledger_pos"]
    line = f"reputd: error: {path} @ {pos}: entry pos field 0 does not match the entry's offset {pos}"
    assert line in res.stderr.splitlines()
    assert "Traceback" not in res.stderr


def test_handoff_writes_the_brokers_checkpoint(whole_store):
    """In DLedger mode physicMsgTimestamp = logicsMsgTimestamp = the last unit's store time (every ConsumeQueue
    write sets both): the checkpoint handoff writes is the broker's, byte for byte."""
    root, config = whole_store
    for name in ("consumequeue", "index"):
        shutil.rmtree(root / name)
    (root / "checkpoint").unlink()
    res = reputd("handoff", "--config", str(config))
    assert res.returncode == 0, res.stderr
    assert (root / "checkpoint").read_bytes() == (STORE.store / "checkpoint").read_bytes()
    assert files_under(root / "consumequeue") == files_under(STORE.store / "consumequeue")


def test_run_until_caught_up_dispatches_to_the_committed_position(workspace, tmp_path):
    _, config = workspace
    out = tmp_path / "out"
    res = reputd("run", "--config", str(config), "--out", str(out), "--until-caught-up")
    assert res.returncode == 0, res.stderr[-2000:]
    assert files_under(out / "consumequeue") == files_under(STORE.store / "consumequeue")
    res = reputd("inspect", str(out / "reputd.checkpoint"), "--config", str(config))
    assert "1591901" in res.stdout


@pytest.mark.parametrize(("env", "needle"), [
    ({"REPUTD_STORE_D_LEGER_SELF_ID": ""}, "store.dLegerSelfId: must be set with enableDLegerCommitLog: true"),
    ({"REPUTD_STORE_D_LEGER_SELF_ID": "n1"}, "store.dLegerSelfId: 'n1' is not one of the dLegerPeers (n0)"),
    ({"REPUTD_STORE_D_LEGER_SELF_ID": "n1", "REPUTD_STORE_D_LEGER_PEERS": "n0-a:1;n1-b:2"},
     "/dledger-n1/data: no such directory: store.dLegerSelfId 'n1' under {root} locates no DLedger CommitLog; "
     "this store has dledger-n0/data"),
])
@pytest.mark.parametrize("command", [["rebuild"], ["verify"], ["query", "key", "TopicTest", "HOTKEY"], ["run"]])
def test_wrong_dledger_settings_exit_2_naming_the_key(workspace, env, needle, command):
    """Settings that cannot be a DLedger node, or that locate no DLedger data: exit 2, one line naming the key
    (and the path). `run` alone waits for a data directory that is not there yet, as it waits for a plain
    commitlog/ (a broker's first start creates it); `run --until-caught-up` refuses at once."""
    root, config = workspace
    if command == ["run"]:
        command = ["run", "--until-caught-up"]
    res = reputd(*command, "--config", str(config), env=env)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert needle.format(root=root) in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
