"""The documentation's examples run as written: every python block of README.md, and every block of
docs/*.md marked with an `<!-- test -->` line just above it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKED = re.compile(r"<!-- test -->\s*\n```python\n(.*?)```", re.S)
PLAIN = re.compile(r"```python\n(.*?)```", re.S)


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
