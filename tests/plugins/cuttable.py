"""A third-party dispatcher for tests that takes part in recovery: one line per record (its store offset), and
`recover(X, state)` keeps only the records below X (the contract docs/recovery.md gives plug-ins)."""

from __future__ import annotations

import os


class ForgetfulDispatcher:
    """One line per record, and no `recover`: recovery cannot cut it back."""

    name = "forgetful"

    def __init__(self, options, store, output_dir):
        self.path = options["path"]
        self.out = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def dispatch(self, batch) -> None:
        self.out.write("".join(f"{int(p)}\n" for p in batch.phy_offset))

    def flush(self) -> None:
        self.out.flush()
        os.fsync(self.out.fileno())

    def checkpoint_state(self) -> dict:
        return {"path": self.path}

    def close(self) -> None:
        self.out.close()


class CuttableDispatcher(ForgetfulDispatcher):
    name = "cuttable"

    def recover(self, reput_from_offset: int, state) -> None:
        self.out.close()
        with open(self.path, encoding="utf-8") as f:
            kept = [line for line in f if int(line) < reput_from_offset]
        with open(self.path, "w", encoding="utf-8") as f:
            f.writelines(kept)
        self.out = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

