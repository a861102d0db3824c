"""`reputd handoff` through the real CLI on a store written by reputd's own writer: what it completes,
checks, changes and prints, and what it refuses (the real 4.9.3 store taking the files:
tests/test_realbroker_handoff.py). Also the `abort` warning of rebuild, run and backfill."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.cli.common import program
from indexcore.checkpoint import StoreCheckpoint
from indexcore.commitlog import TRANSACTION_PREPARED_TYPE, TRANSACTION_ROLLBACK_TYPE
from indexcore.indexfile import INDEX_HEADER_SIZE, IndexHeader
from indexcore.writer import CommitLogWriter, Message
from tests.test_cli import SEGMENT, make_store, run, write_config

MAX_INDEX_NUM = 50  # write_config's maxIndexNum


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def rebuilt_store(tmp_path_factory) -> tuple[Path, list]:
    """One store and reputd's rebuild of it in its root, made once: each test works on a copy."""
    base = tmp_path_factory.mktemp("handoff-store")
    results = make_store(base)
    res = run("rebuild", "--config", str(write_config(base)), "--store", str(base / "store"))
    assert res.returncode == 0, res.stderr
    return base / "store", results


@pytest.fixture
def broker_store(rebuilt_store, tmp_path) -> tuple[Path, Path, list]:
    """A store root holding reputd's rebuild of its CommitLog, left as a killed broker leaves its root:
    `abort` present, `lock` free."""
    template, results = rebuilt_store
    store = tmp_path / "store"
    shutil.copytree(template, store)
    (store / "abort").write_bytes(b"")
    (store / "lock").write_bytes(b"lock")
    return store, write_config(tmp_path), results


def newest_full_index_end(out: Path) -> int:
    end = 0
    for path in sorted((out / "index").iterdir()):
        header = IndexHeader.decode(path.read_bytes()[:INDEX_HEADER_SIZE])
        if header.index_count >= MAX_INDEX_NUM:
            end = header.end_timestamp
    return end


def hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding a POSIX lock on the file's first byte, as a running broker holds `lock`."""
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(path)!r}, os.O_RDWR)\n"
                               "fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)\n"
                               "print('locked', flush=True)\n"
                               "time.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_handoff_sets_the_checkpoint_to_what_the_files_hold_and_removes_abort_last(broker_store):
    """In the store root: the output is already complete, it checks clean, the broker's checkpoint gets
    the store times of the last record, of the last record with a unit and the end of the newest full
    IndexFile, reputd.checkpoint, reputd.lock and abort go, and each change is printed."""
    store, config, results = broker_store
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    last = results[-1].store_timestamp
    cp = StoreCheckpoint.decode((store / "checkpoint").read_bytes())
    assert cp == StoreCheckpoint(last, last, newest_full_index_end(store), 0, 0)
    assert 0 < cp.index_msg_timestamp < last
    assert not (store / "abort").exists()
    assert not (store / "reputd.checkpoint").exists()
    assert lines[0] == f"the output {store} already ends at the end of the CommitLog's written data " \
                       f"({results[-1].phy_offset + results[-1].msg_size})"
    assert lines[1].startswith("checked: 300 messages [0, ")
    assert lines[1].endswith(": consistent")
    assert lines[2].startswith(f"wrote {store / 'checkpoint'} (there was none): physicMsgTimestamp {last} (")
    assert lines[3].startswith(f"removed {store / 'reputd.checkpoint'} ")
    assert lines[4].startswith(f"removed {store / 'reputd.lock'} (reputd's writer lock: nothing of reputd's stays "
                               "in the broker's store root)")
    assert lines[5].startswith(f"removed {store / 'abort'} (the broker's mark of an unclean exit)")
    assert lines[6].startswith(f"handed off: the broker started next on {store} takes its consumequeue/ and "
                               "index/ as its own")
    assert not (store / "reputd.lock").exists()
    # again: nothing left to change
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 0, res.stderr
    assert f"the broker's files in {store} already agree with the output: nothing to change" in res.stdout


def test_a_later_checkpoint_is_set_back_to_what_the_files_hold(broker_store):
    """A checkpoint whose times lie past the files (a broker that ran on other files) is set back, field by
    field, old and new value printed; bytes past the three 4.9.3 fields are kept."""
    store, config, results = broker_store
    later = StoreCheckpoint(2**50, 2**50 + 1, 2**50 + 2, 77, 0)
    (store / "checkpoint").write_bytes(later.encode())
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 0, res.stderr
    last = results[-1].store_timestamp
    cp = StoreCheckpoint.decode((store / "checkpoint").read_bytes())
    assert cp == StoreCheckpoint(last, last, newest_full_index_end(store), 77, 0)
    line = next(x for x in res.stdout.splitlines() if x.startswith("set "))
    assert line.startswith(f"set {store / 'checkpoint'}: physicMsgTimestamp {2**50} (")
    assert f"-> {last} (" in line
    assert "logicsMsgTimestamp" in line
    assert "indexMsgTimestamp" in line


def test_the_last_record_without_a_unit_sets_physic_past_logics(broker_store):
    """PREPARED and ROLLBACK records get no ConsumeQueue unit: logicsMsgTimestamp is the last record with
    one, physicMsgTimestamp the CommitLog's last record."""
    store, config, results = broker_store
    clock = iter(range(results[-1].store_timestamp + 1000, 2**62, 1000))
    with CommitLogWriter(str(store / "commitlog"), SEGMENT, clock=lambda: next(clock)) as w:
        tail = [w.append(Message("TopicA", 0, b"p", {"KEYS": "prep"}, sys_flag=TRANSACTION_PREPARED_TYPE)),
                w.append(Message("TopicA", 0, b"r", {}, sys_flag=TRANSACTION_ROLLBACK_TYPE))]
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "completed the output" in res.stdout
    assert "dispatched 2 messages" in res.stdout
    cp = StoreCheckpoint.decode((store / "checkpoint").read_bytes())
    assert cp.logics_msg_timestamp == results[-1].store_timestamp
    assert cp.physic_msg_timestamp == tail[-1].store_timestamp


def test_a_partial_output_is_completed_to_a_rebuilds_bytes(tmp_path, broker_store):
    """More written after the output stopped (a `reputd run` stopped early): handoff dispatches the rest,
    and the files are those of one rebuild of the whole CommitLog."""
    store, config, results = broker_store
    clock = iter(range(results[-1].store_timestamp + 250, 2**62, 250))
    with CommitLogWriter(str(store / "commitlog"), SEGMENT, clock=lambda: next(clock)) as w:
        for i in range(400):
            w.append(Message(("TopicA", "TopicC")[i % 2], i % 4, b"x" * (i % 300), {"KEYS": f"more-{i}"}))
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"completed the output {store}: dispatched 400 messages up to CommitLog offset" in res.stdout
    assert run("rebuild", "--config", str(config), "--store", str(store), "--out",
               str(tmp_path / "whole")).returncode == 0
    mine = {k: v for k, v in snapshot(store).items() if k.startswith(("consumequeue", "index"))}
    whole = {k: v for k, v in snapshot(tmp_path / "whole").items() if k.startswith(("consumequeue", "index"))}
    assert mine == whole


def test_dry_run_prints_the_changes_and_makes_none(broker_store):
    """--dry-run: the four changes as "would ..." (the checkpoint, then reputd.checkpoint, reputd.lock and
    abort removed), then "dry run: nothing was changed"; no byte changes."""
    store, config, _ = broker_store
    before = snapshot(store)
    res = run("handoff", "--config", str(config), "--store", str(store), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert snapshot(store) == before
    lines = res.stdout.splitlines()
    assert [x.split(" ", 2)[:2] for x in lines if x.startswith("would")] == [
        ["would", "write"], ["would", "remove"], ["would", "remove"], ["would", "remove"]]
    assert lines[-1] == "dry run: nothing was changed"


def test_dry_run_on_an_incomplete_output_says_what_it_would_dispatch(broker_store):
    """--dry-run on an output the CommitLog has gone past: the range it would dispatch, nothing written."""
    store, config, results = broker_store
    end = results[-1].phy_offset + results[-1].msg_size
    with CommitLogWriter(str(store / "commitlog"), SEGMENT) as w:
        added = w.append(Message("TopicA", 0, b"late", {"KEYS": "late"}))
    before = snapshot(store)
    res = run("handoff", "--config", str(config), "--store", str(store), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert snapshot(store) == before
    new_end = added.phy_offset + added.msg_size
    assert f"would complete the output {store}: dispatch CommitLog [{end}, {new_end})" in res.stdout
    assert f"remove {store / 'abort'}" in res.stdout


def test_a_running_broker_is_exit_2_and_nothing_is_touched(broker_store):
    """The broker's `lock` held by another process: exit 2, one line naming it, no file touched or added."""
    store, config, _ = broker_store
    before = snapshot(store)
    holder = hold_lock(store / "lock")
    try:
        for extra in ([], ["--dry-run"]):
            res = run("handoff", "--config", str(config), "--store", str(store), *extra)
            assert res.returncode == 2, res.stdout + res.stderr
            assert res.stdout == ""
            assert res.stderr == (f"reputd: error: {store / 'lock'} is held: the broker is running; stop it first "
                                  "(handoff prepares the files for its next start); nothing was changed\n")
            assert snapshot(store) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_finding_is_exit_1_naming_it_and_the_brokers_files_stay(broker_store):
    """A unit pointing at no record: verify's finding printed, exit 1, `abort` and `checkpoint` as they were."""
    store, config, _ = broker_store
    (store / "checkpoint").write_bytes(StoreCheckpoint(1, 2, 3).encode())
    queue = store / "consumequeue" / "TopicA" / "0"
    unit = queue / sorted(os.listdir(queue))[0]
    data = bytearray(unit.read_bytes())
    data[20:28] = (123).to_bytes(8, "big")  # the second unit points at no record
    unit.write_bytes(bytes(data))
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "cqUnitDangling: 1 finding" in res.stdout
    assert res.stderr.splitlines()[-1] == (f"reputd: error: handoff refused: {store} differs from what the CommitLog "
                                           "implies (1 finding, listed above): nothing of the broker's was changed")
    assert (store / "abort").exists()
    assert StoreCheckpoint.decode((store / "checkpoint").read_bytes()) == StoreCheckpoint(1, 2, 3)


def test_index_files_named_ahead_of_the_clock_are_refused(broker_store):
    """IndexFile names are local times: named later than now (reputd in a zone east of the broker's), the
    broker's next file would sort before them."""
    store, config, _ = broker_store
    index = store / "index"
    newest = sorted(index.iterdir())[-1]
    newest.rename(index / "29991231235959999")
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"indexFileName: {index / '29991231235959999'} is named later than now here" in res.stdout
    assert "set to the broker's time zone" in res.stdout
    assert (store / "abort").exists()


def test_an_output_elsewhere_prints_the_moves_and_the_handoff_to_run(tmp_path):
    """--out other than the store root: the broker's files are left alone, and the commands printed, run
    as printed, put the output in place and finish the handoff there."""
    make_store(tmp_path)
    config = write_config(tmp_path)
    store, out = tmp_path / "store", tmp_path / "out"
    (store / "consumequeue").mkdir()  # the broker's own, incomplete
    (store / "abort").write_bytes(b"")
    res = run("handoff", "--config", str(config))
    assert res.returncode == 0, res.stdout + res.stderr
    assert (store / "abort").exists()
    lines = res.stdout.splitlines()
    start = lines.index(f"to hand {out} to the broker, with the broker stopped, run:")
    commands = [x.strip() for x in lines[start + 1:]]
    assert commands == [f"mv {store / 'consumequeue'} {store / 'consumequeue.before-handoff'}",
                        f"mv {out / 'consumequeue'} {store / 'consumequeue'}",
                        f"mv {out / 'index'} {store / 'index'}",
                        shlex.join([*program(), "handoff", "--config", str(config), "--store", str(store)])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}  # no PATH of its own: as printed
    for command in commands:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stderr
    assert f"removed {store / 'abort'}" in done.stdout
    assert not (store / "abort").exists()
    assert (store / "consumequeue.before-handoff").is_dir()


def test_broker_files_flag_does_the_broker_part_now(tmp_path):
    """--out elsewhere with --broker-files: checkpoint and abort handled now, the moves printed; in the
    store root the flag is a usage error."""
    make_store(tmp_path)
    config = write_config(tmp_path)
    store, out = tmp_path / "store", tmp_path / "out"
    (store / "abort").write_bytes(b"")
    res = run("handoff", "--config", str(config), "--broker-files")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (store / "abort").exists()
    assert (store / "checkpoint").exists()
    assert f"before the broker starts, move {out}'s files into {store}:" in res.stdout
    assert f"  mv {out / 'index'} {store / 'index'}" in res.stdout.splitlines()
    res = run("handoff", "--config", str(config), "--store", str(store), "--broker-files")
    assert res.returncode == 2
    assert "--broker-files goes with --out other than the store root" in res.stderr


@pytest.mark.parametrize("command", ["rebuild", "run", "backfill"])
def test_writing_into_a_root_with_abort_warns_once(tmp_path, command):
    """rebuild, run and backfill into a store root whose broker did not exit cleanly: one line on stderr
    and a log event naming the handoff to run."""
    make_store(tmp_path)
    config = write_config(tmp_path)
    store = tmp_path / "store"
    (store / "abort").write_bytes(b"")
    args = {"rebuild": ["rebuild"], "run": ["run", "--until-caught-up"],
            # a CommitLog directory that does not exist stops it before Spark starts
            "backfill": ["backfill", "--segments", str(tmp_path / "nowhere")]}[command]
    res = run(*args, "--config", str(config), "--store", str(store),
              env={"REPUTD_LOGGING_FORMAT": "json", "REPUTD_LOGGING_LEVEL": "warning"})
    if command != "backfill":
        assert res.returncode == 0, res.stderr
    warnings = [x for x in res.stderr.splitlines() if x.startswith("reputd: warning:")]
    assert warnings == [f"reputd: warning: {store / 'abort'} exists (the broker's last exit was not clean): a 4.9.3 "
                        "broker started on this store discards these IndexFiles and re-dispatches over these "
                        f"ConsumeQueues unless `{shlex.join(program())} handoff --config {config} --store {store}` "
                        "runs first"]
    logged = [json.loads(x) for x in (res.stdout + res.stderr).splitlines() if x.startswith("{")]
    events = [e for e in logged if e.get("event") == "broker_abort_present"]
    assert len(events) == 1
    assert events[0]["path"] == str(store / "abort")
    # into another directory: no warning
    res = run(*args, "--config", str(config), "--store", str(store), "--out", str(tmp_path / "elsewhere"))
    assert "reputd: warning:" not in res.stderr


def test_handoff_has_help():
    """`reputd handoff --help` lists its options."""
    res = run("handoff", "--help")
    assert res.returncode == 0, res.stderr
    assert "--dry-run" in res.stdout
    assert "--broker-files" in res.stdout


def test_a_reader_that_goes_away_stops_the_printing_not_the_handoff(broker_store):
    """`reputd handoff ... | head -1`: every change is still made, abort last, and the exit code is the
    handoff's."""
    store, config, _ = broker_store
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    command = (f"{sys.executable} -m daemon.cli handoff --config {config} --store {store} | head -1; "
               "exit ${PIPESTATUS[0]}")
    res = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 1
    assert not (store / "abort").exists()
    assert (store / "checkpoint").exists()


def test_a_store_without_a_commitlog_is_exit_2_and_nothing_is_created(tmp_path):
    """A mistyped --store: exit 2 naming the CommitLog directory, and no directory or lock file made."""
    config = write_config(tmp_path)
    res = run("handoff", "--config", str(config), "--store", str(tmp_path / "typo"))
    assert res.returncode == 2
    assert res.stderr == (f"reputd: error: {tmp_path / 'typo'}: no such store root directory (--store); nothing was "
                          "changed\n")
    assert not (tmp_path / "typo").exists()


def test_dry_run_takes_trailing_records_without_units_or_keys_for_complete(broker_store):
    """A complete output's files end before a last ROLLBACK record (no unit, no key): the dry run sees
    that nothing is left to dispatch and prints the checkpoint it would write."""
    store, config, results = broker_store
    clock = iter(range(results[-1].store_timestamp + 1000, 2**62, 1000))
    with CommitLogWriter(str(store / "commitlog"), SEGMENT, clock=lambda: next(clock)) as w:
        w.append(Message("TopicA", 0, b"p", {"KEYS": "prep"}, sys_flag=TRANSACTION_PREPARED_TYPE))
        rollback = w.append(Message("TopicA", 0, b"r", {}, sys_flag=TRANSACTION_ROLLBACK_TYPE))
    assert run("rebuild", "--config", str(config), "--store", str(store)).returncode == 0
    res = run("handoff", "--config", str(config), "--store", str(store), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "would complete" not in res.stdout
    assert f"physicMsgTimestamp {rollback.store_timestamp} (" in res.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
def test_files_the_brokers_user_could_not_write_are_refused_with_the_chown_to_run(broker_store):
    """reputd run as root, the broker as its own user: a file under consumequeue/ the broker's user (the
    CommitLog's owner) does not own is a finding, with the command that fixes it; the checkpoint keeps its
    owner."""
    store, config, _ = broker_store
    broker_uid, broker_gid = 4321, 4321
    for path in [store, *store.rglob("*")]:
        if not path.is_relative_to(store / "consumequeue") and not path.is_relative_to(store / "index"):
            os.chown(path, broker_uid, broker_gid)
    (store / "checkpoint").write_bytes(StoreCheckpoint(1, 2, 3).encode())
    os.chown(store / "checkpoint", broker_uid, broker_gid)
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 1, res.stdout + res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("fileOwner: "))
    assert "which could not write them" in line
    command = line.rpartition("give them to it: ")[2]
    assert command == f"chown -R {broker_uid}:{broker_gid} {store / 'consumequeue'} {store / 'index'}"
    assert (store / "abort").exists()
    assert subprocess.run(["bash", "-c", command], check=False).returncode == 0
    res = run("handoff", "--config", str(config), "--store", str(store))
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (store / "abort").exists()
    assert (store / "checkpoint").stat().st_uid == broker_uid
    assert StoreCheckpoint.decode((store / "checkpoint").read_bytes()).physic_msg_timestamp > 1


def test_dry_run_plans_the_moves_the_real_run_prints_for_an_output_still_to_make(tmp_path):
    """Issue 44 item 4, an output that does not exist yet: the dry run says it would create it and prints the
    very plan the real run prints after completing it (the moves first, then the hand-off in the root), not only
    the last step, which alone would re-stamp the broker's old files."""
    make_store(tmp_path)
    config = write_config(tmp_path)
    store, out = tmp_path / "store", tmp_path / "out"
    (store / "consumequeue").mkdir()  # the broker's own: set aside first
    assert not out.exists()
    dry = run("handoff", "--config", str(config), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert not out.exists()
    assert f"would create the output directory {out} (it does not exist)" in dry.stdout.splitlines()
    real = run("handoff", "--config", str(config))
    assert real.returncode == 0, real.stderr
    assert f"reputd: note: created the output directory {out} (it did not exist)" in real.stderr

    def plan(stdout: str) -> list[str]:
        return [line for line in stdout.splitlines() if line.startswith("  ")]

    assert plan(dry.stdout) == plan(real.stdout)
    assert [line.split()[0] for line in plan(real.stdout)][:3] == ["mv", "mv", "mv"]
