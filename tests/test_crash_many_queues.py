"""Kills while many queues are being created: `reputd run` meets a batch of records for 1,200 queues it has
never seen (some first met past their queue offset 0, so created with pre-blank units), and is killed while
it creates their directories and files, at a random instant (the kernel creating them all in one call) or at a
random step of a random file (the fail points, file by file); the restart must end in the files of a clean
rebuild, from a checkpoint and from a replay marker alike.

`make test` runs a few trials; `make stress` (REPUTD_STRESS=1) many. STRESS_MANY_QUEUES_SEED and
STRESS_MANY_QUEUES_TRIALS override the seed and the count.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from daemon.engine.checkpoint import Checkpoint, write_checkpoint
from indexcore.writer import CommitLogWriter, Message
from tests import stress
from tests.test_daemon import clean_env, events, output_files

REPUTD = [sys.executable, "-m", "daemon.cli"]
SEED = int(os.environ.get("STRESS_MANY_QUEUES_SEED", "43"))
TRIALS = int(os.environ.get("STRESS_MANY_QUEUES_TRIALS", str(stress.scale(2, 40))))
TOPICS, QUEUES = 300, 4  # 1,200 queues
OLD = 200  # records over a few queues, dispatched and checkpointed before the kill
SEGMENT = 4 * 1024 * 1024
QUEUE_STEPS = ("before_create", "after_create", "after_allocate", "after_header")


def reputd(command: str, config: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, command, "--config", str(config), *args], env=clean_env(env),
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A CommitLog of OLD records over 8 queues, then one record for each of 1,200 new queues (every tenth
    first met at queue offset 3); the output of a run over the first part, with its checkpoint and with a
    replay marker instead; and a clean rebuild of the whole."""
    root = tmp_path_factory.mktemp("many-queues")
    clock = iter(range(1_700_000_000_000, 1_800_000_000_000, 7))
    writer = CommitLogWriter(str(root / "store" / "commitlog"), SEGMENT, clock=lambda: next(clock))
    for i in range(OLD):
        writer.append(Message(f"Old{i % 2}", i % 4, bytes([i % 251]) * 40, {"KEYS": f"old-{i}"}))
    cfg = {"store": {"storePathRootDir": str(root / "store"), "mappedFileSizeCommitLog": SEGMENT,
                     "mappedFileSizeConsumeQueue": 40 * 20,
                     "maxHashSlotNum": 997, "maxIndexNum": 20_000},
           "output": {"dir": str(root / "out")}, "metrics": {"enabled": False},
           "logging": {"level": "info", "format": "json"}}
    config = root / "reputd.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert reputd("run", config, "--until-caught-up").returncode == 0
    phase1 = {"with": root / "phase1-with", "without": root / "phase1-without"}
    shutil.copytree(root / "out", phase1["with"])
    shutil.copytree(root / "out", phase1["without"])
    write_checkpoint(str(phase1["without"]), Checkpoint(0, {}, 0))
    for t in range(TOPICS):
        for q in range(QUEUES):
            topic = f"Many{t}"
            if (t * QUEUES + q) % 10 == 0:
                writer.queue_offsets.setdefault((topic, q), 3)
            writer.append(Message(topic, q, bytes([t % 251]) * 30, {"KEYS": f"k-{t}-{q}"}))
    writer.close()
    res = reputd("rebuild", config, "--out", str(root / "reference"))
    assert res.returncode == 0, res.stderr
    reference = output_files(root / "reference")
    assert sum(n.startswith("consumequeue/Many") for n in reference) == TOPICS * QUEUES
    return root, config, phase1, reference


def trial_kills(rng: random.Random) -> list[tuple[str, str | None, float]]:
    """(checkpoint, fail point or None, delay before a plain SIGKILL) of each trial."""
    out = []
    for trial in range(TRIALS):
        checkpoint = ("with", "without")[trial % 2]
        if trial % 4 in (0, 3):  # the kernel creating every new queue in one call, killed at a random instant
            out.append((checkpoint, None, rng.uniform(0.3, 1.2)))
        else:  # a random step of a random file, file by file
            point = f"consumequeue.{rng.choice(QUEUE_STEPS)}@{rng.randint(1, TOPICS * QUEUES)}"
            out.append((checkpoint, point, 0.0))
    return out


def test_kills_while_many_queues_are_created_end_as_a_clean_rebuild(many):
    root, config, phase1, reference = many
    started = time.monotonic()
    failures, killed_creating = [], 0
    for trial, (checkpoint, point, delay) in enumerate(trial_kills(random.Random(SEED))):
        out = root / f"trial-{trial}"
        shutil.copytree(phase1[checkpoint], out)
        if point is not None:
            killed = reputd("run", config, "--until-caught-up", "--out", str(out), env={"REPUTD_FAILPOINT": point})
            assert killed.returncode == -9, f"{point} was never reached: {killed.returncode} {killed.stderr[-500:]}"
        else:
            proc = subprocess.Popen([*REPUTD, "run", "--config", str(config), "--out", str(out)], env=clean_env(),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            proc.kill()
            proc.wait(timeout=30)
        made = sum(1 for _ in (out / "consumequeue").glob("Many*/*")) if (out / "consumequeue").exists() else 0
        killed_creating += 0 < made < TOPICS * QUEUES
        restart = reputd("run", config, "--until-caught-up", "--out", str(out))
        if restart.returncode != 0:
            failures.append(f"trial {trial} ({checkpoint}, {point or f'SIGKILL after {delay:.2f} s'}): restart exited "
                            f"{restart.returncode}: {restart.stderr[-800:]}")
            continue
        assert not [e for e in events(restart.stdout) if e["event"] == "output_file_quarantined"]
        actual = output_files(out)
        differ = sorted(n for n in set(actual) | set(reference) if actual.get(n) != reference.get(n))
        if differ:
            failures.append(f"trial {trial} ({checkpoint}, {point or f'SIGKILL after {delay:.2f} s'}): {differ[:5]}")
        shutil.rmtree(out)
    stress.report("many_queue_kills", trials=TRIALS, identical=TRIALS - len(failures), queues=TOPICS * QUEUES,
                  killed_while_creating=killed_creating, seconds=round(time.monotonic() - started, 1), seed=SEED)
    assert not failures, failures


def test_rebuilds_killed_while_they_create_many_queues_at_their_end_are_rerun_as_one(many):
    """A rebuild creates each new queue's file with its first write, most of them at its end (1,200 in pieces of
    MAKE_OPEN_AT_ONCE): killed at a random step of a random file of those, then run again, from a checkpoint and
    from a replay marker, it ends in the files of a clean rebuild."""
    root, config, phase1, reference = many
    rng = random.Random(SEED + 1)
    for trial in range(TRIALS):
        checkpoint = ("with", "without")[trial % 2]
        out = root / f"rebuild-trial-{trial}"
        shutil.copytree(phase1[checkpoint], out)
        point = f"consumequeue.{rng.choice(QUEUE_STEPS)}@{rng.randint(1, TOPICS * QUEUES)}"
        killed = reputd("rebuild", config, "--out", str(out), env={"REPUTD_FAILPOINT": point})
        assert killed.returncode == -9, f"{point} was never reached: {killed.returncode} {killed.stderr[-500:]}"
        made = sum(1 for _ in (out / "consumequeue").glob("Many*/*/*"))
        assert made < TOPICS * QUEUES, f"{point}: {made} files made before the kill"
        again = reputd("rebuild", config, "--out", str(out))
        assert again.returncode == 0, f"trial {trial} ({checkpoint}, {point}): {again.stderr[-800:]}"
        actual = output_files(out)
        differ = sorted(n for n in set(actual) | set(reference) if actual.get(n) != reference.get(n))
        assert not differ, f"trial {trial} ({checkpoint}, {point}): {differ[:5]}"
        shutil.rmtree(out)
