"""The values `daemon.ops.metrics` labels and reports, apart from it: `rebuild` (recovery, the cleaner) counts with
them without importing prometheus_client and http.server (34 ms of a rebuild's CPU, for metrics it never serves)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


# The label values of the labelled counters. Code that increments one passes a member (never a string of
# its own), and every member's series exists from the start at 0, so `increase(...) > 0` sees the first
# event: a series born at 1 has no earlier sample to increase from.
class ErrorKind(StrEnum):
    DISPATCH = "dispatch"
    FLUSH = "flush"
    CHECKPOINT = "checkpoint"
    COMMITLOG = "commitlog"
    RECOVERY = "recovery"
    LOOP = "loop"
    RETENTION = "retention"  # a clean-up pass of expired output files failed (`daemon.engine.cleaner`)


class OutputStage(StrEnum):
    """Where a write to the output met a full disk or quota."""

    DISPATCH = "dispatch"
    FLUSH = "flush"
    RECOVERY = "recovery"


class SkipReason(StrEnum):
    CORRUPTION = "corruption"  # onCorruption: skip-segment
    RETENTION = "retention"  # segments deleted before they were dispatched


class FileKind(StrEnum):
    """The output's file kinds, as `reputd_files` and the deletion counters label them."""

    CONSUME_QUEUE = "consumequeue"
    INDEX = "index"


class RecoveryDecision(StrEnum):
    """How recovery chose where to resume, as logged (`recovered`) and counted (recoveries by decision)."""

    CHECKPOINT = "checkpoint"  # cut back to a checkpoint with every dispatcher's state
    REPLAY = "replay"  # a replay marker: from its offset, dispatchers skipping what they hold
    DERIVED = "derived"  # no checkpoint to trust: from where the files end


@dataclass(frozen=True, slots=True)
class RetentionBehind:
    """Expired output still on disk, as the clean-up's last look found it (`daemon.engine.cleaner`): files the
    CommitLog no longer needs that are not deleted yet (a pass under way, or IndexFiles the checkpoint needs)."""

    files: int = 0  # ConsumeQueue files
    bytes: int = 0  # their allocated bytes
    index_files: int = 0
    index_bytes: int = 0
    oldest_since: float | None = None  # time.monotonic() when a look first found the longest-waiting one expired

    def seconds(self, now: float) -> float:
        return 0.0 if self.oldest_since is None else max(0.0, now - self.oldest_since)
