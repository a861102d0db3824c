"""Fuzzing the readers of output files: damaged IndexFiles and ConsumeQueues through every command that
reads them (issue 32).

A copy of the visible conformance store (the broker's own consumequeue/ and index/) is damaged by byte
surgery, then the reader commands run through the real CLI, each with a time limit that only a hang
reaches: `query key` (and `--raw`), `query msgid`, `query queue`, `inspect`, and on the slower side
`verify`, `run --until-caught-up` and `rebuild` (both load the existing output first). Whatever the
bytes, a command ends within its limit with exit 0 or 1, with no traceback and no internal error.

(a) structured damage, one named kind each (`KINDS`): prev_index cycles of 2 to 5 entries, self-loops,
    slots and links past indexCount or the file, negative slots, links and time diffs, indexCount and
    hashSlotCount changed, time diffs at their maximum, entries and ConsumeQueue units pointing at no
    record (negative, past the CommitLog's end, off a record's start) or with an impossible size. Each
    is reported by the queries that meet it: exit 1, one line naming the file, the entry and the field,
    after the answer found before it.
(b) random byte changes in IndexFile headers, slots and entries and in ConsumeQueue units, seeded
    (`REPUTD_FUZZ_SEED`), `scale(fast, stress)` cases.

`make test` runs every kind through the queries and inspect, the slow commands on one store holding every
kind at once, and a few random cases; `make stress` runs every kind and many random cases through every
command, and reports the counts and the longest run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemon.backfill.commit import LINKED, MERGED, PRESENT, commit_queue_file
from daemon.backfill.plan import BackfillError
from indexcore.consumequeue import CQ_UNIT, CQ_UNIT_SIZE
from indexcore.indexfile import (
    HASH_SLOT,
    HASH_SLOT_SIZE,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_HEADER_SIZE,
)
from indexcore.javahash import index_key_hash
from tests.conformance import discover
from tests.stress import STRESS, report, scale
from tests.test_verify import copy_store

REPUTD = [sys.executable, "-m", "daemon.cli"]
STORE = next((s for s in discover() if s.name == "visible"), None)
TOPIC = "TopicTest"
QUEUE = 0
FUZZ_SEED = int(os.environ.get("REPUTD_FUZZ_SEED", "20261126"))
RANDOM_CASES = scale(12, 200)
# Limits that only a hang reaches: the store is 2.7 MB and every command here takes well under a second.
QUICK_LIMIT_S = 60
SLOW_LIMIT_S = 180
_PREV_AT = 16  # prev_index inside an entry
_TIME_DIFF_AT = 12
_PHY_AT = 4
_HEADER_FIELD_AT = {name: INDEX_HEADER.size - 4 * (2 - i) for i, name in enumerate(("hash_slot_count", "index_count"))}
INT32_MAX = 2**31 - 1

pytestmark = pytest.mark.skipif(STORE is None, reason="the visible conformance store is not here")


# --- the store and what is known of it ---------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One IndexFile and a key whose chain in it starts at the key's own entry."""

    name: str
    key: str  # a UNIQ_KEY of a TopicTest message in this file: `query key` and `query msgid` both walk its chain
    slot: int
    head: int  # the slot's newest entry: the key's own
    index_count: int


@dataclass(frozen=True)
class Layout:
    slots: int
    index_num: int
    commit_log_end: int
    index: list[str]
    targets: dict[str, Target]  # by IndexFile name
    queue_files: list[str]  # TopicTest/0's files, oldest first

    def entry_at(self, n: int) -> int:
        return INDEX_HEADER_SIZE + HASH_SLOT_SIZE * self.slots + INDEX_ENTRY_SIZE * n


def _layout(root: Path) -> Layout:
    settings = STORE.store_settings()
    slots, index_num = settings["maxHashSlotNum"], settings["maxIndexNum"]
    names = sorted(p.name for p in (root / "index").iterdir())
    messages = [m for m in STORE.manifest["messages"] if m["topic"] == TOPIC and m["uniq_key"]]
    targets = {}
    for name in names:
        data = (root / "index" / name).read_bytes()
        *_, count = INDEX_HEADER.unpack_from(data)
        entries_at = INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slots
        heads = {}
        for m in messages:
            h = index_key_hash(f"{TOPIC}#{m['uniq_key']}")
            head = HASH_SLOT.unpack_from(data, INDEX_HEADER_SIZE + HASH_SLOT_SIZE * (h % slots))[0]
            if 6 <= head < count:
                kh, phy, _, _ = INDEX_ENTRY.unpack_from(data, entries_at + INDEX_ENTRY_SIZE * head)
                if (kh, phy) == (h, m["phy_offset"]):
                    heads[m["uniq_key"]] = (h % slots, head)
        if heads:
            key = sorted(heads)[0]
            targets[name] = Target(name, key, *heads[key], count)
    log = sorted((root / "commitlog").iterdir())
    queue_dir = root / "consumequeue" / TOPIC / str(QUEUE)
    return Layout(slots, index_num, int(log[-1].name) + log[-1].stat().st_size, names, targets,
                  sorted(p.name for p in queue_dir.iterdir()))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, Layout]:
    base = tmp_path_factory.mktemp("pristine")
    root, _ = copy_store(STORE, base)
    (root / "lock").unlink(missing_ok=True)
    return base, _layout(root)


class Case:
    """A copy of a store and its config (the pristine one, or a damaged case's), to damage and run commands on."""

    def __init__(self, source: Path, layout: Layout, tmp: Path):
        self.dir, self.layout = tmp, layout
        self.root = tmp / "store"
        shutil.copytree(source / "store", self.root)
        self.config = tmp / "reputd.yaml"
        self.config.write_text((source / "reputd.yaml").read_text().replace(str(source / "store"), str(self.root)))

    @classmethod
    def of(cls, pristine: tuple[Path, Layout], tmp: Path) -> Case:
        return cls(*pristine, tmp)

    def copy(self, tmp: Path) -> Case:
        """This case's files as they are now, for a writer (run, rebuild) to change."""
        return Case(self.dir, self.layout, tmp)

    def index_path(self, name: str) -> Path:
        return self.root / "index" / name

    def queue_path(self, name: str) -> Path:
        return self.root / "consumequeue" / TOPIC / str(QUEUE) / name

    def patch(self, path: Path, position: int, fmt: str, value: int) -> None:
        with open(path, "r+b") as f:
            f.seek(position)
            f.write(struct.pack(">" + fmt, value))

    def read(self, path: Path, position: int, fmt: str) -> int:
        with open(path, "rb") as f:
            f.seek(position)
            return struct.unpack(">" + fmt, f.read(struct.calcsize(">" + fmt)))[0]

    def cli(self, *args: str, limit: float = QUICK_LIMIT_S) -> Run:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REPUTD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        started = time.perf_counter()
        try:
            res = subprocess.run([*REPUTD, *args, "--config", str(self.config)], env=env, capture_output=True,
                                 text=True, timeout=limit, check=False)
        except subprocess.TimeoutExpired as e:
            out = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            return Run(args, None, "", out, time.perf_counter() - started)
        return Run(args, res.returncode, res.stdout, res.stderr, time.perf_counter() - started)


@dataclass
class Run:
    args: tuple[str, ...]
    returncode: int | None  # None: stopped at the time limit
    stdout: str
    stderr: str
    seconds: float

    @property
    def error(self) -> str:
        """The line saying what was found: `reputd: error: ...`, or inspect's `error: ...` trailer."""
        lines = [ln for ln in self.stderr.splitlines() if ln.startswith(("reputd: error: ", "error: "))]
        return lines[-1] if lines else ""

    def check_bounded(self, what: str) -> None:
        """Ended in time, exit 0 or 1, no traceback, no internal error; an exit 1 says why."""
        assert self.returncode is not None, f"{what}: {' '.join(self.args)} still running after {self.seconds:.0f} s"
        assert self.returncode in (0, 1), f"{what}: {' '.join(self.args)} exit {self.returncode}\n{self.stderr[-2000:]}"
        for bad in ("Traceback", "internal error"):
            assert bad not in self.stderr, f"{what}: {' '.join(self.args)}\n{self.stderr[-3000:]}"
        if self.returncode == 1 and self.args[0] not in ("verify", "run", "rebuild"):
            assert self.error or "reputd: no message" in self.stderr, f"{what}: {self.args}: exit 1 saying nothing"


# --- (a) structured damage ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """One kind of damage: where it goes, what must be named when a query meets it (`entry` as a function of
    the target, `fields`: any of them), and which reader commands meet it."""

    part: str  # "index" (the second newest IndexFile) or "queue" (TopicTest/0's oldest file)
    damage: object  # (Case, Target | None) -> None
    entry: object  # (Target | None) -> str
    fields: tuple[str, ...]
    reported_by: tuple[str, ...]
    found: bool = False  # the key's own message is still in the answer before the damage
    detail: str = ""


def _set_prev(n_of, value_of):
    def damage(case: Case, t: Target) -> None:
        path = case.index_path(t.name)
        case.patch(path, case.layout.entry_at(n_of(t)) + _PREV_AT, "i", value_of(case, t))
    return damage


def _cycle(k: int):
    """The key's entry, then the k-1 entries before it, each linking to the next older, and the oldest of them
    back to the key's entry: a cycle of k the chain enters at its head."""
    def damage(case: Case, t: Target) -> None:
        path = case.index_path(t.name)
        ring = [t.head - i for i in range(k)]
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
            case.patch(path, case.layout.entry_at(a) + _PREV_AT, "i", b)
    return damage


def _set_slot(value_of):
    def damage(case: Case, t: Target) -> None:
        case.patch(case.index_path(t.name), INDEX_HEADER_SIZE + HASH_SLOT_SIZE * t.slot, "i", value_of(case, t))
    return damage


def _set_header(name: str, value_of):
    def damage(case: Case, t: Target) -> None:
        case.patch(case.index_path(t.name), _HEADER_FIELD_AT[name], "i", value_of(case, t))
    return damage


def _set_entry(at: int, fmt: str, value_of):
    def damage(case: Case, t: Target) -> None:
        path = case.index_path(t.name)
        case.patch(path, case.layout.entry_at(t.head) + at, fmt, value_of(case, t))
    return damage


UNIT = 3  # the damaged unit of TopicTest/0's oldest file: three messages come before it


def _set_unit(at: int, fmt: str, value_of, file_of=lambda layout: layout.queue_files[0]):
    def damage(case: Case, _t) -> None:
        path = case.queue_path(file_of(case.layout))
        old = CQ_UNIT.unpack(path.read_bytes()[UNIT * CQ_UNIT_SIZE : (UNIT + 1) * CQ_UNIT_SIZE])
        case.patch(path, UNIT * CQ_UNIT_SIZE + at, fmt, value_of(case, old))
    return damage


def _entry(n_of):
    return lambda t: f"entry {n_of(t)}"


HEAD = _entry(lambda t: t.head)
SLOT = lambda t: f"slot {t.slot}"  # noqa: E731
HEADER = lambda t: "header"  # noqa: E731
KEY_QUERIES = ("query key", "query key --raw", "query msgid")
STRUCTURE = (*KEY_QUERIES, "inspect")
UNIT_ENTRY = lambda t: f"unit at queue offset {UNIT}"  # noqa: E731

KINDS: dict[str, Kind] = {
    **{f"cycle_{k}": Kind("index", _cycle(k), _entry(lambda t, k=k: t.head - k + 1), ("prev_index",), STRUCTURE,
                          found=True, detail=f"a cycle of {k}") for k in range(2, 6)},
    "self_loop": Kind("index", _set_prev(lambda t: t.head, lambda c, t: t.head), HEAD, ("prev_index",), STRUCTURE,
                      found=True, detail="a cycle of 1"),
    "link_past_index_count": Kind("index", _set_prev(lambda t: t.head, lambda c, t: t.index_count + 5), HEAD,
                                  ("prev_index",), STRUCTURE, found=True, detail="past indexCount"),
    "link_past_file": Kind("index", _set_prev(lambda t: t.head, lambda c, t: INT32_MAX), HEAD, ("prev_index",),
                           STRUCTURE, found=True, detail="past indexCount"),
    "link_negative": Kind("index", _set_prev(lambda t: t.head, lambda c, t: -7), HEAD, ("prev_index",), STRUCTURE,
                          found=True, detail="negative"),
    "slot_past_index_count": Kind("index", _set_slot(lambda c, t: t.index_count + 3), SLOT, ("slot",), STRUCTURE,
                                  detail="past indexCount"),
    "slot_past_file": Kind("index", _set_slot(lambda c, t: INT32_MAX), SLOT, ("slot",), STRUCTURE,
                           detail="past indexCount"),
    "slot_negative": Kind("index", _set_slot(lambda c, t: -1), SLOT, ("slot",), STRUCTURE, detail="negative"),
    "index_count_past_max": Kind("index", _set_header("index_count", lambda c, t: c.layout.index_num + 1), HEADER,
                                 ("index_count",), STRUCTURE),
    "index_count_negative": Kind("index", _set_header("index_count", lambda c, t: -5), HEADER, ("index_count",),
                                 STRUCTURE),
    # the first slot a query meets past the count: the key's own, or (msgid looks under every topic) another
    "index_count_lowered": Kind("index", _set_header("index_count", lambda c, t: t.head), lambda t: "",
                                ("slot", "hash_slot_count"), STRUCTURE),
    "hash_slot_count_past_slots": Kind("index", _set_header("hash_slot_count", lambda c, t: c.layout.slots + 1),
                                       HEADER, ("hash_slot_count",), STRUCTURE),
    "hash_slot_count_negative": Kind("index", _set_header("hash_slot_count", lambda c, t: -1), HEADER,
                                     ("hash_slot_count",), STRUCTURE),
    "time_diff_negative": Kind("index", _set_entry(_TIME_DIFF_AT, "i", lambda c, t: -1), HEAD, ("time_diff",),
                               STRUCTURE, detail="negative"),
    # a time diff at its maximum is a time far in the future: no rule of the format is broken, the key is found
    "time_diff_overflowing": Kind("index", _set_entry(_TIME_DIFF_AT, "i", lambda c, t: INT32_MAX), HEAD, (), (),
                                  found=True),
    "entry_phy_offset_negative": Kind("index", _set_entry(_PHY_AT, "q", lambda c, t: -1), HEAD, ("phy_offset",),
                                      ("query key", "query msgid")),
    "entry_phy_offset_past_commitlog": Kind(
        "index", _set_entry(_PHY_AT, "q", lambda c, t: c.layout.commit_log_end + 64), HEAD, ("phy_offset",),
        ("query key", "query msgid")),
    "entry_phy_offset_off_record": Kind(
        "index", _set_entry(_PHY_AT, "q", lambda c, t: c.read(c.index_path(t.name), c.layout.entry_at(t.head) + _PHY_AT,
                                                               "q") + 1),
        HEAD, ("phy_offset",), ("query key", "query msgid")),
    "unit_size_zero": Kind("queue", _set_unit(8, "i", lambda c, u: 0), UNIT_ENTRY, ("msg_size",),
                           ("query queue", "inspect", "query time")),
    "unit_size_negative": Kind("queue", _set_unit(8, "i", lambda c, u: -u[1]), UNIT_ENTRY, ("msg_size",),
                               ("query queue", "inspect", "query time")),
    "unit_size_huge": Kind("queue", _set_unit(8, "i", lambda c, u: INT32_MAX - 1), UNIT_ENTRY, ("msg_size",),
                           ("query queue", "query time")),
    "unit_size_wrong": Kind("queue", _set_unit(8, "i", lambda c, u: u[1] + 1), UNIT_ENTRY, ("msg_size",),
                            ("query queue", "query time")),
    "unit_offset_negative": Kind("queue", _set_unit(0, "q", lambda c, u: -1), UNIT_ENTRY, ("commit_log_offset",),
                                 ("query queue", "inspect", "query time")),
    "unit_offset_past_commitlog": Kind("queue", _set_unit(0, "q", lambda c, u: c.layout.commit_log_end + 64),
                                       UNIT_ENTRY, ("commit_log_offset",), ("query queue", "query time")),
    "unit_offset_off_record": Kind("queue", _set_unit(0, "q", lambda c, u: u[0] + 1), UNIT_ENTRY,
                                   ("commit_log_offset",), ("query queue", "query time")),
}

# the reader commands, by name: argv for a case (the queue query reads TopicTest/0 from its first unit)
QUERIES = ("query key", "query key --raw", "query msgid", "query queue", "query time", "query offset")


def argv(name: str, case: Case, target: Target, path: Path) -> tuple[str, ...]:
    return {
        "query key": ("query", "key", TOPIC, target.key, "--json"),
        "query key --raw": ("query", "key", TOPIC, target.key, "--raw"),
        "query msgid": ("query", "msgid", target.key, "--json"),
        "query queue": ("query", "queue", TOPIC, str(QUEUE), str(_first_offset(path, case)), "--json"),
        "query time": ("query", "time", TOPIC, "--queue", str(QUEUE), "--begin", "0", "--count", "1000000", "--json"),
        "query offset": ("query", "offset", TOPIC, str(QUEUE), "0", "--json"),
        "inspect": ("inspect", str(path)),
        "verify": ("verify",),
        "run": ("run", "--until-caught-up"),
        "rebuild": ("rebuild",),
    }[name]


def _first_offset(path: Path, case: Case) -> int:
    """The queue offset a `query queue` starts at: the first unit of the damaged file when a ConsumeQueue file
    is the target, else 0."""
    if path.parent.parent.parent.name == "consumequeue":
        return int(path.name) // CQ_UNIT_SIZE
    return 0


SLOW = ("verify", "run", "rebuild")
TABLE: dict[str, dict[str, tuple[int | None, str, float]]] = {}


def _target(layout: Layout) -> Target:
    """The second newest IndexFile: an older file, so every rule applies (in the newest one a slot past
    indexCount is a put in progress), and the queries still reach it."""
    name = [n for n in layout.index[:-1] if n in layout.targets][-1]
    return layout.targets[name]


def _check_kind(name: str, kind: Kind, run: Run, command: str, target: Target, path: Path) -> None:
    run.check_bounded(f"{name} / {command}")
    if command not in kind.reported_by:
        return
    assert run.returncode == 1, f"{name} / {command}: exit 0, the damage not reported\n{run.stdout[-500:]}"
    line = run.error
    assert str(path) in line, (name, command, line)
    assert f"{kind.entry(target)}: field " in line, (name, command, line)
    assert any(f"field {f}:" in line for f in kind.fields), (name, command, line)
    assert kind.detail in line, (name, command, line)


@pytest.mark.parametrize("name", KINDS)
def test_structured_damage_is_reported_and_bounded(pristine, tmp_path, name):
    """Each kind through the first command that meets it (stress: through every command): bounded, and
    reported by those that meet it, naming the file, the entry and the field, after the answer found before
    it."""
    kind = KINDS[name]
    case = Case.of(pristine, tmp_path / "case")
    target = _target(case.layout)
    path = case.index_path(target.name) if kind.part == "index" else case.queue_path(case.layout.queue_files[0])
    kind.damage(case, target)
    commands = (*QUERIES, "inspect", *SLOW) if STRESS else (
        *(kind.reported_by or ("query key",))[:1], *(("query time",) if kind.part == "queue" else ()))
    for command in commands:
        if command in ("run", "rebuild"):  # writers: each on a copy of its own
            run = case.copy(tmp_path / command).cli(*argv(command, case, target, path), limit=SLOW_LIMIT_S)
        else:
            run = case.cli(*argv(command, case, target, path), limit=SLOW_LIMIT_S if command in SLOW else QUICK_LIMIT_S)
        TABLE.setdefault(name, {})[command] = (run.returncode, run.error or run.stderr.strip()[-200:], run.seconds)
        _check_kind(name, kind, run, command, target, path)
        if command == "query key" and kind.part == "index":
            found = [json.loads(ln)["uniqKey"] for ln in run.stdout.splitlines()]
            assert found == ([target.key] if kind.found else []), (name, found)
        if command == "query queue" and kind.part == "queue":
            *messages, result = [json.loads(ln) for ln in run.stdout.splitlines()]
            assert len(messages) == UNIT, (name, run.stdout[-500:])  # the units before it, then the result
            assert (result["nextBeginOffset"], result["damage"]) == (_first_offset(path, case) + UNIT,
                                                                     run.stderr.strip().removeprefix("reputd: error: "))
        if command == "query time" and kind.part == "queue":  # the units before it at most (none when a search
            found = [json.loads(ln)["queueOffset"] for ln in run.stdout.splitlines()]  # step met it)
            assert found == list(range(len(found))), (name, found)
            assert len(found) <= UNIT, (name, found)
    if STRESS:
        report(f"fuzz_output_kind {name}", **{c: {"exit": r[0], "seconds": round(r[2], 2), "said": r[1]}
                                              for c, r in TABLE[name].items()})


def test_every_kind_at_once_through_the_slow_commands(pristine, tmp_path):
    """verify, run and rebuild on a store holding every kind at once, each in a file of its own: bounded;
    verify reports differences (exit 1)."""
    case = Case.of(pristine, tmp_path / "all")
    layout = case.layout
    for k, (name, kind) in enumerate(KINDS.items()):
        if kind.part == "index":
            names = [n for n in layout.index[:-1] if n in layout.targets]
            kind.damage(case, layout.targets[names[k % len(names)]])
        elif name == "unit_size_zero":
            kind.damage(case, None)
    runs = []
    for command in SLOW:
        c = case if command == "verify" else case.copy(tmp_path / command)
        run = c.cli(*argv(command, c, _target(layout), case.root), limit=SLOW_LIMIT_S)
        run.check_bounded(f"all kinds / {command}")
        runs.append(run)
    assert runs[0].returncode == 1, runs[0].stdout[-2000:]


def test_run_and_rebuild_do_not_build_on_a_damaged_newest_index_file(pristine, tmp_path):
    """A cycle in the newest IndexFile, the one puts go on into: `run` quarantines it and indexes again
    (exit 0, the event naming file, entry and field); `rebuild`, an operator's command, stops at it (exit 1)."""
    case = Case.of(pristine, tmp_path / "case")
    newest = case.layout.index[-1]
    target = case.layout.targets[newest]
    _cycle(3)(case, target)
    path = case.index_path(newest)
    said = f"{path}: entry {target.head - 2}: field prev_index: "
    run = case.copy(tmp_path / "run").cli("run", "--until-caught-up", limit=SLOW_LIMIT_S)
    run.check_bounded("run")
    assert run.returncode == 0, run.stderr[-2000:]
    moved = [json.loads(ln) for ln in run.stdout.splitlines() if "output_file_quarantined" in ln]
    assert [e["error"] for e in moved] == [str(tmp_path / "run" / "store" / "index" / newest) + said[len(str(path)):]
                                           + f"{target.head} links forward; the links from it come back to entry "
                                           f"{target.head - 2} (a cycle of 3)"]
    rebuild = case.cli("rebuild", limit=SLOW_LIMIT_S)
    rebuild.check_bounded("rebuild")
    assert rebuild.returncode == 1
    assert rebuild.error.startswith(f"reputd: error: {said}"), rebuild.stderr[-2000:]


# --- (b) random byte changes -------------------------------------------------------------------------------

@dataclass
class Tally:
    cases: int = 0
    runs: int = 0
    longest: float = 0.0
    longest_command: str = ""
    exits: Counter = field(default_factory=Counter)
    regions: Counter = field(default_factory=Counter)

    def add(self, command: str, run: Run) -> None:
        self.runs += 1
        self.exits[f"{command}: {run.returncode}"] += 1
        if run.seconds > self.longest:
            self.longest, self.longest_command = run.seconds, command


REGIONS = ("index header", "index slots", "index entries", "queue units")


def random_damage(rng: random.Random, case: Case) -> tuple[str, Path, Target]:
    """1 to 8 random byte changes (overwritten bytes, flipped bits, or an interesting int32 written whole) in
    one region of one file; the file and the key whose chain the queries walk."""
    layout = case.layout
    region = rng.choice(REGIONS)
    names = [n for n in layout.index if n in layout.targets]
    target = layout.targets[rng.choice(names)]
    if region == "queue units":
        path = case.queue_path(rng.choice(layout.queue_files))
        lo, hi = 0, path.stat().st_size
    else:
        path = case.index_path(target.name)
        lo, hi = {"index header": (0, INDEX_HEADER_SIZE),
                  "index slots": (INDEX_HEADER_SIZE, layout.entry_at(0)),
                  "index entries": (layout.entry_at(1), layout.entry_at(target.index_count + 2))}[region]
    data = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(lo, hi)
        how = rng.randrange(3)
        if how == 0:
            data[at] = rng.randrange(256)
        elif how == 1:
            data[at] ^= 1 << rng.randrange(8)
        else:
            at -= (at - lo) % 4  # a whole field of an entry, a slot or a header count
            value = rng.choice((0, 1, -1, 2, 3, target.head, target.index_count, target.index_count - 1,
                                layout.index_num, INT32_MAX, -(2**31)))
            if at + 4 <= hi:
                struct.pack_into(">i", data, at, value)
    path.write_bytes(bytes(data))
    return region, path, target


def test_random_byte_changes_are_bounded(pristine, tmp_path):
    """Seeded random damage through the queries and inspect (stress: every command): bounded, exit 0 or 1,
    no traceback; the seed and the case are in the message."""
    rng = random.Random(FUZZ_SEED)
    tally = Tally()
    every = (*QUERIES, "inspect", *SLOW)
    for i in range(RANDOM_CASES):
        case_dir = tmp_path / f"case{i}"
        case = Case.of(pristine, case_dir)
        region, path, target = random_damage(rng, case)
        tally.cases += 1
        tally.regions[region] += 1
        # fast: the query that reads the damaged file, and inspect; stress: every command
        reader = "query queue" if region == "queue units" else QUERIES[i % 3]
        commands = every if STRESS else (reader, "inspect", *(("query time",) if region == "queue units" else ()))
        for command in commands:
            if command in ("run", "rebuild"):
                run = case.copy(case_dir / command).cli(*argv(command, case, target, path), limit=SLOW_LIMIT_S)
            else:
                run = case.cli(*argv(command, case, target, path),
                               limit=SLOW_LIMIT_S if command in SLOW else QUICK_LIMIT_S)
            tally.add(command, run)
            run.check_bounded(f"seed {FUZZ_SEED} case {i} ({region} of {path.name})")
        shutil.rmtree(case_dir)
    report("fuzz_output_files", seed=FUZZ_SEED, cases=tally.cases, commands=len(every) if STRESS else 2,
           runs=tally.runs,
           longest_seconds=round(tally.longest, 2), longest_command=tally.longest_command,
           regions=dict(tally.regions), exits=dict(sorted(tally.exits.items())))
    assert tally.cases == RANDOM_CASES


# --- the backfill's merge ----------------------------------------------------------------------------------

def test_backfill_merge_into_damaged_queue_files_is_bounded(pristine, tmp_path):
    """`commit_queue_file` merges a backfilled ConsumeQueue file into one already in the output: on random
    damage of the file there it merges, finds it present, or refuses with a BackfillError naming the file
    (Spark is not needed for this step, so every case runs in-process)."""
    base, layout = pristine
    rng = random.Random(FUZZ_SEED)
    outcomes: Counter = Counter()
    for i in range(scale(200, 5000)):
        name = rng.choice(layout.queue_files)
        source = base / "store" / "consumequeue" / TOPIC / str(QUEUE) / name
        data = bytearray(source.read_bytes())
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data))
            data[at] = rng.randrange(256) if rng.random() < 0.5 else 0
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]  # a file of another size
        final = tmp_path / f"final{i}" / name
        final.parent.mkdir()
        final.write_bytes(bytes(data))
        staged = tmp_path / f"staged{i}"
        shutil.copyfile(source, staged)
        refused = None
        try:
            outcomes[commit_queue_file(str(staged), str(final))] += 1
        except BackfillError as e:
            refused = str(e)
            outcomes["refused"] += 1
        assert refused is None or str(final) in refused, refused
        shutil.rmtree(final.parent)
        staged.unlink(missing_ok=True)
    assert set(outcomes) <= {LINKED, MERGED, PRESENT, "refused"}
    assert outcomes["refused"], outcomes
