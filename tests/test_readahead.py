"""The read-ahead of a pass over the CommitLog (`daemon.engine.readahead`): results in order, and the dispatching
thread's `idle` work done while it would wait for a batch, through a real rebuild."""

from __future__ import annotations

import threading
import time

import yaml

from daemon.config import load_config
from daemon.engine import rebuild as rebuild_module
from daemon.engine.readahead import ReadAhead
from indexcore.reader import ReadStatus
from indexcore.writer import CommitLogWriter, Message
from tests.test_daemon import output_files


class _SlowReader:
    """Three OK results, then END, each read taking `delay` s (the decode of a big window)."""

    def __init__(self, delay: float):
        self.delay = delay
        self.reads = 0

    def read(self, offset: int):
        time.sleep(self.delay)
        self.reads += 1
        status = ReadStatus.OK if self.reads <= 3 else ReadStatus.END

        class Result:
            batch = ()
            next_offset = offset + 1

        Result.status = status
        return Result()


def test_idle_work_is_done_while_the_next_result_is_not_ready_and_results_keep_their_order():
    calls, threads = [], set()

    def idle() -> bool:
        calls.append(time.monotonic())
        threads.add(threading.get_ident())
        time.sleep(0.005)
        return len(calls) < 5  # five pieces of work, then none left (a new batch may bring more)

    ahead = ReadAhead(_SlowReader(0.05), 10, idle=idle)
    first = next(iter(ahead))
    assert len(calls) == 5  # while the first read took 50 ms: piece after piece until none was left
    results = [first, *ahead]
    assert [r.next_offset for r in results] == [11, 12, 13, 14]
    assert [r.status for r in results][-1] is ReadStatus.END
    assert len(calls) <= 5 + 3  # then once at each wait, to say there is nothing
    assert threads == {threading.get_ident()}  # on the dispatching thread


def test_a_rebuild_makes_its_new_queues_files_while_it_waits_and_ends_as_without(tmp_path, monkeypatch):
    """A rebuild's dispatching thread creates new queues' files while its read-ahead decodes (`idle`); the output
    is the one made without that (each file made by its first write at the end)."""
    writer = CommitLogWriter(str(tmp_path / "store" / "commitlog"), 1 << 20, clock=iter(range(1, 10**9)).__next__)
    for i in range(3000):
        writer.append(Message(f"T{i % 300}", (i // 300) % 4, b"x" * 200, {"KEYS": f"k{i}"}))
    writer.close()
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(tmp_path / "store"),
                                                "mappedFileSizeCommitLog": 1 << 20,
                                                "mappedFileSizeConsumeQueue": 40 * 20, "maxHashSlotNum": 997,
                                                "maxIndexNum": 20_000},
                                      "reput": {"batchBytes": 64 * 1024}}))
    made_ahead = []
    real_idle = rebuild_module.ConsumeQueueDispatcher.idle

    def idle(self):
        more = real_idle(self)
        made_ahead.append(more)
        return more

    real_make_reader = rebuild_module.make_reader

    def slow_reader(*args, **kwargs):  # a read-ahead slower than the dispatch, as over 8,000 queues
        reader = real_make_reader(*args, **kwargs)
        real_read = reader.read
        reader.read = lambda offset: (time.sleep(0.02), real_read(offset))[1]
        return reader

    monkeypatch.setattr(rebuild_module, "make_reader", slow_reader)
    outs = {}
    for ahead in (True, False):
        monkeypatch.setattr(rebuild_module, "REBUILD_BATCH_BYTES", 64 * 1024)
        monkeypatch.setattr(rebuild_module.ConsumeQueueDispatcher, "idle", idle if ahead else lambda self: False)
        out = tmp_path / f"out-{ahead}"
        summary = rebuild_module.rebuild(load_config(str(config), overrides={"output.dir": str(out)}))
        assert summary.messages == 3000
        outs[ahead] = {k: v for k, v in output_files(out).items() if "checkpoint" not in k}
    assert any(made_ahead)  # some files were made ahead, while the dispatch waited
    assert outs[True] == outs[False]
    assert sum(name.startswith("consumequeue/") for name in outs[True]) == 1200
