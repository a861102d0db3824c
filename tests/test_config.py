from __future__ import annotations

import dataclasses
import os
import pickle
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.config import (
    DELAY_UNIT_MS,
    ENV_PREFIX,
    Config,
    ConfigError,
    DispatcherSpec,
    default_config,
    env_var_name,
    load_config,
    parse_delay_levels,
)

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "config" / "reputd.yaml"


def write(tmp_path: Path, text: str, name: str = "reputd.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_for(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {})
    return info.value


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def test_defaults(tmp_path: Path) -> None:
    """default_config() carries RocketMQ's defaults and resolves paths against the working directory."""
    config = default_config()
    root = str(tmp_path / "var" / "store")
    assert config.store.store_path_root_dir == root
    assert config.store.store_path_commit_log == os.path.join(root, "commitlog")
    assert config.store.commit_log_dirs == (os.path.join(root, "commitlog"),)
    assert config.output.dir == root
    assert config.store.mapped_file_size_commit_log == 1073741824
    assert config.store.mapped_file_size_consume_queue == 6000000
    assert config.store.max_hash_slot_num == 5000000
    assert config.store.max_index_num == 20000000
    assert config.store.message_index_enable is True
    assert config.store.max_msgs_num_batch == 64
    assert config.store.max_message_size == 4194304
    assert config.store.check_crc_on_recover is True
    assert config.store.flush_interval_consume_queue == 1000
    assert config.store.flush_consume_queue_least_pages == 2
    assert config.store.flush_consume_queue_thorough_interval == 60000
    assert config.store.delay_levels_ms[0] == 1000
    assert config.store.delay_levels_ms[-1] == 2 * 3600000
    assert len(config.store.delay_levels_ms) == 18
    assert [d.name for d in config.dispatchers] == ["consumequeue", "index"]
    assert all(dict(d.options) == {} for d in config.dispatchers)
    assert config.reput == dataclasses.replace(config.reput)
    assert (config.reput.poll_interval_ms, config.reput.batch_bytes) == (500, 4194304)
    assert (config.reput.on_corruption, config.reput.shutdown_timeout_ms) == ("stop", 10000)
    assert (config.metrics.enabled, config.metrics.host, config.metrics.port) == (True, "127.0.0.1", 9108)
    assert (config.logging.level, config.logging.format) == ("info", "auto")
    assert config.source is None
    assert config == load_config(None, env={})


def test_config_is_frozen() -> None:
    """Config objects are immutable, plug-in options included, so they can be shared across threads."""
    config = default_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.store.max_index_num = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.dispatchers[0].options["x"] = 1  # type: ignore[index]


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    """An empty file (or one with only empty sections) gives the defaults, with paths relative to the file."""
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    for text in ("", "# nothing\n", "store:\noutput:\n"):
        config = load_config(write(conf_dir, text), env={})
        assert config.store.max_index_num == 20000000
        assert config.store.store_path_root_dir == str(tmp_path / "var" / "store")
        assert config.source == str(conf_dir / "reputd.yaml")


def test_shipped_config_loads_relative_to_its_directory(tmp_path: Path) -> None:
    """config/reputd.yaml loads from any cwd and puts the store at <repo>/var/store with demo sizes."""
    config = load_config(SHIPPED, env={})
    root = str(REPO / "var" / "store")
    assert config.store.store_path_root_dir == root
    assert config.store.commit_log_dirs == (str(REPO / "var" / "store" / "commitlog"),)
    assert config.output.dir == root
    assert config.store.mapped_file_size_commit_log == 67108864
    assert config.store.mapped_file_size_consume_queue == 6000000
    assert config.store.max_index_num == 2000000
    assert config.store.max_hash_slot_num == 500000
    assert config.metrics == dataclasses.replace(config.metrics, host="127.0.0.1", port=9108)
    assert [d.name for d in config.dispatchers] == ["consumequeue", "index"]
    assert config.source == str(SHIPPED)
    defaults = default_config()
    assert config.reput == defaults.reput
    assert config.logging == defaults.logging
    assert config.store.message_delay_level == defaults.store.message_delay_level


def test_shipped_config_mentions_every_key() -> None:
    """Every configuration key appears in the shipped file, so operators can find it there."""
    text = SHIPPED.read_text(encoding="utf-8")
    config = default_config()
    for section in ("store", "output", "reput", "metrics", "logging"):
        for field in dataclasses.fields(getattr(config, section)):
            camel = "".join(
                part if i == 0 else part.capitalize() for i, part in enumerate(field.name.split("_"))
            )
            camel = camel.replace("Crc", "CRC")
            assert f"{camel}:" in text, f"{section}.{camel} is not documented"
    assert "REPUTD_" in text
    assert "trusted" in text.lower()


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("store:\n  maxHashSlotNumber: 5\n", "store.maxHashSlotNumber", "maxHashSlotNum"),
        ("storage:\n  maxHashSlotNum: 5\n", "storage", "unknown section"),
        ("maxIndexNum: 5\n", "maxIndexNum", "store"),
        ("store:\n  maxIndexNum: true\n", "store.maxIndexNum", "boolean"),
        ("store:\n  maxHashSlotNum: '97'\n", "store.maxHashSlotNum", "string"),
        ("store:\n  maxHashSlotNum: 9.5\n", "store.maxHashSlotNum", "number"),
        ("store:\n  messageIndexEnable: 1\n", "store.messageIndexEnable", "boolean"),
        ("store:\n  storePathRootDir: 12\n", "store.storePathRootDir", "path"),
        ("store:\n  storePathRootDir: ''\n", "store.storePathRootDir", "empty"),
        (
            "store:\n  mappedFileSizeConsumeQueue: 1234\n",
            "store.mappedFileSizeConsumeQueue",
            "multiple of 20",
        ),
        ("store:\n  mappedFileSizeConsumeQueue: 0\n", "store.mappedFileSizeConsumeQueue", ">= 1"),
        ("store:\n  mappedFileSizeCommitLog: 4294967296\n", "store.mappedFileSizeCommitLog", "Java int"),
        ("store:\n  maxIndexNum: 1\n", "store.maxIndexNum", ">= 2"),
        ("store:\n  maxIndexNum: 200000000\n", "store.maxIndexNum", "2 GiB"),
        ("store:\n  flushConsumeQueueLeastPages: -1\n", "store.flushConsumeQueueLeastPages", ">= 0"),
        ("store:\n  messageDelayLevel: 1s 5x\n", "store.messageDelayLevel", "'5x'"),
        ("store:\n  messageDelayLevel: ''\n", "store.messageDelayLevel", "no delay levels"),
        ("store:\n  storePathCommitLog: '{storeRoot}/cl'\n", "store.storePathCommitLog", "{storeRoot}"),
        ("store:\n  storePathCommitLog: 'a,,b'\n", "store.storePathCommitLog", "empty directory"),
        ("store:\n  storePathCommitLog: 'a,./a'\n", "store.storePathCommitLog", "twice"),
        ("store: [1, 2]\n", "store", "mapping"),
        ("reput:\n  onCorruption: ignore\n", "reput.onCorruption", "skip-segment"),
        ("reput:\n  pollIntervalMs: 0\n", "reput.pollIntervalMs", ">= 1"),
        ("metrics:\n  port: 0\n", "metrics.port", "0"),
        ("metrics:\n  port: 70000\n", "metrics.port", "65535"),
        ("metrics:\n  host: ''\n", "metrics.host", "empty"),
        ("retention:\n  deleteFilesPerSecond: -1\n", "retention.deleteFilesPerSecond", ">= 0"),
        ("retention:\n  deleteBytesPerSecond: -1\n", "retention.deleteBytesPerSecond", ">= 0"),
        ("logging:\n  level: verbose\n", "logging.level", "debug"),
        ("logging:\n  format: xml\n", "logging.format", "json"),
        ("dispatchers: consumequeue\n", "dispatchers", "list"),
        ("dispatchers: []\n", "dispatchers", "non-empty"),
        ("dispatchers: [consumequeue, indexes]\n", "dispatchers[1]", "package.module:Class"),
        ("dispatchers: [consumequeue, 'my.mod:']\n", "dispatchers[1]", "package.module:Class"),
        ("dispatchers: [consumequeue, 7]\n", "dispatchers[1]", "integer"),
        ("dispatchers: [index, index]\n", "dispatchers[1]", "twice"),
        ("dispatchers:\n  - {options: {}}\n", "dispatchers[0].name", "missing"),
        ("dispatchers:\n  - {name: 'a.b:C', opts: {}}\n", "dispatchers[0].opts", "unknown key"),
        ("dispatchers:\n  - {name: 'a.b:C', options: [1]}\n", "dispatchers[0].options", "mapping"),
        ("dispatchers:\n  - {name: 3}\n", "dispatchers[0].name", "string"),
    ],
)
def test_validation_errors_name_their_key(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    """Each bad value raises ConfigError whose key, and str(), name the dotted key and the file."""
    error = error_for(tmp_path, text)
    assert error.key == key
    assert str(error).startswith(f"{key}: ")
    assert fragment in str(error)
    assert str(tmp_path / "reputd.yaml") in str(error)


def test_cq_size_error_message(tmp_path: Path) -> None:
    """The ConsumeQueue size error explains the 20-byte unit and the value the broker would really use."""
    error = error_for(tmp_path, "store:\n  mappedFileSizeConsumeQueue: 1234\n")
    assert str(error).startswith(
        "store.mappedFileSizeConsumeQueue: 1234 is not a multiple of 20 (the ConsumeQueue unit size)"
    )
    assert "1240" in str(error)


def test_bad_value_in_file_is_an_error_even_if_env_overrides_it(tmp_path: Path) -> None:
    """A broken file is reported even when the environment would replace the broken value."""
    error = error_for(tmp_path, "metrics:\n  port: 0\n", env={"REPUTD_METRICS_PORT": "9200"})
    assert error.key == "metrics.port"


@pytest.mark.parametrize(
    "text",
    ["store:\n  maxIndexNum: [1\n", "store:\n\tmaxIndexNum: 1\n", "store: {storePathRootDir}/x\n"],
)
def test_yaml_syntax_error(tmp_path: Path, text: str) -> None:
    """Malformed YAML raises ConfigError with key '' and the file path (and line) in the message."""
    error = error_for(tmp_path, text)
    assert error.key == ""
    assert str(tmp_path / "reputd.yaml") in str(error)
    assert "invalid YAML" in str(error)


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    """A key given twice in one mapping is rejected instead of silently keeping the last value."""
    error = error_for(tmp_path, "store:\n  maxIndexNum: 4\n  maxIndexNum: 8\n")
    assert error.key == ""
    assert "duplicate key 'maxIndexNum'" in str(error)
    assert ":3:" in str(error)


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    """A file whose top level is a list or scalar is rejected, naming the file."""
    error = error_for(tmp_path, "- store\n")
    assert error.key == ""
    assert "mapping of sections" in str(error)


def test_missing_or_unreadable_file(tmp_path: Path) -> None:
    """A missing file or a directory raises ConfigError with key '' and the path."""
    for path in (tmp_path / "nope.yaml", tmp_path):
        with pytest.raises(ConfigError) as info:
            load_config(path, env={})
        assert info.value.key == ""
        assert str(path) in str(info.value)


def test_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    """Relative paths in the file resolve against its directory, '~' is expanded, and output follows root."""
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    path = write(conf_dir, "store:\n  storePathRootDir: ../data/store\n")
    config = load_config(path, env={})
    assert config.store.store_path_root_dir == str(tmp_path / "data" / "store")
    assert config.output.dir == str(tmp_path / "data" / "store")
    path = write(conf_dir, "store:\n  storePathRootDir: ~/rmq\noutput:\n  dir: out\n")
    config = load_config(path, env={})
    assert config.store.store_path_root_dir == os.path.join(os.path.expanduser("~"), "rmq")
    assert config.output.dir == str(conf_dir / "out")


def test_commit_log_placeholder_and_multi_path(tmp_path: Path) -> None:
    """{storePathRootDir} is substituted and comma-separated CommitLog dirs are each resolved."""
    path = write(
        tmp_path,
        """
        store:
          storePathRootDir: /srv/store
          storePathCommitLog: "{storePathRootDir}/commitlog, /disk2/commitlog ,rel/cl"
        """,
    )
    config = load_config(path, env={})
    dirs = ("/srv/store/commitlog", "/disk2/commitlog", str(tmp_path / "rel" / "cl"))
    assert config.store.commit_log_dirs == dirs
    assert config.store.store_path_commit_log == ",".join(dirs)


def test_commit_log_placeholder_follows_overridden_root(tmp_path: Path) -> None:
    """The default CommitLog path follows a root changed by environment or overrides."""
    config = load_config(None, env={"REPUTD_STORE_STORE_PATH_ROOT_DIR": "/data/store"})
    assert config.store.commit_log_dirs == ("/data/store/commitlog",)
    assert config.output.dir == "/data/store"
    config = load_config(None, env={}, overrides={"store.storePathRootDir": "rel"})
    assert config.store.commit_log_dirs == (str(tmp_path / "rel" / "commitlog"),)


def test_env_overrides_file(tmp_path: Path) -> None:
    """REPUTD_<SECTION>_<KEY> variables beat the file; values are parsed as YAML, paths use the cwd."""
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    path = write(
        conf_dir,
        "store:\n  maxHashSlotNum: 11\n  messageIndexEnable: true\nmetrics:\n  port: 9300\n",
    )
    env = {
        "REPUTD_STORE_MAX_HASH_SLOT_NUM": "97",
        "REPUTD_STORE_MESSAGE_INDEX_ENABLE": "false",
        "REPUTD_STORE_CHECK_CRC_ON_RECOVER": "no",
        "REPUTD_OUTPUT_DIR": "out",
        "REPUTD_REPUT_ON_CORRUPTION": "skip-segment",
        "REPUTD_STORE_STORE_PATH_COMMIT_LOG": "{storePathRootDir}/cl",
        "REPUTD_DISPATCHERS": "index, consumequeue",
        "REPUTD_CONFIG": "/etc/reputd.yaml",
        "UNRELATED": "x",
    }
    config = load_config(path, env=env)
    assert config.store.max_hash_slot_num == 97
    assert config.store.message_index_enable is False
    assert config.store.check_crc_on_recover is False
    assert config.metrics.port == 9300
    assert config.output.dir == str(tmp_path / "out")
    assert config.reput.on_corruption == "skip-segment"
    assert config.store.commit_log_dirs == (str(tmp_path / "var" / "store" / "cl"),)
    assert [d.name for d in config.dispatchers] == ["index", "consumequeue"]


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """With env=None the process environment is used."""
    monkeypatch.setenv("REPUTD_METRICS_PORT", "9200")
    assert load_config(None).metrics.port == 9200


def test_env_values_are_validated() -> None:
    """A bad value from the environment names the dotted key and the variable."""
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"REPUTD_METRICS_PORT": "true"})
    assert info.value.key == "metrics.port"
    assert "REPUTD_METRICS_PORT" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"REPUTD_STORE_MAX_INDEX_NUM": "[1"})
    assert info.value.key == "store.maxIndexNum"


def test_env_typo_is_an_error() -> None:
    """A REPUTD_ variable that names no key is rejected, naming the variable and suggesting the right one."""
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"REPUTD_STORE_MAX_HASH_SLOTS_NUM": "97"})
    assert info.value.key == "REPUTD_STORE_MAX_HASH_SLOTS_NUM"
    assert "REPUTD_STORE_MAX_HASH_SLOT_NUM" in str(info.value)


def test_overrides_beat_env_and_file(tmp_path: Path) -> None:
    """The overrides mapping wins over env and file; None means not given; strings are parsed for ints."""
    path = write(tmp_path, "store:\n  storePathRootDir: /file\nmetrics:\n  port: 1\n")
    env = {"REPUTD_STORE_STORE_PATH_ROOT_DIR": "/env", "REPUTD_METRICS_PORT": "2", "REPUTD_OUTPUT_DIR": "/eo"}
    overrides = {
        "store.storePathRootDir": "/x",
        "output.dir": Path("/y"),
        "metrics.port": "3",
        "reput.batchBytes": None,
        "dispatchers": ["consumequeue"],
    }
    config = load_config(path, env=env, overrides=overrides)
    assert config.store.store_path_root_dir == "/x"
    assert config.store.commit_log_dirs == ("/x/commitlog",)
    assert config.output.dir == "/y"
    assert config.metrics.port == 3
    assert config.reput.batch_bytes == 4194304
    assert [d.name for d in config.dispatchers] == ["consumequeue"]
    assert load_config(path, env=env).store.store_path_root_dir == "/env"
    assert load_config(path, env={}).store.store_path_root_dir == "/file"


def test_unknown_or_bad_override_is_an_error() -> None:
    """An override for an unknown key, or with a bad value, names the key."""
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides={"store.rootDir": "/x"})
    assert info.value.key == "store.rootDir"
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides={"metrics.port": True})
    assert info.value.key == "metrics.port"


def test_plugin_dispatcher_options(tmp_path: Path) -> None:
    """Mapping entries give a plug-in its options as a read-only, deeply frozen mapping."""
    path = write(
        tmp_path,
        """
        dispatchers:
          - consumequeue
          - name: acme.reput.audit:AuditDispatcher
            options: {path: /var/log/a.jsonl, tags: [a, b], nested: {k: 1}}
          - {name: index, options: null}
        """,
    )
    config = load_config(path, env={})
    plugin = config.dispatchers[1]
    assert plugin == DispatcherSpec(
        "acme.reput.audit:AuditDispatcher",
        {"path": "/var/log/a.jsonl", "tags": ("a", "b"), "nested": {"k": 1}},
    )
    assert plugin.options["tags"] == ("a", "b")
    with pytest.raises(TypeError):
        plugin.options["nested"]["k"] = 2  # type: ignore[index]
    assert config.dispatchers[2].name == "index"


def test_config_error_pickles_and_formats() -> None:
    """ConfigError keeps key and message through pickling (multiprocessing) and str() leads with the key."""
    error = pickle.loads(pickle.dumps(ConfigError("metrics.port", "0 must be >= 1")))
    assert (error.key, error.message, str(error)) == (
        "metrics.port",
        "0 must be >= 1",
        "metrics.port: 0 must be >= 1",
    )
    assert str(ConfigError("", "bad file")) == "bad file"


def test_env_var_name() -> None:
    """Env names are REPUTD_ + section + the key in upper snake case, acronyms kept whole."""
    assert ENV_PREFIX == "REPUTD_"
    assert env_var_name("store", "maxHashSlotNum") == "REPUTD_STORE_MAX_HASH_SLOT_NUM"
    assert env_var_name("store", "storePathRootDir") == "REPUTD_STORE_STORE_PATH_ROOT_DIR"
    assert env_var_name("store", "checkCRCOnRecover") == "REPUTD_STORE_CHECK_CRC_ON_RECOVER"
    assert env_var_name("output", "dir") == "REPUTD_OUTPUT_DIR"
    assert env_var_name("reput", "onCorruption") == "REPUTD_REPUT_ON_CORRUPTION"
    assert env_var_name("dispatchers") == "REPUTD_DISPATCHERS"


def test_every_key_has_a_working_env_var() -> None:
    """Each field of each section can be set through its environment variable."""
    config = default_config()
    for section in ("store", "output", "reput", "metrics", "logging"):
        for field in dataclasses.fields(getattr(config, section)):
            var = ENV_PREFIX + section.upper() + "_" + field.name.upper()
            value = getattr(getattr(config, section), field.name)
            text = str(value).lower() if isinstance(value, bool) else str(value)
            assert getattr(load_config(None, env={var: text}), section) == getattr(config, section), var


def test_parse_delay_levels() -> None:
    """Delay levels parse to milliseconds, level 1 first; bad tokens raise ValueError."""
    assert parse_delay_levels("1s 5s 2m 1h 1d") == (1000, 5000, 120000, 3600000, 86400000)
    assert parse_delay_levels("  10s   30s ") == (10000, 30000)
    for bad in ("", "1", "s", "1.5s", "1S", "-1s", "1s,2s", "1 s", "١s"):
        with pytest.raises(ValueError, match=r"delay"):
            parse_delay_levels(bad)


@given(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(sorted(DELAY_UNIT_MS))), min_size=1))
def test_parse_delay_levels_roundtrip(levels: list[tuple[int, str]]) -> None:
    """Any well-formed level string parses to count * unit for each token, in order."""
    spec = " ".join(f"{n}{unit}" for n, unit in levels)
    assert parse_delay_levels(spec) == tuple(n * DELAY_UNIT_MS[unit] for n, unit in levels)


def test_config_type_is_exported() -> None:
    """load_config returns the public Config type."""
    assert isinstance(default_config(), Config)


def test_broker_runtime_store_keys_are_accepted_and_ignored(tmp_path):
    """A store: block copied from broker.conf loads: keys that only govern the broker's runtime are ignored."""
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  flushDiskType: ASYNC_FLUSH\n  haListenPort: 10912\n  brokerRole: SLAVE\n"
                    "  duplicationEnable: false\n  dLegerPeers: null\n  maxHashSlotNum: 97\n"
                    "  deleteConsumeQueueFilesInterval: 100\n")  # retention.* paces reputd's deletions
    config = load_config(path, env={})
    assert config.store.max_hash_slot_num == 97


@pytest.mark.parametrize(("key", "value"), [("enableConsumeQueueExt", "true"),
                                            ("readOnlyCommitLogStorePaths", "/ro/commitlog")])
def test_unsupported_broker_settings_are_refused(tmp_path, key, value):
    """Settings that change what the broker writes are refused unless at their default, naming the key."""
    path = tmp_path / "c.yaml"
    path.write_text(f"store:\n  {key}: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == f"store.{key}"
    path.write_text(f"store:\n  {key}: {'null' if key.startswith('readOnly') else 'false'}\n")
    load_config(path, env={})


def test_misspelt_broker_key_is_still_unknown(tmp_path):
    """Recognising broker keys does not let a typo through."""
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  flushDiskTyp: ASYNC_FLUSH\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == "store.flushDiskTyp"
