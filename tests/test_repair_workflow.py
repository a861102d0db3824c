"""The repair workflow as an operator runs it (issue 27 §2, issue 33): every command reputd prints runs as
printed and does what it says, one mistake has one exit code in every command, and the exit code is the
command's result whatever happened to stdout. Each test runs the real CLI as a subprocess on a copy of a
broker-written conformance store and checks the exit code and the line printed."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from daemon.cli.common import program
from indexcore.indexfile import HASH_SLOT_SIZE, INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE
from indexcore.mappedfile import offset_to_file_name
from tests.conformance import discover
from tests.dledger_live import broker_files

REPUTD = [sys.executable, "-m", "daemon.cli"]
PROGRAM = program()  # what the commands reputd prints start with, as this environment runs them
STORE = next((s for s in discover() if s.name == "visible"), None)
_COUNT_AT = INDEX_HEADER_SIZE - 4  # indexCount, the header's last field


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    env.update(extra)
    return env


def reputd(*args: str, cwd: Path | None = None, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, *args], capture_output=True, text=True, env=_env(), cwd=cwd, timeout=300,
                          check=False, **popen)


def run_printed(command: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """A command line reputd printed, run as printed (split as a shell splits it, with no other PATH than the
    test's): it starts with the program that printed it (`program()`: the venv's `reputd` script here)."""
    words = shlex.split(command)
    assert words[:len(PROGRAM)] == PROGRAM, command
    return subprocess.run(words, capture_output=True, text=True, env=_env(), cwd=cwd, timeout=300, check=False)


def closed_stdout(*args: str) -> tuple[int, str]:
    """Run reputd with stdout a pipe whose reader is gone at once (`| true`): (exit code, stderr)."""
    proc = subprocess.Popen([*REPUTD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=300), err


def copy_store(tmp: Path, name: str = "store") -> Path:
    assert STORE is not None, "the conformance store `visible` is not here (REPUTD_CONFORMANCE_DIR)"
    root = tmp / name
    shutil.copytree(STORE.store, root)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


def write_config(tmp: Path, root: Path, name: str = "reputd.yaml", **store) -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **STORE.store_settings(), **store},
                                    "logging": {"level": "warning"}}))
    return path


def newest_index_file(index_dir: Path) -> Path:
    return sorted(p for p in index_dir.iterdir() if p.name.isdigit())[-1]


def damage_last_index_entry(index_dir: Path) -> int:
    """Flip bits of the key hash of the newest IndexFile's last entry; returns the entry's number."""
    path = newest_index_file(index_dir)
    data = bytearray(path.read_bytes())
    count = struct.unpack_from(">i", data, _COUNT_AT)[0]
    at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * STORE.store_settings()["maxHashSlotNum"] + INDEX_ENTRY_SIZE * (count - 1)
    struct.pack_into(">i", data, at, struct.unpack_from(">i", data, at)[0] ^ 0x5A5A)
    path.write_bytes(bytes(data))
    return count - 1


@pytest.fixture
def store(tmp_path):
    root = copy_store(tmp_path)
    return root, write_config(tmp_path, root)


@pytest.fixture
def rebuilt(tmp_path, store):
    """The store's CommitLog rebuilt by reputd into tmp/out."""
    _root, config = store
    res = reputd("rebuild", "--config", str(config), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    return tmp_path / "out", config


# --- 27.2.1: every printed command runs as printed -----------------------------------------------------------

def test_the_repair_plan_for_another_store_runs_as_printed_and_repairs_it(tmp_path, store):
    """`verify --store X` with a config naming another store: the plan's rebuild reads X (its --store is
    carried, paths with spaces quoted), and following the plan makes X verify clean."""
    _root, config = store
    damaged = copy_store(tmp_path / "another disk", "store")
    queue = damaged / "consumequeue" / "TopicTest" / "1"
    shutil.rmtree(queue)
    res = reputd("verify", "--config", str(config), "--store", str(damaged))
    assert res.returncode == 1, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("repair: "))
    command = line.removeprefix("repair: ")
    assert shlex.split(command)[1:] == ["rebuild", "--config", str(config), "--store", str(damaged), "--out",
                                        str(tmp_path / "another disk" / "reputd-rebuilt")]
    assert run_printed(command, cwd=tmp_path / "another disk").returncode == 0
    plan = json.loads(reputd("verify", "--config", str(config), "--store", str(damaged), "--json")
                      .stdout.splitlines()[-1])["repair"]
    assert plan["command"] == command
    for r in plan["replace"]:
        shutil.copytree(r["from"], r["to"])
    res = reputd("verify", "--config", str(config), "--store", str(damaged))
    assert res.returncode == 0, res.stdout
    assert res.stdout.splitlines()[-1].startswith("consistent")


def test_the_query_queue_continuation_reads_the_same_output(tmp_path, store):
    """`query queue` on a terminal says where to go on; that command, run as printed, carries --config and
    --out and answers from the same output (not the config's)."""
    root, _config = store
    other = tmp_path / "elsewhere"
    config = write_config(tmp_path, other, name="other.yaml")  # names a store that does not exist
    out = tmp_path / "with space"
    shutil.copytree(root / "consumequeue", out / "consumequeue")
    args = ["query", "queue", "TopicTest", "0", "0", "--count", "3", "--config", str(config), "--store", str(root),
            "--out", str(out), "--format", "text"]
    res = reputd(*args)
    assert res.returncode == 0, res.stderr
    m = re.search(r"^note: more from queue offset 3: (.+)$", res.stderr, re.MULTILINE)
    assert m, res.stderr
    words = shlex.split(m[1])
    assert words[:len(PROGRAM) + 5] == [*PROGRAM, "query", "queue", "TopicTest", "0", "3"]
    assert {"--config", "--store", "--out"} <= set(words)
    after = run_printed(m[1] + " --format json")
    assert after.returncode == 0, after.stderr
    direct = reputd(*args[:4], "3", *args[5:-2], "--format", "json")
    assert after.stdout == direct.stdout
    *messages, result = [json.loads(x) for x in after.stdout.splitlines()]
    assert [m["queueOffset"] for m in messages] == [3, 4, 5]
    assert (result["status"], result["nextBeginOffset"]) == ("FOUND", 6)


# --- 27.2.2: sizes that are not the broker's ------------------------------------------------------------------

@pytest.mark.parametrize(("setting", "needle", "keys"), [
    ({"mappedFileSizeConsumeQueue": 6000000}, "every ConsumeQueue file here is 1280 bytes, mappedFileSizeConsumeQueue "
                                              "is 6000000", "store.mappedFileSizeConsumeQueue"),
    ({"maxIndexNum": 500}, "every IndexFile here is 8428 bytes; maxHashSlotNum 97 and maxIndexNum 500 give 10428",
     "store.maxHashSlotNum and store.maxIndexNum"),
])
def test_verify_with_sizes_that_are_not_the_brokers_is_a_config_error(tmp_path, store, setting, needle, keys):
    root, _ = store
    config = write_config(tmp_path, root, name="wrong.yaml", **setting)
    res = reputd("verify", "--config", str(config))
    assert res.returncode == 2, res.stdout
    assert res.stdout == ""
    assert res.stderr.startswith("reputd: config error: ")
    assert needle in res.stderr
    value = "values" if " and " in keys else "value"
    assert f"set {keys} to the broker's {value} (config: {config} (--config))" in res.stderr
    assert "Traceback" not in res.stderr


def test_one_queue_file_of_another_size_is_a_finding_not_a_config_error(store):
    root, config = store
    victim = root / "consumequeue" / "TopicTest" / "0" / offset_to_file_name(0)
    with open(victim, "r+b") as f:
        f.truncate(640)
    res = reputd("verify", "--config", str(config))
    assert res.returncode == 1
    assert "cqFileSize: 1 finding" in res.stdout


# --- 27.2.3: an output that holds nothing ----------------------------------------------------------------------

def test_verify_of_an_empty_output_is_not_consistent(tmp_path, store):
    _root, config = store
    (tmp_path / "empty").mkdir()
    res = reputd("verify", "--config", str(config), "--out", str(tmp_path / "empty"))
    assert res.returncode == 1, res.stdout
    assert "outputMissing: 1 finding" in res.stdout
    assert "consumequeue/ and index/ absent; the CommitLog holds data [0, 2550235)" in res.stdout
    assert "consistent:" not in res.stdout
    repair = next(x for x in res.stdout.splitlines() if x.startswith("repair: ")).removeprefix("repair: ")
    assert shlex.split(repair)[1:] == ["rebuild", "--config", str(config), "--out", str(tmp_path / "empty")]
    assert run_printed(repair).returncode == 0
    assert reputd("verify", "--config", str(config), "--out", str(tmp_path / "empty")).returncode == 0


def test_verify_of_an_output_that_does_not_exist_is_a_usage_error(tmp_path, store):
    _root, config = store
    res = reputd("verify", "--config", str(config), "--out", str(tmp_path / "typo"))
    assert res.returncode == 2
    assert res.stderr.strip() == f"reputd: error: {tmp_path / 'typo'}: no such output directory (--out)"


# --- 27.2.4: the exit code is the command's result whatever happened to stdout --------------------------------

def test_exit_codes_survive_a_closed_stdout(tmp_path, store, rebuilt):
    root, config = store
    out, _ = rebuilt
    damage_last_index_entry(out / "index")
    code, err = closed_stdout("verify", "--config", str(config), "--out", str(out))
    assert code == 1, err
    code, err = closed_stdout("verify", "--config", str(config))
    assert code == 0, err
    gone = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *REPUTD, "verify", "--config", str(config), "--out",
                           str(out)], capture_output=True, text=True, env=_env(), timeout=300, check=False)
    assert gone.returncode == 1, gone.stderr  # stdout closed before it started (`>&-`)
    code, err = closed_stdout("query", "key", "NoSuchTopic", "k", "--config", str(config))
    assert code == 1
    assert "no ConsumeQueue of topic 'NoSuchTopic'" in err
    code, err = closed_stdout("query", "queue", "TopicTest", "0", "0", "--config", str(config))
    assert code == 0, err
    code, err = closed_stdout("inspect", str(root / "commitlog" / offset_to_file_name(0)), "--config", str(config))
    assert code == 0, err
    broken = copy_store(tmp_path, "broken")
    segment = broken / "commitlog" / offset_to_file_name(65536)
    data = bytearray(segment.read_bytes())
    data[4:8] = b"\0\0\0\1"  # the first record's magic code
    segment.write_bytes(bytes(data))
    code, err = closed_stdout("rebuild", "--config", str(config), "--store", str(broken), "--out", str(tmp_path / "r"))
    assert code == 1, err
    code, err = closed_stdout("run", "--until-caught-up", "--config", str(config), "--store", str(broken), "--out",
                              str(tmp_path / "u"))
    assert code == 1, err
    assert "Traceback" not in err


# --- 27.2.5: query key with a topic the output has no queue for -------------------------------------------------

def test_query_key_names_the_topics_when_the_topic_has_no_queue(store):
    _root, config = store
    for fmt in ("json", "text"):
        res = reputd("query", "key", "NoSuchTopic", "k", "--config", str(config), "--format", fmt)
        assert res.returncode == 1
        assert res.stdout == ""
        assert ("no ConsumeQueue of topic 'NoSuchTopic' here, so no key of it (topics: %RETRY%cg-alpha, "
                "RMQ_SYS_TRANS_HALF_TOPIC, RMQ_SYS_TRANS_OP_HALF_TOPIC, SCHEDULE_TOPIC_XXXX, TopicTest, "
                "order-events_v2)") in res.stderr
    res = reputd("query", "key", "TopicTest", "no-such-key", "--config", str(config))
    assert (res.returncode, res.stdout) == (0, "")


# --- 27.2.8 and 33.7: the newest record is judged when the output is finished; one count -----------------------

def test_a_wrong_newest_index_entry_of_a_finished_rebuild_is_found(rebuilt):
    out, config = rebuilt
    entry = damage_last_index_entry(out / "index")
    res = reputd("verify", "--config", str(config), "--out", str(out))
    assert res.returncode == 1, res.stdout
    assert f"{newest_index_file(out / 'index').relative_to(out)} @ " in res.stdout
    assert f"1 entry at entries [{entry}, {entry + 1})" in res.stdout
    assert "not judged" not in res.stdout


def test_a_wrong_newest_index_entry_of_a_stopped_broker_is_found(store):
    root, config = store
    damage_last_index_entry(root / "index")
    res = reputd("verify", "--config", str(config))
    assert res.returncode == 1
    assert "indexEntryWrong: 1 finding" in res.stdout


def test_the_newest_record_of_an_output_a_writer_holds_is_left_out_and_said(rebuilt):
    out, config = rebuilt
    damage_last_index_entry(out / "index")
    with open(out / "reputd.lock", "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(f"{os.getpid()} run\n".encode())
        lock.flush()
        res = reputd("verify", "--config", str(config), "--out", str(out))
    assert res.returncode == 0, res.stdout
    assert (f"note: the newest record's 2 index entries (the record ending at 2550235) were not judged: a reputd "
            f"writer is running on this output (PID {os.getpid()}, reputd run)") in res.stdout
    assert "6,548 entries (2 not judged: see the note)" in res.stdout


def test_a_rebuild_and_the_brokers_identical_files_count_alike(store, rebuilt):
    out, config = rebuilt
    broker = json.loads(reputd("verify", "--config", str(config), "--json").stdout.splitlines()[-1])
    ours = json.loads(reputd("verify", "--config", str(config), "--out", str(out), "--json").stdout.splitlines()[-1])
    assert broker["consistent"]
    assert ours["consistent"]
    assert ours["indexEntries"] == broker["indexEntries"] == 6548
    assert ours["indexEntriesNotJudged"] == broker["indexEntriesNotJudged"] == 0


# --- 27.2.9: a newest segment cut short is one rule for run and rebuild --------------------------------------------

def test_run_until_caught_up_refuses_a_newest_segment_cut_short_as_rebuild_does(tmp_path):
    root = copy_store(tmp_path)
    for sub in ("consumequeue", "index", "checkpoint"):
        p = root / sub
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    newest = sorted((root / "commitlog").iterdir())[-1]
    with open(newest, "r+b") as f:
        f.truncate(30000)
    config = write_config(tmp_path, root)
    line = f"reputd: error: {newest}: segment is 30000 bytes, mappedFileSizeCommitLog is 65536"
    run = reputd("run", "--until-caught-up", "--config", str(config), "--out", str(tmp_path / "run"))
    rebuild = reputd("rebuild", "--config", str(config), "--out", str(tmp_path / "rebuild"))
    assert (run.returncode, rebuild.returncode) == (1, 1)
    assert line in run.stderr.splitlines()
    assert line in rebuild.stderr.splitlines()
    assert "dispatched 0 messages" in run.stderr
    assert not (tmp_path / "run").exists()  # it failed having written nothing: no trace (issue 33 item 2)
    (tmp_path / "run").mkdir()
    verify = reputd("verify", "--config", str(config), "--out", str(tmp_path / "run"))
    assert verify.returncode == 1
    assert f"note: {newest} is 30000 bytes, not mappedFileSizeCommitLog 65536: not read" in verify.stdout


# --- 33.4 and 33.5: wording, and one exit code for one mistake ---------------------------------------------------

@pytest.mark.parametrize("command", [["verify"], ["rebuild"], ["run", "--until-caught-up"], ["query", "key", "T", "k"],
                                     ["query", "queue", "T", "0", "0"], ["backfill", "--to", "5000"]])
def test_a_store_root_that_does_not_exist_is_a_usage_error_naming_store(tmp_path, store, command):
    """The same line in every command, queries included (they look at the store root before the output)."""
    _root, config = store
    missing = tmp_path / "nonexist"
    res = reputd(*command, "--config", str(config), "--store", str(missing))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == f"reputd: error: {missing}: no such store root directory (--store)"
    assert not missing.exists()


@pytest.mark.parametrize("command", [["verify"], ["rebuild"], ["run", "--until-caught-up"]])
def test_a_store_without_its_commitlog_is_data_missing(tmp_path, store, command):
    root, config = store
    shutil.rmtree(root / "commitlog")
    res = reputd(*command, "--config", str(config), "--out", str(tmp_path / "out"))
    assert res.returncode == 1, res.stderr
    if command[0] == "run":  # the daemon's own report: a log event, then its summary
        assert f"{root / 'commitlog'}: CommitLog directory does not exist" in res.stderr
    else:
        assert f"{root / 'commitlog'}: the store root {root} has no commitlog/ directory" in res.stderr


def test_inspect_of_a_directory_says_what_inspect_takes(store):
    root, config = store
    res = reputd("inspect", str(root / "commitlog"), "--config", str(config))
    assert res.returncode == 2
    assert res.stderr.startswith(f"reputd: error: {root / 'commitlog'}: is a directory; inspect decodes a CommitLog "
                                 "segment (commitlog/<20 digits>)")
    assert "a data file (dledger-<selfId>/data/<20 digits>)" in res.stderr
    res = reputd("inspect", str(root / "nonexist"), "--config", str(config))
    assert res.returncode == 2
    assert res.stderr.strip() == f"reputd: error: {root / 'nonexist'}: no such file"


def test_backfill_offsets_inside_a_record_are_refused_before_spark(tmp_path, store):
    """No Java on PATH: a message about Java would mean Spark was being started."""
    _root, config = store
    env = {"JAVA_HOME": str(tmp_path / "no-java"), "PATH": os.path.dirname(sys.executable)}
    for option in ("--to", "--from"):
        res = subprocess.run([*REPUTD, "backfill", "--config", str(config), "--out", str(tmp_path / "bf"), option,
                              "5000"], capture_output=True, text=True, env=_env(**env), timeout=120, check=False)
        assert res.returncode == 2, res.stderr
        assert (f"reputd: error: {option} 5000 is not a record boundary: it falls inside the record at [4658, 5145)"
                in res.stderr)
        assert "the nearest boundaries are 4658 and 5145" in res.stderr
        assert "Java" not in res.stderr
        assert not (tmp_path / "bf").exists()


# --- 33.10: only what exists is suggested ----------------------------------------------------------------------------

def test_the_plan_for_reputds_output_removes_its_checkpoint_only_when_there_is_one(rebuilt):
    out, config = rebuilt
    with open(out / "consumequeue" / "TopicTest" / "0" / offset_to_file_name(0), "r+b") as f:
        f.seek(12)  # the first unit's tagsCode
        f.write(b"\x7f" * 8)
    res = reputd("verify", "--config", str(config), "--out", str(out))
    assert f"  remove {out / 'reputd.checkpoint'}" in res.stdout.splitlines()
    (out / "reputd.checkpoint").unlink()
    res = reputd("verify", "--config", str(config), "--out", str(out))
    assert res.returncode == 1
    assert "cqUnitWrong: 1 finding" in res.stdout
    assert not [line for line in res.stdout.splitlines() if line.startswith("  remove ")]


def closed_output(*args: str) -> int:
    """Run reputd with stdout and stderr one pipe whose reader is gone at once (`2>&1 | true`): the exit code."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([*REPUTD, *args], stdout=write, stderr=write, env=_env(), timeout=300,
                              check=False).returncode
    finally:
        os.close(write)


def test_a_closed_log_pipe_ends_no_command_halfway(tmp_path, store, rebuilt):
    """`2>&1 | head`: the log lines meet a closed pipe as the result does; each command still runs to its end
    and exits with its own code (a rebuild exited 1 at its first log line, leaving a checkpoint, no files)."""
    root, _ = store
    reference, _ = rebuilt
    config = tmp_path / "info.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **STORE.store_settings()},
                                      "logging": {"level": "info"}}))
    assert closed_output("rebuild", "--config", str(config), "--out", str(tmp_path / "r")) == 0
    assert broker_files(tmp_path / "r") == broker_files(reference)
    assert closed_output("run", "--until-caught-up", "--config", str(config)) == 0
    assert reputd("verify", "--config", str(config)).returncode == 0
    damage_last_index_entry(tmp_path / "r" / "index")
    assert closed_output("verify", "--config", str(config), "--out", str(tmp_path / "r")) == 1
    assert closed_output("verify", "--config", str(tmp_path / "missing.yaml")) == 2
