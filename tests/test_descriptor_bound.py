"""Descriptors bounded by activity, not by the number of queues: `reputd rebuild` and `reputd run` over 20,000
queues under `ulimit -n 1024` (soft and hard: the commands cannot raise it) write the same files, each
holding at most the store's bounded set of queue files open (`indexcore.queuestore.OPEN_QUEUE_FILES`) beside
its own few descriptors.

A store of 5,000 topics x 4 queues, three records a queue (every tenth queue first met past queue offset 0);
`make stress` (REPUTD_STRESS=1) runs 100,000 queues instead.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from indexcore.queuestore import OPEN_QUEUE_FILES
from indexcore.writer import CommitLogWriter, Message
from tests import stress
from tests.test_daemon import clean_env, output_files

NOFILE = 1024
# `reputd` as `ulimit -n 1024` in a shell starts it: soft and hard limit 1,024, which it cannot raise
LIMITED = [sys.executable, "-c", "import resource, runpy, sys; "
           f"resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE})); sys.argv[0] = 'reputd'; "
           "runpy.run_module('daemon.cli', run_name='__main__')"]
QUEUES = stress.scale(20_000, 100_000)
PER_TOPIC = 4
OWN_DESCRIPTORS = 64  # the process's own: the interpreter's, the CommitLog's, the IndexFile's, logs, pipes


class PeakDescriptors(threading.Thread):
    """The most descriptors a process holds, from /proc every few milliseconds."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.most = pid, 0
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.005):
            try:
                self.most = max(self.most, len(os.listdir(f"/proc/{self.pid}/fd")))
            except OSError:
                return


def limited(command: str, config: Path, out: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run a command under RLIMIT_NOFILE NOFILE (soft and hard); its result and the most descriptors it held."""
    args = ["--until-caught-up"] if command == "run" else []
    proc = subprocess.Popen([*LIMITED, command, "--config", str(config), "--out", str(out), *args], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = PeakDescriptors(proc.pid)
    stdout, stderr = proc.communicate(timeout=600)
    peak.done.set()
    peak.join()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), peak.most


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    root = tmp_path_factory.mktemp("descriptors")
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 3))
    with CommitLogWriter(str(root / "store" / "commitlog"), 64 * 1024 * 1024, clock=lambda: next(clock)) as w:
        for i in range(3 * QUEUES):
            topic, queue = f"T{i % QUEUES // PER_TOPIC}", i % PER_TOPIC
            if i < QUEUES and i % 10 == 0:
                w.queue_offsets.setdefault((topic, queue), 2)
            w.append(Message(topic, queue, b"x", {"KEYS": f"k{i}"}))
    config = root / "reputd.yaml"
    config.write_text(yaml.safe_dump({
        "store": {"storePathRootDir": str(root / "store"), "mappedFileSizeCommitLog": 64 * 1024 * 1024,
                  "mappedFileSizeConsumeQueue": 100 * 20, "maxHashSlotNum": 10_007, "maxIndexNum": 4 * QUEUES},
        "output": {"dir": str(root / "unused")}, "metrics": {"enabled": False}, "logging": {"level": "warning"}}))
    return root, config


def test_rebuild_and_run_over_many_queues_under_a_small_descriptor_limit(many):
    root, config = many
    peaks = {}
    for command in ("rebuild", "run"):
        res, peaks[command] = limited(command, config, root / command)
        assert res.returncode == 0, f"{command}: {res.stderr[-2000:]}"
        assert len(list((root / command / "consumequeue").glob("*/*"))) == QUEUES
    bound = min(OPEN_QUEUE_FILES, NOFILE // 2) + OWN_DESCRIPTORS
    assert max(peaks.values()) <= bound, f"descriptors held: {peaks}, bound {bound}"
    assert output_files(root / "run") == output_files(root / "rebuild")


def test_a_store_keeps_a_small_set_open_whatever_the_descriptor_limit(tmp_path, monkeypatch):
    """A container's 1,048,576 descriptors once meant 65,536 queue files open; now the set is OPEN_QUEUE_FILES,
    and half the limit under a lower one."""
    from indexcore.queuestore import ConsumeQueueStore

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1 << 20, 1 << 20))
    assert ConsumeQueueStore(str(tmp_path)).open_files.limit == OPEN_QUEUE_FILES
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 1 << 20))
    assert ConsumeQueueStore(str(tmp_path)).open_files.limit == 128
