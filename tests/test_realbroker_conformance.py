"""Conformance stores written now by the real RocketMQ 4.9.3 store, with seeds of the run's choosing.

`../shared/conformance/` holds stores that the broker's own code wrote once (`ConformanceWriter` in
`../shared/realbroker/`, LMQ multi-dispatch on); this writes new ones, one per workload variant (their
topic and LMQ names differ: the second has names such as `%LMQ%v2..double.dot` and `%LMQ%p%q`), so what is
held is the rule and not the fixture. For each: `reputd rebuild` of the CommitLog writes the broker's
ConsumeQueue files byte for byte (and no other), its IndexFiles equal the broker's in name order, and
`reputd verify` finds the broker's own store consistent. Needs a JDK 17 (skipped, saying why, without one);
runs under `make stress`. `STRESS_CONFORMANCE_SEED` picks the seed (by default a new one, printed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import stress
from tests.conformance import files_under
from tests.test_realbroker_live import java_build, java_command

pytestmark = pytest.mark.stress_only

SEED = int(os.environ.get("STRESS_CONFORMANCE_SEED", random.randrange(1, 2**31)))
MESSAGES = int(os.environ.get("STRESS_CONFORMANCE_MESSAGES", "3000"))
# the settings ConformanceWriter gives the store (its `config`), as reputd spells them
SETTINGS = {"mappedFileSizeCommitLog": 65536, "mappedFileSizeConsumeQueue": 1280, "maxHashSlotNum": 97,
            "maxIndexNum": 400, "enableLmq": True, "enableMultiDispatch": True}
REPUTD = [sys.executable, "-m", "daemon.cli"]


@pytest.mark.parametrize("variant", [0, 1])
def test_rebuild_equals_a_store_the_broker_writes_now(tmp_path: Path, variant: int) -> None:
    build = java_build()
    store, out = tmp_path / "store", tmp_path / "out"
    print(f"ConformanceWriter seed {SEED}, variant {variant}, {MESSAGES} messages", flush=True)
    with (tmp_path / "writer.log").open("w") as log:
        res = subprocess.run([*java_command(build), "ConformanceWriter", "write", "--store", str(store), "--seed",
                              str(SEED), "--variant", str(variant), "--messages", str(MESSAGES), "--out",
                              str(tmp_path / "raw.json"), "--ha-port", "0"],
                             stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False)
    assert res.returncode == 0, (tmp_path / "writer.log").read_text()[-3000:]
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(store), **SETTINGS},
                                      "logging": {"level": "warning"}}, allow_unicode=True))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}

    rebuilt = subprocess.run([*REPUTD, "rebuild", "--config", str(config), "--out", str(out), "--json"],
                             capture_output=True, text=True, env=env, timeout=300, check=False)
    assert rebuilt.returncode == 0, rebuilt.stderr
    summary = json.loads(rebuilt.stdout.strip().splitlines()[-1])

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
    stress.report("realbroker-conformance", seed=SEED, variant=variant, messages=summary["messages"],
                  consumequeue_files=len(broker_cq), index_files=len(broker_index))
