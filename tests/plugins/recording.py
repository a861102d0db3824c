"""A third-party dispatcher for tests: appends one JSON line per batch to a file named in its options."""

from __future__ import annotations

import json


class RecordingDispatcher:
    name = "recording"

    def __init__(self, options, store, output_dir):
        self.path = options["path"]
        self.out = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.segment_size = store.mapped_file_size_commit_log

    def dispatch(self, batch) -> None:
        self.out.write(json.dumps({"start": batch.start_offset, "end": batch.end_offset, "messages": len(batch),
                                   "phy": batch.phy_offset.tolist()}) + "\n")

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.out.write(json.dumps({"closed": True}) + "\n")
        self.out.close()


class NotADispatcher:
    def __init__(self, options, store, output_dir):
        pass
