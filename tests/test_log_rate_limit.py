"""A failure that repeats identically is logged once, then once a minute with a count (issue 28 §6): a full
output disk used to log `flush_failed` and `output_space_exhausted` on every flush, two lines a second."""

from __future__ import annotations

from daemon.ops.logs import RepeatedFailures
from tests.test_daemon import Store, events, fail_flushes_while, stop, wait_for


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_first_at_once_then_one_line_per_interval_with_the_count():
    clock = Clock()
    repeats = RepeatedFailures(60.0, clock)
    full = ("output_space_exhausted", "flush", "/out/index/1", "ENOSPC")
    assert repeats.admit(full) == {}
    for _ in range(119):  # two a second for a minute, less the first
        clock.now += 0.5
        assert repeats.admit(full) is None
    other = ("output_space_exhausted", "flush", "/out/index/2", "ENOSPC")
    assert repeats.admit(other) == {}, "another file is another failure: logged at once"
    clock.now += 0.5
    assert repeats.admit(full) == {"repeated": 119, "repeated_over_s": 60.0}
    clock.now += 61
    assert repeats.admit(full) == {}, "nothing held back since the last line: no count to give"
    clock.now += 1
    assert repeats.admit(full) is None
    clock.now += 2
    assert repeats.ended(lambda key: key[2] == "/out/index/1") == [(full, 1, 3.0)]
    assert repeats.admit(full) == {}, "ended: the next one is a new failure, logged at once"
    assert repeats.ended() == []  # nothing held back for either


def test_a_daemon_whose_flushes_fail_logs_once_and_counts_the_rest(tmp_path):
    """Every flush fails (every 50 ms here) until the marker goes: one `flush_failed` line, every failure in
    `reputd_errors_total{kind=flush}`, and when flushes succeed again one `failure_repeats_ended` line with
    how many lines were held back."""
    store = Store(tmp_path)
    marker = fail_flushes_while(store, tmp_path / "io-error")
    store.append(300)
    proc = store.start()
    try:
        wait_for(lambda: store.health().get("checkpointOffset") == store.end, what="first checkpoint")
        marker.touch()
        store.append(300)
        wait_for(lambda: store.metrics()["reputd_errors_total{kind=flush}"] >= 40, what="40 failed flushes")
        marker.unlink()
        wait_for(lambda: store.health()["status"] == "healthy", what="healthy once flushes succeed")
        wait_for(lambda: store.health()["checkpointOffset"] == store.end, what="checkpoint moves on")
        failed = store.metrics()["reputd_errors_total{kind=flush}"]
    finally:
        code, out, err = stop(proc)
        store.writer.close()
    assert code == 0, err
    logged = events(out)
    assert len([e for e in logged if e["event"] == "flush_failed"]) == 1
    (ended,) = [e for e in logged if e["event"] == "failure_repeats_ended"]
    assert ended["failure"] == "flush_failed"
    assert ended["repeated"] == failed - 1
    assert ended["level"] == "info"
