"""Finding the conformance stores written by the real RocketMQ broker, and configs to rebuild them.

Stores are read from `../shared/conformance/` and, next to it, `../shared/conformance-next/` (stores of
features added later, such as LMQ multi-dispatch). `REPUTD_CONFORMANCE_DIR` replaces the first with one
or more directories (separated by `os.pathsep`); a `-next` sibling of each is read too when it exists.
Every store is rebuilt with the settings its own manifest gives (`store_config`), so a store written with
other settings (LMQ on, say) needs nothing but its folder.
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

    def store_settings(self) -> dict:
        """The broker's whole MessageStoreConfig as the manifest gives it, paths left out: reputd takes a
        block copied from broker.conf as it is."""
        cfg = self.manifest["store_config"]
        merged = {**cfg.get("all_values_after_setting", {}), **cfg["explicitly_set"]}
        return {k: v for k, v in merged.items() if k not in _PATH_KEYS}

    def make_workspace(self, tmp: Path) -> Path:
        """A store root holding a copy of the CommitLog only, and a config to rebuild it."""
        root = tmp / "store"
        shutil.copytree(self.store / "commitlog", root / "commitlog")
        for p in (root / "commitlog").iterdir():
            p.chmod(0o644)
        config = {"store": {"storePathRootDir": str(root), **self.store_settings()},
                  "logging": {"level": "warning"}}
        path = tmp / "reputd.yaml"
        path.write_text(yaml.safe_dump(config))
        return path


def discover() -> list[ConformanceStore]:
    """Every store (a folder with manifest.json and store/commitlog) under `conformance_roots()`, named by
    its folder (prefixed with the root's name when two roots hold the same name)."""
    found = [(root, d) for root in conformance_roots() for d in sorted(root.iterdir())
             if (d / "manifest.json").is_file() and (d / "store" / "commitlog").is_dir()]
    names = [d.name for _, d in found]
    return [ConformanceStore(d.name if names.count(d.name) == 1 else f"{root.name}/{d.name}", d,
                             json.loads((d / "manifest.json").read_text())) for root, d in found]


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
