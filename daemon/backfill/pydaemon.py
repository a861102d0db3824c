"""PySpark's Python daemon (`spark.python.daemon.module`), minus one traceback.

When Spark cancels or kills a task (a Ctrl-C, a failed task's siblings), the JVM closes the task's socket
and the worker's last flush fails with a broken pipe. PySpark then ends the worker, as it should, but prints
the BrokenPipeError's traceback first, and it reaches the operator's terminal through the JVM. Here the
worker ends the same way (exit status 1, Spark starts another one) without it. Everything else is
`pyspark.daemon`: its manager forks and serves the workers.
"""

from __future__ import annotations

import gc
import importlib.machinery
import os
import re
import sys


def prefer_installed_pyspark(path: list[str]) -> list[str]:
    """`path` with Spark's zipped Python sources moved to its end when the same sources are installed.

    Spark puts `SPARK_HOME/python/lib/pyspark.zip` and `py4j-VERSION-src.zip` first on every Python worker's
    path. Python cannot cache compiled modules inside a zip, so each daemon compiled PySpark's sources again
    (1.4-1.6 CPU-s of every backfill's fixed cost, against 0.3 s importing the installed ones). A pip-installed
    PySpark carries that very zip inside its own directory, so its installed modules are the same code: its
    zip goes last, and py4j's too when the installed py4j is the zip's version. A zip of a Spark installation
    elsewhere (a cluster's SPARK_HOME) keeps its place: it may not match what pip installed."""
    rest = [p for p in path if not p.endswith(".zip")]
    spec = importlib.machinery.PathFinder.find_spec("pyspark", rest)
    if spec is None or not spec.submodule_search_locations:
        return list(path)
    installed = os.path.realpath(next(iter(spec.submodule_search_locations)))
    later = [p for p in path if p.endswith(".zip") and os.path.realpath(p).startswith(installed + os.sep)
             and _installed_too(os.path.basename(p), rest)]
    return [p for p in path if p not in later] + later


def _installed_too(zip_name: str, path: list[str]) -> bool:
    """Whether the modules of one of a pip-installed PySpark's own zips are installed on `path` as well."""
    if zip_name == "pyspark.zip":
        return True
    m = re.fullmatch(r"py4j-(.+)-src\.zip", zip_name)
    return m is not None and _installed_py4j(path) == m.group(1)


def _installed_py4j(path: list[str]) -> str | None:
    spec = importlib.machinery.PathFinder.find_spec("py4j", path)
    if spec is None or not spec.submodule_search_locations:
        return None
    version = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        with open(version, encoding="utf-8") as f:
            m = re.search(r"__version__\s*=\s*[\"']([^\"']+)", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


if __name__ == "__main__":
    sys.path[:] = prefer_installed_pyspark(sys.path)

import pyspark.daemon  # noqa: E402 - after the path is set

_pyspark_worker = pyspark.daemon.worker
WORKER_GONE_EXIT = 1  # what pyspark.daemon's manager exits a worker with after an exception


def worker(sock, authenticated):
    """`pyspark.daemon.worker`, ending quietly when the JVM has closed the task's socket."""
    try:
        return _pyspark_worker(sock, authenticated)
    except (BrokenPipeError, ConnectionResetError):
        os._exit(WORKER_GONE_EXIT)


pyspark.daemon.worker = worker

# glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # a decode window's arrays (8 MiB each at most) come from the heap
TRIM_THRESHOLD_BYTES = 128 << 20  # free heap a worker keeps for the next window instead of returning it


def keep_freed_memory() -> bool:
    """Let a worker's allocator reuse the memory of a decode window's arrays (numpy's, several MiB each, made
    anew for every window) instead of unmapping or trimming it and faulting in zeroed pages again for the next
    window: 4 ranges of the 16M store (617,000 messages) decoded with a catalog in 0.384 CPU-s against 0.430
    (medians of 8 runs each). A worker keeps at most TRIM_THRESHOLD_BYTES more. False where the C library is
    not glibc (nothing changes)."""
    import ctypes  # noqa: PLC0415

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                 TRIM_THRESHOLD_BYTES))

if __name__ == "__main__":
    # what each worker imports for its first task (PySpark's worker, the task functions and with them numpy and
    # pyarrow), imported once here before the manager forks them: every worker inherits it instead
    import pyspark.worker

    import daemon.backfill.tasks  # noqa: F401

    # and moved out of the collector's reach: a worker's full collections otherwise walk every object of those
    # imports again and again (2 of the workers' 12 CPU-s on the 16M store went to the collector), writing
    # into each object's header and so copying the daemon's pages into the worker
    gc.freeze()
    keep_freed_memory()  # before the manager forks the workers, which inherit it
    pyspark.daemon.manager()
