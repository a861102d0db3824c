"""The layers a configuration is built from, each replacing the one before key by key: defaults < YAML file
< ``REPUTD_*`` environment variables < explicit overrides (the command line); `load_config` and which file
a command reads (`config_path`)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any

from daemon.config.keys import (
    _DERIVED_DEFAULTS,
    _DISPATCHERS_ENV,
    _DISPATCHERS_SECTION,
    _ENV_KEYS,
    _JAVA_INT_MAX,
    _KEY_LIST,
    _KEYS,
    _NULL_AS_EMPTY,
    _SECTION_CLASSES,
    _STRING_KINDS,
    _Key,
)
from daemon.config.model import (
    BUILTIN_DISPATCHERS,
    CONFIG_ENV,
    DEFAULT_CONFIG_FILE,
    ENV_IGNORED,
    ENV_PREFIX,
    ROOT_DIR_PLACEHOLDER,
    Config,
    ConfigError,
    DispatcherSpec,
    StoreConfig,
)
from daemon.config.validate import (
    _broker_only,
    _describe,
    _error,
    _parse_dispatchers,
    _Setting,
    _split_names,
    _suggest,
    _validate,
)
from daemon.config.yamlfile import _parse_env_yaml, _read_yaml
from indexcore.indexfile import index_file_size

_PLACEHOLDER = re.compile(r"\{[A-Za-z_]\w*\}", re.ASCII)


class _Layers:
    """Accumulates validated settings; later layers replace earlier ones key by key."""

    def __init__(self, cwd: str) -> None:
        self.settings: dict[_Key, _Setting] = {}
        for key in _KEY_LIST:
            where = (key.section, key.name)
            if where in _DERIVED_DEFAULTS:
                default = _DERIVED_DEFAULTS[where]
            else:
                default = next(f.default for f in fields(_SECTION_CLASSES[key.section]) if f.name == key.attr)
            self.settings[key] = _Setting(default, cwd, "")
        self.dispatchers = tuple(DispatcherSpec(name, MappingProxyType({})) for name in BUILTIN_DISPATCHERS)
        # Plug-ins the config file names. A plug-in is code to import, so only the file (trusted input) may
        # name one; the environment and overrides may only choose among these and the built-ins.
        self.file_plugins: dict[str, DispatcherSpec] = {}

    def set(self, key: _Key, value: Any, base_dir: str, origin: str) -> None:
        self.settings[key] = _Setting(_validate(key, value, origin), base_dir, origin)

    def apply_file(self, data: Any, source: str) -> None:
        if data is None:
            return
        if not isinstance(data, Mapping):
            raise ConfigError(
                "", f"{source}: the top level must be a mapping of sections, got {_describe(data)}"
            )
        origin = f"in {source}"
        base_dir = os.path.dirname(source)
        sections = [*_SECTION_CLASSES, _DISPATCHERS_SECTION]
        for section, body in data.items():
            if section == _DISPATCHERS_SECTION:
                self.dispatchers = _parse_dispatchers(body, origin)
                self.file_plugins = {d.name: d for d in self.dispatchers if d.name not in BUILTIN_DISPATCHERS}
                continue
            if section not in _SECTION_CLASSES:
                owner = next((k.section for k in _KEY_LIST if k.name == section), None)
                hint = (
                    f"; {section!r} belongs under '{owner}:'" if owner else _suggest(str(section), sections)
                )
                raise _error(str(section), f"unknown section{hint}", origin)
            if body is None:
                continue
            if not isinstance(body, Mapping):
                raise _error(section, f"expected a mapping of keys, got {_describe(body)}", origin)
            for name, value in body.items():
                key = _KEYS.get((section, name))
                if key is None and _broker_only(section, name, value, origin):
                    continue
                if key is None:
                    known = [k.name for k in _KEY_LIST if k.section == section]
                    raise _error(f"{section}.{name}", f"unknown key{_suggest(str(name), known)}", origin)
                # the DLedger ids broker.conf leaves unset (Java null)
                self.set(key, "" if value is None and key.name in _NULL_AS_EMPTY else value, base_dir, origin)

    def apply_env(self, env: Mapping[str, str], cwd: str) -> None:
        for var in sorted(env):
            if not var.startswith(ENV_PREFIX) or var in ENV_IGNORED:
                continue
            raw = env[var]
            origin = f"from {var}"
            if var == _DISPATCHERS_ENV:
                self.dispatchers = self._known_plugins_only(
                    _parse_dispatchers(_split_names(_parse_env_yaml(var, var, raw)), origin), origin)
                continue
            key = _ENV_KEYS.get(var)
            if key is None:
                known = [*_ENV_KEYS, _DISPATCHERS_ENV]
                raise ConfigError(
                    var, f"environment variable names no configuration key{_suggest(var, known)}"
                )
            value = raw if key.kind in _STRING_KINDS else _parse_env_yaml(key.dotted, var, raw)
            self.set(key, value, cwd, origin)

    def apply_overrides(self, overrides: Mapping[str, Any], cwd: str) -> None:
        origin = "from overrides"
        for dotted, value in overrides.items():
            if value is None:
                continue
            if dotted == _DISPATCHERS_SECTION:
                self.dispatchers = self._known_plugins_only(_parse_dispatchers(_split_names(value), origin), origin)
                continue
            section, _, name = dotted.partition(".")
            key = _KEYS.get((section, name))
            if key is None:
                known = [k.dotted for k in _KEY_LIST] + [_DISPATCHERS_SECTION]
                raise ConfigError(dotted, f"unknown override key{_suggest(dotted, known)}")
            parsed = os.fspath(value) if isinstance(value, os.PathLike) else value
            if isinstance(value, str) and key.kind not in _STRING_KINDS:
                parsed = _parse_env_yaml(dotted, "override", value)
            self.set(key, parsed, cwd, origin)

    def _known_plugins_only(self, specs: tuple[DispatcherSpec, ...], origin: str) -> tuple[DispatcherSpec, ...]:
        """A dispatcher list from the environment or an override: built-ins, and plug-ins only as the config
        file names them (with the file's options). Anything else would let an environment variable or a
        flag make reputd import code, so it is refused (exit 2) and nothing is imported."""
        out = []
        for index, spec in enumerate(specs):
            if spec.name in BUILTIN_DISPATCHERS:
                out.append(spec)
                continue
            named = self.file_plugins.get(spec.name)
            if named is None:
                raise _error(
                    f"{_DISPATCHERS_SECTION}[{index}]",
                    f"plug-in {spec.name!r} is not named in the config file's dispatchers: list; a plug-in is "
                    "code to import, so only the config file may name one (here, only built-ins "
                    f"{', '.join(BUILTIN_DISPATCHERS)} and the file's plug-ins can be chosen)",
                    origin,
                )
            out.append(named)
        return tuple(out)

    def build(self, source: str | None) -> Config:
        kwargs: dict[str, dict[str, Any]] = {section: {} for section in _SECTION_CLASSES}
        for key, setting in self.settings.items():
            kwargs[key.section][key.attr] = setting.value
        root = self._path(_KEYS[("store", "storePathRootDir")], root=None)
        kwargs["store"]["store_path_root_dir"] = root
        commit_log = self._commit_log(_KEYS[("store", "storePathCommitLog")], root)
        kwargs["store"]["store_path_commit_log"] = commit_log
        out_key = _KEYS[("output", "dir")]
        kwargs["output"]["dir"] = root if self.settings[out_key].value is None else self._path(out_key, root)
        built = {section: cls(**kwargs[section]) for section, cls in _SECTION_CLASSES.items()}
        self._check_index_size(built["store"])
        self._check_dledger(built["store"])
        defaulted = frozenset(key.dotted for key, setting in self.settings.items() if not setting.origin)
        return Config(dispatchers=self.dispatchers, source=source, defaulted=defaulted, **built)

    def _check_dledger(self, store: StoreConfig) -> None:
        """DLedger mode needs dLegerSelfId (it names the data directory, dledger-<selfId>), and the node must be
        one of dLegerPeers (`id-host:port;...`, MemberState) when they are given."""
        if not store.enable_d_leger_commit_log:
            return
        self_key = _KEYS[("store", "dLegerSelfId")]
        if not store.d_leger_self_id.strip():
            raise _error(self_key.dotted, "must be set with enableDLegerCommitLog: true (the data path is "
                                          "<storePathRootDir>/dledger-<dLegerSelfId>/data)",
                         self.settings[self_key].origin)
        if store.d_leger_peers.strip():
            ids = [peer.split("-")[0].strip() for peer in store.d_leger_peers.split(";") if peer.strip()]
            if store.d_leger_self_id not in ids:
                raise _error(self_key.dotted, f"{store.d_leger_self_id!r} is not one of the dLegerPeers "
                                              f"({', '.join(ids) or 'none'})", self.settings[self_key].origin)

    def _check_index_size(self, store: StoreConfig) -> None:
        size = index_file_size(store.max_hash_slot_num, store.max_index_num)
        if size > _JAVA_INT_MAX:
            key = _KEYS[("store", "maxIndexNum")]
            raise _error(
                key.dotted,
                f"an IndexFile of {store.max_hash_slot_num} slots and {store.max_index_num} entries would be "
                f"{size} bytes, over the broker's 2 GiB file limit",
                self.settings[key].origin,
            )

    def _path(self, key: _Key, root: str | None, text: str | None = None) -> str:
        setting = self.settings[key]
        text = setting.value if text is None else text
        if root is not None:
            text = text.replace(ROOT_DIR_PLACEHOLDER, root)
        leftover = _PLACEHOLDER.search(text)
        if leftover:
            if root is None:
                allowed = "; no placeholders are substituted in this key"
            else:
                allowed = f"; only {ROOT_DIR_PLACEHOLDER} is substituted"
            raise _error(key.dotted, f"unknown placeholder {leftover[0]}{allowed}", setting.origin)
        return os.path.normpath(os.path.join(setting.base_dir, os.path.expanduser(text.strip())))

    def _commit_log(self, key: _Key, root: str) -> str:
        setting = self.settings[key]
        dirs: list[str] = []
        for part in setting.value.split(","):
            if not part.strip():
                raise _error(key.dotted, f"empty directory in {setting.value!r}", setting.origin)
            resolved = self._path(key, root, part)
            if resolved in dirs:
                raise _error(key.dotted, f"directory {resolved} is listed twice", setting.origin)
            dirs.append(resolved)
        return ",".join(dirs)


def load_config(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    memo: bool = False,
) -> Config:
    """Load and validate the configuration.

    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment. ``overrides`` maps dotted keys
    (``"store.storePathRootDir"``, or ``"dispatchers"``) to values and wins over everything; a None value
    means "not given", so CLI flags can be passed straight through. Relative paths in the file are resolved
    against the file's directory, all others (defaults included) against the current directory. ``memo``
    lets the file's parsed text come from daemon/config/memo.py (commands that import no plug-ins only).
    """
    cwd = os.getcwd()
    layers = _Layers(cwd)
    source = None
    if path is not None:
        source = os.path.abspath(os.path.expanduser(os.fspath(path)))
        layers.apply_file(_read_yaml(source, memo=memo), source)
    layers.apply_env(os.environ if env is None else env, cwd)
    if overrides:
        layers.apply_overrides(overrides, cwd)
    return layers.build(source)


def config_path(explicit: str | None, env: Mapping[str, str], cwd: str) -> tuple[str | None, str]:
    """Which config file a command reads, and why: `--config FILE`, else $REPUTD_CONFIG, else
    ./config/reputd.yaml when the current directory has one (a checkout, after `make run`), else none,
    which means the built-in defaults (the broker's own default sizes)."""
    if explicit:
        return explicit, "--config"
    if env.get(CONFIG_ENV):
        return env[CONFIG_ENV], f"from {CONFIG_ENV}"
    candidate = os.path.join(cwd, DEFAULT_CONFIG_FILE)
    if os.path.isfile(candidate):
        return candidate, f"{DEFAULT_CONFIG_FILE} in the current directory"
    return None, f"no --config, {CONFIG_ENV} or ./{DEFAULT_CONFIG_FILE}"


def default_config() -> Config:
    """All defaults, ignoring the environment; paths resolve against the current directory."""
    return load_config(None, env={})
