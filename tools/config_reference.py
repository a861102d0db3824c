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
_KEY_LINE = re.compile(r"^  (# )?([A-Za-z][A-Za-z0-9]*):")
_SECTION_LINE = re.compile(r"^([a-z]+):")


@dataclasses.dataclass
class Comments:
    """What config/reputd.yaml says: each key's comment (keys listed together under one comment, with no blank
    line between them, share it: `group` maps each key to the first of its group), the example a key shown
    commented out gives (`# dir: ../var/rebuilt`), and each section's opening comment (a comment block right
    below `section:`, ended by a blank line), which is about the section and not about its first key."""

    text: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    group: dict[tuple[str, str], tuple[str, str]] = dataclasses.field(default_factory=dict)
    example: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    intro: dict[str, str] = dataclasses.field(default_factory=dict)


def read_comments(text: str) -> Comments:
    found = Comments()
    section, block, leader, started = "", [], None, False
    for line in text.splitlines():
        if m := _SECTION_LINE.match(line):
            section, block, leader, started = m.group(1), [], None, False
            continue
        if (m := _KEY_LINE.match(line)) and (section, m.group(2)) in config._KEYS:
            key = (section, m.group(2))
            if block or leader is None:
                found.text[key], leader = " ".join(block), key
            else:
                found.text[key] = found.text[leader]
            found.group[key] = leader
            if m.group(1):
                found.example[key] = line.strip().lstrip("#").strip()
            block, started = [], True
            continue
        stripped = line.strip()
        if stripped.startswith("#") and line.startswith("  "):
            block.append(stripped.lstrip("#").strip())
        elif not stripped:
            if block and not started:
                found.intro[section] = " ".join(block)
            block, leader, started = [], None, started or bool(block)
    return found


def key_comments(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment above the key (a group's keys share theirs)."""
    return read_comments(text).text


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
    """The generated part of the page: one table of every key, then what each key does: under each section's
    heading its opening comment, then a heading per key and its comment, said once for keys that share it
    (their headings stand together above it), with the example of a key the file shows commented out."""
    said = read_comments(EXAMPLE.read_text(encoding="utf-8"))
    comments = said.text
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
    keys = config._KEY_LIST
    for i, key in enumerate(keys):
        at = (key.section, key.name)
        if key.section != section:
            section = key.section
            out += ["", f"## `{section}:`"]
            if section in said.intro:
                out += ["", _escape(said.intro[section])]
        out += ["", f"### `{key.dotted}`"]
        following = keys[i + 1] if i + 1 < len(keys) else None
        if following is not None and said.group.get((following.section, following.name)) == said.group[at]:
            continue  # the next key shares this comment: its heading goes here too, the text once after both
        out += ["", _escape(comments[at])]
        examples = [(k, said.example[k]) for k in said.example if said.group[k] == said.group[at]]
        if examples:
            out += ["", "```yaml", f"{section}:", *(f"  {line}" for _, line in examples), "```"]
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
