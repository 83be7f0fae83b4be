"""The documentation stays inside the repository: every relative Markdown link and image in README.md, docs/**/*.md,
packages/*/README.md and export/README.md resolves to a path that exists in the repository, and no page points at
the design notes outside it (``../shared``, ``DESIGN.md``: the repository's own is docs/design.md)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]

# [text](target) and ![alt](target), with an optional "title"; <target> for targets with spaces
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
FENCE = re.compile(r"^ {0,3}(```|~~~)")
EXTERNAL = ("http://", "https://", "mailto:")
FORBIDDEN = ("../shared", "DESIGN.md")


def pages(root: Path = ROOT) -> list[Path]:
    """The Markdown pages under the check: the README, everything under docs/ and the packages' READMEs."""
    found = [root / "README.md", *sorted((root / "docs").rglob("*.md")), *sorted(root.glob("packages/*/README.md")),
             root / "export" / "README.md"]
    return [page for page in found if page.is_file()]


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in ``text``; fenced code blocks and code spans hold none."""
    found, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if opened and (fence is None or opened.group(1) == fence):
            fence = opened.group(1) if fence is None else None
            continue
        if fence is not None:
            continue
        line = CODE_SPAN.sub("", line)
        for pattern in (INLINE_LINK, REFERENCE_DEFINITION, HTML_LINK):
            found += [(number, match.group(1).strip("<>")) for match in pattern.finditer(line)]
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """``file:line: target (why)`` for every relative link of ``page`` that does not resolve inside ``root``."""
    root, problems = root.resolve(), []
    for number, target in links(page.read_text(encoding="utf-8")):
        if target.lower().startswith(EXTERNAL):
            continue
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not path:  # "#anchor": this page
            continue
        where = f"{page.relative_to(root)}:{number}: {target}"
        if re.match(r"^[a-z][a-z0-9+.-]*:", path, re.I) or path.startswith("/"):
            problems.append(f"{where} (not a relative path)")
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(root):
            problems.append(f"{where} (outside the repository: {resolved})")
        elif not resolved.exists():
            problems.append(f"{where} (no such file: {resolved.relative_to(root)})")
    return problems


def forbidden_mentions(page: Path, root: Path = ROOT) -> list[str]:
    """``file:line: ...`` for every line of ``page`` that points at the design notes outside the repository."""
    return [f"{page.relative_to(root.resolve())}:{number}: mentions {word!r}: {line.strip()[:120]}"
            for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            for word in FORBIDDEN if word in line]


PAGES = pages()


def test_the_pages_are_found():
    names = {str(page.relative_to(ROOT)) for page in PAGES}
    assert {"README.md", "export/README.md", "packages/data/README.md"} <= names
    assert any(name.startswith("docs/") for name in names)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves_inside_the_repository(page):
    problems = broken_links(page)
    assert not problems, f"{len(problems)} broken link(s):\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_page_points_outside_the_repository(page):
    problems = forbidden_mentions(page)
    assert not problems, "\n".join(problems)


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: move detail into docs/ and link it"


def test_the_checker_catches_what_it_should(tmp_path):
    """The checks can fail: broken, escaping and absolute links are reported with file:line; external links,
    anchors, code and existing files (and directories) are not."""
    (tmp_path / "docs" / "img").mkdir(parents=True)
    (tmp_path / "docs" / "img" / "plot.png").write_bytes(b"")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.md").write_text("x\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("\n".join([
        "# Page",
        "[ok](../results/x.md#section) and ![plot](img/plot.png \"title\") and [dir](../results/)",
        "[web](https://example.org/a.md) [mail](mailto:a@b.c) [here](#page)",
        "[gone](results/x.md)",  # 4: relative to docs/, so docs/results/x.md: missing
        "![missing image](img/none.png)",  # 5
        "[escape](../../outside.md)",  # 6: outside the repository
        "`[code](nowhere.md)` is not a link",
        "```",
        "[also code](nowhere.md)",
        "```",
        "[ref]: ../nowhere.md",  # 11
        '<img src="img/none.svg">',  # 12
        "[absolute](/etc/passwd)",  # 13
        "see ../shared/DESIGN.md",  # 14
    ]) + "\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(" ", 1)[0] for p in problems] == [
        "docs/page.md:4:", "docs/page.md:5:", "docs/page.md:6:", "docs/page.md:11:", "docs/page.md:12:",
        "docs/page.md:13:"], problems
    assert "outside the repository" in problems[2] and "no such file: docs/results/x.md" in problems[0]
    mentions = forbidden_mentions(page, root=tmp_path)
    assert [m.split(" ", 1)[0] for m in mentions] == ["docs/page.md:14:", "docs/page.md:14:"], mentions
