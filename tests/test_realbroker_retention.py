"""Retention against the real RocketMQ 4.9.3 store (issue 28 §1; stress mode only: `make stress`).

The real store writes a CommitLog (LiveWriter, 1 MiB segments, 30-unit ConsumeQueue files) and `reputd run`
builds its output from it; the oldest segments are then deleted, as the broker's retention deletes them. The
real store loads and runs one `cleanFilesPeriodically` (its CleanCommitLogService, then its
CleanConsumeQueueService: `tests/fixtures/realbroker/RetentionPass.java`), and `reputd run --until-caught-up`
catches up and applies its own rule once. The ConsumeQueue files kept must be the broker's, byte for byte, and
the IndexFiles kept the broker's by content in name order (it names them by its wall clock).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import stress
from tests.test_daemon import clean_env
from tests.test_realbroker_live import java_build, java_command

pytestmark = pytest.mark.stress_only

HARNESS = Path(__file__).parent / "fixtures" / "realbroker" / "RetentionPass.java"
SIZES = {"mappedFileSizeCommitLog": 1 << 20, "mappedFileSizeConsumeQueue": 600, "maxHashSlotNum": 97,
         "maxIndexNum": 400}
REPUTD = [sys.executable, "-m", "daemon.cli"]


def files(root: Path, sub: str) -> dict[str, bytes]:
    return {str(p.relative_to(root / sub)): p.read_bytes() for p in sorted((root / sub).rglob("*")) if p.is_file()}


def test_files_kept_after_retention_are_the_brokers(tmp_path):
    build = java_build()
    classes = tmp_path / "classes"
    classes.mkdir()
    cp = f"{build}/classes:{build}/lib/*"
    subprocess.run(["javac", "-cp", cp, "-d", str(classes), str(HARNESS)], check=True, timeout=300)
    java = java_command(build)
    java[-1] += f":{classes}"
    root = tmp_path / "store"
    sizes = [str(SIZES[k]) for k in ("mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxHashSlotNum",
                                     "maxIndexNum")]
    writer = subprocess.run([*java, "LiveWriter", "--store", str(root), "--messages", "8000", "--rate", "4000",
                             "--seed", "7", "--commitlog-size", sizes[0], "--cq-size", sizes[1], "--hash-slots",
                             sizes[2], "--index-num", sizes[3], "--linger-ms", "2000", "--ha-port", "0"],
                            capture_output=True, text=True, timeout=600, check=False)
    assert writer.returncode == 0, writer.stderr[-2000:]
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **SIZES},
                                      "output": {"dir": str(tmp_path / "out")}, "metrics": {"enabled": False}}))
    run = [*REPUTD, "run", "--config", str(config), "--until-caught-up"]
    assert subprocess.run(run, env=clean_env(), capture_output=True, timeout=300, check=False).returncode == 0
    segments = sorted(os.listdir(root / "commitlog"))
    assert len(segments) > 20
    for name in segments[: len(segments) * 3 // 5]:
        os.unlink(root / "commitlog" / name)
    broker = subprocess.run([*java, "RetentionPass", str(root), *sizes], capture_output=True, text=True,
                            timeout=300, check=False)
    assert broker.returncode == 0, broker.stderr[-2000:]
    assert json.loads(broker.stdout.splitlines()[-1])["minPhyOffset"] == int(segments[len(segments) * 3 // 5])
    caught_up = subprocess.run(run, env=clean_env(), capture_output=True, text=True, timeout=300, check=False)
    assert caught_up.returncode == 0, caught_up.stderr
    passes = [json.loads(line) for line in caught_up.stdout.splitlines()
              if line.startswith("{") and '"expired_files_deleted"' in line]
    # the pass at the start of the run, cut short when it catches up at once, and the one at its end
    deleted = {kind: sum(p[kind] for p in passes) for kind in ("consumequeue_files", "index_files")}
    assert deleted["consumequeue_files"] > 0
    assert deleted["index_files"] > 0
    out = tmp_path / "out"
    assert files(out, "consumequeue") == files(root, "consumequeue")
    ours, theirs = files(out, "index"), files(root, "index")
    assert len(ours) == len(theirs)
    assert list(ours.values()) == list(theirs.values())
    stress.report("realbroker_retention", segments_deleted=len(segments) * 3 // 5, segments=len(segments),
                  consumequeue_files_kept=len(theirs_cq := files(root, "consumequeue")), index_files_kept=len(theirs),
                  consumequeue_files_deleted=deleted["consumequeue_files"],
                  index_files_deleted=deleted["index_files"], identical=files(out, "consumequeue") == theirs_cq)
