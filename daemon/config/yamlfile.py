"""Reading a config file's YAML: PyYAML's safe loader refusing duplicate keys, imported on first use (a
query with a remembered file does without it, daemon/config/memo.py), and YAML values given in
environment variables."""

from __future__ import annotations

from typing import Any

from daemon.config.model import (
    ConfigError,
)

_strict_loader: type | None = None


def _loader() -> type:
    """PyYAML's safe loader, rejecting duplicate keys (which plain PyYAML silently resolves to the last one),
    on LibYAML's parser when PyYAML has it (most builds). Made on first use: importing PyYAML is a third of
    a query's start-up, and a query with a remembered config file (daemon/config/memo.py) does without it."""
    global _strict_loader  # noqa: PLW0603 - one class, made once
    if _strict_loader is None:
        import yaml  # noqa: PLC0415 - see above

        def construct_unique_mapping(loader, node) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = loader.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
            return loader.construct_mapping(node, deep=True)

        loader = type("StrictLoader", (getattr(yaml, "CSafeLoader", yaml.SafeLoader),), {})
        loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_unique_mapping)
        _strict_loader = loader
    return _strict_loader


def _read_yaml(source: str, *, memo: bool = False) -> Any:
    try:
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {source}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"config file {source} is not UTF-8 text: {exc}") from exc
    if memo:
        from daemon.config import memo as configmemo  # noqa: PLC0415 - the query commands only

        found, data = configmemo.recall(source, text)
        if found:
            return data
    import yaml  # noqa: PLC0415 - see _loader

    try:
        data = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = ": ".join(p for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
        raise ConfigError("", f"{where}: invalid YAML: {problem or exc}") from exc
    if memo:
        configmemo.remember(source, text, data)
    return data


def _parse_env_yaml(key: str, var: str, raw: str) -> Any:
    import yaml  # noqa: PLC0415 - see _loader

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"{raw!r} from {var} is not a valid YAML value: {exc}") from exc
