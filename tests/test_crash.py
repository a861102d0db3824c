"""Crash trials: `kill -9` of the daemon, and of the writer, at random seeded moments.

The promise of `reputd run` is that a restart after `kill -9` at any instant ends in the files of an
uninterrupted run. Each trial here starts the real CLI on a CommitLog that a writer is appending to, kills
it at a random moment (during start-up and recovery, mid-dispatch, mid-flush, mid-checkpoint), and checks
that a restart from what the kill left (`reputd run --until-caught-up` on a copy of the output) equals a
clean rebuild, with no ConsumeQueue unit and no index entry lost or doubled; the next trial restarts on the
killed output itself, so the kills accumulate. The writer is killed too: mid-record, leaving a torn tail
that never completes, which the daemon must not dispatch, until a new writer overwrites it from the
record's start, as a restarted broker does after truncating its CommitLog to the last good record.

`make test` runs a fast mode; `make stress` (REPUTD_STRESS=1) the long one. STRESS_CRASH_SEED,
STRESS_CRASH_TRIALS and STRESS_WRITER_KILLS override the seed and the counts.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import structlog

from daemon.config import load_config
from daemon.engine.rebuild import rebuild
from indexcore.javahash import index_key_hash
from tests import stress
from tests.test_daemon import (
    START_MS,
    Store,
    assert_same_as_rebuild,
    events,
    free_port,
    output_files,
    stop,
    wait_for,
)
from tests.test_torn_writes import (
    ORDERS,
    LiveLog,
    RecordSource,
    check_output_against_commitlog,
    index_entries,
    message,
    spawn_torn_writer,
)

CRASH_SEED = int(os.environ.get("STRESS_CRASH_SEED", "20261121"))
CRASH_TRIALS = int(os.environ.get("STRESS_CRASH_TRIALS", str(stress.scale(20, 200))))
WRITER_KILLS = int(os.environ.get("STRESS_WRITER_KILLS", str(stress.scale(3, 30))))
NO_METRICS = {"REPUTD_METRICS_ENABLED": "false"}


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.writer.close()


class Appender(threading.Thread):
    """Appends `n` messages in bursts spread over about `seconds`, as a broker under load does."""

    def __init__(self, store: Store, n: int, seconds: float, rng: random.Random):
        super().__init__(daemon=True)
        self.store, self.n, self.seconds = store, n, seconds
        self.rng = random.Random(rng.random())
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            left = self.n
            bursts = max(1, self.rng.randint(1, 12))
            for b in range(bursts):
                k = left if b == bursts - 1 else self.rng.randint(0, left)
                self.store.append(k)
                left -= k
                time.sleep(self.rng.uniform(0, 2 * self.seconds / bursts))
        except BaseException as e:  # reported by the test
            self.error = e


def quiet_rebuild(store: Store, out: Path) -> None:
    """A clean in-process rebuild of the CommitLog into `out` (the reference for one trial)."""
    config = load_config(store.config, {}, {"output.dir": str(out)})
    with structlog.testing.capture_logs():
        rebuild(config)


def restart_is_identical(store: Store, trial: int) -> tuple[str | None, str | None]:
    """Restart on a copy of what the kill left, catch up, compare with a clean rebuild and check every unit
    and entry against the CommitLog. Returns what went wrong (None: identical) and the restart's recovery
    decision."""
    copy = store.tmp / f"after-kill-{trial}"
    ref = store.tmp / f"reference-{trial}"
    if store.out.exists():
        shutil.copytree(store.out, copy)
    else:  # killed before it made its output directory
        copy.mkdir()
    try:
        res = store.run("--until-caught-up", "--out", str(copy), env=NO_METRICS)
        decision = next((e["decision"] for e in events(res.stdout) if e["event"] == "recovered"), None)
        if res.returncode != 0:
            return f"restart exited {res.returncode}: {res.stdout[-1000:]} {res.stderr[-1000:]}", decision
        quiet_rebuild(store, ref)
        actual, expected = output_files(copy), output_files(ref)
        differ = sorted(n for n in set(actual) | set(expected) if actual.get(n) != expected.get(n))
        if differ:
            return f"differs from a clean rebuild in {differ[:10]}", decision
        try:
            check_output_against_commitlog(copy, store.tmp / "store" / "commitlog")
        except AssertionError as e:
            return str(e), decision
        return None, decision
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.rmtree(ref, ignore_errors=True)


def test_kill9_at_random_moments_then_restart_is_byte_identical(store):
    """The promise: kill -9 at any moment, restart, catch up -> the files of a clean rebuild."""
    started = time.monotonic()
    rng = random.Random(CRASH_SEED)
    store.append(300)
    decisions: list[str] = []  # recovery decisions of the killed daemons, in order
    restarts: Counter = Counter()  # recovery decisions of the restarts on each kill's output
    failures: list[str] = []
    before_recovery = early = 0
    for trial in range(CRASH_TRIALS):
        store.port = free_port()  # a fresh port each time: a port held for minutes may be taken by anyone
        proc = store.start(env={"REPUTD_METRICS_PORT": str(store.port)})
        # now and then a burst big enough for multi-megabyte batches, segment and IndexFile rolls mid-batch
        burst = rng.randint(1500, 4000) if rng.random() < 0.1 else rng.randint(10, 300)
        appender = Appender(store, burst, rng.uniform(0.05, 1.0), rng)
        appender.start()
        if rng.random() < 0.3:  # during start-up: imports, recovery (truncation, replay marker), first batches
            early += 1
            time.sleep(rng.uniform(0.02, 0.8))
        else:  # once it follows: mid-dispatch, mid-flush, mid-checkpoint
            try:
                wait_for(lambda: "reputFromOffset" in store.health(), what=f"trial {trial}: the daemon's session")
            except AssertionError:
                proc.kill()
                out, err = proc.communicate(timeout=20)
                raise AssertionError(f"trial {trial}: no session (exit {proc.returncode}): {out[-3000:]} "
                                     f"{err[-3000:]}") from None
            time.sleep(rng.uniform(0.0, 0.8))
        proc.kill()
        out, err = proc.communicate(timeout=20)
        appender.join(timeout=30)
        assert appender.error is None, appender.error
        assert proc.returncode == -signal.SIGKILL, f"trial {trial}: daemon was not running when killed: {err}"
        got = [e["decision"] for e in events(out) if e["event"] == "recovered"]
        decisions += got
        before_recovery += not got
        problem, decision = restart_is_identical(store, trial)
        restarts[decision] += 1
        if problem:
            failures.append(f"trial {trial}: {problem}")
            print(f"crash trial {trial} (seed {CRASH_SEED}): {problem}", flush=True)
    res = store.run("--until-caught-up")
    decisions += [e["decision"] for e in events(res.stdout) if e["event"] == "recovered"]
    if res.returncode == 0:
        quiet_rebuild(store, store.tmp / "reference-final")
    final_identical = res.returncode == 0 and output_files(store.out) == output_files(store.tmp / "reference-final")
    stress.report("crash_trials", trials=CRASH_TRIALS, identical=CRASH_TRIALS - len(failures),
                  final_identical=int(final_identical), killed_early=early, killed_before_recovery=before_recovery,
                  recovered=dict(Counter(decisions)), recovered_from_checkpoint=decisions.count("checkpoint"),
                  restart_recovered=dict(restarts), records=store.count,
                  seconds=round(time.monotonic() - started, 1), seed=CRASH_SEED)
    assert not failures, failures
    assert res.returncode == 0, res.stderr
    assert len(decisions) <= CRASH_TRIALS + 1  # a kill during start-up comes before the recovery event
    assert decisions[0] in ("derived", "replay"), decisions
    assert set(decisions) <= {"derived", "replay", "checkpoint"}, decisions
    assert "checkpoint" in decisions[1:], "no trial recovered from a checkpoint"
    assert_same_as_rebuild(store)
    figures = check_output_against_commitlog(store.out, store.tmp / "store" / "commitlog")
    assert figures["records"] == store.count
    assert figures["units"] == store.count  # every record here gets one unit
    assert figures["index_entries"] == 3 * store.count  # UNIQ_KEY and two KEYS tokens each


def test_writer_killed_mid_record_then_resumed_from_the_record_start(store):
    """A writer killed mid-record leaves a torn tail that never completes. The daemon must not dispatch it,
    and must go on once a new writer overwrites it from the record's start (a restarted broker truncates its
    CommitLog to the last good record and appends from there, over whatever bytes lie past it)."""
    started = time.monotonic()
    rng = random.Random(CRASH_SEED + 1)
    store.append(200)
    store.writer.close()  # from here on, writer processes own the CommitLog
    commitlog = store.tmp / "store" / "commitlog"
    live = LiveLog(commitlog)
    end = store.end
    torn_hashes = set()
    declared_corrupt = 0
    per_order: Counter = Counter()
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("reputFromOffset") == end, what="catch-up")
        for kill in range(WRITER_KILLS):
            order = ORDERS[kill % len(ORDERS)] if kill < len(ORDERS) else rng.choice(ORDERS)
            per_order[order] += 1
            index = 10**6 + kill  # a UNIQ_KEY no resumed record has
            writer, offset, size, written = spawn_torn_writer(store, order, rng.randrange(2**31), index)
            time.sleep(rng.uniform(0, 0.05))
            writer.kill()
            writer.communicate(timeout=10)
            assert offset == end
            assert 0 < written < size
            torn = message(index)
            torn_hashes.add(index_key_hash(f"{torn.topic}#{torn.properties['UNIQ_KEY']}"))
            # past the in-flight grace: the torn record is not dispatched, whatever it looks like by then
            deadline = time.monotonic() + 1.4
            while time.monotonic() < deadline:
                assert store.health()["reputFromOffset"] == offset, f"{order}: a torn record was dispatched"
                time.sleep(0.05)
            # a torn record that still has its TOTALSIZE (front to back) is waited for; one without it but
            # with bytes after it reads as a zero TOTALSIZE with data after it: corrupt once the grace is over
            # (onCorruption: stop holds at it, reports it and re-reads it every poll interval)
            if order != "forward" and any(live.read(offset, size)):
                wait_for(lambda: store.health()["status"] == "degraded", timeout=5, what=f"{order}: corrupt")
                declared_corrupt += 1
            else:
                assert store.health()["status"] == "healthy", f"{order}: an incomplete record was declared corrupt"
            assert store.health()["reputFromOffset"] == offset
            # the restarted writer: from the torn record's start, over its bytes, until past them
            source = RecordSource(commitlog, store.tmp / "resume-scratch", START_MS + 2 * 10**9 + kill * 10**7,
                                  resume_at=offset)
            i = 0
            while source.end < offset + size or i < 5:
                for piece in source.next(message(store.count + 10 * kill + i, body_size=rng.choice((40, 160, 600)))):
                    live.write(piece.offset, piece.data)
                time.sleep(rng.uniform(0, 0.003))
                i += 1
            end = source.end
            source.close()
            wait_for(lambda end=end: store.health().get("reputFromOffset") == end, timeout=10,
                     what="the resumed records")
            wait_for(lambda: store.health()["status"] == "healthy", timeout=5, what="health back to healthy")
    finally:
        code, out, err = stop(proc)
        live.close()
    assert code == 0, err
    corrupt = [e for e in events(out) if e["event"] == "corrupt_commitlog"]
    assert declared_corrupt <= len(corrupt) <= WRITER_KILLS
    assert_same_as_rebuild(store)
    figures = check_output_against_commitlog(store.out, commitlog)
    assert figures["index_entries"] == 3 * figures["records"]
    assert not torn_hashes & {h for h, _ in index_entries(store.out)}, "a torn record's key was indexed"
    stress.report("writer_kill9", kills=WRITER_KILLS, orders=dict(per_order), declared_corrupt=declared_corrupt,
                  corrupt_events=len(corrupt), identical=1, records=figures["records"],
                  seconds=round(time.monotonic() - started, 1), seed=CRASH_SEED + 1)
