"""Guards every writing command holds, through the real CLI (issue 44 §1.2-1.4): `produce` never appends to a
running broker's CommitLog, nor to a broker's store without being told; files of sizes that are not the store
root's are refused by every command that would put them there (`handoff --out`, `rebuild`/`run`/`backfill`/
`verify` with `--out`), naming the keys to set; `handoff --dry-run` finds what the hand-off would refuse (an
output a `run` writes, a read-only store root), and the hand-off leaves nothing of reputd's in the root."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_cli import make_store, run, write_config
from tests.test_cli_papercuts import hold_broker_lock
from tests.test_handoff import snapshot
from tests.test_one_writer import _start_daemon

NO_JAVA = {"JAVA_HOME": "/nonexistent-java", "PATH": os.path.dirname(sys.executable)}


def segment_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "commitlog").iterdir())}


# --- 1.2: produce ---------------------------------------------------------------------------------------

def test_produce_refuses_a_running_brokers_store_root_whatever_the_options(tmp_path):
    """The broker's `lock` held: exit 2, one line naming the root, the PID and the lock, `nothing was written`
    (the wording of rebuild's refusal), the CommitLog unchanged, --broker-store or not."""
    make_store(tmp_path, n=20)
    root = tmp_path / "store"
    config = write_config(tmp_path)
    before = segment_bytes(root)
    holder = hold_broker_lock(root / "lock")
    try:
        results = [run("produce", "--config", str(config), "--messages", "5", *extra)
                   for extra in ([], ["--broker-store"])]
    finally:
        holder.stdin.close()
        holder.wait(10)
    for res in results:
        assert res.returncode == 2, res.stderr
        assert res.stderr == (f"reputd: error: {root} is the store root of a running broker (PID {holder.pid} holds "
                              f"{root / 'lock'}), which writes commitlog/ there itself: produce into another store "
                              "root (--store DIR); nothing was written\n")
    assert segment_bytes(root) == before


@pytest.mark.parametrize("files", [["lock"], ["checkpoint"], ["consumequeue/"],
                                   ["lock", "checkpoint", "consumequeue/"]])
def test_produce_appends_to_a_brokers_store_only_when_told(tmp_path, files):
    """A stopped broker's store root (its `lock`, `checkpoint` or `consumequeue/`): exit 2 naming the files and
    --broker-store, nothing written; with --broker-store the messages are appended."""
    make_store(tmp_path, n=20)
    root = tmp_path / "store"
    for name in files:
        (root / name).mkdir() if name.endswith("/") else (root / name).write_bytes(b"lock")
    config = write_config(tmp_path)
    before = segment_bytes(root)
    res = run("produce", "--config", str(config), "--messages", "5")
    assert res.returncode == 2, res.stderr
    assert res.stderr == (f"reputd: error: {root} holds a broker's files ({', '.join(files)}): produce appends sample "
                          "messages to its CommitLog, which a broker started there serves as real ones; produce into "
                          "another store root (--store DIR), or pass --broker-store to append anyway; nothing was "
                          "written\n")
    assert segment_bytes(root) == before
    res = run("produce", "--config", str(config), "--messages", "5", "--broker-store")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("produced 5 messages")


def test_a_sample_store_reputd_writes_takes_more_messages_without_asking(tmp_path):
    """`make run`'s store: produced into (as daemon/commands/sample_store.py seeds it), then `run` writes its
    consumequeue/ beside reputd.checkpoint in the root; `produce` adds messages there as before (reputd's
    own files are not a broker's), and `run` takes them."""
    config = write_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    del cfg["output"]
    config.write_text(yaml.safe_dump(cfg))
    assert run("produce", "--config", str(config), "--messages", "50").returncode == 0
    assert run("run", "--config", str(config), "--until-caught-up").returncode == 0
    assert (tmp_path / "store" / "consumequeue").is_dir()
    res = run("produce", "--config", str(config), "--messages", "10")
    assert res.returncode == 0, res.stderr
    res = run("run", "--config", str(config), "--until-caught-up")
    assert res.returncode == 0, res.stderr
    assert "dispatched 10 messages" in res.stderr


# --- 1.3: files of another size than the store root's ---------------------------------------------------

def _other_sizes(tmp: Path, **sizes) -> Path:
    """write_config's store with other file sizes (the broker's left out of the config, say)."""
    config = write_config(tmp, **sizes)
    path = tmp / "other.yaml"
    config.rename(path)
    return path


@pytest.fixture
def root_and_other_output(tmp_path):
    """A broker store root (reputd's rebuild of it in the root: 400-byte ConsumeQueue files, 31-slot 50-entry
    IndexFiles), an output built beside it before with other sizes, and a config with each."""
    make_store(tmp_path, n=300)
    other = _other_sizes(tmp_path, mappedFileSizeConsumeQueue=800, maxHashSlotNum=37, maxIndexNum=60)
    assert run("rebuild", "--config", str(other), "--out", str(tmp_path / "out")).returncode == 0
    right = write_config(tmp_path)
    assert run("rebuild", "--config", str(right), "--store", str(tmp_path / "store")).returncode == 0
    (tmp_path / "store" / "lock").write_bytes(b"lock")
    return tmp_path, right, other


@pytest.mark.parametrize("dry_run", [True, False])
def test_handoff_out_refuses_files_of_other_sizes_than_the_roots(root_and_other_output, dry_run):
    """`handoff --out` with the sizes the output was built with, which the store root's files do not have:
    exit 2 naming the root's file and the keys, nothing changed, no move printed (it said `consistent` and
    printed the moves)."""
    tmp, _right, other = root_and_other_output
    before = snapshot(tmp)
    res = run("handoff", "--config", str(other), "--out", str(tmp / "out"), *(["--dry-run"] if dry_run else []))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout == ""
    assert res.stderr.startswith(f"reputd: config error: {tmp / 'store' / 'consumequeue'}"), res.stderr
    assert ("every ConsumeQueue file in the store root (the broker's, which the output's files are to replace) is "
            "400 bytes, mappedFileSizeConsumeQueue is 800: set store.mappedFileSizeConsumeQueue to the broker's "
            "value") in res.stderr
    assert len(res.stderr.splitlines()) == 1
    assert snapshot(tmp) == before


def test_the_index_sizes_are_named_too(root_and_other_output):
    """Only the IndexFile sizes differ: the IndexFile and both keys are named."""
    tmp, _right, _other = root_and_other_output
    config = _other_sizes(tmp, maxHashSlotNum=37, maxIndexNum=60)
    res = run("handoff", "--config", str(config), "--out", str(tmp / "elsewhere"), "--dry-run")
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"reputd: config error: {tmp / 'store' / 'index'}" in res.stderr
    assert ("every IndexFile in the store root (the broker's, which the output's files are to replace) is 1164 bytes; "
            "maxHashSlotNum 37 and maxIndexNum 60 give 1388: set store.maxHashSlotNum and store.maxIndexNum to the "
            "broker's values") in res.stderr


@pytest.mark.parametrize("command", [["rebuild"], ["run", "--until-caught-up"], ["verify"], ["backfill"]])
def test_an_output_beside_a_root_with_files_of_other_sizes_is_refused(root_and_other_output, command):
    """`rebuild`/`run`/`backfill` into a new directory, and `verify` of the output built with the same sizes
    (whose repair plan would replace the root's files by it), beside a store root whose files have other
    sizes: exit 2 naming the keys, before anything is written (no directory made)."""
    tmp, _right, other = root_and_other_output
    out = tmp / ("out" if command == ["verify"] else "new")
    before = snapshot(tmp)
    res = run(*command, "--config", str(other), "--out", str(out), env=NO_JAVA if command[0] == "backfill" else None)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith(f"reputd: config error: {tmp / 'store' / 'consumequeue'}"), res.stderr
    assert "set store.mappedFileSizeConsumeQueue to the broker's value " in res.stderr
    assert snapshot(tmp) == before


# --- 1.4: handoff --dry-run finds what the hand-off refuses; nothing of reputd's stays in the root -------

def test_a_dry_run_refuses_an_output_a_run_writes_as_the_handoff_does(tmp_path):
    """`run` writes the output: the dry run exits 2 with the hand-off's own line (it said `consistent`); the
    hand-off refused so never takes the broker's lock, which the `run` would take for a broker starting."""
    make_store(tmp_path, n=200)
    config = write_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    del cfg["output"]  # the run writes the store root, a stopped broker's (its `lock` free)
    config.write_text(yaml.safe_dump(cfg))
    (tmp_path / "store" / "lock").write_bytes(b"lock")
    daemon, _ = _start_daemon(config)
    try:
        dry = run("handoff", "--config", str(config), "--dry-run")
        real = run("handoff", "--config", str(config))
        time.sleep(0.2)  # the run looks at the broker's lock every 50 ms while it waits
        assert daemon.poll() is None
    finally:
        daemon.terminate()
        assert daemon.wait(60) == 0
    out = tmp_path / "store"
    for res in (dry, real):
        assert res.returncode == 2, res.stdout + res.stderr
        assert res.stderr == (f"reputd: error: output directory {out} is in use by another reputd writer (PID "
                              f"{daemon.pid}, reputd run); stop it first: one writer per output (queries and "
                              "inspect need no lock)\n")


@contextlib.contextmanager
def read_only(path: Path):
    """`path` read-only: a read-only bind mount of it as root (root writes whatever the modes say), its write
    bits removed otherwise."""
    if os.geteuid() == 0:
        if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, check=False).returncode:
            pytest.skip("a read-only store root needs mount --bind (root with CAP_SYS_ADMIN)")
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True, capture_output=True)
            yield "Read-only file system"
        finally:
            subprocess.run(["umount", str(path)], check=True, capture_output=True)
    else:
        modes = {p: p.stat().st_mode for p in [path, *path.iterdir()]}
        for p, mode in modes.items():
            p.chmod(mode & ~0o222)
        try:
            yield "Permission denied"
        finally:
            for p, mode in modes.items():
                p.chmod(mode)


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_read_only_store_root_is_refused_in_words_dry_run_or_not(tmp_path, dry_run):
    """A read-only store root (a mount, or a user who cannot write it): exit 2, one line saying so and naming
    the lock, no raw `[Errno 30]` (the dry run passed; the hand-off printed the errno, exit 1)."""
    make_store(tmp_path, n=50)
    root = tmp_path / "store"
    config = write_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    del cfg["output"]
    config.write_text(yaml.safe_dump(cfg))
    assert run("rebuild", "--config", str(config)).returncode == 0
    (root / "lock").write_bytes(b"lock")
    with read_only(root) as why:
        res = run("handoff", "--config", str(config), *(["--dry-run"] if dry_run else []))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr == (f"reputd: error: store root {root} cannot be written ({why}: {root / 'lock'}): handoff "
                          "takes the broker's lock there, sets its checkpoint and removes abort; nothing was changed\n")
    assert "Errno" not in res.stderr


def test_the_handoff_leaves_no_reputd_lock_in_the_broker_root(tmp_path):
    """A root whose files reputd rebuilt in an earlier run and whose reputd.lock was removed since: the
    hand-off takes the lock (creating reputd.lock), and removes it with the rest of reputd's files before
    saying the files are the broker's, without listing it (it made it itself)."""
    make_store(tmp_path, n=100)
    root = tmp_path / "store"
    config = write_config(tmp_path)
    assert run("rebuild", "--config", str(config), "--store", str(root)).returncode == 0
    (root / "reputd.lock").unlink()
    (root / "lock").write_bytes(b"lock")
    res = run("handoff", "--config", str(config), "--store", str(root))
    assert res.returncode == 0, res.stderr
    assert "reputd.lock" not in res.stdout
    assert sorted(os.listdir(root)) == ["checkpoint", "commitlog", "consumequeue", "index", "lock"]
