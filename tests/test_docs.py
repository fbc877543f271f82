"""The docs' references stay true: every relative link in README.md and docs/*.md reaches a file (and its
`#anchor` a heading of that page), and every test a doc names as `test_x.py::name` exists."""

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_REFERENCE = re.compile(r"\b((?:tests/)?test_\w+\.py)::(\w+)")


def heading_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, hyphens and spaces
    kept), spaces turned into hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache  # a page is linked to many times
def anchors(page: Path) -> frozenset[str]:
    """The anchors GitHub makes for a page's headings (a repeated heading's second anchor gets `-1`), code blocks
    left out."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"#{1,6}\s+(.*)", line)):
            slug = heading_slug(match.group(1))
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(found)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not this test's business (no network here)
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such heading)")
    return broken


def missing_tests(page: Path) -> list[str]:
    missing = []
    for file, name in set(TEST_REFERENCE.findall(page.read_text())):
        test_file = ROOT / "tests" / Path(file).name
        if not test_file.exists() or not re.search(rf"^\s*(?:async\s+)?(?:def|class) {name}\b",
                                                   test_file.read_text(), re.MULTILINE):
            missing.append(f"{file}::{name}")
    return sorted(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_reaches_a_file_and_heading(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_test_a_page_names_exists(page):
    assert missing_tests(page) == []


def test_the_checks_see_a_broken_link_a_lost_heading_and_a_renamed_test(tmp_path):
    (tmp_path / "other.md").write_text("# A heading: with `code`\n\n## Twice\n\n## Twice\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-code) [ok](other.md#twice-1) [gone](missing.md) "
                    "[lost](other.md#not-a-heading) [lost](other.md#twice-2) [web](https://example.com/x#y)\n"
                    "`tests/test_docs.py::heading_slug` and `test_docs.py::no_such_test`\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#not-a-heading (no such heading)",
                                  "other.md#twice-2 (no such heading)"]
    assert missing_tests(page) == ["test_docs.py::no_such_test"]
