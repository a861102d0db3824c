"""The store settings held against the files already there: ConsumeQueue files or IndexFiles all of one size
that the config's sizes do not give mean a config that is not the broker's (SizeMismatchError: a
configuration error, exit 2, in every command), while one file of another size among right ones is damage
(a finding for `verify`, a quarantine for `run`, exit 1 for `rebuild`). The CommitLog's segments follow the
same rule in the reader (`indexcore.reader.CommitLog`)."""

from __future__ import annotations

import os

from daemon.config import Config, StoreConfig
from indexcore.consumequeue import CONSUME_QUEUE_DIR
from indexcore.errors import SizeMismatchError
from indexcore.indexfile import index_file_size
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import FILE_NAME_DIGITS


def _uniform(paths, expected: int) -> tuple[str, int] | None:
    """(the first path, the size) when every path has one size other than `expected`, else None. Stops at the
    first file of the right size, so a right config costs one stat."""
    seen = None
    for path in paths:
        size = os.path.getsize(path)
        if size == expected or (seen is not None and size != seen[1]):
            return None
        seen = seen or (path, size)
    return seen


def _queue_files(out: str, topic: str | None = None):
    root = os.path.join(out, CONSUME_QUEUE_DIR)
    topics = [topic] if topic is not None else sorted(os.listdir(root)) if os.path.isdir(root) else []
    for t in topics:
        tdir = os.path.join(root, t)
        for qid in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
            qdir = os.path.join(tdir, qid)
            for name in sorted(os.listdir(qdir)) if os.path.isdir(qdir) else []:
                if len(name) == FILE_NAME_DIGITS and name.isdigit():
                    yield os.path.join(qdir, name)


def _index_files(out: str):
    root = os.path.join(out, INDEX_DIR)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.isdigit() and os.path.isfile(path) and os.path.getsize(path):  # 0 bytes: being created
            yield path


def check_output_sizes(out: str, store: StoreConfig, *, queues: bool = True, index: bool = True,
                       topic: str | None = None) -> None:
    """SizeMismatchError when every ConsumeQueue file (of `topic`, when given: a query's one topic), or every
    IndexFile, under `out` has one size other than the configured one: the setting is not the broker's."""
    try:
        if queues and (u := _uniform(_queue_files(out, topic), store.mapped_file_size_consume_queue)):
            raise SizeMismatchError(u[0], f"every ConsumeQueue file here is {u[1]} bytes, mappedFileSizeConsumeQueue "
                                          f"is {store.mapped_file_size_consume_queue}")
        expected = index_file_size(store.max_hash_slot_num, store.max_index_num)
        if index and (u := _uniform(_index_files(out), expected)):
            raise SizeMismatchError(u[0], f"every IndexFile here is {u[1]} bytes; maxHashSlotNum "
                                          f"{store.max_hash_slot_num} and maxIndexNum {store.max_index_num} give "
                                          f"{expected}")
    except FileNotFoundError:  # a writer deleting files meanwhile: the command says what it finds
        return


def check_store_root_sizes(config: Config) -> None:
    """With the output elsewhere (`rebuild`, `run`, `backfill`, `verify` and `handoff` with `--out`), the store
    root's own ConsumeQueue files and IndexFiles held to the configured sizes: the output's files are to
    replace them, and a 4.9.3 broker maps whatever file is there at its own sizes (IndexFile's constructor maps
    40 + 4·slots + 20·entries bytes). SizeMismatchError (exit 2) naming the root's file, as for the output's."""
    root, out = config.store.store_path_root_dir, config.output.dir
    if not os.path.isdir(root) or os.path.realpath(root) == os.path.realpath(out) or (
            os.path.isdir(out) and os.path.samefile(root, out)):
        return
    names = {d.name for d in config.dispatchers}
    try:
        check_output_sizes(root, config.store, queues="consumequeue" in names,
                           index="index" in names and config.store.message_index_enable)
    except SizeMismatchError as e:
        raise SizeMismatchError(e.path, e.detail.replace(" here ", " in the store root (the broker's, which the "
                                                         "output's files are to replace) ", 1)) from None


def check_config_sizes(config: Config) -> None:
    """What every writer checks before it writes: the output's files of the kinds its dispatchers write held to
    the configured sizes (the same line `verify` and `query` give, `every IndexFile here is ...`, rather than
    the loader's for the first file it opens), then the store root's (`check_store_root_sizes`)."""
    names = {d.name for d in config.dispatchers}
    if os.path.isdir(config.output.dir):
        check_output_sizes(config.output.dir, config.store, queues="consumequeue" in names,
                           index="index" in names and config.store.message_index_enable)
    check_store_root_sizes(config)


def size_setting(path: str) -> str:
    """The store setting that fixes the size of the file at `path`."""
    parts = os.path.normpath(path).split(os.sep)
    if INDEX_DIR in parts[-2:-1]:
        return "store.maxHashSlotNum and store.maxIndexNum"
    if CONSUME_QUEUE_DIR in parts[:-1]:
        return "store.mappedFileSizeConsumeQueue"
    return "store.mappedFileSizeCommitLog"


def size_advice(error: SizeMismatchError) -> str:
    """The one line every command gives for a size that is not the broker's: the file, the sizes, the keys."""
    keys = size_setting(error.path)
    return f"{error}: set {keys} to the broker's {'values' if ' and ' in keys else 'value'}"


def settings_or_damage(error: SizeMismatchError, out: str, store: StoreConfig) -> None:
    """For a file of the output refused for its size: raise the SizeMismatchError that names the setting when
    every file of its kind has that size; return when it is one damaged file among right ones."""
    parts = os.path.relpath(os.path.abspath(error.path), os.path.abspath(out)).split(os.sep)
    if parts[0] in (CONSUME_QUEUE_DIR, INDEX_DIR):
        check_output_sizes(out, store, queues=parts[0] == CONSUME_QUEUE_DIR, index=parts[0] == INDEX_DIR)


__all__ = ["check_config_sizes", "check_output_sizes", "check_store_root_sizes", "settings_or_damage", "size_advice",
           "size_setting"]
