"""The settings no file stores, told by the files: ConsumeQueue files or IndexFiles all of one size other
than the configured store settings give (`mappedFileSizeConsumeQueue`; 40 + 4·maxHashSlotNum +
20·maxIndexNum bytes) mean a config that is not the broker's, not a store whose every file is damaged
(SizeMismatchError, exit 2 in every command). A file of another size among right ones is damage: verify's
finding, recovery's quarantine.

An output is held to the settings (`verify`, `query`, recovery); so is the store root beside an output
elsewhere (`rebuild`, `run`, `backfill`, `verify` and `handoff` with `--out`): the files written there are
to replace the broker's, which a 4.9.3 broker then maps at its own sizes (`IndexFile`'s constructor maps
40 + 4·slots + 20·entries bytes of whatever file is there)."""

from __future__ import annotations

import os

from daemon.config import Config
from indexcore.consumequeue import CONSUME_QUEUE_DIR
from indexcore.errors import SizeMismatchError
from indexcore.indexfile import index_file_size
from indexcore.indexservice import INDEX_DIR
from indexcore.mappedfile import FILE_NAME_DIGITS


def _uniform(paths, expected: int) -> tuple[str, int] | None:
    """The first file and the size every file has, when none has `expected` and all have one size."""
    seen = None
    for path in paths:
        size = os.path.getsize(path)
        if size == expected or (seen is not None and size != seen[1]):
            return None
        seen = seen or (path, size)
    return seen


def _queue_files(directory: str):
    root = os.path.join(directory, CONSUME_QUEUE_DIR)
    for topic in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        tdir = os.path.join(root, topic)
        for qid in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
            qdir = os.path.join(tdir, qid)
            for name in sorted(os.listdir(qdir)) if os.path.isdir(qdir) else []:
                if len(name) == FILE_NAME_DIGITS and name.isdigit():
                    yield os.path.join(qdir, name)


def _index_files(directory: str):
    root = os.path.join(directory, INDEX_DIR)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.isdigit() and os.path.isfile(path) and os.path.getsize(path):  # 0 bytes: being created
            yield path


def check_file_sizes(directory: str, store, *, queues: bool, index: bool, where: str = "here") -> None:
    """SizeMismatchError when every ConsumeQueue file, or every IndexFile, under `directory` has one size
    other than the configured one (`where` says whose files they are). Stops at the first file of the right
    size, so a right config costs one stat."""
    try:
        if queues and (u := _uniform(_queue_files(directory), store.mapped_file_size_consume_queue)):
            raise SizeMismatchError(u[0], f"every ConsumeQueue file {where} is {u[1]} bytes, "
                                          f"mappedFileSizeConsumeQueue is {store.mapped_file_size_consume_queue}")
        expected = index_file_size(store.max_hash_slot_num, store.max_index_num)
        if index and (u := _uniform(_index_files(directory), expected)):
            raise SizeMismatchError(u[0], f"every IndexFile {where} is {u[1]} bytes; maxHashSlotNum "
                                          f"{store.max_hash_slot_num} and maxIndexNum {store.max_index_num} give "
                                          f"{expected}")
    except FileNotFoundError:  # a broker deleting files meanwhile: the pass will say what it finds
        return


def written_kinds(config: Config) -> tuple[bool, bool]:
    """Whether the config writes ConsumeQueues, and IndexFiles."""
    names = {d.name for d in config.dispatchers}
    return "consumequeue" in names, "index" in names and config.store.message_index_enable


def check_store_root_sizes(config: Config) -> None:
    """With the output elsewhere: SizeMismatchError when the store root's own ConsumeQueue files or IndexFiles
    all have one size the config does not give (the output's files would not be the broker's)."""
    root, out = config.store.store_path_root_dir, config.output.dir
    if not os.path.isdir(root) or (os.path.isdir(out) and os.path.samefile(root, out)) or \
            os.path.realpath(root) == os.path.realpath(out):
        return
    queues, index = written_kinds(config)
    check_file_sizes(root, config.store, queues=queues, index=index,
                     where="in the store root (the broker's, which the output's files are to replace)")


__all__ = ["check_file_sizes", "check_store_root_sizes", "written_kinds"]
