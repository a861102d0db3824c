"""Where a local backfill's driver JVM finds or records its class-data archive (daemon/backfill/jvm.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from daemon.backfill.driver import check_java
from daemon.backfill.jvm import ARCHIVE_AUTO, ARCHIVE_OFF, ClassArchive, choose_archive, default_archive_dir
from daemon.config import ConfigError, load_config

JAVA = "/no/such/java"  # the digest takes what it can read; no JVM is started here


def test_auto_records_an_archive_in_the_cache_directory_then_maps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = choose_archive(ARCHIVE_AUTO, JAVA, "-XX:TieredStopAtLevel=1")
    assert first.saving
    assert os.path.dirname(first.path) == str(tmp_path / "reputd") == default_archive_dir()
    assert f"-XX:ArchiveClassesAtExit={first.temporary}" in first.java_options()
    assert first.temporary != first.path  # written aside, moved into place once the JVM has exited
    with open(first.path, "wb") as f:
        f.write(b"archive")
    again = choose_archive(ARCHIVE_AUTO, JAVA, "-XX:TieredStopAtLevel=1")
    assert again == ClassArchive(first.path, saving=False)
    assert f"-XX:SharedArchiveFile={first.path}" in again.java_options()
    # other JVM options, another archive: one archive fits the options it was made with
    assert choose_archive(ARCHIVE_AUTO, JAVA, "-Xmx1g").path != first.path


def test_the_same_pyspark_in_another_environment_gets_an_archive_of_its_own(tmp_path, monkeypatch):
    """An archive records the class path: a JVM whose jars are in another directory does not map it (the JVM
    said "Required classpath entry does not exist" only with cds logging on), so every backfill run from a
    second virtualenv with the same PySpark and Java started without one."""
    import pyspark

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = choose_archive(ARCHIVE_AUTO, JAVA, "-XX:TieredStopAtLevel=1")
    other = tmp_path / "other-venv" / "pyspark"
    (other / "jars").mkdir(parents=True)
    for entry in os.scandir(os.path.join(os.path.dirname(pyspark.__file__), "jars")):
        with open(other / "jars" / entry.name, "wb") as f:  # same names and sizes, sparse
            f.truncate(entry.stat().st_size)
    monkeypatch.setattr(pyspark, "__file__", str(other / "__init__.py"))
    elsewhere = choose_archive(ARCHIVE_AUTO, JAVA, "-XX:TieredStopAtLevel=1")
    assert elsewhere.path != here.path
    assert os.path.dirname(elsewhere.path) == os.path.dirname(here.path)


def test_the_same_jars_installed_again_get_an_archive_of_their_own(tmp_path, monkeypatch):
    """The JVM maps an archive only over jars of the modification times it was recorded with: the same
    PySpark installed again in the same place (a virtualenv made anew) is another archive, not one the JVM
    refuses at every start."""
    import pyspark

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    venv = tmp_path / "venv" / "pyspark"
    (venv / "jars").mkdir(parents=True)
    for name, size in (("spark-core.jar", 100), ("slf4j-api.jar", 10)):
        with open(venv / "jars" / name, "wb") as f:
            f.truncate(size)
    monkeypatch.setattr(pyspark, "__file__", str(venv / "__init__.py"))
    first = choose_archive(ARCHIVE_AUTO, JAVA, "-XX:TieredStopAtLevel=1")
    assert choose_archive(ARCHIVE_AUTO, JAVA, "-XX:TieredStopAtLevel=1").path == first.path  # nothing changed
    jar = venv / "jars" / "slf4j-api.jar"
    os.utime(jar, ns=(jar.stat().st_atime_ns, jar.stat().st_mtime_ns + 1_000_000_000))  # installed again
    assert choose_archive(ARCHIVE_AUTO, JAVA, "-XX:TieredStopAtLevel=1").path != first.path


def test_an_empty_archive_is_recorded_again(tmp_path):
    path = tmp_path / "driver.jsa"
    path.touch()
    assert choose_archive(str(path), JAVA, "") == ClassArchive(str(path), saving=True)


def test_a_recording_that_died_leaves_no_temporary_archive_behind(tmp_path):
    """A backfill killed while recording leaves `NAME.PID.tmp`; the next recording removes it, not the
    temporary archive of one still running (this process) nor other files."""
    path = tmp_path / "driver.jsa"
    dead = subprocess.Popen(["true"])
    dead.wait()
    abandoned = tmp_path / f"driver.jsa.{dead.pid}.tmp"
    running = tmp_path / f"driver.jsa.{os.getpid()}.tmp"
    other = tmp_path / "notes.tmp"
    for f in (abandoned, running, other):
        f.write_bytes(b"x")
    assert choose_archive(str(path), JAVA, "").saving
    assert not abandoned.exists()
    assert running.exists()
    assert other.exists()


def test_off_and_a_directory_that_cannot_be_made_mean_no_archive(tmp_path):
    told = []
    assert choose_archive(ARCHIVE_OFF, JAVA, "", lambda *why: told.append(why)) is None
    assert told == []  # off is not a failure
    (tmp_path / "a-file").write_text("")
    assert choose_archive(str(tmp_path / "a-file" / "driver.jsa"), JAVA, "", lambda *why: told.append(why)) is None
    assert told == [(str(tmp_path / "a-file"), "not a directory")]


def test_a_backfill_says_once_that_auto_has_no_cache_directory(tmp_path, monkeypatch):
    """A user without a home and without XDG_CACHE_HOME (a container image's) made `auto` give up silently: every
    backfill paid the JVM's whole start. The backfill says so once, before Spark starts, naming the directory."""
    import structlog

    from daemon.backfill import job
    from indexcore.writer import CommitLogWriter, Message

    class SparkWouldStartHere(Exception):
        pass

    def create_context(*args):
        raise SparkWouldStartHere

    store = tmp_path / "store"
    with CommitLogWriter(str(store / "commitlog"), 1 << 20) as writer:
        writer.append(Message("T", 0, b"body", {"KEYS": "k"}))
    config = tmp_path / "reputd.yaml"
    config.write_text(f"store: {{storePathRootDir: {store}, mappedFileSizeCommitLog: {1 << 20}}}\n"
                      f"output: {{dir: {tmp_path / 'out'}}}\n")
    (tmp_path / "no-home").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-home" / ".cache"))
    monkeypatch.setattr(job, "create_context", create_context)
    with structlog.testing.capture_logs() as logs, pytest.raises(SparkWouldStartHere):
        job.backfill(load_config(config, env={}), master="local[1]")
    told = [e for e in logs if e["event"] == "jvm_class_archive_unavailable"]
    assert [(e["log_level"], e["directory"], e["error"], e["setting"]) for e in told] == [
        ("warning", str(tmp_path / "no-home" / ".cache" / "reputd"), "Not a directory", "auto")]
    assert "XDG_CACHE_HOME" in told[0]["detail"]


def test_an_archive_that_does_not_fit_is_ignored_quietly(tmp_path):
    """A damaged archive (or one of another JVM) is not an error: the JVM starts without it, and says
    nothing on standard output, which `--json` keeps for the summary."""
    damaged = tmp_path / "driver.jsa"
    damaged.write_bytes(os.urandom(64 * 1024))
    options = ClassArchive(str(damaged), saving=False).java_options().split()
    res = subprocess.run([check_java(), *options, "-version"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    assert "version" in res.stderr


@pytest.mark.parametrize("value", ["relative/driver.jsa", "on", ""])
def test_a_bad_setting_is_a_config_error(tmp_path, value):
    config = tmp_path / "reputd.yaml"
    config.write_text(f"backfill:\n  jvmClassArchive: '{value}'\n")
    with pytest.raises(ConfigError, match="jvmClassArchive"):
        load_config(config)


@pytest.mark.parametrize("value", ["auto", "off", "/var/cache/reputd/driver.jsa"])
def test_good_settings_load(tmp_path, value):
    config = tmp_path / "reputd.yaml"
    config.write_text(f"backfill:\n  jvmClassArchive: '{value}'\n")
    assert load_config(config).backfill.jvm_class_archive == value


def test_auto_removes_the_archives_no_backfill_mapped_for_thirty_days(tmp_path, monkeypatch):
    """An archive is 70-160 MB and an upgrade (Java, PySpark, reputd's jobs) leaves the old one behind: mapping
    an archive marks it used (its modification time), and recording a new one removes those of the cache
    directory unused for UNUSED_ARCHIVE_DAYS; not a recent one, not other files, not an archive a path names."""
    import time

    from daemon.backfill import jvm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "reputd"
    cache.mkdir()
    old = time.time() - (jvm.UNUSED_ARCHIVE_DAYS + 1) * 86400
    stale, recent, other = (cache / "spark-driver-0000000000000001.jsa", cache / "spark-driver-2.jsa",
                            cache / "config-1.json")
    for f, when in ((stale, old), (recent, time.time() - 86400), (other, old)):
        f.write_bytes(b"x")
        os.utime(f, (old, when))
    in_use = cache / f"spark-driver-{jvm.install_digest(JAVA, '-Xmx1g')}.jsa"  # recorded long ago
    in_use.write_bytes(b"archive")
    os.utime(in_use, (old, old))
    mapped = choose_archive(ARCHIVE_AUTO, JAVA, "-Xmx1g")  # a backfill maps it: used now
    assert not mapped.saving
    assert os.path.getmtime(mapped.path) > old + 86400
    assert stale.exists()  # nothing removed while only mapping
    recording = choose_archive(ARCHIVE_AUTO, JAVA, "-XX:TieredStopAtLevel=1")
    assert recording.saving
    assert not stale.exists()
    assert recent.exists()
    assert other.exists()
    assert os.path.exists(mapped.path)
    named = tmp_path / "ops" / "spark-driver-named.jsa"  # a path the operator named is never removed
    named.parent.mkdir()
    named.write_bytes(b"x")
    os.utime(named, (old, old))
    assert choose_archive(str(named.parent / "spark-driver-new.jsa"), JAVA, "").saving
    assert named.exists()
