"""Every relative link in README.md and docs/*.md resolves: the file exists, and a `#anchor` into a markdown
file names one of its headings (GitHub's anchor rule: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    """The page with fenced code blocks and inline code removed (links inside code are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (a repeated heading gets -1, -2, ...)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    targets = LINK.findall(_without_code(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: left out


def test_the_pages_exist_and_hold_links():
    assert (REPO / "README.md").is_file() and len(PAGES) > 10
    assert len(relative_links(REPO / "README.md")) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_anchor_rule():
    page = REPO / "docs" / "bench-vision-real.md"
    assert "surgery--probsurgery-at-seeds-1-and-2-256-per-task-cached-features-2026-12-04" in anchors(page)


TEST_PATH = re.compile(r"\btests/(?:[\w]+/)*test_\w+\.py\b")
NAMING_FILES = [*PAGES, *sorted((REPO / "src" / "featcal").rglob("*.py")), *sorted((REPO / "benchmarks").rglob("*.py"))]


def test_every_test_file_named_in_docs_and_code_exists():
    """A test file named in prose (`tests/calibration/test_prefetch.py`) exists: after tests/ moved into
    folders, five pages and comments still named the old flat paths."""
    missing = sorted({f"{p.relative_to(REPO)}: {m}" for p in NAMING_FILES for m in TEST_PATH.findall(p.read_text())
                      if not (REPO / m).is_file()})
    assert TEST_PATH.findall("see tests/calibration/test_prefetch.py and tests/test_x.py") == [
        "tests/calibration/test_prefetch.py", "tests/test_x.py"]
    assert not missing, missing
