"""daemon: the reputd service built on indexcore, laid out by role (docs/architecture.md draws it).

    engine/     what `run` and `rebuild` share: recovery, the reader, the session, dispatchers, the flusher
                and checkpoint, the cleaner, the offline rebuild, the live service (service, runner) and
                its loop (reput)
    commands/   each command's logic: verify (frontier, verify_text), handoff (brokerfiles), query (render),
                inspect_file, produce, sample_store
    cli/        the `reputd` command line: parsing, dispatch, exit codes; one module per command's front end
    config/     the configuration: model, keys (the key table), validate, yamlfile, layers, memo
    ops/        metrics and /healthz, sdnotify, healthcheck, logs, outlock, periodic, failpoint, deferred
    backfill/   `reputd backfill` on Spark
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
    except PackageNotFoundError:  # a source tree that was never installed: the one place it is written
        import tomllib  # noqa: PLC0415 - see above

        try:
            pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
            with open(pyproject, "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"
