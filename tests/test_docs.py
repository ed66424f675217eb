"""The documentation's examples run as written: every python block of README.md, and every block of
docs/*.md marked with an `<!-- test -->` line just above it; and every relative link of README.md and docs/ leads to
a file that exists and, for a page's `#anchor`, to one of its headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKED = re.compile(r"<!-- test -->\s*\n```python\n(.*?)```", re.S)
PLAIN = re.compile(r"```python\n(.*?)```", re.S)
FENCED = re.compile(r"```.*?```", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*)$", re.M)


def examples():
    found = [("README.md", index, code) for index, code in enumerate(PLAIN.findall((ROOT / "README.md").read_text()))]
    for page in sorted((ROOT / "docs").glob("*.md")):
        found += [(f"docs/{page.name}", index, code) for index, code in enumerate(MARKED.findall(page.read_text()))]
    return found


def test_readme_has_an_example():
    assert any(source == "README.md" for source, _, _ in examples())


@pytest.mark.parametrize("source, index, code", examples(), ids=lambda value: str(value)[:30])
def test_example_runs(source, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    exec(compile(code, f"{source} example {index}", "exec"), {"__name__": "__example__"})


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, repeats
    numbered."""
    anchors, seen = set(), {}
    for heading in HEADING.findall(FENCED.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_links_lead_to_files_and_headings_that_exist():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in LINK.findall(FENCED.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            destination = (page.parent / path).resolve() if path else page
            if not destination.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in heading_anchors(destination):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
