"""Finding the conformance stores written by the real RocketMQ broker, and configs to rebuild them."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFORMANCE_ROOT = Path(os.environ.get("REPUTD_CONFORMANCE_DIR", REPO.parent / "shared" / "conformance"))

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
    stores = []
    if CONFORMANCE_ROOT.is_dir():
        for d in sorted(CONFORMANCE_ROOT.iterdir()):
            manifest = d / "manifest.json"
            if manifest.is_file() and (d / "store" / "commitlog").is_dir():
                stores.append(ConformanceStore(d.name, d, json.loads(manifest.read_text())))
    return stores


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
