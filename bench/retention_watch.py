"""What retention does to an output over a daemon's life, watched from outside (bench/life.py).

A thread lists the output every `interval` seconds (names only: no stat, so 10,000 queue directories cost
about a tenth of a second) and keeps each file's life: when it appeared, when its queue (or the index) got a
newer file, and when it disappeared. A ConsumeQueue file's key, the commit_log_offset of its last unit, is
the writer's (bench/life.py's writer notes the offset of every record whose unit ends a file, `keys_file`):
what a broker running all along holds there, known even for a file that rolled and was deleted between two
scans. An IndexFile's key, its endPhyOffset, is read from its header at each scan while it is on disk. The
broker's retention, played by bench/life.py's `retain`, reports each new CommitLog first offset with the
time just before the unlink that made it.

From those, after the run: when each file expired by the broker's rule (`indexcore.retention`: its key below
the first offset, not the newest, and every older file of its queue expired: the walk takes a prefix), and
the delay of its deletion, counted from its expiry or from the start of the daemon life that deleted it,
whichever is later (no daemon deletes while it is stopped). The delays are late by up to `interval`.

Every `sample_every` seconds it also weighs the output (allocated bytes) against what the live window
needs: the files of the broker's rule kept at that moment's first offset, i.e. the files holding retained
messages and each queue's current file, and the IndexFiles from the first one reaching it.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CQ_UNIT_SIZE = 20
INF = float("inf")
INDEX_END_PHY_OFFSET_AT = 24  # the header: beginTimestamp 8, endTimestamp 8, beginPhyOffset 8, endPhyOffset 8


@dataclass(slots=True)
class FileLife:
    kind: str  # "consumequeue" or "index"
    group: str  # the queue's directory, or "index"
    name: str
    born: float
    older_at: float | None = None  # when a newer file of its group appeared
    key: int | None = None  # last unit's commit_log_offset / endPhyOffset, once written no more
    deleted_at: float | None = None
    expired_at: float | None = None


def _read_key(path: str, kind: str, cq_file_size: int) -> int | None:
    try:
        with open(path, "rb") as f:
            if kind == "index":
                data = os.pread(f.fileno(), 8, INDEX_END_PHY_OFFSET_AT)
            else:
                data = os.pread(f.fileno(), CQ_UNIT_SIZE, cq_file_size - CQ_UNIT_SIZE)
    except FileNotFoundError:
        return None
    if len(data) < 8 or not any(data):
        return None  # not written yet: read again at the next scan
    return int.from_bytes(data[:8], "big", signed=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class OutputWatch:
    out: Path
    cq_file_size: int
    keys_file: Path | None = None  # lines "topic queue_id queue_offset commit_log_offset" of units ending a file
    interval: float = 5.0
    sample_every: float = 30.0
    t0: float = field(default_factory=time.monotonic)
    files: dict[tuple[str, str], FileLife] = field(default_factory=dict)
    firsts: list[tuple[float, int]] = field(default_factory=lambda: [(0.0, 0)])  # (t, CommitLog first offset)
    lives: list[tuple[float, float | None]] = field(default_factory=list)  # (start, stop) of each daemon life
    samples: list[dict] = field(default_factory=list)
    scan_seconds: list[float] = field(default_factory=list)
    recreated: int = 0  # files deleted (a recovery cutting the output back) and written again
    recovered: list[float] = field(default_factory=list)  # when each start's recovery was over (`recovered`)
    wall0: float = field(default_factory=time.time)  # time.time() at t0: the daemon's log times to ours
    _ends: dict[tuple[str, str, int], int] = field(default_factory=dict)  # (topic, queue, last unit) -> offset
    _ends_read: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="retention-watch", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- what the harness reports -----------------------------------------------------------------------------

    def first_moved(self, first: int, at: float | None = None) -> None:
        with self._lock:
            if first > self.firsts[-1][1]:
                self.firsts.append((self.now() if at is None else at, first))

    def life_started(self) -> None:
        with self._lock:
            self.lives.append((self.now(), None))

    def recovered_at(self, wall_times: list[float]) -> None:
        """The daemon's `recovered` events (time.time()): a file gone between a start and the end of its recovery
        was cut back by the recovery, not deleted by retention."""
        self.recovered = sorted(w - self.wall0 for w in wall_times)

    def _cut_by_recovery(self, t: float) -> bool:
        start = self._life_start(t)
        after = [r for r in self.recovered if r >= start]
        return bool(after) and t <= after[0] + self.interval

    def life_stopped(self) -> None:
        with self._lock:
            start, _ = self.lives[-1]
            self.lives[-1] = (start, self.now())

    # --- the scans ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.scan()  # the last word: what is on disk at the end

    def _run(self) -> None:
        next_sample = 0.0
        while not self._stop.wait(self.interval):
            self.scan()
            if self.now() >= next_sample:
                self.sample()
                next_sample = self.now() + self.sample_every

    def _groups(self) -> dict[str, tuple[float, list[str]]]:
        """group -> when it was listed and its file names, sorted: each queue directory, and the index directory.
        A scan of 10,000 queue directories takes a tenth of a second or more: a file missing from a listing was
        deleted before that listing, not before the scan began (stamped with the scan's start, a deletion made
        just after it read as one made before the CommitLog's first offset moved)."""
        groups: dict[str, tuple[float, list[str]]] = {}
        root = self.out / "consumequeue"
        try:
            topics = list(os.scandir(root))
        except FileNotFoundError:
            topics = []
        for topic in topics:
            for queue in os.scandir(topic.path):
                names = sorted(e.name for e in os.scandir(queue.path) if e.name.isdigit())
                groups[queue.path] = (self.now(), names)
        with contextlib.suppress(FileNotFoundError):
            names = sorted(e.name for e in os.scandir(self.out / "index") if e.name.isdigit())
            groups["index"] = (self.now(), names)
        return groups

    def scan(self) -> None:
        started = time.monotonic()
        groups = self._groups()
        end = self.now()
        seen = set()
        with self._lock:
            for group, (t, names) in groups.items():
                kind = "index" if group == "index" else "consumequeue"
                directory = str(self.out / "index") if kind == "index" else group
                for i, name in enumerate(names):
                    key = (group, name)
                    seen.add(key)
                    life = self.files.get(key)
                    if life is not None and life.deleted_at is not None:  # a recovery's cut, dispatched again
                        self.recreated += 1
                        life = None
                    if life is None:
                        life = self.files[key] = FileLife(kind, group, name, t)
                    if i < len(names) - 1 and life.older_at is None:
                        life.older_at = t
                    if kind == "index" and (life.older_at is None or life.older_at == t):  # final once older
                        life.key = _read_key(os.path.join(directory, name), kind, self.cq_file_size) or life.key
            for key, life in self.files.items():
                if life.deleted_at is None and key not in seen:
                    life.deleted_at = groups[key[0]][0] if key[0] in groups else end
        self.scan_seconds.append(time.monotonic() - started)

    # --- the broker's rule over the lives ----------------------------------------------------------------------

    def _first_at(self, t: float) -> int:
        i = bisect.bisect_right([at for at, _ in self.firsts], t) - 1
        return self.firsts[max(i, 0)][1]

    def _expiry(self, key: int) -> float | None:
        """When the CommitLog's first offset first went past `key`."""
        for at, first in self.firsts:
            if first > key:
                return at
        return None

    def _read_ends(self) -> None:
        if self.keys_file is None or not self.keys_file.exists():
            return
        with open(self.keys_file) as f:
            f.seek(self._ends_read)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self._ends_read += len(complete.encode())
        for line in complete.splitlines():
            topic, queue, queue_offset, offset = line.split()
            self._ends[(topic, queue, int(queue_offset))] = int(offset)

    def _cq_key(self, life: FileLife) -> int | None:
        topic_dir, queue = os.path.split(life.group)
        last = (int(life.name) + self.cq_file_size) // CQ_UNIT_SIZE - 1
        return self._ends.get((os.path.basename(topic_dir), queue, last))

    def expire(self) -> None:
        """Each file's expiry by the broker's rule, walking each group oldest first."""
        by_group: dict[str, list[FileLife]] = {}
        self._read_ends()
        with self._lock:
            for life in self.files.values():
                if life.kind == "consumequeue" and life.key is None:
                    life.key = self._cq_key(life)
                by_group.setdefault(life.group, []).append(life)
            for lives in by_group.values():
                lives.sort(key=lambda f: f.name)
                # an older file holds the walk back until it expires or is gone (a recovery cut it back)
                gate = 0.0
                for life in lives:
                    rule = None if life.key is None or life.older_at is None else self._expiry(life.key)
                    life.expired_at = None if rule is None or gate == INF else max(rule, life.older_at, gate)
                    gate = max(gate, min(INF if life.expired_at is None else life.expired_at,
                                         INF if life.deleted_at is None else life.deleted_at))

    def sample(self) -> dict:
        """The output against what the live window needs, now (allocated bytes)."""
        self.expire()
        t = self.now()
        out_bytes = needed = expired_bytes = 0
        expired_files = {"consumequeue": 0, "index": 0}
        with self._lock:
            present = [life for life in self.files.values() if life.deleted_at is None]
        for life in present:
            directory = str(self.out / "index") if life.kind == "index" else life.group
            try:
                size = os.stat(os.path.join(directory, life.name)).st_blocks * 512
            except FileNotFoundError:
                continue
            out_bytes += size
            if life.expired_at is not None and life.expired_at <= t:
                expired_bytes += size
                expired_files[life.kind] += 1
            else:
                needed += size
        with self._lock:
            running = self.lives[-1][0] if self.lives and self.lives[-1][1] is None else None
        s = {"t": round(t, 1), "output_bytes": out_bytes, "needed_bytes": needed, "expired_bytes": expired_bytes,
             "expired_files": expired_files, "ratio_to_needed": round(out_bytes / needed, 3) if needed else None,
             "daemon_up_s": None if running is None else round(t - running, 1)}
        self.samples.append(s)
        return s

    # --- the summary --------------------------------------------------------------------------------------------

    def _life_start(self, t: float) -> float:
        starts = [start for start, _ in self.lives if start <= t]
        return starts[-1] if starts else 0.0

    def summary(self) -> dict:
        self.expire()
        out: dict = {}
        for kind in ("index", "consumequeue"):
            lives = [f for f in self.files.values() if f.kind == kind]
            delays, early, kept, cut, examples = [], 0, 0, 0, []
            for f in lives:
                if f.deleted_at is not None and f.older_at is None:
                    cut += 1  # deleted while the newest: a recovery's cut (retention never deletes one)
                elif f.deleted_at is not None and f.expired_at is not None and f.expired_at <= f.deleted_at:
                    delays.append(f.deleted_at - max(f.expired_at, self._life_start(f.deleted_at)))
                elif f.deleted_at is not None and self._cut_by_recovery(f.deleted_at):
                    cut += 1  # gone while a start recovered: cut back to the checkpoint
                elif f.deleted_at is not None:
                    early += 1  # gone before the broker's rule expired it, and not written again
                    if len(examples) < 10:
                        examples.append({"path": os.path.join(f.group, f.name), "born": round(f.born, 1),
                                         "older_at": f.older_at, "key": f.key, "deleted_at": f.deleted_at,
                                         "expired_at": f.expired_at, "first_then": self._first_at(f.deleted_at)})
                if f.deleted_at is None and f.expired_at is not None:
                    kept += 1
            out[kind] = {"files": len(lives), "deleted": sum(1 for f in lives if f.deleted_at is not None),
                         "delay_s_max": round(max(delays), 1) if delays else None,
                         "delay_s_p99": round(percentile(delays, 0.99), 1) if delays else None,
                         "delay_s_p50": round(percentile(delays, 0.5), 1) if delays else None,
                         "deleted_before_expiry": early, "expired_still_present": kept, "cut_by_recovery": cut,
                         "deleted_before_expiry_examples": examples}
        ratios = [s["ratio_to_needed"] for s in self.samples if s["ratio_to_needed"] is not None]
        out["ratio_to_needed_max"] = max(ratios) if ratios else None
        # no daemon deletes while stopped: the target holds from a minute after a start (as the IndexFiles')
        up = [s["ratio_to_needed"] for s in self.samples if s["ratio_to_needed"] is not None
              and s["daemon_up_s"] is not None and s["daemon_up_s"] >= INDEX_DELAY_TARGET_S]
        out["ratio_to_needed_max_running"] = max(up) if up else None
        out["samples"] = self.samples
        out["scan_seconds_p50"] = round(percentile(self.scan_seconds, 0.5) or 0, 3)
        out["interval_s"] = self.interval
        out["sample_every_s"] = self.sample_every
        out["recreated"] = self.recreated
        return out


# the targets (46): an expired IndexFile deleted within a minute, the output at most twice what the live
# window needs (sampled every 30 s), and nothing deleted before the broker's rule expires it
INDEX_DELAY_TARGET_S = 60.0
NEEDED_RATIO_TARGET = 2.0
PASS_FILES_MIN = 100  # passes that deleted at least this many ConsumeQueue files give the deletion rate


def pass_rates(events: list[dict]) -> dict:
    """ConsumeQueue files deleted a second by the passes that deleted many (`expired_files_deleted`)."""
    rates = sorted(e["consumequeue_files"] / e["seconds"] for e in events
                   if e.get("event") == "expired_files_deleted" and e.get("consumequeue_files", 0) >= PASS_FILES_MIN
                   and e.get("seconds"))
    passes = [e for e in events if e.get("event") == "expired_files_deleted"]
    return {"passes": len(passes), "passes_of_many": len(rates),
            "files_per_s_p50": round(percentile(rates, 0.5)) if rates else None,
            "files_per_s_max": round(max(rates)) if rates else None,
            "pass_seconds_max": round(max((e.get("seconds", 0) for e in passes), default=0), 1)}


def verdict(summary: dict) -> list[str]:
    """The targets missed, one line each (empty: all met)."""
    missed = []
    delay = summary["index"]["delay_s_max"]
    if delay is not None and delay > INDEX_DELAY_TARGET_S + summary["interval_s"]:
        missed.append(f"an IndexFile waited {delay} s after expiring (target {INDEX_DELAY_TARGET_S:.0f} s, "
                      f"measured to {summary['interval_s']:.0f} s)")
    ratio = summary["ratio_to_needed_max_running"]
    if ratio is not None and ratio > NEEDED_RATIO_TARGET:
        missed.append(f"the output reached {ratio}x what the live window needs a minute or more into a daemon "
                      f"life (target {NEEDED_RATIO_TARGET}x)")
    for kind in ("index", "consumequeue"):
        if summary[kind]["deleted_before_expiry"]:
            missed.append(f"{summary[kind]['deleted_before_expiry']} {kind} files deleted before they expired")
    return missed


def lines(summary: dict) -> list[str]:
    """What a run prints about retention."""
    out = []
    for kind, name in (("index", "IndexFiles"), ("consumequeue", "ConsumeQueue files")):
        k = summary[kind]
        out.append(f"{name}: {k['files']:,} seen, {k['deleted']:,} deleted; deletion after expiry (or after the "
                   f"start of the life that deleted) s: p50 {k['delay_s_p50']}, p99 {k['delay_s_p99']}, max "
                   f"{k['delay_s_max']}; deleted before expiring {k['deleted_before_expiry']}, cut back by a recovery "
                   f"{k['cut_by_recovery']}; expired and still there at the end "
                   f"{k['expired_still_present']}")
    rates = summary.get("passes", {})
    out.append(f"passes: {rates.get('passes')} that deleted, the longest {rates.get('pass_seconds_max')} s; "
               f"ConsumeQueue files deleted a second by the {rates.get('passes_of_many')} passes of at least "
               f"{PASS_FILES_MIN}: p50 {rates.get('files_per_s_p50')}, max {rates.get('files_per_s_max')}")
    series = ", ".join(f"{s['t']:.0f}s {s['ratio_to_needed']}x{'' if s['daemon_up_s'] is not None else ' (down)'}"
                       for s in summary["samples"] if s["ratio_to_needed"])
    out.append(f"output / what the live window needs, every {summary.get('sample_every_s', 30):.0f} s: {series} "
               f"(max {summary['ratio_to_needed_max']}x; a minute or more into a daemon life "
               f"{summary['ratio_to_needed_max_running']}x)")
    return out


__all__ = ["INDEX_DELAY_TARGET_S", "NEEDED_RATIO_TARGET", "FileLife", "OutputWatch", "lines", "pass_rates",
           "percentile", "verdict"]
