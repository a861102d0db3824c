"""StoreCheckpoint: the broker's `{root}/checkpoint`, one 4096-byte page of big-endian int64s.

    offset  field
    0       physic_msg_timestamp    store time covered by the last thorough CommitLog flush
    8       logics_msg_timestamp    store time of the last ConsumeQueue unit, as of the last thorough flush
    16      index_msg_timestamp     end_timestamp of the last full, flushed IndexFile
    24      master_flushed_offset   [5.x] HA
    32      confirm_phy_offset      [5.x] controller mode
    40..    zeros
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from indexcore.errors import StoreLayoutError

CHECKPOINT_FILE_SIZE = 4096
CHECKPOINT_FIELDS = struct.Struct(">qqqqq")
CHECKPOINT_FILE = "checkpoint"


class StoreCheckpoint(NamedTuple):
    physic_msg_timestamp: int = 0
    logics_msg_timestamp: int = 0
    index_msg_timestamp: int = 0
    master_flushed_offset: int = 0
    confirm_phy_offset: int = 0

    def encode(self) -> bytes:
        return CHECKPOINT_FIELDS.pack(*self).ljust(CHECKPOINT_FILE_SIZE, b"\0")

    @classmethod
    def decode(cls, data: bytes, path: str = CHECKPOINT_FILE) -> StoreCheckpoint:
        if len(data) != CHECKPOINT_FILE_SIZE:
            raise StoreLayoutError(path, f"checkpoint is {len(data)} bytes, not {CHECKPOINT_FILE_SIZE}")
        return cls(*CHECKPOINT_FIELDS.unpack_from(data))
