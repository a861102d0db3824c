"""What the YAML parser made of a config file's text, remembered for the next query.

Importing PyYAML costs a `reputd query` about 24 ms, a third of its start-up (most of it one Unicode
regular expression that PyYAML's pure-Python reader compiles at import; reputd parses with LibYAML and
never uses that reader). A config file rarely changes between two queries, so the query and inspect
commands keep, per config file, its exact text and the values the parser gave for it, in
`$XDG_CACHE_HOME/reputd/` (default `~/.cache/reputd/`). A memo is used only when the file's text now is
that text, character for character, so its values are the parser's for this very text; anything else
(another text, no memo, an unreadable or damaged one, values JSON does not carry exactly: keys that are
not strings, dates, bytes) goes to the parser, and the memo is written again when it can be (atomically;
a cache directory that cannot be written just means no memo). Only commands that import no plug-ins use
it, so a memo can never make reputd run code. `MEMO_VERSION` changes when what the loader accepts does.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from collections.abc import Mapping
from typing import Any

MEMO_VERSION = 1
MEMO_DIR_NAME = "reputd"


def memo_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, MEMO_DIR_NAME)


def memo_path(source: str) -> str:
    """The memo of the config file at `source` (an absolute path)."""
    return os.path.join(memo_dir(), f"config-{zlib.crc32(source.encode('utf-8', 'surrogateescape')):08x}.json")


def recall(source: str, text: str) -> tuple[bool, Any]:
    """(True, the parsed values) when the memo of `source` is of exactly `text`; (False, None) otherwise."""
    try:
        with open(memo_path(source), encoding="utf-8") as f:
            memo = json.load(f)
    except (OSError, ValueError):
        return False, None
    if (not isinstance(memo, dict) or memo.get("version") != MEMO_VERSION or memo.get("source") != source
            or memo.get("text") != text or "data" not in memo):
        return False, None
    return True, memo["data"]


def remember(source: str, text: str, data: Any) -> None:
    """Keep `data`, the parser's values for `text`, when JSON carries them exactly; failures are ignored."""
    if not _exact_in_json(data):
        return
    path = memo_path(source)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"version": MEMO_VERSION, "source": source, "text": text, "data": data}, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _exact_in_json(value: Any) -> bool:
    """Whether json.loads(json.dumps(value)) == value, with the same types."""
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_exact_in_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _exact_in_json(v) for k, v in value.items())
    return False


__all__ = ["MEMO_VERSION", "memo_dir", "memo_path", "recall", "remember"]
