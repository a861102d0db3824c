"""daemon: the reputd service built on indexcore.

    config        YAML configuration, environment overrides, validation (ConfigError names the key)
    dispatchers   the Dispatcher protocol and the built-in ConsumeQueue and IndexFile dispatchers
    rebuild       the offline pipeline: CommitLog reader -> batches -> dispatchers -> flush
    reput         `reputd run`: the live reput loop, recovery and the session around it
    flusher       the flush thread and the checkpoint it writes after each complete flush
    checkpoint    reputd's own checkpoint file (reputFromOffset + dispatcher states)
    metrics       Prometheus instruments, /metrics and /healthz
    sdnotify      systemd notifications (READY, WATCHDOG, STATUS)
    query         queries by key, queue offset and msgId (read-only)
    inspect_file  decoding any store file for `reputd inspect`
    produce       sample messages for demos and load
    logs          structlog set-up
    cli           the `reputd` command line
"""

import os

# numpy's OpenBLAS starts a spinning thread per core at import; reputd does no linear algebra, and on a
# small machine those threads take CPU from the reput loop.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def __getattr__(name: str) -> str:
    """`__version__`, looked up on first use: importlib.metadata costs more start-up time than a
    rebuild of a small store, and only the metrics need it."""
    if name != "__version__":
        raise AttributeError(name)
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - see above

    try:
        return version("reputd")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"
