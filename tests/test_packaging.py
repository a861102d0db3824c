"""The deployment files — systemd/reputd.service, Dockerfile, .dockerignore — checked without systemd or a
container engine: parsed here and held against the config, the CLI and the repository's files. The image's
HEALTHCHECK command is run for real against a local HTTP server and a real daemon; `systemd-analyze` checks
the unit when it is installed."""

from __future__ import annotations

import errno
import glob
import http.server
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from daemon.cli import EXIT_USAGE, build_parser
from daemon.cli.backfill import IMAGE_ENV, RUNTIME_IMAGE, backfill_import_error
from daemon.config import load_config
from daemon.ops import healthcheck as image_healthcheck
from daemon.ops.metrics import DOWN, HEALTH_PATH
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "reputd.service"
SYSTEMD_README = ROOT / "docs" / "systemd.md"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CONFIG = ROOT / "config" / "reputd.yaml"

CONFIG_IN_IMAGE = "/etc/reputd/reputd.yaml"
RUNTIME_UID = "10001"


# --- a systemd unit file parser (systemd.syntax(7)): sections of key -> list of values --------------------

def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def timespan_seconds(value: str) -> float:
    """A systemd time span (systemd.time(7)) in seconds: "30s", "1min 30s", "500ms", or bare seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit or "s"]
    assert total > 0 or value.strip() == "0", f"unparsed time span {value!r}"
    return total


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(unit, section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= is missing"
    return values[-1]


# --- a Dockerfile parser: stages of (instruction, arguments) ----------------------------------------------

@dataclass
class Stage:
    name: str | None
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            continue  # comments, also between continuation lines, are dropped by the builder
        if not stripped and not pending:
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(name, base))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, args))
    return stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


def stage(stages: list[Stage], name: str) -> Stage:
    found = [s for s in stages if s.name == name]
    assert len(found) == 1, f"expected one stage named {name!r}"
    return found[0]


def chain(stages: list[Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, outermost ancestor first."""
    out = [stage(stages, name)]
    while any(s.name == out[0].base for s in stages):
        out.insert(0, stage(stages, out[0].base))
    return out


def instructions(stages: list[Stage], name: str, keyword: str) -> list[str]:
    return [args for s in chain(stages, name) for args in s.all(keyword)]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"not exec (JSON array) form: {args}"
    assert value, "empty exec form"
    assert all(isinstance(v, str) for v in value)
    return value


def env_of(stages: list[Stage], name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in instructions(stages, name, "ENV"):
        for word in shlex.split(args):
            key, sep, value = word.partition("=")
            assert sep, f"use ENV key=value, not the legacy 'ENV key value': {args}"
            env[key] = value
    return env


def healthcheck(stages: list[Stage], name: str) -> tuple[dict[str, str], list[str]]:
    checks = instructions(stages, name, "HEALTHCHECK")
    assert checks, f"no HEALTHCHECK in stage {name}"
    m = re.fullmatch(r"((?:--[\w-]+=\S+\s+)*)CMD\s+(.+)", checks[-1], re.DOTALL)
    assert m, f"HEALTHCHECK is not 'HEALTHCHECK [OPTIONS] CMD [...]': {checks[-1]}"
    options = dict(opt[2:].split("=", 1) for opt in m.group(1).split())
    return options, exec_form(m.group(2))


def copies(stages: list[Stage]) -> Iterator[tuple[Stage, dict[str, str], list[str], str]]:
    """Every COPY/ADD as (stage, --flags, sources, destination)."""
    for s in stages:
        for keyword in ("COPY", "ADD"):
            for args in s.all(keyword):
                words = shlex.split(args)
                flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
                paths = [w for w in words if not w.startswith("--")]
                assert len(paths) >= 2, f"{keyword} {args}"
                yield s, flags, paths[:-1], paths[-1]


# --- .dockerignore, matched the way the builder matches it ------------------------------------------------

def dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        i = 0
        while i < len(line):
            if line.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif line.startswith("**", i):
                regex += ".*"
                i += 2
            elif line[i] == "*":
                regex += "[^/]*"
                i += 1
            elif line[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(line[i])
                i += 1
        patterns.append((negate, re.compile(regex)))
    return patterns


def dockerignored(relpath: str) -> bool:
    """Whether the builder leaves `relpath` out of the context (a match on a parent directory counts)."""
    parts = relpath.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, pattern in dockerignore_patterns():
        if any(pattern.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


# --- the systemd unit -------------------------------------------------------------------------------------

def test_unit_is_a_notify_service_with_watchdog(unit):
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert 10 <= timespan_seconds(one(unit, "Service", "WatchdogSec")) <= 300
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_unit_execstart_runs_the_daemon_from_the_readme_venv(unit):
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    assert argv == ["/opt/reputd/bin/reputd", "run", "--config", CONFIG_IN_IMAGE]
    readme = SYSTEMD_README.read_text()
    venv = os.path.dirname(os.path.dirname(argv[0]))
    assert f"-m venv {venv}\n" in readme, "docs/systemd.md must install the venv the unit runs"
    assert f"{venv}/bin/pip install --no-cache-dir ." in readme
    assert f"install -m 0640 -o root -g reputd config/reputd.yaml {argv[3]}" in readme
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.config) == ("run", CONFIG_IN_IMAGE)


def test_unit_restarts_on_failure_but_not_on_config_errors(unit):
    assert one(unit, "Service", "Restart") == "on-failure"
    assert timespan_seconds(one(unit, "Service", "RestartSec")) >= 1
    assert str(EXIT_USAGE) in one(unit, "Service", "RestartPreventExitStatus").split()
    # The rate limit only works in [Unit]; systemd ignores it (with a warning) in [Service].
    assert "StartLimitIntervalSec" not in unit["Service"]
    assert timespan_seconds(one(unit, "Unit", "StartLimitIntervalSec")) >= 60
    assert 1 <= int(one(unit, "Unit", "StartLimitBurst")) <= 10


def test_unit_stop_timeout_exceeds_the_shutdown_timeout(unit):
    shutdown_s = load_config(CONFIG, env={}).reput.shutdown_timeout_ms / 1000
    assert shutdown_s == 10
    assert timespan_seconds(one(unit, "Service", "TimeoutStopSec")) > shutdown_s + 5
    assert timespan_seconds(one(unit, "Service", "TimeoutStartSec")) > timespan_seconds(
        one(unit, "Service", "WatchdogSec"))


def test_unit_runs_as_a_dedicated_user(unit):
    assert one(unit, "Service", "User") == "reputd"
    assert one(unit, "Service", "Group") == "reputd"
    assert "DynamicUser" not in unit["Service"]
    text = UNIT.read_text()
    assert "useradd --system" in text
    assert "DynamicUser" in text  # the trade-off is explained
    assert "useradd --system" in SYSTEMD_README.read_text()


def test_unit_sandbox(unit):
    expected = {
        "ProtectSystem": "strict", "NoNewPrivileges": "yes", "PrivateTmp": "yes", "ProtectHome": "yes",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes", "LockPersonality": "yes",
    }
    assert {k: one(unit, "Service", k) for k in expected} == expected
    assert set(one(unit, "Service", "RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert unit["Service"]["CapabilityBoundingSet"] == [""]
    assert int(one(unit, "Service", "LimitNOFILE")) >= 65536


def test_unit_gives_way_to_the_broker(unit):
    """A sidecar's manners (issue 28 §6): below-default CPU and I/O weight and priority, picked first by the
    OOM killer, throttled above a memory mark rather than killed at one, no IPC left behind, and network on
    loopback only, where the metrics endpoint binds by default; each setting sized in docs/systemd.md."""
    assert 1 < int(one(unit, "Service", "CPUWeight")) < 100
    assert 1 < int(one(unit, "Service", "IOWeight")) < 100
    assert int(one(unit, "Service", "Nice")) > 0
    assert one(unit, "Service", "IOSchedulingClass") == "best-effort"
    assert int(one(unit, "Service", "IOSchedulingPriority")) == 7
    assert 0 < int(one(unit, "Service", "OOMScoreAdjust")) <= 1000
    assert re.fullmatch(r"\d+[KMG]", one(unit, "Service", "MemoryHigh"))
    assert "MemoryMax" not in unit["Service"]
    assert one(unit, "Service", "RemoveIPC") == "yes"
    assert one(unit, "Service", "IPAddressDeny") == "any"
    assert one(unit, "Service", "IPAddressAllow") == "localhost"
    assert load_config(CONFIG, env={}).metrics.host == "127.0.0.1"
    readme = SYSTEMD_README.read_text()
    for key in ("CPUWeight", "IOWeight", "Nice", "OOMScoreAdjust", "MemoryHigh", "RemoveIPC", "IPAddressAllow"):
        assert f"`{key}=" in readme, key


def test_unit_paths_match_the_config_they_are_documented_with(unit):
    # The unit's own commented examples give the store root and output dir; resolve them the way the daemon
    # does and check the sandbox opens exactly those: CommitLog read-only, output read-write.
    examples = dict(re.findall(r"^#Environment=(REPUTD_\w+)=(\S+)$", UNIT.read_text(), re.MULTILINE))
    config = load_config(CONFIG, env=examples)  # also proves every example names a real config key
    assert config.metrics.port == 9108
    read_only = [p.lstrip("-") for p in one(unit, "Service", "ReadOnlyPaths").split()]
    assert list(config.store.commit_log_dirs) == read_only == ["/data/rocketmq/store/commitlog"]
    read_write = one(unit, "Service", "ReadWritePaths").split()
    assert read_write == [config.output.dir] == ["/var/lib/reputd"]
    assert f"/var/lib/{one(unit, 'Service', 'StateDirectory')}" == config.output.dir
    mounts = one(unit, "Unit", "RequiresMountsFor").split()
    assert config.store.store_path_root_dir in mounts
    assert config.output.dir in mounts
    # The live environment must not silently override the config file: all REPUTD_ examples stay comments.
    assert not [e for e in unit["Service"].get("Environment", []) if e.startswith("REPUTD_")]


def _unit_with_existing_binary(tmp_path: Path) -> Path:
    """The unit, with ExecStart pointing at an executable that exists here (reputd is not under /opt)."""
    shim = tmp_path / "reputd"
    shim.write_text("#!/bin/sh\nexit 0\n")
    shim.chmod(0o755)
    copy = tmp_path / "reputd.service"
    copy.write_text(UNIT.read_text().replace("/opt/reputd/bin/reputd", str(shim)))
    return copy


def _systemd_analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60, check=False)


def test_systemd_analyze_verify(tmp_path):
    require_tool("systemd-analyze", "systemd", "the unit's directives are still checked by the tests above")
    copy = _unit_with_existing_binary(tmp_path)
    result = _systemd_analyze("--man=no", "verify", str(copy))
    assert result.returncode == 0, result.stderr
    assert not [line for line in (result.stdout + result.stderr).splitlines() if "reputd" in line], result.stderr

    # The shipped file as is: the only complaint allowed is the binary missing from this machine.
    result = _systemd_analyze("--man=no", "verify", str(UNIT))
    if os.access("/opt/reputd/bin/reputd", os.X_OK):
        assert result.returncode == 0, result.stderr
    else:
        complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        assert complaints
        assert all("/opt/reputd/bin/reputd is not executable" in line for line in complaints), complaints

    # And it does read the file: a bad directive in the same unit is reported.
    broken = tmp_path / "broken.service"
    broken.write_text(copy.read_text().replace("Type=notify", "Type=notify\nWatchdogSec=soon\nBogusKey=1"))
    result = _systemd_analyze("--man=no", "verify", str(broken))
    output = result.stdout + result.stderr
    assert "BogusKey" in output, output
    assert "soon" in output, output


def test_systemd_analyze_security_exposure(tmp_path):
    require_tool("systemd-analyze", "systemd", "the unit's exposure was not rated")
    result = _systemd_analyze("security", "--offline=yes", "--no-pager", str(_unit_with_existing_binary(tmp_path)))
    if result.returncode != 0 and "offline" in result.stderr:
        pytest.skip(f"this systemd-analyze has no offline security check: {result.stderr.strip()}")
    m = re.search(r"Overall exposure level for reputd\.service: (\d+(?:\.\d+)?)", result.stdout)
    assert m, result.stdout + result.stderr
    assert float(m.group(1)) <= 3.0, result.stdout  # systemd rates <= 1.9 "OK" and <= 4.9 "MEDIUM"


# --- the Dockerfile ---------------------------------------------------------------------------------------

def test_docker_build_without_target_gives_the_daemon(stages):
    assert [s.name for s in stages][-1] == "runtime"
    assert {"build", "runtime", "backfill"} <= {s.name for s in stages}
    assert all(s.name for s in stages), "every stage is named, so --target works for each"


def test_docker_base_image_is_python_311_slim_bookworm(stages):
    names = {s.name for s in stages}
    external = {s.base for s in stages if s.base not in names}
    assert external == {"python:3.11-slim-bookworm"}


def test_docker_runtime_user_is_not_root(stages):
    for target in ("runtime", "backfill"):
        users = instructions(stages, target, "USER")
        assert users, f"{target} runs as root"
        user = users[-1].split(":")[0]
        assert user not in {"root", "0"}
        assert user == RUNTIME_UID
    runs = " ".join(instructions(stages, "runtime", "RUN"))
    assert f"useradd --system --uid {RUNTIME_UID}" in runs
    assert f"--gid {RUNTIME_UID}" in runs


def test_docker_entrypoint_and_cmd_are_exec_form(stages):
    assert exec_form(instructions(stages, "runtime", "ENTRYPOINT")[-1]) == ["reputd"]
    cmd = exec_form(instructions(stages, "runtime", "CMD")[-1])
    assert cmd == ["run", "--config", CONFIG_IN_IMAGE]
    args = build_parser().parse_args(cmd)
    assert (args.command, args.config) == ("run", CONFIG_IN_IMAGE)
    assert exec_form(instructions(stages, "backfill", "ENTRYPOINT")[-1]) == ["reputd"]
    assert exec_form(instructions(stages, "backfill", "CMD")[-1])[0] == "backfill"
    # The config the CMD names is the repository's default config, copied into the image.
    assert any(src == ["config/reputd.yaml"] and dest == CONFIG_IN_IMAGE and s in chain(stages, "runtime")
               for s, _, src, dest in copies(stages))


def test_docker_expose_matches_the_default_metrics_port(stages):
    port = yaml.safe_load(CONFIG.read_text())["metrics"]["port"]
    assert instructions(stages, "runtime", "EXPOSE") == [str(port)]
    assert port == image_healthcheck.DEFAULT_PORT
    # The check's own copies of the daemon's names (it does not import daemon.ops.metrics, to start fast).
    assert (image_healthcheck.HEALTH_PATH, image_healthcheck.DOWN) == (HEALTH_PATH, DOWN)
    assert load_config(CONFIG, env={image_healthcheck.PORT_VARIABLE: "19999"}).metrics.port == 19999


def test_docker_volumes_and_environment(stages):
    assert [exec_form(v) for v in instructions(stages, "runtime", "VOLUME")] == [["/store", "/out"]]
    env = env_of(stages, "runtime")
    reputd_env = {k: v for k, v in env.items() if k.startswith("REPUTD_")}
    assert reputd_env == {"REPUTD_STORE_STORE_PATH_ROOT_DIR": "/store", "REPUTD_OUTPUT_DIR": "/out",
                          "REPUTD_METRICS_HOST": "0.0.0.0", IMAGE_ENV: RUNTIME_IMAGE}
    assert env["PATH"].startswith("/opt/reputd/bin:")
    # Those variables, over the config copied into the image, give the paths the volumes provide.
    config = load_config(CONFIG, env=reputd_env)
    assert config.store.store_path_root_dir == "/store"
    assert config.store.commit_log_dirs == ("/store/commitlog",)
    assert config.output.dir == "/out"
    assert (config.metrics.host, config.metrics.port) == ("0.0.0.0", 9108)
    # The volume directories belong to the runtime user, so a fresh named volume is writable by it; so does its
    # cache directory (the user has no home): a backfill's class archive and the queries' memo go there.
    assert "chown reputd:reputd /store /out /cache" in " ".join(instructions(stages, "runtime", "RUN"))
    assert env["XDG_CACHE_HOME"] == "/cache" == env_of(stages, "backfill")["XDG_CACHE_HOME"]
    assert env_of(stages, "backfill")[IMAGE_ENV] == "backfill"


def test_the_backfill_image_holds_its_drivers_class_archive(stages):
    """`jvmClassArchive: auto` in the image: recorded at build time by a local backfill run as the image's user
    (the one that runs containers, so the archive is its own and in its XDG_CACHE_HOME), and checked there."""
    steps = stage(stages, "backfill").instructions
    (at,) = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "reputd backfill" in a]
    recording = steps[at][1]
    assert [a for k, a in steps[:at] if k == "USER"] == [f"{RUNTIME_UID}:{RUNTIME_UID}"]
    assert "--master 'local[1]'" in recording
    assert recording.rstrip().endswith(f"ls {env_of(stages, 'backfill')['XDG_CACHE_HOME']}/reputd/spark-driver-*.jsa")


def test_docker_java_only_in_the_backfill_stage(stages):
    java = re.compile(r"openjdk|\bjre\b|\bjdk\b|\bjava\b", re.IGNORECASE)
    for s in chain(stages, "runtime"):
        for keyword, args in s.instructions:
            assert not java.search(args), f"runtime image pulls in Java: {keyword} {args}"
    backfill_runs = " ".join(stage(stages, "backfill").all("RUN"))
    assert "apt-get install -y --no-install-recommends openjdk-17-jre-headless" in backfill_runs
    assert "rm -rf /var/lib/apt/lists/*" in backfill_runs
    assert "backfill" not in {s.name for s in chain(stages, "runtime")}


def test_docker_installs_the_project_without_test_extras(stages):
    build_runs = " ".join(stage(stages, "build").all("RUN"))
    assert re.findall(r"pip install ([^&;]*?)\s*(?:&&|$)", build_runs) == ["--no-cache-dir ."]
    assert "[" not in build_runs, "no extras: the image gets the runtime dependencies only"
    assert not re.search(r"pip install[^&]* (-e|--editable) ", build_runs)
    # What the build stage installed is what the runtime image runs, less pip and setuptools, which it does not
    # use (about 20 MB): the runtime image copies the virtualenv of a stage built FROM build that removes them.
    venv_copies = [(flags, src, dest) for s, flags, src, dest in copies(stages) if s in chain(stages, "runtime")
                   and "from" in flags]
    assert venv_copies == [({"from": "build-runtime"}, ["/opt/reputd"], "/opt/reputd")]
    assert stage(stages, "build-runtime").base == "build"
    assert not [a for a in instructions(stages, "runtime", "RUN") if "pip install" in a]
    for venv in ("build-runtime", "build-backfill"):
        assert "-m pip uninstall --yes --quiet pip setuptools" in " ".join(stage(stages, venv).all("RUN")), venv


def test_docker_backfill_stage_adds_the_backfill_extra(stages):
    """PySpark is the [backfill] extra: installed in the backfill image only, with pyproject's own spec."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any("pyspark" in d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                   ["dependencies"]), "the daemon image must not carry PySpark"
    runs = " ".join(stage(stages, "build-backfill").all("RUN"))
    specs = [spec for line in re.findall(r'pip install --no-cache-dir ((?:"[^"]+" ?)+)', runs)
             for spec in re.findall(r'"([^"]+)"', line)]
    assert specs == extras["backfill"]
    assert stage(stages, "build-backfill").base == "build"
    venv_copies = [(flags, src, dest) for s, flags, src, dest in copies(stages) if s in chain(stages, "backfill")
                   and "from" in flags]
    assert venv_copies == [({"from": "build-backfill"}, ["/opt/reputd"], "/opt/reputd")]


def test_backfill_in_the_daemon_image_points_at_the_backfill_image(stages, monkeypatch):
    """`reputd backfill` without PySpark says how to get it: in the daemon image (no PySpark, Java or pip),
    the backfill image; elsewhere, the command that installs the extra's requirements into the environment
    running it (`pip install 'reputd[backfill]'` found reputd only with a checkout's own pip)."""
    missing = ImportError("No module named 'pyspark'", name="pyspark")
    monkeypatch.setenv(IMAGE_ENV, env_of(stages, "runtime")[IMAGE_ENV])
    said = backfill_import_error(missing)
    assert "docker build --target backfill" in said
    assert "pip" not in said
    monkeypatch.delenv(IMAGE_ENV)
    said = backfill_import_error(missing)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["backfill"]
    command = said.split(" install them with ", 1)[1].split(" (and Java", 1)[0]
    argv = shlex.split(command)
    assert argv[:4] == [sys.executable, "-m", "pip", "install"]
    def spec(text: str) -> tuple[str, list[str]]:  # "pyspark[sql]<5,>=3.5" (the metadata's) == ">=3.5,<5"
        name, versions = re.fullmatch(r"([\w.\-\[\]]+)(.*)", text.replace(" ", "")).groups()
        return name, sorted(versions.split(","))

    assert sorted(map(spec, argv[4:])) == sorted(map(spec, extras))


def test_docker_copy_sources_exist_and_reach_the_context(stages):
    names = [s.name for s in stages]
    seen = 0
    for s, flags, sources, _dest in copies(stages):
        if "from" in flags:
            assert flags["from"] in names[: names.index(s.name)], f"COPY --from={flags['from']} is not an earlier stage"
            continue
        for source in sources:
            matches = glob.glob(str(ROOT / source))
            assert matches, f"COPY {source}: no such file in the repository"
            assert not dockerignored(source), f"COPY {source} is excluded by .dockerignore"
            seen += 1
    assert seen >= 4
    # The package build reads its readme, so README.md must be in the context, next to pyproject.toml.
    assert "readme" in (ROOT / "pyproject.toml").read_text()


def test_docker_healthcheck_runs_the_packaged_check(stages):
    options, command = healthcheck(stages, "runtime")
    assert command == ["python", "-m", "daemon.healthcheck"]
    # `python` is the image venv's (PATH), which has the daemon package installed.
    assert env_of(stages, "runtime")["PATH"].startswith("/opt/reputd/bin:")
    # urlopen's timeout lets the check print its own line before Docker kills it.
    assert timespan_seconds(options["timeout"]) > image_healthcheck.TIMEOUT_S
    assert timespan_seconds(options["start-period"]) >= 30
    assert int(options["retries"]) >= 1


class _Health(http.server.BaseHTTPRequestHandler):
    answer = (200, {"status": "healthy"})
    paths: list[str] = []  # noqa: RUF012 - shared on purpose: the test reads what the server saw

    def do_GET(self):
        type(self).paths.append(self.path)
        code, body = type(self).answer if self.path == "/healthz" else (404, {"error": "not found"})
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _run_healthcheck(stages: list[Stage], port: int) -> subprocess.CompletedProcess[str]:
    _, command = healthcheck(stages, "runtime")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPUTD_")}
    env["REPUTD_METRICS_PORT"] = str(port)
    return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=30,
                          check=False)


@pytest.mark.parametrize(("code", "body", "healthy", "line"), [
    (200, {"status": "healthy", "reason": "", "reputFromOffset": 1024, "commitLogMaxOffset": 1024},
     True, "healthy (HTTP 200; reputFromOffset 1024, commitLogMaxOffset 1024)"),
    (200, {"status": "degraded", "reason": "corrupt segment skipped"}, True,
     "degraded: corrupt segment skipped (HTTP 200)"),
    (503, {"status": "down", "reason": "CommitLog unavailable: /store/commitlog: no such directory"}, False,
     "down: CommitLog unavailable: /store/commitlog: no such directory (HTTP 503)"),
    (503, {"status": "down"}, False, "down (HTTP 503)"),
    (200, ["not", "a", "health", "answer"], False, "unhealthy: "),
])
def test_docker_healthcheck_command_against_a_live_server(stages, health_server, code, body, healthy, line):
    """Exit 0 while running (healthy, degraded), 1 when down; one line saying why, which Docker keeps in
    State.Health.Log, never a traceback."""
    _Health.answer = (code, body)
    _Health.paths.clear()
    result = _run_healthcheck(stages, health_server)
    assert (result.returncode == 0) is healthy, result.stdout + result.stderr
    assert _Health.paths == ["/healthz"]
    assert result.stdout.startswith(line), result.stdout
    assert result.stdout.count("\n") == 1
    assert result.stderr == ""


def test_docker_healthcheck_command_without_a_server(stages):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]  # bound, never listening: connections are refused
        result = _run_healthcheck(stages, closed_port)
    assert result.returncode == 1
    assert result.stdout == f"unhealthy: no answer from http://127.0.0.1:{closed_port}/healthz: " \
                            f"[Errno {errno.ECONNREFUSED}] Connection refused\n"
    assert result.stderr == ""


def test_docker_healthcheck_against_a_daemon_waiting_for_its_commitlog(stages, tmp_path):
    """The real daemon with no CommitLog directory (in a store root that exists: a missing root is a
    configuration mistake, exit 2) is down (503): the check exits 1 printing the daemon's own reason, which
    names the missing directory."""
    (tmp_path / "store").mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "reputd.yaml"
    config.write_text(yaml.safe_dump({"store": {"storePathRootDir": str(tmp_path / "store")},
                                      "output": {"dir": str(tmp_path / "out")}, "metrics": {"port": port}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPUTD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli", "run", "--config", str(config)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        result = None
        for _ in range(600):
            result = _run_healthcheck(stages, port)
            if "no answer" not in result.stdout:
                break
        assert result is not None
        assert result.returncode == 1, result.stdout
        assert result.stdout.startswith("down: "), result.stdout
        assert str(tmp_path / "store" / "commitlog") in result.stdout
        assert result.stdout.rstrip().endswith("(HTTP 503)")
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, err


# --- .dockerignore ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    ".venv", ".venv/bin/python", ".git", ".git/HEAD", "var/store/commitlog/00000000000000000000",
    ".pytest_cache/v", ".ruff_cache/x", ".hypothesis/examples", "bench/results/run.json",
    "daemon/__pycache__/cli.cpython-311.pyc", "reputd.egg-info/PKG-INFO",
])
def test_dockerignore_excludes(path):
    assert dockerignored(path)


@pytest.mark.parametrize("path", ["pyproject.toml", "setup.py", "README.md", "daemon/cli.py", "indexcore/commitlog.py",
                                  "indexcore/_kernels.c", "config/reputd.yaml", "Dockerfile"])
def test_dockerignore_keeps_the_build_inputs(path):
    assert not dockerignored(path)


def test_dockerignore_comment_names_every_file_the_build_copies(stages):
    comment = " ".join(line for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("#"))
    for s, flags, sources, _ in copies(stages):
        for source in sources if "from" not in flags else ():
            assert source.rstrip("/").split("/")[-1] in comment, f"{source} (COPY in {s.name})"


# --- the documented `docker run` --------------------------------------------------------------------------

def documented_docker_run() -> list[str]:
    """The `docker run` example of the Dockerfile's header, as argv."""
    header = []
    for line in DOCKERFILE.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    text = "\n".join(header)
    m = re.search(r"^docker run .*?(?<!\\)$", text.replace("\\\n", " "), re.MULTILINE)
    assert m, "the Dockerfile's header has no docker run example"
    return shlex.split(m.group(0))


def test_docker_run_example_sets_the_four_sizes_it_calls_required(stages):
    argv = documented_docker_run()
    env = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-e")
    image_env = {k: v for k, v in env_of(stages, "runtime").items() if k.startswith("REPUTD_")}
    config = load_config(CONFIG, env={**image_env, **env})
    demo = load_config(CONFIG, env=image_env)
    names = {"mappedFileSizeCommitLog": "mapped_file_size_commit_log",
             "mappedFileSizeConsumeQueue": "mapped_file_size_consume_queue",
             "maxHashSlotNum": "max_hash_slot_num", "maxIndexNum": "max_index_num"}
    # RocketMQ's defaults, which the example shows, and not the image config's demo sizes
    assert {k: getattr(config.store, v) for k, v in names.items()} == {
        "mappedFileSizeCommitLog": 1073741824, "mappedFileSizeConsumeQueue": 6000000,
        "maxHashSlotNum": 5000000, "maxIndexNum": 20000000}
    assert getattr(demo.store, names["mappedFileSizeCommitLog"]) != 1073741824
    assert "/store:ro" in " ".join(argv)
    assert argv[-1] == "reputd"


def test_docker_docs_say_podman_needs_the_docker_format():
    header = DOCKERFILE.read_text()
    assert "--format docker" in header
    assert "--format docker" in (ROOT / "README.md").read_text()
    assert "--format docker" in (ROOT / "docs" / "operations.md").read_text()
