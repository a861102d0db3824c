"""The documentation holds to the code: the generated configuration page, the README's links, the mkdocs nav, and
the version written in one place (issue 30, items 3 and 4)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from daemon.config import keys as config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """The anchors GitHub and mkdocs give a Markdown file's headings (outside fenced code)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def test_the_configuration_page_is_the_one_the_key_table_generates():
    """docs/configuration.md's key reference is what tools/config_reference.py writes from daemon/config/keys.py's
    key table, so a key added, removed or re-checked without regenerating the page fails here."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "config_reference.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    page = (DOCS / "configuration.md").read_text()
    for key in config._KEY_LIST:
        assert f"### `{key.dotted}`" in page, key.dotted
        assert f"`{config.env_var_name(key.section, key.name)}`" in page, key.dotted


def test_the_key_reference_says_each_comment_once_with_its_example():
    """Keys that share one comment in config/reputd.yaml (the dLeger* keys, the s3* keys, ...) get their headings
    together and the comment once; a section's opening comment stands under the section, not inside its first
    key's text; a key the file shows commented out keeps its example (`output.dir` ended on "Set it to rebuild
    into a separate directory:" with the example dropped)."""
    page = (DOCS / "configuration.md").read_text().split("<!-- Generated below", 1)[1]
    paragraphs = [p.strip() for p in re.sub(r"^```.*?^```", "", page, flags=re.MULTILINE | re.DOTALL).split("\n\n")
                  if p.strip() and not p.lstrip().startswith(("#", "|"))]
    assert [p for p in set(paragraphs) if paragraphs.count(p) > 1] == []
    section, shown = "", []
    for line in (ROOT / "config" / "reputd.yaml").read_text().splitlines():
        if m := re.match(r"(\w+):", line):
            section = m[1]
        elif (m := re.match(r"  # (\w+): \S", line)) and (section, m[1]) in config._KEYS:
            shown.append((section, line[4:]))
    assert ("output", "dir: ../var/rebuilt") in shown
    for section, line in shown:
        assert f"```yaml\n{section}:\n  {line}\n```" in page, line
    for section in {k.section for k in config._KEY_LIST}:
        after = page.split(f"## `{section}:`\n\n", 1)[1]
        first_key = next(k for k in config._KEY_LIST if k.section == section)
        assert after.startswith(f"### `{first_key.dotted}`") or not after.startswith("#"), section
    groups = {"store.dLegerSelfId": "store.enableDLegerCommitLog", "backfill.s3SecretAccessKey": "backfill.s3Endpoint"}
    for key, leader in groups.items():
        headings = re.search(rf"### `{re.escape(leader)}`\n\n(?:### `[\w.]+`\n\n)*", page)
        assert headings, leader
        assert f"### `{key}`" in headings[0], key


def test_a_stale_configuration_page_is_reported(tmp_path, monkeypatch):
    """--check exits 1 and names the command when the page and the key table disagree."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import config_reference
    finally:
        sys.path.remove(str(ROOT / "tools"))
    stale = tmp_path / "configuration.md"
    stale.write_text((DOCS / "configuration.md").read_text().replace("`store.maxIndexNum`", "`store.maxIndexNumber`"))
    monkeypatch.setattr(config_reference, "PAGE", stale)
    assert config_reference.main(["--check"]) == 1
    assert config_reference.main([]) == 0
    assert stale.read_text() == (DOCS / "configuration.md").read_text()


def test_the_readme_is_a_short_document_whose_links_resolve():
    """The README stays a user's first ten minutes (at most ~350 lines), and every relative link in it names a
    file that exists and, with an anchor, a heading of that file (mkdocs checks docs/ itself, not the README)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    targets = [t for t in LINK.findall(text) if not t.startswith(("http://", "https://"))]
    assert any(t.startswith("docs/") for t in targets)
    for target in targets:
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else README
        assert file.is_file(), target
        if anchor:
            assert anchor in anchors(file.read_text()), target


def test_every_source_path_the_docs_name_exists():
    """A module the pages name by path is there (docs/recovery.md named daemon/dledgerfollow.py and
    daemon/dledgerfence.py after they moved to daemon/engine/)."""
    source = r"`((?:daemon|indexcore|tools|bench|tests)/[\w/-]+\.py|(?:config|systemd)/[\w./-]+)`"
    named = {m for page in [README, *DOCS.glob("*.md")] for m in re.findall(source, page.read_text())}
    assert len(named) > 20
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def test_every_docs_page_is_in_the_mkdocs_nav():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = {page for entry in nav for page in entry.values()}
    assert listed == {p.name for p in DOCS.glob("*.md")}


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"(docs/{page.name})" in text, page.name


def test_the_version_is_written_once_and_read_everywhere():
    """pyproject.toml holds the version; `reputd --version` and daemon.__version__ read it; no module writes a
    version of its own. It says which release an operator has: the changelog's newest release, or, while
    [Unreleased] lists changes, a development version of the next release (`0.2.0.dev0`, which pip orders
    after 0.1.0 and before 0.2.0): 0.1.0 was printed by builds that held DLedger mode and `handoff`."""
    import daemon

    assert daemon.__version__ == VERSION
    done = subprocess.run([str(Path(sys.executable).parent / "reputd"), "--version"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, f"reputd {VERSION}\n")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d[^\]]*)\]", changelog, re.MULTILINE)
    assert releases, "CHANGELOG.md names no release"
    unreleased = changelog.split("## [Unreleased]", 1)[1].split(f"## [{releases[0]}]", 1)[0]
    if re.search(r"^- ", unreleased, re.MULTILINE):
        m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)\.dev\d+", VERSION)
        assert m, f"[Unreleased] lists changes: the version must be the next release's .devN, not {VERSION}"
        newest = tuple(int(x) for x in releases[0].split("."))
        assert tuple(int(x) for x in m.groups()) > newest, (VERSION, releases[0])
    else:
        assert releases[0] == VERSION
    for path in [*ROOT.glob("daemon/**/*.py"), *ROOT.glob("indexcore/**/*.py")]:
        # a version of its own, not a keyword that ends in one (`data_page_version="2.0"`)
        assert not re.search(r"""__version__\s*=|\bversion\s*=\s*["']\d""", path.read_text()), path


def test_a_source_tree_never_installed_reads_the_version_from_pyproject(tmp_path):
    """Without installed metadata (the package on PYTHONPATH, run isolated from the venv's site-packages),
    daemon.__version__ is still pyproject.toml's."""
    done = subprocess.run([sys.executable, "-S", "-c", "import daemon; print(daemon.__version__)"],
                          capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert (done.returncode, done.stdout.strip()) == (0, VERSION), done.stderr
