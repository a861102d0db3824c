"""`reputd run` following the real RocketMQ 4.9.3 store while it writes, killed again and again, half the
time at an IndexFile roll: its files must end as the broker's own (stress mode only: `make stress`).

The writer is the store's own Java code (`../shared/realbroker/`, LiveWriter: DefaultMessageStore with its
reput, flush, file pre-allocation and schedule threads, 1 MiB segments, 97 slots / 400 entries per
IndexFile, KEYS, delay levels, transactions). reputd follows the CommitLog with the broker's default flush
settings, so most restarts have only a replay marker, no dispatcher state (issue 11: the first minute
after a start). Kills alternate between a random moment (SIGKILL) and a step of an IndexFile's creation
(REPUTD_FAILPOINT). When the writer is done, a last `reputd run` catches up; the lag gauge must read 0
although the broker has pre-created its next segments; then ConsumeQueue files are compared byte for byte
and IndexFiles by content in name order (the broker names them by its wall clock).

Skipped, with the reason, when java or javac is missing. STRESS_LIVE_MESSAGES, STRESS_LIVE_RATE,
STRESS_LIVE_KILLS and STRESS_LIVE_SEED override the workload.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests import stress
from tests.conformance import REPO
from tests.test_daemon import clean_env, free_port

pytestmark = pytest.mark.stress_only

REALBROKER = Path(os.environ.get("REPUTD_REALBROKER_DIR", REPO.parent / "shared" / "realbroker"))
MESSAGES = int(os.environ.get("STRESS_LIVE_MESSAGES", "20000"))
RATE = int(os.environ.get("STRESS_LIVE_RATE", "400"))
KILLS = int(os.environ.get("STRESS_LIVE_KILLS", "10"))
SEED = int(os.environ.get("STRESS_LIVE_SEED", "7"))
SIZES = {"mappedFileSizeCommitLog": 1 << 20, "mappedFileSizeConsumeQueue": 6000, "maxHashSlotNum": 97,
         "maxIndexNum": 400}
ROLL_POINTS = ("index.after_rename", "index.after_allocate", "index.before_create", "index.after_straddling_key",
               "index.after_header", "index.after_create", "index.after_fsync")
ROLL_WAIT_S = 20.0
REPUTD = [sys.executable, "-m", "daemon.cli", "run", "--config"]


def java_build() -> str:
    """The build directory of the real store (built once by build.sh), or skip saying why."""
    missing = [tool for tool in ("java", "javac") if shutil.which(tool) is None]
    reason = None
    if missing:
        reason = f"the real-broker live check needs {' and '.join(missing)} (a JDK 17) on PATH"
    elif not (REALBROKER / "build.sh").is_file():
        reason = f"the real-broker live check needs {REALBROKER}/build.sh (set REPUTD_REALBROKER_DIR)"
    if reason is None:
        res = subprocess.run([str(REALBROKER / "build.sh")], capture_output=True, text=True, timeout=1800,
                             check=False)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip().splitlines()[-1]
        reason = f"building the real store failed: {res.stderr.strip()[-500:]}"
    print(f"SKIPPED: {reason}", flush=True)
    pytest.skip(reason)


def java_command(build: str) -> list[str]:
    return ["java", "-Xms256m", "-Xmx512m", "-Duser.timezone=UTC", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "--add-opens", "java.base/java.nio=ALL-UNNAMED", "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED",
            "--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED", "--add-exports", "java.base/sun.nio.ch=ALL-UNNAMED",
            "-cp", f"{build}/harness:{build}/classes:{build}/lib/*"]


def get(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError):
        return None


def gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def same_files(broker: Path, ours: Path) -> tuple[int, int, int, int, list[str]]:
    """(ConsumeQueue files identical, of, IndexFiles identical in name order, of, what differs)."""
    cq_b = {str(p.relative_to(broker)): p for p in sorted((broker / "consumequeue").rglob("*")) if p.is_file()}
    cq_o = {str(p.relative_to(ours)): p for p in sorted((ours / "consumequeue").rglob("*")) if p.is_file()}
    names = sorted(set(cq_b) | set(cq_o))
    cq_same = sum(1 for n in names if n in cq_b and n in cq_o and cq_b[n].read_bytes() == cq_o[n].read_bytes())
    ix_b = sorted((broker / "index").iterdir())
    ix_o = sorted((ours / "index").iterdir())
    ix_same = sum(1 for b, o in zip(ix_b, ix_o, strict=False) if b.read_bytes() == o.read_bytes())
    differ = [n for n in names if not (n in cq_b and n in cq_o and cq_b[n].read_bytes() == cq_o[n].read_bytes())]
    differ += [f"index #{i}" for i, (b, o) in enumerate(zip(ix_b, ix_o, strict=False))
               if b.read_bytes() != o.read_bytes()]
    return cq_same, len(names), ix_same, max(len(ix_b), len(ix_o)), differ


def writer_failure(tmp_path: Path) -> str:
    """The LiveWriter's own last words (its FAILED line), or the tail of its log."""
    text = (tmp_path / "writer.log").read_text(errors="replace")
    failed = [line for line in text.splitlines() if "FAILED" in line]
    return failed[-1] if failed else text[-1000:]


def precreated_beyond(log_dir: Path, offset: int) -> bool:
    """Whether the CommitLog has a segment past the one holding `offset` that holds nothing yet: one the
    broker created ahead of time."""
    size = SIZES["mappedFileSizeCommitLog"]
    for path in log_dir.iterdir():
        if path.name.isdigit() and int(path.name) > offset - offset % size:
            with open(path, "rb") as f:
                if not any(f.read(4096)):
                    return True
    return False


def test_follows_the_real_broker_through_kills_at_index_rolls(tmp_path):
    build = java_build()
    store, out = tmp_path / "store", tmp_path / "out"
    port = free_port()
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(store), **SIZES}, "output": {"dir": str(out)},
                                      "metrics": {"port": port}, "logging": {"level": "info", "format": "json"}}))
    writer_log = (tmp_path / "writer.log").open("w")  # the writer's stderr, closed below
    writer = subprocess.Popen([*java_command(build), "LiveWriter", "--store", str(store), "--messages", str(MESSAGES),
                               "--rate", str(RATE), "--seed", str(SEED), "--ha-port", "0",
                               "--commitlog-size", str(SIZES["mappedFileSizeCommitLog"]),
                               "--cq-size", str(SIZES["mappedFileSizeConsumeQueue"]),
                               "--hash-slots", str(SIZES["maxHashSlotNum"]), "--index-num", str(SIZES["maxIndexNum"])],
                              stdout=subprocess.PIPE, stderr=writer_log, text=True)
    rng = random.Random(SEED)
    kills: list[dict] = []
    lag_samples: list[float] = []  # the lag gauge whenever reputd had caught up and a pre-created segment existed
    started = time.monotonic()
    final = None
    try:
        assert writer.stdout.readline().startswith("STARTED"), "LiveWriter did not start"
        k = 0
        while len(kills) < KILLS or sum(x["at_roll"] for x in kills) < KILLS // 2:
            # a writer that stopped (the broker refuses puts on a disk over 90% full) rolls no IndexFile: without
            # this the loop would wait for a roll for ever
            assert writer.poll() is None, "the writer stopped: " + writer_failure(tmp_path)
            at_roll = k % 2 == 1
            point = ROLL_POINTS[(k // 2) % len(ROLL_POINTS)] if at_roll else None
            env = {"REPUTD_FAILPOINT": point} if point else {}
            with open(tmp_path / f"run-{k}.log", "w") as log:
                proc = subprocess.Popen([*REPUTD, str(config)], env=clean_env(env), stdout=log,
                                        stderr=subprocess.STDOUT)
                try:
                    proc.wait(timeout=ROLL_WAIT_S if at_roll else rng.uniform(0.5, 4.0))
                    by = "fail point"
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    by = "SIGKILL"
            assert proc.returncode == -signal.SIGKILL, (tmp_path / f"run-{k}.log").read_text()[-2000:]
            kills.append({"run": k, "point": point, "by": by, "at_roll": by == "fail point"})
            k += 1
        assert writer.poll() is None, "the writer finished before the kills did: raise STRESS_LIVE_MESSAGES"
        # the last run follows the writer to its end: while it writes, the broker keeps its next segment created
        final = subprocess.Popen([*REPUTD, str(config)], env=clean_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        since: tuple[float, float] | None = None  # (reput offset, when it got there)
        while writer.poll() is None:
            metrics = get(port, "/metrics")
            offset = gauge(metrics, "reputd_reput_offset_bytes") if metrics else None
            if offset is not None:
                now = time.monotonic()
                if since is None or since[0] != offset:
                    since = (offset, now)
                # caught up: the offset has not moved for a second (the writer pauses 0.6-3 s at times), and
                # the broker has its next segment created, all zeros
                elif now - since[1] >= 1.0 and precreated_beyond(store / "commitlog", int(offset)):
                    lag_samples.append(gauge(metrics, "rocketmq_storage_dispatch_behind_bytes"))
            time.sleep(0.1)
        writer_summary = json.loads(writer.stdout.read().strip().splitlines()[-1])
        assert writer.wait(timeout=300) == 0
        end = writer_summary["max_phy_offset"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            health = get(port, "/healthz")
            if health and json.loads(health).get("checkpointOffset") == end:
                break
            time.sleep(0.2)
        health = json.loads(get(port, "/healthz"))
        metrics = get(port, "/metrics")
        behind = gauge(metrics, "rocketmq_storage_dispatch_behind_bytes")
        max_offset = gauge(metrics, "reputd_commitlog_max_offset_bytes")
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        writer_log.close()
        if final is not None:
            final.send_signal(signal.SIGTERM)
            _, err = final.communicate(timeout=60)
    assert final.returncode == 0, err
    cq_same, cq_total, ix_same, ix_total, differ = same_files(store, out)
    roll_kills = sum(x["at_roll"] for x in kills)
    stress.report("realbroker-live", messages=MESSAGES, rate=RATE, seed=SEED, kills=len(kills), roll_kills=roll_kills,
                  roll_points=sorted({x["point"] for x in kills if x["at_roll"]}), commitlog_end=end,
                  lag_samples_caught_up_with_precreated_segment=len(lag_samples),
                  lag_bytes_then=sorted(set(lag_samples)), lag_bytes_at_end=behind,
                  commitlog_max_offset_gauge=max_offset, healthz_commitlog_max_offset=health.get("commitLogMaxOffset"),
                  cq_identical=f"{cq_same}/{cq_total}", index_identical=f"{ix_same}/{ix_total}", differ=differ[:10],
                  seconds=round(time.monotonic() - started, 1))
    assert len(kills) >= KILLS
    assert roll_kills >= KILLS // 2
    assert health["checkpointOffset"] == end
    assert lag_samples, "never saw reputd caught up while the broker had its next segment created"
    assert set(lag_samples) == {0.0}
    assert behind == 0
    assert max_offset == end
    assert health["commitLogMaxOffset"] == end
    assert differ == []
    assert (cq_same, ix_same) == (cq_total, ix_total)

