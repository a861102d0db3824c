"""One mistake, one answer, in every command (issue 44, items 5-8): every configuration mistake the docs name,
made against copies of the real 4.9.3 stores (plain and DLedger), through every command's real command line.
Each is a configuration or usage error, exit 2, one line on stderr naming what to set, nothing written, no
traceback; `run` included (its JSON log on stdout, the line on stderr too).

The commands run as forked children of one driver (tests/cli_table.py), so the whole table (some 220
command lines) costs about as much as a few interpreters' start-ups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conformance import discover

STORES = {s.name: s for s in discover()}
PLAIN, DLEDGER = STORES.get("visible"), STORES.get("dledger")
pytestmark = pytest.mark.skipif(PLAIN is None or DLEDGER is None,
                                reason="the conformance stores `visible` and `dledger` are not here")
TOPIC, KEY = "TopicTest", "HOTKEY"
CONSUME_QUEUE_FILE = f"consumequeue/{TOPIC}/0/{0:020d}"
KEYS_ARE = "set store.mappedFileSizeCommitLog to the broker's value"
SIZE_KEYS = ("mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxHashSlotNum", "maxIndexNum")

# name: (store, settings over the store's own, what the line on stderr says)
MISTAKES = {
    "commitlog size smaller": ("plain", {"mappedFileSizeCommitLog": 32768}, KEYS_ARE),
    "commitlog size left out": ("plain", {"mappedFileSizeCommitLog": None}, KEYS_ARE),
    "dledger commitlog size left out": ("dledger", {"mappedFileSizeCommitLog": None, "enableDLegerCommitLog": True,
                                                    "dLegerSelfId": "n0"}, KEYS_ARE),
    "dledger commitlog size smaller": ("dledger", {"mappedFileSizeCommitLog": 32768, "enableDLegerCommitLog": True,
                                                   "dLegerSelfId": "n0"}, KEYS_ARE),
    "consumequeue size": ("plain", {"mappedFileSizeConsumeQueue": 2000},
                          "set store.mappedFileSizeConsumeQueue to the broker's value"),
    "index sizes left out": ("plain", {"maxHashSlotNum": None, "maxIndexNum": None},
                             "set store.maxHashSlotNum and store.maxIndexNum to the broker's values"),
    "dledger store without the dledger keys": ("dledger", {},
                                               "set store.enableDLegerCommitLog: true and store.dLegerSelfId: n0"),
    "plain store with the dledger keys": ("plain", {"enableDLegerCommitLog": True, "dLegerSelfId": "n0"},
                                          "set store.enableDLegerCommitLog: false"),
    "dLegerSelfId of another node": ("dledger", {"enableDLegerCommitLog": True, "dLegerSelfId": "n1"},
                                     "this store has dledger-n0/data"),
    "dLegerSelfId unset": ("dledger", {"enableDLegerCommitLog": True}, "store.dLegerSelfId: must be set"),
    "dLegerSelfId not a peer": ("dledger", {"enableDLegerCommitLog": True, "dLegerSelfId": "n0",
                                            "dLegerPeers": "n1-127.0.0.1:40911"}, "is not one of the dLegerPeers"),
    "unknown key": ("plain", {"mappedFileSizeCommitlog": 65536}, "store.mappedFileSizeCommitlog: unknown key"),
    "impossible value": ("plain", {"mappedFileSizeConsumeQueue": 1234}, "store.mappedFileSizeConsumeQueue"),
    "refused key": ("plain", {"enableConsumeQueueExt": True}, "store.enableConsumeQueueExt"),
    "config file missing": ("plain", None, "no-such.yaml"),
    "store root missing": ("plain", {"storePathRootDir": "{tmp}/nowhere/store"}, "{tmp}/nowhere/store"),
    "store root left out": ("plain", {"storePathRootDir": None},
                            "{tmp}/var/store: no such store root directory (store.storePathRootDir: built-in default, "
                            "not in {tmp}/configs/"),
    "commitlog directory missing": ("plain", {"storePathCommitLog": "{tmp}/nowhere/commitlog"},
                                    "{tmp}/nowhere/commitlog"),
    "output directory a file": ("plain", {"output.dir": "{tmp}/a-file"}, "{tmp}/a-file: not a directory"),
    "plug-in only in the environment": ("plain", {"env": {"REPUTD_DISPATCHERS": "consumequeue,index,x.y:Z"}},
                                        "REPUTD_DISPATCHERS"),
}

# The cells where the mistake is not one: `inspect` decodes the file it is given, wherever the config says
# the store is; `produce` writes no output directory; `run` waits for a CommitLog directory that is not there
# yet (a mount, a broker not started: tests/test_startup_contract.py).
NOT_A_MISTAKE = {("inspect", m) for m in ("dledger store without the dledger keys", "plain store with the dledger keys",
                                          "dLegerSelfId of another node", "store root missing", "store root left out",
                                          "commitlog directory missing", "output directory a file")}
SKIPPED = {("produce", "output directory a file"), ("run", "commitlog directory missing")}  # (command, mistake)


def _inspected(store: str, mistake: str, root: Path) -> str:
    """The file `inspect` is given: the kind of file the mistake is about."""
    if mistake == "consumequeue size":
        return str(root / CONSUME_QUEUE_FILE)
    if mistake == "index sizes left out":
        return str(sorted((root / "index").iterdir())[0])
    return str(root / ("dledger-n0/data" if store == "dledger" else "commitlog") / f"{0:020d}")


def _commands(store: str, mistake: str, root: Path, msg_id: str) -> dict[str, list[str]]:
    return {
        "run": ["run"],
        "run --until-caught-up": ["run", "--until-caught-up"],
        "rebuild": ["rebuild"],
        "verify": ["verify"],
        "handoff --dry-run": ["handoff", "--dry-run"],
        "handoff": ["handoff"],
        "backfill": ["backfill", "--master", "local[1]"],
        "query key": ["query", "key", TOPIC, KEY],
        "query queue": ["query", "queue", TOPIC, "0", "0"],
        "query msgid": ["query", "msgid", msg_id],
        "query time": ["query", "time", TOPIC, "--begin", "0"],
        "query offset": ["query", "offset", TOPIC, "0", "0"],
        "query trace": ["query", "trace", msg_id],
        "inspect": ["inspect", _inspected(store, mistake, root), "--limit", "1"],
        "produce": ["produce", "--messages", "1"],
    }


def _copy_store(source: Path, into: Path) -> Path:
    subprocess.run(["cp", "-r", "--sparse=always", str(source), str(into)], check=True, timeout=120)
    for p in into.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return into


def _snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for root in roots for p in root.rglob("*")
            if p.is_file()}


def _config(tmp: Path, roots: dict[str, Path], store: str, settings: dict | None) -> tuple[Path, dict]:
    sizes = STORES["visible" if store == "plain" else "dledger"].store_settings()
    base = {"storePathRootDir": str(roots[store]), **{k: sizes[k] for k in SIZE_KEYS}}
    settings = dict(settings or {})
    env = settings.pop("env", {})
    out = settings.pop("output.dir", None)
    for key, value in settings.items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value.replace("{tmp}", str(tmp)) if isinstance(value, str) else value
    doc = {"store": base, "logging": {"level": "warning"}}
    if out:
        doc["output"] = {"dir": out.replace("{tmp}", str(tmp))}
    path = tmp / "configs" / f"{len(list((tmp / 'configs').iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return path, env


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Every command with every mistake, run once; the stores' files before and after."""
    tmp = tmp_path_factory.mktemp("one-answer")
    # two copies of each, the mistakes alternating between them: the driver runs two command lines at once, never
    # two on one copy (its writers would find the other's lock)
    copies = [{"plain": _copy_store(PLAIN.store, tmp / f"plain{n}"),
               "dledger": _copy_store(DLEDGER.store, tmp / f"dledger{n}")} for n in (0, 1)]
    (tmp / "configs").mkdir()
    (tmp / "a-file").write_text("")
    before = _snapshot(*(root for c in copies for root in c.values()))
    msg_id = PLAIN.manifest["messages"][0]["msg_id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")} | {"REPUTD_METRICS_ENABLED": "false"}
    cells, cases = [], []
    for n, (mistake, (store, settings, _)) in enumerate(MISTAKES.items()):
        roots = copies[n % 2]
        if settings is None:
            config, extra = tmp / "no-such.yaml", {}
        else:
            config, extra = _config(tmp, roots, store, settings)
        for command, argv in _commands(store, mistake, roots[store], msg_id).items():
            if (command, mistake) in SKIPPED:
                continue
            cells.append((command, mistake))
            cases.append({"argv": [*argv, "--config", str(config)], "env": env | extra, "cwd": str(tmp),
                          "timeout": 60, "group": n % 2})
    done = subprocess.run([sys.executable, "-m", "tests.cli_table"], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=900, check=True, cwd=Path(__file__).resolve().parents[1])
    results = dict(zip(cells, map(json.loads, done.stdout.splitlines()), strict=True))
    return tmp, results, before, _snapshot(*(root for c in copies for root in c.values()))


def _last_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip()]
    return lines[-1] if lines else ""


def test_every_command_gives_a_mistake_one_answer(table):
    """Exit 2 and one line on stderr saying what to set, for every command and every mistake; no traceback,
    no internal error, nothing on stdout but `run`'s JSON log. The table is printed (pytest -s)."""
    tmp, results, _, _ = table
    wrong = []
    rows = {}
    for (command, mistake), r in results.items():
        needle = MISTAKES[mistake][2].replace("{tmp}", str(tmp))
        line = _last_line(r["stderr"])
        expected = 0 if (command.split()[0], mistake) in NOT_A_MISTAKE else 2
        rows.setdefault(mistake, {})[command] = r["code"]
        ok = r["code"] == expected and not r["timedOut"] and "Traceback" not in r["stderr"] \
            and "internal error" not in r["stderr"]
        if expected == 2:
            ok = ok and line.startswith(("reputd: error: ", "reputd: config error: ")) and needle in line
            ok = ok and all(x.startswith("{") for x in r["stdout"].splitlines())
        if not ok:
            wrong.append(f"{command} / {mistake}: exit {r['code']}{' (timed out)' * r['timedOut']}, expected "
                         f"{expected}; stderr {r['stderr'][-600:]!r}")
    slowest = sorted(results.items(), key=lambda kv: -kv[1]["seconds"])[:8]
    print("\nslowest:", ", ".join(f"{c} / {m} {r['seconds']} s" for (c, m), r in slowest))
    commands = list(next(iter(rows.values())))
    print("\n| mistake | " + " | ".join(commands) + " |")
    for mistake, codes in rows.items():
        print(f"| {mistake} | " + " | ".join(str(codes.get(c, "-")) for c in commands) + " |")
    assert not wrong, "\n".join(wrong)


def test_no_command_writes_anything_on_a_mistake(table):
    """The store copies' files, the outputs of the writing commands, are as they were."""
    _, _, before, after = table
    assert after == before


def test_the_same_mistake_reads_the_same_in_every_command(table):
    """Not only the exit code: the line that names the setting is one line, in `run` as in `verify` (`handoff`
    adds that it changed nothing of the broker's, as all its refusals do); a store root that is not there is one
    line in `run` and `produce` too, and says when it is the built-in default."""
    _, results, _, _ = table
    for mistake in ("commitlog size left out", "dledger commitlog size left out",
                    "dledger store without the dledger keys", "plain store with the dledger keys",
                    "index sizes left out", "store root missing", "store root left out"):
        answers = {_last_line(r["stderr"]).split(" (config: ")[0].removesuffix("; nothing was changed")
                   for (command, m), r in results.items() if m == mistake and command.split()[0] != "inspect"}
        assert len(answers) == 1, (mistake, answers)
