"""The docs hold together: every relative link in README.md and docs/ resolves, anchors included; the
README stays short; nothing in the repository points outside it (at a ``shared`` folder beside it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *ROOT.glob("*/**/README.md")])
PAGES = [p for p in PAGES if not any(part.startswith(".venv") for part in p.relative_to(ROOT).parts)]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks and inline code, numbered from 1."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", "", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_with_code_spans(path.read_text()):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose_with_code_spans(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced blocks, inline code kept (a heading's slug keeps the words in backticks)."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for number, line in prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif root not in dest.parents and dest != root:
                bad.append(f"{where} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading with that anchor)")
    return bad


def test_docs_pages_exist() -> None:
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"architecture.md", "benchmarks.md", "failures.md", "tuning.md", "vllm-backend.md", "metrics.md",
            "trace-format.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Some `code` heading\n\n[x](b.md) [y](#top) [z](#nope)\n"
                                   "[w](#some-code-heading)\n```\n[not](checked.md)\n```\n")
    bad = broken_links(tmp_path / "a.md", tmp_path)
    assert bad == ["a.md:5: b.md (no such file)", "a.md:5: #nope (no heading with that anchor)"]


def test_readme_is_short_and_keeps_the_ci_test_command() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/install.sh dev && python3 -m pytest -q" in ci
    assert "scripts/install.sh dev && python3 -m pytest -q" in text


def test_nothing_points_outside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"\.\./" + r"shared\b|" + r"DESIGN" + r"\.md")
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".sh", ".toml", ".txt", ".yaml", ".yml", ".cfg"} or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:100]}")
    assert hits == []
