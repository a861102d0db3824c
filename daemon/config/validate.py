"""Validation of one value against its key, with the dotted key and where the value came from in the error;
the dispatchers list (built-ins and `package.module:Class` plug-ins)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from daemon.config.keys import (
    _DISPATCHERS_SECTION,
    _KINDS,
    _UNSUPPORTED_WHY,
    BROKER_RUNTIME_STORE_KEYS,
    UNSUPPORTED_STORE_SETTINGS,
    _Key,
)
from daemon.config.model import (
    BUILTIN_DISPATCHERS,
    ConfigError,
    DispatcherSpec,
    _camel_to_snake,
)

_PLUGIN_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", re.ASCII)


def _broker_only(section: str, name: Any, value: Any, origin: str) -> bool:
    """Whether a store key is a recognised broker setting that reputd ignores; refuses unsupported values."""
    if section != "store" or not isinstance(name, str):
        return False
    if name in UNSUPPORTED_STORE_SETTINGS:
        default = UNSUPPORTED_STORE_SETTINGS[name]
        if value != default and value not in ("", [], "false"):
            raise _error(f"store.{name}", f"only {default!r} is supported: {_UNSUPPORTED_WHY[name]}", origin)
        return True
    if name in BROKER_RUNTIME_STORE_KEYS:
        if isinstance(value, Mapping | list | tuple):
            raise _error(f"store.{name}", f"expected a scalar broker setting, got {_describe(value)}", origin)
        return True
    return False


class _Setting(NamedTuple):
    value: Any
    base_dir: str
    origin: str


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _error(key: str, message: str, origin: str) -> ConfigError:
    return ConfigError(key, f"{message} ({origin})" if origin else message)


def _validate(key: _Key, value: Any, origin: str) -> Any:
    expected, label = _KINDS[key.kind]
    wrong_type = not isinstance(value, expected) or (key.kind == "int" and isinstance(value, bool))
    if wrong_type:
        raise _error(key.dotted, f"expected {label}, got {_describe(value)}", origin)
    if key.kind in ("path", "paths") and not value.strip():
        raise _error(key.dotted, "must not be empty", origin)
    for check in key.checks:
        problem = check(value)
        if problem:
            raise _error(key.dotted, problem, origin)
    return value


def _suggest(word: str, candidates: list[str]) -> str:
    by_snake = {_camel_to_snake(c): c for c in candidates}
    if word in by_snake:
        return f"; did you mean {by_snake[word]!r}?"
    import difflib  # noqa: PLC0415 - only for a message about a mistyped key

    close = difflib.get_close_matches(word, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, set | frozenset):
        return frozenset(value)
    return value


def _parse_dispatchers(raw: Any, origin: str) -> tuple[DispatcherSpec, ...]:
    if not isinstance(raw, list | tuple) or not raw:
        raise _error(
            _DISPATCHERS_SECTION, f"expected a non-empty list of dispatchers, got {_describe(raw)}", origin
        )
    specs: list[DispatcherSpec] = []
    for index, item in enumerate(raw):
        key = f"{_DISPATCHERS_SECTION}[{index}]"
        name_key = key
        options: Any = {}
        if isinstance(item, Mapping):
            for extra in item:
                if extra not in ("name", "options"):
                    raise _error(
                        f"{key}.{extra}", "unknown key; a dispatcher entry has 'name' and 'options'", origin
                    )
            if "name" not in item:
                raise _error(f"{key}.name", "missing", origin)
            name_key = f"{key}.name"
            name = item["name"]
            options = {} if item.get("options") is None else item["options"]
            if not isinstance(options, Mapping):
                raise _error(f"{key}.options", f"expected a mapping, got {_describe(options)}", origin)
            if not all(isinstance(k, str) for k in options):
                raise _error(f"{key}.options", "option names must be strings", origin)
        elif isinstance(item, str):
            name = item
        else:
            raise _error(
                key,
                f"expected a dispatcher name or a mapping with name/options, got {_describe(item)}",
                origin,
            )
        if not isinstance(name, str):
            raise _error(name_key, f"expected a string, got {_describe(name)}", origin)
        if name not in BUILTIN_DISPATCHERS and not _PLUGIN_NAME.fullmatch(name):
            raise _error(
                name_key,
                f"{name!r} is neither a built-in dispatcher ({', '.join(BUILTIN_DISPATCHERS)}) "
                "nor a plug-in class written as package.module:Class",
                origin,
            )
        if name in BUILTIN_DISPATCHERS and any(s.name == name for s in specs):
            raise _error(name_key, f"{name!r} is listed twice; it would write the same files twice", origin)
        specs.append(DispatcherSpec(name, _freeze(options)))
    return tuple(specs)


def _split_names(raw: Any) -> Any:
    """Let an env var or CLI flag give dispatchers as 'consumequeue,index' instead of a YAML list."""
    if isinstance(raw, str):
        return [part.strip() for part in raw.split(",")]
    return raw
