"""The docs: the README is a short front door that links into docs/ (tests/ui/test_docs_site.py
builds the site strictly and reads it)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_is_a_front_door_starting_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    [first_block] = re.findall(r"```bash\n(.*?)```", text, re.S)[:1]
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"
