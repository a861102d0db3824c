"""DLedger CommitLog mode (`store.enableDLegerCommitLog: true`): which log a command reads, and the checks on
the settings that locate it, made before anything is read or written.

In this mode the broker's CommitLog is `<storePathRootDir>/dledger-<dLegerSelfId>/data` (DLedgerConfig, as
DLedgerCommitLog configures it); `storePathCommitLog` still names the old plain CommitLog of a store switched
to DLedger, read below dividedCommitlogOffset (indexcore/dledgerlog.py).
"""

from __future__ import annotations

import os

from daemon.config import StoreConfig
from daemon.engine.dledgerfollow import OneNodeDLedgerLog, one_node_group
from indexcore.dledger import DATA_DIR, HOME_PREFIX, data_dir, home_dir
from indexcore.dledgerlog import DLedgerLog
from indexcore.reader import CommitLog


def enabled(store: StoreConfig) -> bool:
    return store.enable_d_leger_commit_log


def commit_log_path(store: StoreConfig) -> str:
    """Where the CommitLog a command reads lives, for messages: the DLedger data directory in this mode."""
    return data_dir(store.store_path_root_dir, store.d_leger_self_id) if enabled(store) else \
        store.store_path_commit_log


def open_commit_log(store: StoreConfig, *, follow: bool = False, committed: bool = True) -> CommitLog:
    """The CommitLog the broker's reput reads: the plain one, or in DLedger mode the DLedger data files (after
    the old commitlog/ of a mixed store), stopping at the committed position unless `committed` is False."""
    if not enabled(store):
        return CommitLog(store.commit_log_dirs, store.mapped_file_size_commit_log, follow=follow)
    cls = OneNodeDLedgerLog if one_node_group(store) else DLedgerLog  # daemon/dledgerfollow.py
    return cls(store.store_path_root_dir, store.d_leger_self_id, store.mapped_file_size_commit_log,
               commit_log_dirs=store.commit_log_dirs, follow=follow, committed=committed)


def reput_offset(log: CommitLog, offset: int | None) -> int | None:
    """An offset an operator gives (`--from`, `--to`) as the reput takes it: in a DLedger log reput offsets are
    entry positions, and a message's store offset (entry pos + 48, what ConsumeQueue units, IndexFiles and
    msgIds hold) is taken as its entry's position. Anything else is left for the command to refuse."""
    if offset is None or not isinstance(log, DLedgerLog):
        return offset
    return log.entry_start(offset)


def input_problem(store: StoreConfig, root_option: str = "store.storePathRootDir") -> str | None:
    """The one line saying why the DLedger settings do not locate a DLedger log (a usage error), or None;
    `root_option` is what chose the store root (`--store` or the config key)."""
    root = store.store_path_root_dir
    if not os.path.isdir(root):
        return f"{root}: no such store root directory ({root_option})"
    home = home_dir(root, store.d_leger_self_id)
    data = data_dir(root, store.d_leger_self_id)
    if os.path.isdir(data):
        return None
    others = _dledger_homes(root)
    hint = f"; this store has {', '.join(f'{n}/data' for n in others)}" if others else ""
    if not others and any(os.path.isdir(d) for d in store.commit_log_dirs):
        hint = (f"; it has {_plain_dirs(store)}, a plain CommitLog: set store.enableDLegerCommitLog: false (or "
                "leave it out), as in the broker's broker.conf")
    held = (f"names {home}, which holds no data/" if os.path.isdir(home) else
            f"under {root} locates no DLedger CommitLog")
    return f"{data}: no such directory: store.dLegerSelfId {store.d_leger_self_id!r} {held}{hint}"


def _plain_dirs(store: StoreConfig) -> str:
    """The plain CommitLog directories that exist, named as the operator knows them (`commitlog/` in the
    store root, else the path)."""
    root = os.path.abspath(store.store_path_root_dir)
    names = [os.path.relpath(d, root) + "/" if os.path.dirname(os.path.abspath(d)) == root else d
             for d in store.commit_log_dirs if os.path.isdir(d)]
    return ", ".join(names)


def store_mode_problem(store: StoreConfig) -> str | None:
    """The one line saying that the store root holds a CommitLog of the other kind than the config reads (a
    DLedger log read without the DLedger keys, a plain `commitlog/` read with them, a DLedger log of another
    `dLegerSelfId`), naming the settings that read it; None otherwise, a store root or CommitLog that is
    not there among them (each command says its own way what is missing: `run` waits for it)."""
    root = store.store_path_root_dir
    if not os.path.isdir(root):
        return None
    if enabled(store):
        if os.path.isdir(data_dir(root, store.d_leger_self_id)):
            return None
        if not _dledger_homes(root) and not any(os.path.isdir(d) for d in store.commit_log_dirs):
            return None  # nothing there yet: not a mistake of kind
        return input_problem(store)
    if any(os.path.isdir(d) for d in store.commit_log_dirs):
        return None
    hint = dledger_settings_hint(root)
    if not hint:
        return None
    plain = store.commit_log_dirs[0]
    return f"{plain}: the store root {root} has no {os.path.basename(plain)}/ directory: no CommitLog to read{hint}"

def _dledger_homes(root: str) -> list[str]:
    """The `dledger-<id>` directories of a store root that hold a data directory."""
    return sorted(n for n in os.listdir(root)
                  if n.startswith(HOME_PREFIX) and os.path.isdir(os.path.join(root, n, DATA_DIR)))


def dledger_settings_hint(root: str) -> str:
    """For a store read as a plain CommitLog: when its root holds a DLedger log instead, the settings that
    read it (an operator who copied only the store block of a DLedger broker's broker.conf); else ''."""
    try:
        names = _dledger_homes(root)
    except OSError:
        return ""
    if not names:
        return ""
    ids = " or ".join(n.removeprefix(HOME_PREFIX) for n in names)
    return (f"; it has {', '.join(n + '/data' for n in names)}, a DLedger CommitLog: set "
            f"store.enableDLegerCommitLog: true and store.dLegerSelfId: {ids}, as in the broker's broker.conf")


__all__ = ["commit_log_path", "dledger_settings_hint", "enabled", "input_problem", "open_commit_log",
           "reput_offset", "store_mode_problem"]
