"""`reputd backfill --master spark://...` on a Spark standalone cluster started here (a master and two
one-core workers from the PySpark install, on free ports of 127.0.0.1): the files of a rebuild.
Long mode only (`make stress`): starting a cluster takes a minute on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from bench.spark_cluster import StandaloneCluster
from daemon.engine.rebuild import rebuild
from tests import stress
from tests.backfill_stores import write_forged_store
from tests.test_backfill import SEGMENT, assert_same_files, config_file, make_config, outputs

pytestmark = pytest.mark.stress_only


def test_standalone_cluster_backfill_equals_rebuild(tmp_path):
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime: a Spark cluster needs one")
    results = write_forged_store(tmp_path / "store" / "commitlog", SEGMENT, 3000)
    rebuild(make_config(tmp_path, "reference", tmp_path / "store"))
    config = config_file(tmp_path, "out", tmp_path / "store", backfill={"rangeBytes": 100_000})
    with StandaloneCluster(workers=2, work_dir=tmp_path / "cluster") as cluster:
        env = {k: v for k, v in cluster.env().items() if not k.startswith("REPUTD_")}
        env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the driver records its class archive there
        res = subprocess.run([sys.executable, "-m", "daemon.cli", "backfill", "--config", str(config), "--master",
                              cluster.url, "--json", "--conf", "spark.ui.enabled=false"], capture_output=True,
                             text=True, env=env, timeout=900, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["master"] == cluster.url
    assert summary["messages"] == len(results)
    assert_same_files(outputs(tmp_path / "out"), outputs(tmp_path / "reference"))
    # a cluster's driver starts from a class archive too (it spent 12.3 of its 19.4 CPU-s without one)
    archives = list((tmp_path / "cache" / "reputd").glob("spark-driver-*.jsa"))
    assert len(archives) == 1
    assert archives[0].stat().st_size > 0
    assert "saveClassArchive" in summary["phaseSeconds"]
    stress.report("backfill standalone cluster", workers=2, messages=summary["messages"], ranges=summary["ranges"],
                  reread_ranges=summary["rereadRanges"], seconds=summary["seconds"],
                  phase_seconds=summary["phaseSeconds"], identical=True)
