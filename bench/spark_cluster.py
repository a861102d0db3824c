"""A Spark standalone cluster on this machine, from the PySpark install: one master and N one-core workers,
bound to 127.0.0.1 on free ports. Used by the cluster stress test and `make bench`.

    with StandaloneCluster(workers=2, work_dir=...) as cluster:
        reputd backfill --master cluster.url ...

The processes are the ones docs/backfill.md's cluster section starts by hand (`spark-class
org.apache.spark.deploy.master.Master`, `...deploy.worker.Worker spark://HOST:PORT`); executors run
PYSPARK_PYTHON, this interpreter, so they import reputd from the same environment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"


def spark_home() -> str:
    import pyspark  # noqa: PLC0415

    return os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class StandaloneCluster:
    def __init__(self, workers: int = 2, work_dir: str | os.PathLike = "spark-cluster", worker_memory: str = "1g",
                 timeout: float = 180.0):
        self.workers = workers
        self.work_dir = Path(work_dir)
        self.worker_memory = worker_memory
        self.timeout = timeout
        self.port = free_port()
        self.url = f"spark://{HOST}:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def env(self) -> dict[str, str]:
        return {**os.environ, "SPARK_LOCAL_IP": HOST, "SPARK_HOME": spark_home(), "PYSPARK_PYTHON": sys.executable,
                "SPARK_WORKER_DIR": str(self.work_dir / "work"), "SPARK_LOG_DIR": str(self.work_dir / "logs"),
                "SPARK_NO_DAEMONIZE": "1"}

    def _start(self, name: str, args: list[str]) -> None:
        log = self.work_dir / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen([os.path.join(spark_home(), "bin", "spark-class"), *args],
                                               stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                               start_new_session=True))

    def start(self) -> StandaloneCluster:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._start("master", ["org.apache.spark.deploy.master.Master", "--host", HOST, "--port", str(self.port),
                               "--webui-port", str(free_port())])
        for i in range(self.workers):
            self._start(f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", "--host", HOST, "--cores", "1",
                                        "--memory", self.worker_memory, "--webui-port", str(free_port()),
                                        "--work-dir", str(self.work_dir / f"work-{i}"), self.url])
        deadline = time.monotonic() + self.timeout
        while True:
            registered = sum("Successfully registered with master" in log.read_text(errors="replace")
                             for log in self.logs[1:])
            if registered == self.workers:
                return self
            dead = [p.args[1] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(log.read_text(errors="replace")[-2000:] for log in self.logs)
                raise RuntimeError(f"the standalone cluster did not come up ({registered} of {self.workers} "
                                   f"workers registered, exited: {dead}):\n{tail}")
            time.sleep(0.5)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
