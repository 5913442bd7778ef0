"""The documentation stays in the repository and the README stays short.

README.md under 12 KB with its sections; every relative link in every Markdown file resolves
to a file (and heading) inside the repository; no file points outside it (``../shared``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_LIMIT = 12_000  # bytes
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = ("../shared", "/work/shared")


def _files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return [REPO / name for name in out if name and (REPO / name).is_file()]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_readme_is_short_and_has_its_sections():
    readme = REPO / "README.md"
    size = readme.stat().st_size
    assert size < README_LIMIT, f"README.md is {size} bytes; move detail into docs/ (limit {README_LIMIT})"
    text = readme.read_text()
    for heading in ("## The two commands", "## Quick start", "## Documentation", "## Troubleshooting"):
        assert heading in text, heading
    troubleshooting = text.split("## Troubleshooting", 1)[1]
    assert "docs/troubleshooting.md" in troubleshooting
    for command in ("make test", "make demo"):
        assert command in text


def test_docs_keep_the_controller_signals_table():
    text = (REPO / "docs" / "algorithm.md").read_text()
    section = text.split("## Controller signals", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in section.splitlines() if line.startswith("|"))
    assert "signal" in header and "cost" in header
    rows = [
        line.split("|")[1].strip()
        for line in section.splitlines()
        if line.startswith("|") and not line.startswith("|---") and line != header
    ]
    assert "`train` (default)" in rows and "`probe`" in rows


def test_links_stay_inside_the_repository():
    bad = []
    for path in _files():
        if (
            path.suffix not in (".md", ".py", ".sh", ".txt", ".toml", ".cfg", ".yml", ".yaml", "")
            and path.name != "Dockerfile"
        ):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(REPO)
        if rel == Path("tests/test_docs.py"):
            continue
        for needle in OUTSIDE:
            if needle in text:
                bad.append(f"{rel}: mentions {needle}")
        if path.suffix != ".md":
            continue
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):  # http(s):, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if REPO not in dest.parents and dest != REPO:
                bad.append(f"{rel}: link {target} leaves the repository")
            elif not dest.exists():
                bad.append(f"{rel}: link {target} points to a missing file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{rel}: link {target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, "\n".join(bad)


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `code` heading (x)\n")
    assert _anchors(page) == {"title", "a-code-heading-x"}
    assert LINK.findall("see [a](../shared/DESIGN.md) and ![img](x.png) [b](docs/x.md#y)") == [
        "../shared/DESIGN.md",
        "docs/x.md#y",
    ]
