"""reputd's own checkpoint: how far the output is durable, in one small file in the output directory.

The broker's `checkpoint` file records timestamps, not a dispatch offset, so reputd keeps its own:
`reputd.checkpoint`, a JSON object holding `reputFromOffset` (every record below it is in the
dispatchers' files and those files are flushed) and each dispatcher's state at that offset (the
newest IndexFile's header, for instance), so recovery can cut the files back to exactly that point.

The file is replaced atomically (temporary file, fsync, rename, fsync of the directory) and carries a
CRC32 of its payload, so a torn or edited file is detected rather than trusted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

CHECKPOINT_FILE = "reputd.checkpoint"
CHECKPOINT_VERSION = 1
_TMP_SUFFIX = ".tmp"
_MAX_CHECKPOINT_BYTES = 1 << 20


class CheckpointError(Exception):
    """The checkpoint file exists but cannot be trusted; str() names the file and the reason."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"{path}: {detail}")
        self.path = path
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Checkpoint:
    reput_from_offset: int
    dispatchers: dict[str, Any] = field(default_factory=dict)
    written_at_ms: int = 0

    def payload(self) -> dict[str, Any]:
        return {"version": CHECKPOINT_VERSION, "reputFromOffset": self.reput_from_offset,
                "dispatchers": self.dispatchers, "writtenAtMs": self.written_at_ms}


def checkpoint_path(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINT_FILE)


def _crc(payload: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())


def write_checkpoint(output_dir: str, checkpoint: Checkpoint) -> None:
    """Replace the checkpoint so that a crash at any instant leaves either the old or the new one."""
    payload = checkpoint.payload()
    data = json.dumps({"payload": payload, "crc32": _crc(payload)}, sort_keys=True).encode() + b"\n"
    path = checkpoint_path(output_dir)
    tmp = path + _TMP_SUFFIX
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = os.write(fd, data)
        if written != len(data):  # a file system running out of room may take part of a write
            raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes", tmp)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(output_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_checkpoint(output_dir: str) -> Checkpoint | None:
    """The checkpoint, None when there is none; CheckpointError when it is damaged."""
    path = checkpoint_path(output_dir)
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CHECKPOINT_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > _MAX_CHECKPOINT_BYTES:
        raise CheckpointError(path, "file is too large to be a checkpoint")
    try:
        doc = json.loads(data)
        payload, crc = doc["payload"], doc["crc32"]
    except (ValueError, TypeError, KeyError):
        raise CheckpointError(path, "not a reputd checkpoint (unreadable JSON)") from None
    if not isinstance(payload, dict) or _crc(payload) != crc:
        raise CheckpointError(path, "CRC32 does not match the content")
    if payload.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(path, f"unsupported checkpoint version {payload.get('version')!r}")
    offset, dispatchers, written = (payload.get("reputFromOffset"), payload.get("dispatchers"),
                                    payload.get("writtenAtMs", 0))
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise CheckpointError(path, f"reputFromOffset {offset!r} is not a non-negative integer")
    if not isinstance(dispatchers, dict) or not isinstance(written, int):
        raise CheckpointError(path, "dispatchers or writtenAtMs has the wrong type")
    return Checkpoint(offset, dispatchers, written)


def remove_checkpoint(output_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(checkpoint_path(output_dir))
