"""A decode task's output, staged as files: the JVM never carries the output's bytes.

Each decode attempt of a range writes into a directory of its own under the job's staging tree
(`OUT/.reputd-backfill/JOB/rNNNNN-aATTEMPT/`, on the output's file system, which every executor sees):

    units.data    ConsumeQueue units (20 bytes each) in the order the decode made them
    units.meta    (topic, queue id) -> that queue's runs in put order: (physical offset of the first unit,
                  first queue offset, count, byte offset in units.data, whether the units' ends grow)
    keys.data     the range's IndexFile keys in `buildIndex` order, KEY_DTYPE records: hash, physical offset
                  and store time of the owning record, and the store time of the record that would create
                  the next IndexFile if one filled at this key (NO_CREATOR: the first record of the next range)
    catalog.data  Arrow IPC record batch messages of catalog rows, one a window, its rows grouped by (topic, UTC
                  day) (their schema is `catalogstage.read_groups`'s)
    catalog.meta  (topic, UTC day) -> that group's rows in each message, in CommitLog order: (the message's
                  byte offset and length, the group's first row in it and rows, the columns left out,
                  `catalog.StagedForm`)

The task returns only its `RangeOutcome` (a few hundred bytes, with the units per queue bucket and the rows
per catalog group the driver balances the writers with: buckets, not queues, so that a CommitLog with
hundreds of thousands of LMQ queues does not fill the driver's memory with their names). The runs of a
range are in CommitLog order already, so a writer takes each queue's, file's or group's runs range after
range and nothing is sorted anywhere.
"""

from __future__ import annotations

import mmap
import os
import pickle
import zlib
from collections.abc import Iterator
from contextlib import suppress

import numpy as np

from indexcore.consumequeue import CQ_UNIT_DTYPE, CQ_UNIT_SIZE

KEY_DTYPE = np.dtype([("hash", "<i4"), ("phy", "<i8"), ("ts", "<i8"), ("creator", "<i8")])
UNITS_DATA, UNITS_META, KEYS_DATA, CATALOG_DATA, CATALOG_META = (
    "units.data", "units.meta", "keys.data", "catalog.data", "catalog.meta")


QUEUE_BUCKETS = 4096


def queue_bucket(topic: str, queue_id: int) -> int:
    """Which of QUEUE_BUCKETS a queue is counted and written in (the same in every process)."""
    return zlib.crc32(f"{topic}\x00{queue_id}".encode("utf-8", "surrogatepass")) % QUEUE_BUCKETS


def range_dir(stage_root: str, number: int, attempt_id: int) -> str:
    return os.path.join(stage_root, f"r{number:05d}-a{attempt_id}")


class RangeStage:
    """The files of one range's decode attempt, appended to window by window."""

    def __init__(self, directory: str, catalog: bool):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.units = open(os.path.join(directory, UNITS_DATA), "wb")  # noqa: SIM115 - closed by close()
        self.keys = open(os.path.join(directory, KEYS_DATA), "wb")  # noqa: SIM115
        self.catalog = None
        if catalog:  # pyarrow: only for a run that writes a catalog
            from daemon.backfill.catalogstage import StagedMessages  # noqa: PLC0415

            self.catalog = StagedMessages(os.path.join(directory, CATALOG_DATA))
        self.unit_runs: dict[tuple[str, int], list[tuple[int, int, int, int, bool]]] = {}
        self.catalog_runs: dict[tuple[str, int], list[tuple[int, int, int, int, tuple]]] = {}
        self.unit_bytes = self.key_count = self.catalog_bytes = 0

    def add_units(self, topic: str, queue_id: int, phy: int, first_qo: int, count: int, data,
                  streak: bool = False) -> None:
        """A run of consecutive queue offsets; `streak`: its units' ends grow too (`QueueUnits.one_streak`)."""
        self.unit_runs.setdefault((topic, queue_id), []).append((phy, first_qo, count, self.unit_bytes, streak))
        self.units.write(data)
        self.unit_bytes += count * CQ_UNIT_SIZE

    def add_keys(self, records: np.ndarray) -> None:
        self.keys.write(memoryview(records.view(np.uint8)))  # not tobytes(): no copy
        self.key_count += len(records)

    def add_catalog(self, rows, groups: list[tuple[str, int, int, int, tuple]]) -> None:
        """A window's catalog rows (a record batch) and (topic, day, first row, rows, form) of each of its
        groups (`catalog.catalog_window`)."""
        at, length = self.catalog.write(rows)
        runs = self.catalog_runs
        for topic, day, first, count, form in groups:
            runs.setdefault((topic, day), []).append((at, length, first, count, form))
        self.catalog_bytes = at + length

    def close(self) -> None:
        for f in (self.units, self.keys, self.catalog):
            if f is not None:
                f.close()
        with open(os.path.join(self.directory, UNITS_META), "wb") as f:
            pickle.dump(self.unit_runs, f, protocol=pickle.HIGHEST_PROTOCOL)
        if self.catalog is not None:
            with open(os.path.join(self.directory, CATALOG_META), "wb") as f:
                pickle.dump(self.catalog_runs, f, protocol=pickle.HIGHEST_PROTOCOL)

    def abandon(self) -> None:
        with suppress(OSError):
            self.close()

    def bucket_units(self) -> dict[int, int]:
        """Units staged per queue bucket."""
        out: dict[int, int] = {}
        for q, runs in self.unit_runs.items():
            b = queue_bucket(*q)
            out[b] = out.get(b, 0) + sum(r[2] for r in runs)
        return out

    def catalog_rows(self) -> dict[tuple[str, int], int]:
        return {g: sum(r[3] for r in runs) for g, runs in self.catalog_runs.items()}


def _map(path: str):
    """A read-only map of a staged file (None when empty: mmap refuses length 0)."""
    size = os.path.getsize(path)
    if size == 0:
        return None
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)


class StagedRange:
    """A writer's view of one range's staged files."""

    def __init__(self, directory: str):
        self.directory = directory
        self._maps: dict[str, object] = {}
        self._meta: dict[str, dict] = {}

    def _data(self, name: str):
        if name not in self._maps:
            self._maps[name] = _map(os.path.join(self.directory, name))
        return self._maps[name]

    def meta(self, name: str) -> dict:
        if name not in self._meta:
            with open(os.path.join(self.directory, name), "rb") as f:
                self._meta[name] = pickle.load(f)
        return self._meta[name]

    def queues(self, buckets) -> list[tuple[str, int]]:
        """The range's queues that fall in `buckets`."""
        return [q for q in self.meta(UNITS_META) if queue_bucket(*q) in buckets]

    def unit_runs(self, queue: tuple[str, int]) -> Iterator[tuple[int, int, np.ndarray, bool]]:
        """(physical offset, first queue offset, units, whether the run is a streak (`RangeStage.add_units`))
        of each of a queue's runs."""
        runs = self.meta(UNITS_META).get(queue)
        if not runs:
            return
        data = self._data(UNITS_DATA)
        for phy, first_qo, count, at, streak in runs:
            units = np.frombuffer(data, dtype=CQ_UNIT_DTYPE, count=count, offset=at)
            yield phy, first_qo, units, streak

    def keys(self, lo: int, hi: int) -> np.ndarray:
        """Keys [lo, hi) of the range (KEY_DTYPE)."""
        data = self._data(KEYS_DATA)
        if data is None or hi <= lo:
            return np.zeros(0, dtype=KEY_DTYPE)
        return np.frombuffer(data, dtype=KEY_DTYPE, count=hi - lo, offset=lo * KEY_DTYPE.itemsize)

    def catalog_pieces(self, group: tuple[str, int]) -> Iterator[tuple[int, memoryview, int, int, tuple]]:
        """Each of a group's pieces for `catalogstage.read_groups`: (the message's offset, the message, the group's
        first row in it, rows, form)."""
        runs = self.meta(CATALOG_META).get(group)
        if not runs:
            return
        data = memoryview(self._data(CATALOG_DATA))
        for at, length, first, rows, form in runs:
            yield at, data[at : at + length], first, rows, form

    def release(self) -> None:
        """Unmap the pages of the staged files read so far (they stay in the page cache, and a view still
        held faults them in again): a writer reading a whole job's staged rows through maps it keeps counts
        them all in its RSS, which a resource manager may hold against it (2 GB for the 16M store's catalog)."""
        for m in self._maps.values():
            if m is not None:
                m.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._meta.clear()
        for m in self._maps.values():
            if m is not None:
                with suppress(BufferError):  # a view still held by a caller: the map goes with it
                    m.close()
        self._maps.clear()
