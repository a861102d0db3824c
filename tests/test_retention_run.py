"""`reputd run` under retention (issue 28 §1): segments deleted under a running daemon, its output shrinks by
the broker's rule. A second daemon that never cleans follows the same CommitLog; the broker's rule applied to
its files (`indexcore.retention`) must give, byte for byte, what the cleaning daemon left."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import yaml

from daemon.cli import EXIT_OK
from indexcore.indexservice import IndexService
from indexcore.queuestore import ConsumeQueueStore
from indexcore.retention import delete_expired
from tests import stress
from tests.test_daemon import REPUTD, SEGMENT, Store, clean_env, events, free_port, output_files, stop, wait_for

KEEP_SEGMENTS = 3  # the retention loop keeps the newest segments, as CleanCommitLogService does
ROUNDS = stress.scale(4, 40)  # write, catch up, delete old segments, wait for the clean-up


def du(root: Path) -> int:
    """Allocated bytes of the broker-format files under `root` (ConsumeQueue files are sparse)."""
    return sum(p.stat().st_blocks * 512 for sub in ("consumequeue", "index") for p in (root / sub).rglob("*")
               if p.is_file())


def apply_rule(out: Path, copy: Path, first_offset: int, cfg: dict) -> dict[str, bytes]:
    """The broker's rule over a copy of an output that never cleaned."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(out, copy)
    queues = ConsumeQueueStore(str(copy), cfg["store"]["mappedFileSizeConsumeQueue"])
    queues.load()
    index = IndexService(str(copy), cfg["store"]["maxHashSlotNum"], cfg["store"]["maxIndexNum"])
    index.load()
    delete_expired(list(queues), index, first_offset)
    queues.close()
    index.close()
    return output_files(copy)


def test_output_shrinks_by_the_brokers_rule_while_segments_are_deleted_under_it(tmp_path):
    store = Store(tmp_path, store={"cleanResourceInterval": 100, "deleteConsumeQueueFilesInterval": 5})
    cfg = yaml.safe_load(store.config.read_text())
    keeper_out = tmp_path / "keeper"
    keeper_cfg = {**cfg, "output": {"dir": str(keeper_out)}, "metrics": {"port": free_port()},
                  "store": {**cfg["store"], "cleanResourceInterval": 2**31 - 1}}
    keeper_path = tmp_path / "keeper.yaml"
    keeper_path.write_text(yaml.safe_dump(keeper_cfg, allow_unicode=True))
    log_dir = tmp_path / "store" / "commitlog"
    store.append(2000)
    cleaner = store.start()
    keeper = subprocess.Popen([*REPUTD, "run", "--config", str(keeper_path)], env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sizes = []
    try:
        for _ in range(ROUNDS):
            store.append(1500)
            end = store.end
            wait_for(lambda end=end: store.health()["reputFromOffset"] == end, what="the cleaning daemon caught up")
            wait_for(lambda end=end: json.loads((keeper_out / "reputd.checkpoint").read_text())["payload"][
                "reputFromOffset"] == end, what="the keeper caught up")
            for name in sorted(os.listdir(log_dir))[:-KEEP_SEGMENTS]:
                os.unlink(log_dir / name)
            first = int(sorted(os.listdir(log_dir))[0])
            expected = apply_rule(keeper_out, tmp_path / "expected", first, cfg)
            wait_for(lambda expected=expected: sorted(output_files(store.out)) == sorted(expected), timeout=30,
                     what="the cleaning daemon's files to be the broker's rule")
            sizes.append((first, sum(p.stat().st_size for p in log_dir.iterdir()), du(store.out), du(keeper_out)))
    finally:
        code, out, err = stop(cleaner)
        keeper_code, _, keeper_err = stop(keeper)
    assert code == EXIT_OK, err
    assert keeper_code == EXIT_OK, keeper_err
    actual = output_files(store.out)
    assert actual == apply_rule(keeper_out, tmp_path / "expected", first, cfg)
    passes = [e for e in events(out) if e["event"] == "expired_files_deleted"]
    assert sum(e["consumequeue_files"] + e["index_files"] for e in passes) > 0
    # each pass for the CommitLog's first offset as it was then: never a lower one than the pass before
    assert [e["cleaned_below"] for e in passes] == sorted(e["cleaned_below"] for e in passes)
    # (the writer's `.tmp` segments may make the reader report commitlog_unavailable for a moment: issue 28 §6)
    assert not [e for e in events(out) if e["event"] in ("expired_files_delete_failed", "flush_failed",
                                                          "dispatch_failed", "reput_loop_failed")], out
    # the cleaning daemon's output stays near the CommitLog's size while the keeper's grows with history
    assert sizes[-1][2] < sizes[-1][3], sizes
    assert sizes[-1][2] <= sizes[0][2] * 1.5, sizes
    print("\nfirst offset, CommitLog bytes, cleaned output bytes, uncleaned output bytes:", *sizes, sep="\n  ")
    stress.report("retention_run", rounds=ROUNDS, commitlog_bytes=sizes[-1][1], output_bytes=sizes[-1][2],
                  output_bytes_max=max(row[2] for row in sizes), uncleaned_output_bytes=sizes[-1][3],
                  passes=len(passes), files_deleted=sum(e["consumequeue_files"] + e["index_files"] for e in passes))
    res = subprocess.run([*REPUTD, "verify", "--config", str(store.config)], env=clean_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == EXIT_OK, res.stdout + res.stderr
    assert sizes[-1][1] <= SEGMENT * KEEP_SEGMENTS


def test_a_kill_at_any_deletion_of_a_pass_ends_in_the_brokers_rule(tmp_path):
    """`kill -9` after the 1st, a middle and the last deletion of a pass (REPUTD_FAILPOINT): the next start
    loads what is left and its pass ends in the rule's files, which verify finds consistent."""
    store = Store(tmp_path)
    store.append(4000)
    cfg = yaml.safe_load(store.config.read_text())
    assert store.run("--until-caught-up").returncode == EXIT_OK
    log_dir = tmp_path / "store" / "commitlog"
    for name in sorted(os.listdir(log_dir))[:-KEEP_SEGMENTS]:
        os.unlink(log_dir / name)
    first = int(sorted(os.listdir(log_dir))[0])
    pristine = tmp_path / "pristine"
    shutil.copytree(store.out, pristine)
    expected = apply_rule(pristine, tmp_path / "expected", first, cfg)
    deletions = len(output_files(pristine)) - len(expected)
    assert deletions > 10
    for kill_at in (1, deletions // 2, deletions):
        shutil.rmtree(store.out)
        shutil.copytree(pristine, store.out)
        killed = store.run("--until-caught-up", env={"REPUTD_FAILPOINT": f"retention.after_delete@{kill_at}"})
        assert killed.returncode == -9, killed.stderr
        assert len(output_files(store.out)) == len(output_files(pristine)) - kill_at
        res = store.run("--until-caught-up")
        assert res.returncode == EXIT_OK, res.stderr
        assert output_files(store.out) == expected, f"killed after deletion {kill_at}"
        verify = subprocess.run([*REPUTD, "verify", "--config", str(store.config)], env=clean_env(),
                                capture_output=True, text=True, timeout=120, check=False)
        assert verify.returncode == EXIT_OK, verify.stdout
