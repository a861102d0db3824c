"""DLedger CommitLog stores written now by the real RocketMQ 4.9.3 `DLedgerCommitLog` on DLedger 0.2.3
(`DLedgerConformanceWriter` in `../shared/realbroker/`, built by `build_dledger.sh`), with a seed of the run's
choosing: a pure DLedger store (`write`), and a store upgraded from the plain CommitLog (`mixed`: plain
records in `commitlog/`, a CommitLog BLANK written by DLedgerCommitLog.recover, then DLedger entries from
dividedCommitlogOffset). `reputd rebuild` writes the broker's ConsumeQueue files byte for byte and its
IndexFiles in name order, and `reputd verify` finds the broker's own store consistent. Needs a JDK 17
(skipped, saying why, without one); runs under `make stress`."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import stress
from tests.conformance import files_under
from tests.test_realbroker_live import REALBROKER, java_command

pytestmark = pytest.mark.stress_only

SEED = int(os.environ.get("STRESS_CONFORMANCE_SEED", random.randrange(1, 2**31)))
SETTINGS = {"mappedFileSizeCommitLog": 65536, "mappedFileSizeConsumeQueue": 1280, "maxHashSlotNum": 97,
            "maxIndexNum": 400, "enableDLegerCommitLog": True, "dLegerGroup": "broker-a", "dLegerSelfId": "n0"}
REPUTD = [sys.executable, "-m", "daemon.cli"]


def dledger_build() -> str:
    """The build directory of the real DLedgerCommitLog (build_dledger.sh), or skip saying why."""
    missing = [tool for tool in ("java", "javac") if shutil.which(tool) is None]
    reason = f"the real DLedger store needs {' and '.join(missing)} (a JDK 17) on PATH" if missing else None
    if reason is None and not (REALBROKER / "build_dledger.sh").is_file():
        reason = f"the real DLedger store needs {REALBROKER}/build_dledger.sh (set REPUTD_REALBROKER_DIR)"
    if reason is None:
        res = subprocess.run([str(REALBROKER / "build_dledger.sh")], capture_output=True, text=True, timeout=1800,
                             check=False)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip().splitlines()[-1]
        reason = f"building the real DLedger store failed: {res.stderr.strip()[-500:]}"
    print(f"SKIPPED: {reason}", flush=True)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["write", "mixed"])
def test_rebuild_equals_a_dledger_store_the_broker_writes_now(tmp_path: Path, mode: str) -> None:
    build = dledger_build()
    store, out, port = tmp_path / "store", tmp_path / "out", free_port()
    sizes = ["--messages", "1500"] if mode == "write" else ["--messages-plain", "700", "--messages-dledger", "700"]
    print(f"DLedgerConformanceWriter {mode} seed {SEED}", flush=True)
    with (tmp_path / "writer.log").open("w") as log:
        res = subprocess.run([*java_command(build)[:1], "-Dtls.server.mode=disabled", *java_command(build)[1:],
                              "DLedgerConformanceWriter", mode, "--store", str(store), "--seed", str(SEED),
                              "--variant", "0", *sizes, "--peer-port", str(port), "--out", str(tmp_path / "raw.json")],
                             stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False)
    assert res.returncode == 0, (tmp_path / "writer.log").read_text()[-3000:]
    assert (store / "dledger-n0" / "data").is_dir()
    assert (store / "commitlog").is_dir() == (mode == "mixed")
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(store), **SETTINGS,
                                                "dLegerPeers": f"n0-127.0.0.1:{port}"},
                                      "logging": {"level": "warning"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    rebuilt = subprocess.run([*REPUTD, "rebuild", "--config", str(config), "--out", str(out), "--json"],
                             capture_output=True, text=True, env=env, timeout=300, check=False)
    assert rebuilt.returncode == 0, rebuilt.stderr
    summary = json.loads(rebuilt.stdout.strip().splitlines()[-1])
    raw = json.loads((tmp_path / "raw.json").read_text())
    # up to the broker's max offset at shutdown: DLedgerCommitLog.getMaxOffset, the committed position
    assert summary["endOffset"] == raw["live_before_shutdown"]["max_phy_offset"]
    broker_cq, reputd_cq = files_under(store / "consumequeue"), files_under(out / "consumequeue")
    assert sorted(reputd_cq) == sorted(broker_cq)
    differ = [name for name, data in broker_cq.items() if reputd_cq[name] != data]
    assert not differ, differ[:10]
    broker_index, reputd_index = sorted((store / "index").iterdir()), sorted((out / "index").iterdir())
    assert len(reputd_index) == len(broker_index)
    differ = [(a.name, b.name) for a, b in zip(broker_index, reputd_index, strict=True)
              if a.read_bytes() != b.read_bytes()]
    assert not differ, differ[:10]
    verified = subprocess.run([*REPUTD, "verify", "--config", str(config), "--json"], capture_output=True, text=True,
                              env=env, timeout=300, check=False)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr
    stress.report("realbroker-dledger", seed=SEED, mode=mode, messages=summary["messages"],
                  consumequeue_files=len(broker_cq), index_files=len(broker_index))
