"""The documentation's shape (issue 23): README.md is a front page of at most 300 lines, the rest
lives in docs/ and the dated logs in bench_results/, and every relative link among them resolves:
to a file or folder that exists and, with a `#fragment`, to a heading of that file (GitHub's
anchors). The README keeps the sections whose fenced commands tests/test_user_path.py runs, and
the package layout tree is written once, in docs/design.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from user_path_helpers import readme_blocks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300
DOCS = sorted([README, *(ROOT / "docs").glob("*.md"), *(ROOT / "bench_results").glob("*_log.md")])
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced blocks and code spans (a bracket there is code, not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_files_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/design.md", "docs/usage.md", "docs/serving.md", "docs/speculation.md",
            "docs/benchmarks.md", "docs/testing.md"} <= names, names


def test_the_readme_is_a_front_page():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move the detail to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    broken = []
    for target in relative_links(doc):
        file, _, fragment = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and (dest.suffix != ".md" or fragment not in anchors(dest)):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_links():
    # Guards the check itself: the README links into docs/, and a made-up target is caught.
    assert "docs/usage.md" in relative_links(README)
    assert "#no-such-heading" not in {"#" + a for a in anchors(README)}
    assert "how-exact-is-speculation-never-moves-a-token" in anchors(ROOT / "docs" / "speculation.md")


@pytest.mark.parametrize("section", [None, "## Commands", "## Use", "## A real model", "## Serve"])
def test_the_readme_keeps_the_sections_the_user_path_runs(section):
    # tests/test_user_path.py reads these sections' fenced commands; this fails at once, not after
    # minutes of subprocesses, when a section or its blocks move.
    assert readme_blocks(section)


def test_one_layout_tree():
    """The package tree is drawn once (docs/design.md §4); a second copy drifts (issue 23)."""
    trees = [p.relative_to(ROOT).as_posix() for p in DOCS
             for block in FENCE.findall(p.read_text()) if re.search(r"^```[^\n]*\ngmlx/ ", block, re.M)]
    assert trees == ["docs/design.md"], trees
