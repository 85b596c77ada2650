"""Docs that list the fixtures cannot fall behind them."""

from __future__ import annotations

import re
from pathlib import Path

from kvc import fixtures

ROOT = Path(__file__).resolve().parent.parent


def test_coverage_table_and_fixture_readme_list_every_fixture():
    coverage = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "coverage.md").read_text(), re.M))
    readme = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "fixtures" / "README.md").read_text(), re.M))
    assert coverage == set(fixtures.MODELS + fixtures.COMPRESSED), \
        "regenerate docs/coverage.md: python scripts/coverage.py"
    assert readme == set(fixtures.MODELS), "add the fixture to the table in fixtures/README.md"
    assert "FAILS" not in (ROOT / "docs" / "coverage.md").read_text()
