"""Java and the Spark context of a backfill: which `java` Spark launches, whether a standalone master
answers, the context's settings, and Spark's failures as one line (a memory limit names the setting to
raise)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping

from daemon.backfill.jvm import ClassArchive, java_version_text
from daemon.backfill.plan import BackfillError

DEFAULT_MASTER = "local[*]"
MIN_JAVA = 17
JAVA_INSTALL_HINT = (f"Spark needs a Java {MIN_JAVA} (or later) runtime: install one (Debian/Ubuntu: apt-get "
                     f"install openjdk-{MIN_JAVA}-jre-headless; RHEL: dnf install java-{MIN_JAVA}-openjdk-headless) "
                     f"or set JAVA_HOME to it")
LOCAL_DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"
STANDALONE_PREFIX = "spark://"
MASTER_CONNECT_TIMEOUT_S = 5.0
# the driver JVM's logging: Spark's errors only, not its start-up chatter (the file says why)
DRIVER_LOG_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")
# what Java prints as every Spark 4 driver JVM starts (Spark's launcher adds the module it names): the first
# line an operator saw of every backfill, about nothing they can or need to change
JVM_INCUBATOR_WARNING = b"WARNING: Using incubator modules: jdk.incubator.vector"
_JAVA_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')
_JAVA_ERROR = re.compile(r"^(?:: |Caused by: )?((?:java|org|scala)\.[\w.$]*(?:Exception|Error)): (.+)$", re.M)
_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Fault|Failed)): (.+)$")


def check_java(env: Mapping[str, str] | None = None) -> str:
    """The `java` Spark will launch (JAVA_HOME's, else the one on PATH), checked to be Java 17 or later."""
    env = os.environ if env is None else env
    home = env.get("JAVA_HOME")
    if home:
        java = os.path.join(home, "bin", "java")
        if not os.access(java, os.X_OK):
            raise BackfillError(f"JAVA_HOME is {home}, but {java} is not an executable file; {JAVA_INSTALL_HINT}")
    else:
        java = shutil.which("java", path=env.get("PATH", os.defpath))
        if java is None:
            raise BackfillError(f"no Java runtime found (JAVA_HOME is not set and there is no `java` on PATH); "
                                f"{JAVA_INSTALL_HINT}")
    try:
        text = java_version_text(java)
    except OSError as e:
        raise BackfillError(f"{java} does not run ({e}); {JAVA_INSTALL_HINT}") from None
    match = _JAVA_VERSION.search(text)
    if match:
        major = int(match[1]) if match[1] != "1" else int(match[2] or 0)  # "1.8.0" is Java 8
        if major < MIN_JAVA:
            raise BackfillError(f"{java} is Java {major}; {JAVA_INSTALL_HINT}")
    return java


def check_master_answers(master: str, timeout: float = MASTER_CONNECT_TIMEOUT_S) -> None:
    """A standalone master (`spark://HOST:PORT`, or several, comma-separated, for a master with standbys)
    must accept a connection at one of its addresses. Spark itself retries for over a minute, then fails
    with "Cannot call methods on a stopped SparkContext", the reason (no master answered) being a log line
    the backfill keeps quiet; a wrong port is the usual cause. Other masters are left to Spark."""
    if not master.startswith(STANDALONE_PREFIX):
        return
    failures = []
    for address in master[len(STANDALONE_PREFIX):].split(","):
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            raise BackfillError(f"--master {master}: {address!r} is not HOST:PORT")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            return
        except OSError as e:
            failures.append(f"{address.strip()} ({e.strerror or e})")
    raise BackfillError(f"no Spark master answers at {', '.join(failures)}: is the master running, and is "
                        "that its port (the one its web UI shows as spark://HOST:PORT)?")


def create_context(master: str = DEFAULT_MASTER, conf: Mapping[str, str] | None = None,
                   archive: ClassArchive | None = None):
    """A SparkContext for the backfill, not a SparkSession: both jobs are RDD jobs over a partition per work
    item, whose tasks hand back pickled outcomes, so nothing needs Spark SQL. Its session, its planner and the
    DataFrame jobs' planning (`range(...).mapInArrow`) cost the driver JVM about a third of a 10,000-message
    backfill's CPU. Local workers run this interpreter (so they import reputd and numpy from the same
    environment); on a cluster, PYSPARK_PYTHON or spark.pyspark.python decides. `archive`: the class-data
    archive a local driver JVM maps or records (`jvm.py`)."""
    from pyspark import SparkConf, SparkContext  # noqa: PLC0415 - the driver's only: workers import tasks.py

    check_java()
    check_master_answers(master)
    if master.startswith("local") and "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = sys.executable
    # Spark's stage progress bar on a terminal only, as `reputd rebuild` draws its own: written into a log
    # file or the journal it is a stream of carriage-return lines
    settings = {"spark.app.name": "reputd-backfill", "spark.master": master,
                "spark.ui.showConsoleProgress": str(sys.stderr.isatty()).lower(), "spark.log.level": "FATAL",
                "spark.python.worker.reuse": "true",
                # a Python worker talks to its JVM over a Unix socket (Spark 4.1+; older ones ignore it): over
                # loopback TCP every task's short last write waited for a delayed ACK, about 40 ms a task
                "spark.python.unix.domain.socket.enabled": "true",
                # PySpark's daemon, but a worker whose task was cancelled ends without a BrokenPipeError traceback
                "spark.python.daemon.module": "daemon.backfill.pydaemon"}
    driver_options = [driver_log_option()]
    if master.startswith("local"):
        # the driver JVM runs the tasks too: a short job spends seconds in the optimising JIT (C2) on cores the
        # decode needs; the quick compiler alone cut the work after start-up by about a quarter here
        driver_options.append(LOCAL_DRIVER_JAVA_OPTIONS)
        # no web UI for a job that runs on this machine and ends with it: its Jetty server and pages cost the
        # driver JVM about 1 CPU-s of a 10,000-message job's 8.6 (--conf spark.ui.enabled=true brings it back)
        settings["spark.ui.enabled"] = "false"
    if archive is not None:  # a cluster's driver starts the same way (it spent 12.3 of its 19.4 CPU-s without)
        driver_options.append(archive.java_options())
    settings["spark.driver.extraJavaOptions"] = " ".join(driver_options)
    settings.update(conf or {})
    quiet_pyspark_servers()
    try:
        spark_conf = SparkConf(loadDefaults=True).setAll(settings.items())
        if SparkContext._active_spark_context is not None or SparkContext._gateway is not None:
            return SparkContext.getOrCreate(spark_conf)
        return SparkContext(conf=spark_conf, gateway=launch_driver_jvm(spark_conf))
    except Exception as e:  # the JVM did not come up: PySparkRuntimeError, Py4JError...
        raise BackfillError(f"Spark did not start with master {master}: {spark_error_line(e)}") from None


def launch_driver_jvm(spark_conf):
    """PySpark's gateway JVM, its standard error passed on by `forward_jvm_stderr`."""
    from pyspark.java_gateway import launch_gateway  # noqa: PLC0415

    gateway = launch_gateway(spark_conf, popen_kwargs={"stderr": subprocess.PIPE})
    proc = getattr(gateway, "proc", None)
    if proc is not None and proc.stderr is not None:
        proc.stderr_forwarder = forward_jvm_stderr(proc.stderr)  # joined as the JVM ends (`jvm.end_gateway`)
    return gateway


def forward_jvm_stderr(stream, fd: int = 2) -> threading.Thread:
    """Copy the driver JVM's standard error (Spark's errors, the Python workers' tracebacks) to `fd` line by
    line, without Java's JVM_INCUBATOR_WARNING. It reads to the end whatever happens to `fd` (a closed pipe):
    a JVM whose standard error filled would block."""

    def run() -> None:
        for line in iter(stream.readline, b""):
            if line.rstrip(b"\r\n") == JVM_INCUBATOR_WARNING:
                continue
            with contextlib.suppress(OSError):
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
        stream.close()

    thread = threading.Thread(target=run, name="reputd-jvm-stderr", daemon=True)
    thread.start()
    return thread


# the kind of jobs the driver runs, in the archive's key: one recorded by a backfill that ran DataFrame jobs
# holds Spark SQL's classes and misses those of RDD jobs, so an upgraded reputd records its own once
ARCHIVE_JOBS = "rdd-jobs"


def archive_key(master: str) -> str:
    """What a driver's class archive is made for besides Java and Spark: a local driver runs the tasks (and
    its JVM options), a cluster's driver only schedules them, so each kind records an archive of its own."""
    return f"{LOCAL_DRIVER_JAVA_OPTIONS if master.startswith('local') else 'cluster-driver'} {ARCHIVE_JOBS}"


def driver_log_option() -> str:
    """The JVM option that makes the driver log with DRIVER_LOG_CONFIG (a URI: the path may hold spaces)."""
    return f"-Dlog4j2.configurationFile={pathlib.Path(DRIVER_LOG_CONFIG).as_uri()}"


MEMORY_HINT = ("raise spark.driver.memory (a local master runs the tasks in the driver JVM) or, on a cluster, "
               "spark.executor.memory, e.g. --conf spark.driver.memory=4g")
_OUT_OF_MEMORY = re.compile(r"java\.lang\.OutOfMemoryError(?::\s*([^\n]+))?")


def quiet_pyspark_servers() -> None:
    """When the JVM dies (out of memory, killed), PySpark's accumulator server printed a traceback ("Exception
    occurred during processing of request from") and py4j logged its own: the backfill's one line says it."""
    import logging  # noqa: PLC0415
    import socketserver  # noqa: PLC0415

    from pyspark import accumulators  # noqa: PLC0415

    logging.getLogger("py4j").setLevel(logging.CRITICAL)
    # and py4j's gateway logs "Exception while sending command." with a traceback on the root logger (the
    # module's logging.exception), e.g. when a signal kills the JVM mid-call: the error reaches the backfill
    root = logging.getLogger()
    if _not_py4j not in root.filters:
        root.addFilter(_not_py4j)
    for value in vars(accumulators).values():
        if isinstance(value, type) and issubclass(value, socketserver.BaseServer):
            value.handle_error = lambda *_args: None


def _not_py4j(record) -> bool:
    return f"{os.sep}py4j{os.sep}" not in record.pathname


def spark_error_line(error: BaseException) -> str:
    """The Python exception a task died of (the last `Name: message` line of the worker's traceback),
    or the first line of what Spark said; never a stack trace. A JVM out of memory, or gone, says which
    setting to raise."""
    text = str(error)
    memory = _OUT_OF_MEMORY.search(text)
    if memory:
        return f"Spark's JVM ran out of memory (java.lang.OutOfMemoryError: {memory[1] or 'no detail'}): {MEMORY_HINT}"
    if isinstance(error, ConnectionError) or type(error).__name__ == "Py4JNetworkError":
        return (f"Spark's JVM ended during the backfill ({type(error).__name__}: {text.splitlines()[0] if text else ''}"
                f"); if it ran out of memory, {MEMORY_HINT}")
    found = None
    for line in text.splitlines():
        match = _PY_ERROR.match(line.strip())
        if match and not match[1].startswith(("org.", "java.", "py4j.", "scala.")):
            found = f"{match[1].rsplit('.', 1)[-1]}: {match[2]}"
    if found:
        return found
    java = _JAVA_ERROR.search(text)
    if java:
        return f"{java[1]}: {java[2].strip()}"[:500]
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return first[:500]
