"""`reputd handoff`, then the real RocketMQ 4.9.3 store loads and starts on the directory: every unit, key and
record served, new writes go on at each queue's next offset, and the files end as the same CommitLog
dispatched by the store alone (issue 27 §1).

The store is the broker's own Java code (`../shared/realbroker/`, LiveWriter: DefaultMessageStore with its
reput, flush and schedule threads; keys incl. CJK and emoji, PREPARED/COMMIT/ROLLBACK, delay levels,
1 MiB segments, 6,000-byte ConsumeQueue files, 400-entry IndexFiles: many rolls), stopped cleanly or killed
with SIGKILL while it writes (its `checkpoint` then carries recent times and `abort` is left behind). Its
own consumequeue/ and index/ are replaced by reputd's: rebuilt by `reputd rebuild` in the store root, or
the output of a `reputd run` that followed the writer and was stopped early (handed over with the moves
`handoff --out` prints, run as printed); with the broker's `checkpoint` kept or deleted. Then
`tests/fixtures/java/HandoffCheck.java`, compiled against the built store, loads and starts the store on
the directory and asks it for every record, unit and key, writes more, and shuts down; the same harness on
a copy of the final CommitLog alone gives the store's own files to compare with.

`make test` runs one scenario (killed x followed x checkpoint deleted, the one 4.9.3 corrupts without the
handoff); `REPUTD_STRESS=1` runs all eight with a larger workload. Skipped, with the reason, without `java`
and `javac`. STRESS_HANDOFF_MESSAGES, STRESS_HANDOFF_RATE and STRESS_HANDOFF_SEED override the workload.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from daemon.cli.common import program
from daemon.engine.checkpoint import read_checkpoint
from indexcore.checkpoint import StoreCheckpoint
from tests import stress
from tests.conformance import REPO
from tests.test_daemon import clean_env
from tests.test_realbroker_live import java_build, java_command, same_files

MESSAGES = int(os.environ.get("STRESS_HANDOFF_MESSAGES", stress.scale(4000, 20000)))
RATE = int(os.environ.get("STRESS_HANDOFF_RATE", stress.scale(800, 400)))
SEED = int(os.environ.get("STRESS_HANDOFF_SEED", "27"))
WRITES = stress.scale(500, 3000)
# 1,000 entries per IndexFile, not LiveWriter's 400: the store dispatching a whole CommitLog alone fills
# 400-entry files faster than one per millisecond, names the next file as the full one and drops its keys
# (4.9.3, see docs/correctness.md, "What exact means"), which would make the reference lose keys, not the handoff
SIZES = {"mappedFileSizeCommitLog": 1 << 20, "mappedFileSizeConsumeQueue": 6000, "maxHashSlotNum": 97,
         "maxIndexNum": 1000}
SIZE_FLAGS = ["--commitlog-size", str(SIZES["mappedFileSizeCommitLog"]), "--cq-size",
              str(SIZES["mappedFileSizeConsumeQueue"]), "--hash-slots", str(SIZES["maxHashSlotNum"]),
              "--index-num", str(SIZES["maxIndexNum"])]
HARNESS = REPO / "tests" / "fixtures" / "java" / "HandoffCheck.java"
REPUTD = [sys.executable, "-m", "daemon.cli"]
FOLLOW_STOP = 0.35  # `reputd run` is stopped this far into the writer's put phase
KILL_AT = 0.8  # the killed writer gets SIGKILL this far into it

SCENARIOS = [(broker, source, cp) for broker in ("killed", "clean") for source in ("followed", "rebuilt")
             for cp in ("deleted", "kept")]
DEFAULT = ("killed", "followed", "deleted")


def scenario_params():
    for s in SCENARIOS:
        marks = [] if stress.STRESS or s == DEFAULT else [pytest.mark.stress_only]
        yield pytest.param(*s, id="-".join(s), marks=marks)


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> tuple[str, Path]:
    """The built store and HandoffCheck compiled against it."""
    build = java_build()
    classes = tmp_path_factory.mktemp("handoff-harness")
    res = subprocess.run(["javac", "-nowarn", "-cp", f"{build}/classes:{build}/lib/*", "-d", str(classes),
                          str(HARNESS)], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return build, classes


def write_config(path: Path, root: Path, out: Path) -> Path:
    path.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(root), **SIZES}, "output": {"dir": str(out)},
                                    "metrics": {"enabled": False}, "logging": {"level": "warning"}}))
    return path


def wait_into_run(writer: subprocess.Popen, log: Path, started: float, share: float) -> None:
    """Until `share` of the writer's put phase (MESSAGES / RATE seconds) has passed; it must still be writing."""
    time.sleep(max(0.0, started + share * MESSAGES / RATE - time.monotonic()))
    assert writer.poll() is None, "the writer finished early: " + log.read_text(errors="replace")[-2000:]


@pytest.fixture(scope="module")
def written(harness, tmp_path_factory):
    """One LiveWriter run per way the broker stops, each with the output of a `reputd run` that followed
    it and was stopped early: {"killed" | "clean": (store root, run output, facts)}."""
    build, _ = harness
    made: dict[str, tuple[Path, Path, dict]] = {}

    def make(broker: str) -> tuple[Path, Path, dict]:
        if broker in made:
            return made[broker]
        base = tmp_path_factory.mktemp(f"writer-{broker}")
        store, out, log = base / "store", base / "followed", base / "writer.log"
        config = write_config(base / "follow.yaml", store, out)
        with log.open("w") as err:
            writer = subprocess.Popen([*java_command(build), "LiveWriter", "--store", str(store), "--messages",
                                       str(MESSAGES), "--rate", str(RATE), "--seed", str(SEED), "--ha-port", "0",
                                       "--linger-ms", "3000", *SIZE_FLAGS],
                                      stdout=subprocess.PIPE, stderr=err, text=True)
        follower = None
        try:
            assert writer.stdout.readline().startswith("STARTED"), log.read_text()[-2000:]
            started = time.monotonic()
            follower = start_follower(config, out)
            wait_into_run(writer, log, started, FOLLOW_STOP)
            stop_follower(follower)
            if broker == "killed":
                wait_into_run(writer, log, started, KILL_AT)
                writer.send_signal(signal.SIGKILL)
                writer.wait(timeout=60)
            else:
                assert writer.wait(timeout=900) == 0, log.read_text(errors="replace")[-2000:]
        finally:
            kill_left(writer, follower)
        checkpoint = StoreCheckpoint.decode((store / "checkpoint").read_bytes())
        facts = {"abort": (store / "abort").exists(), "checkpoint": checkpoint._asdict(),
                 "followed_to": read_checkpoint(str(out)).reput_from_offset,
                 "commitlog_bytes": sum(p.stat().st_size for p in (store / "commitlog").iterdir())}
        made[broker] = (store, out, facts)
        return made[broker]

    return make


def start_follower(config: Path, out: Path) -> subprocess.Popen:
    """`reputd run` following a writer's store, once it is up (its replay marker written)."""
    follower = subprocess.Popen([*REPUTD, "run", "--config", str(config)], env=clean_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "reputd.checkpoint").exists():
        assert follower.poll() is None, follower.communicate()[1]
        assert time.monotonic() < deadline, "reputd run wrote no checkpoint"
        time.sleep(0.05)
    return follower


def stop_follower(follower: subprocess.Popen) -> None:
    """SIGTERM: the follower stops early, exit 0."""
    follower.send_signal(signal.SIGTERM)
    _, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err


def kill_left(*processes: subprocess.Popen | None) -> None:
    """Whatever a failed fixture left running."""
    for p in processes:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def copy_store(writer_store: Path, store: Path, checkpoint: str) -> None:
    """The stopped broker's store (sparse files kept sparse) with its consumequeue/ and index/ gone (and its
    `checkpoint` if asked)."""
    subprocess.run(["cp", "-r", "--sparse=always", str(writer_store), str(store)], check=True, timeout=300)
    for sub in ("consumequeue", "index"):
        subprocess.run(["rm", "-r", str(store / sub)], check=True, timeout=60)
    if checkpoint == "deleted":
        (store / "checkpoint").unlink()


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for sub in ("consumequeue", "index") if (root / sub).is_dir()
            for p in sorted((root / sub).rglob("*")) if p.is_file()}


def reputd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*REPUTD, *args], capture_output=True, text=True, env=clean_env(), timeout=600, check=False)


def run_printed(commands: list[str]) -> list[str]:
    """Run the commands handoff printed, each as printed (reputd's by the path it printed); what they print."""
    env = clean_env({})
    printed = []
    for command in commands:
        res = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=600,
                             check=False)
        assert res.returncode == 0, f"{command}: {res.stdout[-2000:]} {res.stderr[-2000:]}"
        printed += [f"$ {command}", *res.stdout.splitlines()]
    return printed


def printed_commands(stdout: str, header: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    return [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


def check_store(harness, root: Path, writes: int) -> dict:
    build, classes = harness
    cmd = [*java_command(build), "HandoffCheck", "--store", str(root), "--writes", str(writes), "--ha-port", "0",
           *SIZE_FLAGS]
    cmd[cmd.index("-cp") + 1] = f"{classes}:{build}/classes:{build}/lib/*"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])



def serve_and_compare(harness, store: Path, reference: Path, handed: dict[str, str], writes: int = WRITES,
                      check=check_store, logs: tuple[str, ...] = ("commitlog",)):
    """The real store started on `store` (every unit, key and record asked for, `writes` more written); the
    store alone dispatching the same final CommitLog (the `logs` directories of the root) in `reference`;
    their files compared; and how many of the handed files the broker's load and start left as they were.
    `check` runs HandoffCheck (check_store's arguments)."""
    served = check(harness, store, writes)
    reference.mkdir()
    for sub in logs:  # sparse: DLedger's index file is 160 MiB of mostly holes
        subprocess.run(["cp", "-r", "--sparse=always", str(store / sub), str(reference / sub)], check=True,
                       timeout=300)
    alone = check(harness, reference, 0)
    unchanged = sum(1 for name, digest in served["digests"].items() if handed.get(name) == digest)
    return served, alone, same_files(reference, store), unchanged

def hand_off(store: Path, followed: Path, tmp_path: Path, broker: str, source: str, checkpoint: str,
             write_conf) -> list[str]:
    """reputd's files into the stopped broker's store root as an operator does it: `rebuild` in place then
    `handoff`, or a followed `run` output handed off with the moves it prints (`--broker-files` first when
    the broker's checkpoint is kept); returns what reputd printed. `write_conf(path, root, out)` writes the
    config."""
    printed: list[str] = []
    if source == "rebuilt":
        config = write_conf(tmp_path / "reputd.yaml", store, store)
        res = reputd("rebuild", "--config", str(config))
        assert res.returncode == 0, res.stderr
        if broker == "killed":  # the warning: the broker would discard this index without a handoff
            warnings = [line for line in res.stderr.splitlines() if line.startswith("reputd: warning:")]
            assert len(warnings) == 1, res.stderr
            assert f"{store / 'abort'} exists" in warnings[0]
            assert f"reputd handoff --config {config} --store {store}" in warnings[0]
        res = reputd("handoff", "--config", str(config))
        assert res.returncode == 0, res.stdout + res.stderr
        printed = res.stdout.splitlines()
    else:
        out = tmp_path / "out"
        subprocess.run(["cp", "-r", "--sparse=always", str(followed), str(out)], check=True, timeout=300)
        config = write_conf(tmp_path / "reputd.yaml", store, out)
        if checkpoint == "kept":  # the broker-file part now, the moves after
            res = reputd("handoff", "--config", str(config), "--broker-files")
            assert res.returncode == 0, res.stdout + res.stderr
            printed = res.stdout.splitlines()
            printed += run_printed(printed_commands(res.stdout, "before the broker starts, move"))
        else:  # the moves, then `reputd handoff` in the store root, as printed
            res = reputd("handoff", "--config", str(config))
            assert res.returncode == 0, res.stdout + res.stderr
            printed = res.stdout.splitlines()
            commands = printed_commands(res.stdout, f"to hand {out} to the broker")
            assert commands[-1].startswith(f"{shlex.join(program())} handoff"), commands
            printed += run_printed(commands)
        assert not (out / "consumequeue").exists()
        assert not (out / "index").exists()
    assert not (store / "abort").exists()
    assert not (store / "reputd.checkpoint").exists()
    return printed


@pytest.mark.parametrize(("broker", "source", "checkpoint"), list(scenario_params()))
def test_the_real_broker_takes_the_handed_off_files(harness, written, tmp_path, broker, source, checkpoint):
    writer_store, followed, facts = written(broker)
    store = tmp_path / "store"
    copy_store(writer_store, store, checkpoint)  # the broker's own files gone: reputd's take their place
    assert (store / "abort").exists() == (broker == "killed")
    printed = hand_off(store, followed, tmp_path, broker, source, checkpoint, write_config)
    handed = digests(store)
    assert handed

    served, alone, (cq_same, cq_total, ix_same, ix_total, differ), unchanged = serve_and_compare(
        harness, store, tmp_path / "reference", handed)
    stress.report("realbroker-handoff", scenario=f"{broker}/{source}/checkpoint {checkpoint}", messages=MESSAGES,
                  seed=SEED, writer_checkpoint=facts["checkpoint"], followed_to=facts["followed_to"],
                  commitlog_bytes=facts["commitlog_bytes"], handoff=printed,
                  files_unchanged_by_load_and_start=f"{unchanged}/{len(handed)}",
                  records=f"{served['records_served']}/{served['records']}",
                  units=f"{served['units_served']}/{served['units']} (exact {served['units_exact']})",
                  keys=f"{served['keys_served']}/{served['keys']}",
                  writes=f"continued {served['writes_continued']}, served {served['writes_served']} of "
                         f"{served['writes']}",
                  store_alone=f"records {alone['records_served']}/{alone['records']}, units "
                              f"{alone['units_served']}/{alone['units']}, keys {alone['keys_served']}/{alone['keys']}",
                  cq_identical=f"{cq_same}/{cq_total}", index_identical=f"{ix_same}/{ix_total}",
                  differ=differ[:10], examples=served["examples"][:5])
    assert_served_all(served, alone, (cq_same, cq_total, ix_same, ix_total, differ), unchanged, handed)


def assert_served_all(served: dict, alone: dict, compared: tuple, unchanged: int, handed: dict[str, str],
                      writes: int = WRITES) -> None:
    """What serve_and_compare found is the handoff's promise: no abort left, every record, unit and key
    served from the handed files, each new write at its queue's next offset, the handed files unchanged by
    load and start, and the final files those of the store alone."""
    cq_same, cq_total, ix_same, ix_total, differ = compared
    assert served["abort_before_load"] is False
    assert served["examples"] == []
    assert served["max_phy_offset_at_start"] > 0
    # the store alone answers for the CommitLog with the new writes in it: each has a unit and three keys
    assert served["records_served"] == served["records"] == alone["records"] - writes
    assert served["units_served"] == served["units_exact"] == served["units"] == alone["units"] - writes
    assert served["keys_served"] == served["keys"] == alone["keys"] - 3 * writes
    # the reference itself is whole (see SIZES)
    assert alone["records_served"] == alone["records"]
    assert alone["units_served"] == alone["units_exact"] == alone["units"]
    assert alone["keys_served"] == alone["keys"], "the store alone dropped keys: " + str(alone["examples"][:3])
    assert served["writes_continued"] == served["writes_served"] == served["writes"] == writes
    assert unchanged == len(handed) == len(served["digests"])
    assert differ == []
    assert (cq_same, ix_same) == (cq_total, ix_total)


def report_control(name: str, scenario: str, served: dict, alone: dict, compared: tuple, unchanged: int,
                   handed: dict[str, str]) -> None:
    """A control run (the files handed over without `reputd handoff`): its figures reported, and the proof that
    the handoff checks would catch it: `abort` was there at load, and something was not served, or the
    files differ from the store alone's, or its load and start changed handed files."""
    cq_same, cq_total, ix_same, ix_total, differ = compared
    stress.report(name, scenario=scenario, files_unchanged_by_load_and_start=f"{unchanged}/{len(handed)}",
                  records=f"{served['records_served']}/{served['records']}",
                  units=f"{served['units_served']}/{served['units']} (exact {served['units_exact']})",
                  keys=f"{served['keys_served']}/{served['keys']}",
                  writes=f"continued {served['writes_continued']}, served {served['writes_served']} of "
                         f"{served['writes']}",
                  store_alone=f"records {alone['records']}, units {alone['units']}, keys {alone['keys']}",
                  cq_identical=f"{cq_same}/{cq_total}", index_identical=f"{ix_same}/{ix_total}",
                  examples=served["examples"][:3])
    assert served["abort_before_load"] is True
    everything = (served["units_served"] == served["units_exact"] == served["units"]
                  and served["keys_served"] == served["keys"] and served["writes_served"] == served["writes"])
    assert not everything or differ or unchanged < len(handed)


@pytest.mark.stress_only
@pytest.mark.parametrize(("source", "checkpoint"), [("followed", "kept"), ("rebuilt", "deleted")])
def test_without_the_handoff_the_killed_broker_loses_what_reputd_built(harness, written, tmp_path, source,
                                                                       checkpoint):
    """The control: the same files handed to the killed broker's store without `reputd handoff` (the run
    output moved in as it was, or a complete rebuild with `abort` still there) are not what the store
    serves or ends with, or are thrown away by its load (IndexFiles destroyed and made again), as issue 27
    found: the scenarios above would catch a handoff that did nothing."""
    writer_store, followed, _ = written("killed")
    store = tmp_path / "store"
    copy_store(writer_store, store, checkpoint)
    if source == "rebuilt":
        res = reputd("rebuild", "--config", str(write_config(tmp_path / "reputd.yaml", store, store)))
        assert res.returncode == 0, res.stderr
    else:
        for sub in ("consumequeue", "index"):
            shutil.copytree(followed / sub, store / sub)
    handed = digests(store)
    served, alone, compared, unchanged = serve_and_compare(harness, store, tmp_path / "reference", handed)
    report_control("realbroker-handoff-control", f"killed/{source}/checkpoint {checkpoint}/no handoff", served,
                   alone, compared, unchanged, handed)
