"""The front door and the docs stay readable and self-contained.

Every relative link in the repository's hand-written Markdown must name a file inside the
repository (and, with a ``#fragment``, a heading of that file); the README stays short; the
user-facing pages say what a thing is rather than which issue brought it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250
USER_FACING = [README, *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "bench" / "results"
LINKED_PAGES = [*USER_FACING, ROOT / "deploy" / "README.md", RESULTS / "README.md", RESULTS / "HISTORY.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
ISSUE_REFERENCE = re.compile(r"\bissues?\s*#?\d+", re.I)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def link_targets(text: str) -> list[str]:
    body = prose(text)
    return INLINE_LINK.findall(body) + REFERENCE_LINK.findall(body)


def heading_anchors(text: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings of ``text`` (GitHub's rule)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", text).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in link_targets(page.read_text()):
        if SCHEME.match(target):
            continue  # a URL, not a path in the repository
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in heading_anchors(resolved.read_text()):
            problems.append(f"{target}: no heading #{fragment} in {resolved.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    assert page.exists()
    assert broken_links(page) == []


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_the_readme_shows_the_two_commands():
    text = README.read_text()
    assert "make serve" in text and "make test" in text


@pytest.mark.parametrize("page", USER_FACING, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_facing_pages_name_no_issue_numbers(page):
    assert ISSUE_REFERENCE.findall(prose(page.read_text())) == []


def test_the_checker_finds_broken_links(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two words\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#two-words) [ok](#top) [url](https://example.org/x)\n"
        "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n"
        "[gone](docs/b.md) [out](../shared/DESIGN.md) [anchor](docs/a.md#three)\n\n# Top\n"
    )
    assert broken_links(page) == [
        "docs/b.md: no such file",
        "../shared/DESIGN.md: outside the repository",
        "docs/a.md#three: no heading #three in docs/a.md",
    ]
