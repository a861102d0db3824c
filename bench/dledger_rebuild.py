"""The `rebuild-dledger` scenario of `make bench`: `reputd rebuild` of a DLedger CommitLog beside the plain one.

The DLedger store holds the same messages as the `rebuild` data set (256-byte bodies, UNIQ_KEY + 1 KEY), each in
a DLedger entry of a one-node group, written once by `indexcore.dledgerwriter.copy_commitlog` (the bytes DLedger
0.2.3's appendAsLeader writes: tests/test_dledger_writer.py checks them against the real store). Both rebuilds
are timed the same way, process start to exit, fastest of `repeat`, from the same warm page cache; the figures
are msgs/s of each and their ratio. The two outputs must hold the same ConsumeQueue units and IndexFile keys at
offsets 48 apart, which the conformance suite checks on the real stores; here only the message counts are
compared, the bench measures.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from indexcore.dledgerwriter import copy_commitlog

DLEDGER = {"enableDLegerCommitLog": True, "dLegerSelfId": "n0", "dLegerGroup": "bench",
           "dLegerPeers": "n0-127.0.0.1:40911"}
GIB = 1024**3


def ensure_dledger_store(plain: Path, messages: int, work: Path) -> Path:
    """The DLedger copy of the plain data set `plain`, made once (kept with a marker, as the data sets are)."""
    store = work / "data" / (plain.name + "-dledger")
    marker = store / "converted.json"
    if marker.exists() and json.loads(marker.read_text()).get("messages") == messages:
        return store
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    print(f"writing the DLedger copy of {plain.name}: {messages:,} entries ...", flush=True)
    entries = copy_commitlog(str(plain / "commitlog"), GIB, str(store / "dledger-n0"))
    assert entries == messages, (entries, messages)
    marker.write_text(json.dumps({"messages": messages}))
    return store


def bench_rebuild_dledger(work: Path, scale: float, repeat: int, suite) -> dict:
    """Rebuild rates of the plain data set and of its DLedger copy; `suite` is bench_suite (its helpers)."""
    plain, messages = suite.ensure_data_set(work, suite.REBUILDS["rebuild"][0], scale)
    store = ensure_dledger_store(plain, messages, work)
    outs = work / "out" / "rebuild-dledger"
    figures = {}
    for name, root, settings in (("plain", plain, {}), ("dledger", store, DLEDGER)):
        runs = []
        for run in range(repeat):
            shutil.rmtree(outs, ignore_errors=True)
            config = suite.write_config(work / f"rebuild-dledger-{name}.yaml", root, outs / f"{name}-{run}",
                                        **settings)
            data = sorted((root / "dledger-n0" / "data").iterdir()) if settings else suite.commitlog_bytes(root)[0]
            for path in data:  # the same warm page cache for both
                with open(path, "rb") as f:
                    while f.read(suite.READ_CHUNK):
                        pass
            wall, rss, stdout = suite.run_measured([*suite.REPUTD, "rebuild", "--config", str(config), "--json"])
            summary = suite.last_json(stdout)
            assert summary["messages"] == messages, summary
            runs.append((wall, rss, summary))
        shutil.rmtree(outs, ignore_errors=True)
        wall, rss, summary = min(runs, key=lambda r: r[0])
        figures[name] = {"seconds": round(wall, 3), "msgs_per_s": round(messages / wall),
                         "mb_per_s": round(summary["bytes"] / suite.MIB / wall, 1),
                         "peak_rss_mb": round(rss / suite.MIB, 1), "runs": [round(r[0], 3) for r in runs]}
    return {"scenario": "rebuild-dledger", "messages": messages, "plain": figures["plain"],
            "dledger": figures["dledger"],
            "ratio_to_plain_msgs_per_s": round(figures["dledger"]["msgs_per_s"] / figures["plain"]["msgs_per_s"], 3)}


def print_line(r: dict) -> None:
    p, d = r["plain"], r["dledger"]
    print(f"\nrebuild-dledger: {r['messages']:,} messages; DLedger CommitLog {d['msgs_per_s']:,} msgs/s "
          f"({d['seconds']:.2f} s, {d['mb_per_s']:,.0f} MB/s, peak RSS {d['peak_rss_mb']:.0f} MB), the plain "
          f"CommitLog with the same messages {p['msgs_per_s']:,} msgs/s ({p['seconds']:.2f} s): "
          f"{r['ratio_to_plain_msgs_per_s']:.0%} of the plain rate")
