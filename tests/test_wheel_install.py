"""The package as users get it: an sdist of this tree, the wheel built from it, installed into a fresh
virtualenv outside the source tree, and that install's `reputd` run on a conformance store from there.

`make` installs the project editable, which imports from the source tree and so hides any module the
wheel leaves out (as `daemon.backfill` once was). Only reputd itself is installed into the new venv, with
--no-deps: its dependencies (numpy, PySpark, ...) are links to the test venv's own copies, so the test
needs no network and no 300 MB PySpark install; `pip check` holds them to the wheel's requirements.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.cli import OWN_PACKAGES
from daemon.engine.checkpoint import CHECKPOINT_FILE
from daemon.ops.outlock import LOCK_FILE
from tests.conformance import discover, files_under

ROOT = Path(__file__).resolve().parent.parent
STORES = discover()
PIP_TIMEOUT_S = 600
RUN_TIMEOUT_S = 300


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    deps: Path  # the dependency links, one per top-level entry of the test venv's site-packages
    site_packages: Path
    work: Path  # the working directory of every command: outside the source tree

    @property
    def reputd(self) -> str:
        return str(self.venv / "bin" / "reputd")

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")


def _run(argv: list[str], cwd: Path, timeout: int = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPUTD_", "PYTHON"))}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _checked(argv: list[str], cwd: Path, timeout: int = PIP_TIMEOUT_S) -> str:
    result = _run(argv, cwd, timeout)
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _source_copy(dest: Path) -> Path:
    """The files a release is made from: what git tracks (with their working-tree content), else the tree
    without local environments and caches."""
    listed = _run(["git", "ls-files", "-z"], ROOT, 60) if shutil.which("git") else None
    if listed is not None and listed.returncode == 0 and listed.stdout:
        for rel in filter(None, listed.stdout.split("\0")):
            src = ROOT / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:
        shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "var", "*.so"))
    return dest


def _link_dependencies(deps: Path, hidden: tuple[str, ...] = ()) -> None:
    """Link every top-level entry of the test venv's site-packages into `deps`, except reputd's own
    (packages, metadata, the editable install's hooks) and the distributions named in `hidden`."""
    own = {*OWN_PACKAGES, "reputd"}
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        stem = entry.name.split("-")[0].split(".")[0].lower()
        if stem in own or entry.name.startswith("__editable__") or stem in hidden or entry.suffix == ".pth":
            continue
        target = deps / entry.name
        if not target.exists():
            target.symlink_to(entry)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    # The sdist first, then the wheel from it, as `python -m build` does: a file the sdist lacks fails here.
    # --no-build-isolation: the build requirements are in the test extra (checked below), so nothing is fetched.
    sdist = _checked([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                      "print(b.build_sdist(sys.argv[1]))", str(tmp / "sdist")], src).strip().splitlines()[-1]
    with tarfile.open(tmp / "sdist" / sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    _checked([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
              "--wheel-dir", str(tmp / "dist"), str(unpacked)], tmp)
    (wheel,) = (tmp / "dist").glob("reputd-*.whl")

    venv = tmp / "venv"
    _checked([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp)
    _checked([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
              "--no-deps", "--no-index", str(wheel)], tmp)
    site_packages = Path(_checked([str(venv / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).strip())
    deps = tmp / "deps"
    deps.mkdir()
    _link_dependencies(deps)
    (site_packages / "reputd-test-dependencies.pth").write_text(f"{deps}\n")
    work = tmp / "work"
    work.mkdir()
    return Installed(wheel, venv, deps, site_packages, work)


def test_build_requirements_are_in_the_test_extra():
    """The wheel is built without build isolation, so the test extra must carry what the build needs."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    test_extra = pyproject["project"]["optional-dependencies"]["test"]
    assert set(pyproject["build-system"]["requires"]) <= set(test_extra)


def test_wheel_holds_every_package_of_the_source_tree(installed):
    """Every package directory under daemon/ and indexcore/ is in the wheel, with the compiled kernels."""
    packages = sorted(str(p.parent.relative_to(ROOT)) for name in OWN_PACKAGES
                      for p in (ROOT / name).rglob("__init__.py") if "__pycache__" not in p.parts)
    assert "daemon/backfill" in packages
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
    assert [p for p in packages if f"{p}/__init__.py" not in names] == []
    sources = sorted(str(p.relative_to(ROOT)) for name in OWN_PACKAGES for p in (ROOT / name).rglob("*.py"))
    assert [s for s in sources if s not in names] == []
    assert [n for n in names if n.startswith("indexcore/_kernels.") and n.endswith(".so")]
    assert "daemon/backfill/log4j2.properties" in names  # the backfill driver's logging, read by its JVM
    assert not [n for n in names if n.split("/")[0] in {"tests", "bench"}]


def test_installed_reputd_imports_from_the_venv_not_the_source_tree(installed):
    out = _checked([installed.python, "-c", "import daemon, daemon.backfill, indexcore._kernels as k; "
                    "print(daemon.__file__); print(k.__file__)"], installed.work)
    for path in out.split():
        assert Path(path).is_relative_to(installed.site_packages), out
    # The wheel's requirements are met by what it sees (pip itself comes from the linked dependencies).
    check = _run([installed.python, "-m", "pip", "check"], installed.work)
    assert not [line for line in check.stdout.splitlines() if line.lower().startswith("reputd ")], check.stdout
    assert "Traceback" not in check.stderr, check.stderr
    help_text = _checked([installed.reputd, "--help"], installed.work)
    for command in ("run", "rebuild", "backfill", "query", "inspect", "produce"):
        assert command in help_text
    print(f"installed {installed.wheel.name}: {out.split()[0]}")


@pytest.fixture(scope="module")
def store():
    if not STORES:
        pytest.skip("no conformance store found (REPUTD_CONFORMANCE_DIR or ../shared/conformance)")
    return STORES[0]


@pytest.fixture(scope="module")
def rebuilt(installed, store, tmp_path_factory) -> tuple[Path, Path]:
    """`reputd rebuild` of the installed package into an empty output; (config, output dir)."""
    tmp = tmp_path_factory.mktemp("installed-rebuild")
    config = store.make_workspace(tmp)
    out = tmp / "rebuilt"
    result = _run([installed.reputd, "rebuild", "--config", str(config), "--out", str(out)], installed.work)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    print(f"installed reputd rebuild: {result.stdout.strip().splitlines()[-1]}")
    return config, out


def test_installed_rebuild_writes_the_brokers_consume_queues(rebuilt, store):
    _, out = rebuilt
    assert files_under(out / "consumequeue") == files_under(store.store / "consumequeue")
    assert list(files_under(out / "index").values()) == list(files_under(store.store / "index").values())


def _output(path: Path) -> dict[str, bytes]:
    """The files a command wrote, without the writers' lock file (it names the process that held it) and the
    checkpoint (a rebuild ends with one; a backfill does not)."""
    return {k: v for k, v in files_under(path).items() if k not in (LOCK_FILE, CHECKPOINT_FILE)}


def _java_or_skip() -> None:
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        pytest.skip("no Java runtime (JAVA_HOME or java on PATH): `reputd backfill` needs one")


def test_installed_backfill_builds_the_rebuilds_files(installed, rebuilt, tmp_path):
    _java_or_skip()
    config, out = rebuilt
    backfilled = tmp_path / "backfilled"
    result = _run([installed.reputd, "backfill", "--config", str(config), "--out", str(backfilled),
                   "--master", "local[1]", "--conf", "spark.ui.enabled=false"], installed.work)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "No module named" not in result.stderr
    assert "log4j" not in result.stderr  # the installed logging file was found: neither Spark's nor an error
    assert _output(backfilled) == _output(out)
    print(f"installed reputd backfill: {result.stdout.strip().splitlines()[-1]}")


def test_installed_backfill_without_pyspark_says_to_install_the_extra(installed, rebuilt, tmp_path):
    """A daemon-only install (no [backfill] extra): exit 1, one line naming PySpark and the extra."""
    config, _ = rebuilt
    pth = installed.site_packages / "reputd-test-dependencies.pth"
    without = tmp_path / "deps-without-pyspark"
    without.mkdir()
    _link_dependencies(without, hidden=("pyspark", "py4j"))
    pth.write_text(f"{without}\n")
    try:
        result = _run([installed.reputd, "backfill", "--config", str(config), "--out", str(tmp_path / "out")],
                      installed.work)
    finally:
        pth.write_text(f"{installed.deps}\n")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "needs PySpark" in lines[0]
    assert "No module named 'pyspark'" in lines[0]
    assert f"{installed.python} -m pip install 'pyspark[sql]" in lines[0]  # into this environment, from anywhere
    assert _output(tmp_path / "out") == {}


def test_installed_backfill_missing_its_own_module_says_the_install_is_broken(installed, rebuilt, tmp_path):
    """PySpark is there but the install lacks daemon.backfill (what the wheel once shipped): the message
    names the missing module and a reinstall, not PySpark."""
    config, _ = rebuilt
    package = installed.site_packages / "daemon" / "backfill"
    aside = installed.site_packages / "daemon-backfill.aside"
    package.rename(aside)
    try:
        result = _run([installed.reputd, "backfill", "--config", str(config), "--out", str(tmp_path / "out")],
                      installed.work)
    finally:
        aside.rename(package)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "No module named 'daemon.backfill'" in lines[0]
    assert "installation is incomplete" in lines[0]
    assert "reinstall reputd" in lines[0]
    assert "needs PySpark" not in lines[0]
