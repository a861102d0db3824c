"""Write reputd-rules.yml with your scrape selector and runbook base, as the exporter mixins' `_config` does.

    python3 render_rules.py [--selector 'job="reputd"'] [--runbook-base URL] [--rules reputd-rules.yml]

The rules next to this script are the rendering with the defaults below; every series selector in their
expressions carries DEFAULT_SELECTOR, and every runbook_url starts with DEFAULT_RUNBOOK_BASE followed by
`#`, so rendering is a replacement of those two, checked here (every expression must still name the
selector) and in tests/test_ops_kit.py (promtool loads a rendering with another selector). The header
comment names the selector too, and a rendering says what it was rendered with. Standard library only: run
it with any python3.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DEFAULT_SELECTOR = 'job="reputd"'
DEFAULT_RUNBOOK_BASE = "docs/operations.md"
RULES = Path(__file__).resolve().parent / "reputd-rules.yml"
MATCHER = r'\s*[a-zA-Z_]\w*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
SELECTOR = re.compile(rf"{MATCHER}(?:,{MATCHER})*")
EXPR = re.compile(r"^(\s*expr: )(.*)$", re.MULTILINE)
RUNBOOK = re.compile(r'^(\s*runbook_url: ")' + re.escape(DEFAULT_RUNBOOK_BASE) + "#", re.MULTILINE)


def render(text: str, selector: str = DEFAULT_SELECTOR, runbook_base: str = DEFAULT_RUNBOOK_BASE) -> str:
    """`text` (the shipped rules) with `selector` in every expression and runbook links under `runbook_base`."""
    if not SELECTOR.fullmatch(selector):
        raise ValueError(f"not a list of label matchers: {selector!r} (e.g. 'job=\"reputd\"')")
    selector = selector.strip()

    def expr(m: re.Match) -> str:
        if DEFAULT_SELECTOR not in m.group(2):
            raise ValueError(f"an expression without the selector {DEFAULT_SELECTOR}: {m.group(2)}")
        return m.group(1) + m.group(2).replace(DEFAULT_SELECTOR, selector)

    text = EXPR.sub(expr, text)
    text = RUNBOOK.sub(lambda m: m.group(1) + runbook_base + "#", text)
    if (selector, runbook_base) == (DEFAULT_SELECTOR, DEFAULT_RUNBOOK_BASE):
        return text
    head, groups = text.split("\ngroups:", 1)  # the header comment: the selector it names is the rendering's
    said = (f"# Rendered by render_rules.py --selector '{selector}' --runbook-base '{runbook_base}' "
            "from the shipped rules.\n")
    return said + head.replace(DEFAULT_SELECTOR, selector) + "\ngroups:" + groups


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selector", default=DEFAULT_SELECTOR, help="label matchers of reputd's scrape targets")
    parser.add_argument("--runbook-base", default=DEFAULT_RUNBOOK_BASE,
                        help="where operators read reputd's docs/operations.md (the runbook links add #anchor)")
    parser.add_argument("--rules", type=Path, default=RULES, help="the shipped rules to render")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render(args.rules.read_text(encoding="utf-8"), args.selector, args.runbook_base))
    except (OSError, ValueError) as e:
        print(f"render_rules: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
