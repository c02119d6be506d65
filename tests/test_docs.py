"""The documentation: the README stays a short front page whose links work, and the manual
under docs/ builds with `mkdocs build --strict` (no broken link or anchor, no orphan page)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# [text](target) outside fenced code blocks; images too (a leading "!" is not captured).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def prose(path: Path) -> str:
    """The file's text without its fenced code blocks."""
    return FENCE.sub("", path.read_text())


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings."""
    return {github_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose(path), re.M)}


def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    """The site builds with every mkdocs warning (broken link or anchor, page not in the nav) fatal."""
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"


def test_readme_is_a_short_front_page() -> None:
    """Under 260 lines, and its quick start is the two make targets."""
    text = README.read_text()
    assert len(text.splitlines()) < 260, f"README.md has {len(text.splitlines())} lines"
    quick = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.M | re.S)
    assert quick, "README.md has no '## Quick start' section"
    assert "make demo" in quick.group(1) and "make test" in quick.group(1)


def test_readme_links_resolve() -> None:
    """Every relative link in README.md names an existing file, and a heading if it has an anchor."""
    broken = []
    for target in LINK.findall(prose(README)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (ROOT / path).resolve() if path else README
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, "broken links in README.md:\n" + "\n".join(broken)


def nav_pages(nav: Any) -> set[str]:
    """Every page file named in an mkdocs nav, however nested."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(nav_pages(value) for value in nav.values()))
    return set()


def test_every_docs_page_is_in_the_nav() -> None:
    """Each page directly under docs/ is listed in mkdocs.yml's nav, and the nav names no missing page."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    pages = {p.name for p in DOCS.glob("*.md")}
    assert not pages - listed, f"docs pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert not listed - pages, f"mkdocs.yml's nav names missing pages: {sorted(listed - pages)}"
