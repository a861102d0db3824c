"""Write the key reference of docs/configuration.md from the key table the configuration is validated against.

    .venv/bin/python tools/config_reference.py           # rewrite the generated part of the page
    .venv/bin/python tools/config_reference.py --check   # exit 1 when the committed page is not what it writes

Each key's name, environment variable, kind, allowed values and default come from daemon/config/keys.py (its
`_KEY_LIST`, the section dataclasses and the derived defaults), so the page cannot name a key the loader
does not take, or miss one it does; what a key does is the comment above it in config/reputd.yaml, the
commented default config. Everything above MARKER in the page is written by hand and left as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.config import keys as config  # noqa: E402 - the checkout's own daemon, whatever is installed

PAGE = ROOT / "docs" / "configuration.md"
EXAMPLE = ROOT / "config" / "reputd.yaml"
MARKER = "<!-- Generated below by tools/config_reference.py from daemon/config/keys.py; do not edit by hand. -->"
_KEY_LINE = re.compile(r"^  (?:# )?([A-Za-z][A-Za-z0-9]*):")
_SECTION_LINE = re.compile(r"^([a-z]+):")


def key_comments(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment block above the key in the commented config; keys listed together under
    one comment (no blank line between them) share it. A key shown commented out (`# dir: ...`) counts."""
    found: dict[tuple[str, str], str] = {}
    section, block, shared = "", [], ""
    for line in text.splitlines():
        if m := _SECTION_LINE.match(line):
            section, block, shared = m.group(1), [], ""
            continue
        if (m := _KEY_LINE.match(line)) and (section, m.group(1)) in config._KEYS:
            shared = " ".join(block) or shared
            found[(section, m.group(1))] = shared
            block = []
            continue
        stripped = line.strip()
        if stripped.startswith("#") and line.startswith("  "):
            block.append(stripped.lstrip("#").strip())
        elif not stripped:
            block, shared = [], ""
    return found


def _checks(key: config._Key) -> str:
    """What the key's checks allow, read from the checks themselves."""
    said = []
    for check in key.checks:
        free = dict(zip(check.__code__.co_freevars, (c.cell_contents for c in check.__closure__ or ()),
                        strict=True))
        if "low" in free:
            high = free["high"]
            said.append(f">= {free['low']}" if high is None else f"{free['low']} to {high}{free['why']}")
        elif "choices" in free:
            said.append("one of " + ", ".join(f"`{c}`" for c in free["choices"]))
        else:
            said.append(_NAMED_CHECKS[check.__name__])
    return "; ".join(said)


# the checks that are plain functions, said in words (a new one without words here fails the generation)
_NAMED_CHECKS = {
    "_cq_multiple": "a multiple of 20 (the ConsumeQueue unit size)",
    "_delay_levels": "space-separated levels, each digits then s, m, h or d",
    "_class_archive": "`auto`, `off` or an absolute path",
    "_non_empty": "not empty",
}


def _default(key: config._Key) -> str:
    if (key.section, key.name) in config._DERIVED_DEFAULTS:
        value = config._DERIVED_DEFAULTS[(key.section, key.name)]
        return "the store root (`store.storePathRootDir`)" if value is None else f"`{value}`"
    field = {f.name: f for f in dataclasses.fields(config._SECTION_CLASSES[key.section])}[key.attr]
    value = field.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return '`""` (empty)' if value == "" else f"`{value}`"


def _escape(text: str) -> str:
    """A comment as Markdown text: `<repo>` is not an HTML tag."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def generate() -> str:
    """The generated part of the page: one table of every key, then what each key does."""
    comments = key_comments(EXAMPLE.read_text(encoding="utf-8"))
    missing = [k.dotted for k in config._KEY_LIST if not comments.get((k.section, k.name))]
    if missing:
        raise SystemExit(f"config_reference: no comment in {EXAMPLE.relative_to(ROOT)} for {', '.join(missing)}")
    out = [MARKER, "", "## Every key", "",
           f"Every key the configuration loader accepts ({len(config._KEY_LIST)}, and the `dispatchers` list, "
           f"`{config._DISPATCHERS_ENV}`), its kind, what values pass its checks and its built-in default. "
           "A value that fails a check is a configuration error naming the key (exit 2).", "",
           "| key | environment variable | kind | allowed | default |", "|---|---|---|---|---|"]
    for key in config._KEY_LIST:
        kind = config._KINDS[key.kind][1]
        out.append(f"| `{key.dotted}` | `{config.env_var_name(key.section, key.name)}` | {kind} "
                   f"| {_checks(key) or 'any'} | {_default(key)} |")
    out += ["", "What each key does is the comment above it in `config/reputd.yaml`, the commented config `make run` "
            "uses (whose values are the demo's where it says so):"]
    section = ""
    for key in config._KEY_LIST:
        if key.section != section:
            section = key.section
            out += ["", f"## `{section}:`"]
        out += ["", f"### `{key.dotted}`", "", _escape(comments[(key.section, key.name)])]
    return "\n".join(out) + "\n"


def page_with(generated: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    head = text.split(MARKER, 1)[0]
    return head.rstrip("\n") + "\n\n" + generated


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page differs")
    args = parser.parse_args(argv)
    wanted = page_with(generate())
    if args.check:
        if PAGE.read_text(encoding="utf-8") != wanted:
            print(f"config_reference: {os.path.relpath(PAGE, ROOT)} is out of date: run tools/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
