"""Finding the conformance stores written by the real RocketMQ broker, and configs to rebuild them.

Stores are read from `../shared/conformance/` and, next to it, `../shared/conformance-next/` (stores of
features added later, such as LMQ multi-dispatch). `REPUTD_CONFORMANCE_DIR` replaces the first with one
or more directories (separated by `os.pathsep`); a `-next` sibling of each is read too when it exists.
Every store is rebuilt with the settings its own manifest gives (`store_config`), so a store written with
other settings (LMQ on, say) needs nothing but its folder. A store written in DLedger CommitLog mode has no
`commitlog/`: its messages are in `store/dledger-<selfId>/data/`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFORMANCE_ROOT = REPO.parent / "shared" / "conformance"
NEXT_SUFFIX = "-next"


def conformance_roots() -> list[Path]:
    """The directories holding conformance stores: each configured one, then its `-next` sibling."""
    configured = os.environ.get("REPUTD_CONFORMANCE_DIR")
    roots = [Path(p) for p in configured.split(os.pathsep) if p] if configured else [CONFORMANCE_ROOT]
    out: list[Path] = []
    for root in roots:
        for d in (root, root.with_name(root.name + NEXT_SUFFIX)):
            if d.is_dir() and d.resolve() not in {o.resolve() for o in out}:
                out.append(d)
    return out

_PATH_KEYS = ("storePathRootDir", "storePathCommitLog")


@dataclass(frozen=True)
class ConformanceStore:
    name: str
    path: Path
    manifest: dict

    @property
    def store(self) -> Path:
        return self.path / "store"

    @property
    def is_dledger(self) -> bool:
        return bool(self.store_settings().get("enableDLegerCommitLog"))

    @property
    def log_dir(self) -> str:
        """Where the messages are, relative to the store root: `commitlog`, or the DLedger data directory."""
        if self.is_dledger:
            return f"dledger-{self.store_settings()['dLegerSelfId']}/data"
        return "commitlog"

    def segment_path(self, root: Path, offset: int) -> Path:
        """The CommitLog (or DLedger data) file of `root`, a workspace store root, holding store offset `offset`
        (a record's offset: a DLedger entry starts 48 bytes before it, in the same file)."""
        size = self.store_settings()["mappedFileSizeCommitLog"]
        return root / self.log_dir / f"{offset - offset % size:020d}"

    def store_settings(self) -> dict:
        """The broker's whole MessageStoreConfig as the manifest gives it, paths left out: reputd takes a
        block copied from broker.conf as it is."""
        cfg = self.manifest["store_config"]
        merged = {**cfg.get("all_values_after_setting", {}), **cfg["explicitly_set"]}
        return {k: v for k, v in merged.items() if k not in _PATH_KEYS}

    def make_workspace(self, tmp: Path) -> Path:
        """A store root holding a copy of the CommitLog only (in DLedger mode the `dledger-<selfId>/` directory:
        its data files, checkpoint and the index file as stored, truncated), and a config to rebuild it."""
        root = tmp / "store"
        for name in ("commitlog", *(d.name for d in sorted(self.store.glob("dledger-*")) if d.is_dir())):
            if (self.store / name).is_dir():
                shutil.copytree(self.store / name, root / name)
                for p in (root / name).rglob("*"):
                    p.chmod(0o755 if p.is_dir() else 0o644)
        config = {"store": {"storePathRootDir": str(root), **self.store_settings()},
                  "logging": {"level": "warning"}}
        path = tmp / "reputd.yaml"
        path.write_text(yaml.safe_dump(config))
        return path


def store_writer(store: ConformanceStore, root: Path, **kw):
    """A writer appending to the workspace store `root` of `store` as its broker would: a CommitLogWriter on
    `commitlog/`, or in DLedger mode a DLedgerWriter (tests/dledger_writer.py) committing what it wrote."""
    from indexcore.writer import CommitLogWriter

    settings = store.store_settings()
    if store.is_dledger:
        from tests.dledger_writer import DLedgerWriter

        return DLedgerWriter(str(root), settings["dLegerSelfId"], settings["mappedFileSizeCommitLog"], **kw)
    return CommitLogWriter(str(root / "commitlog"), settings["mappedFileSizeCommitLog"], **kw)


def has_log(store: Path) -> bool:
    """Whether a store root holds messages: `commitlog/`, or a DLedger data directory `dledger-*/data/`."""
    return (store / "commitlog").is_dir() or any(d.is_dir() for d in store.glob("dledger-*/data"))


def discover() -> list[ConformanceStore]:
    """Every store (a folder with manifest.json and store/commitlog or store/dledger-*/data) under
    `conformance_roots()`, named by its folder (prefixed with the root's name when two roots hold the same
    name)."""
    found = [(root, d) for root in conformance_roots() for d in sorted(root.iterdir())
             if (d / "manifest.json").is_file() and has_log(d / "store")]
    names = [d.name for _, d in found]
    return [ConformanceStore(d.name if names.count(d.name) == 1 else f"{root.name}/{d.name}", d,
                             json.loads((d / "manifest.json").read_text())) for root, d in found]


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
