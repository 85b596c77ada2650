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


def test_the_tour_is_what_kvc_prints_now():
    """docs/tour.md against a fresh run of its commands (scripts/tour.py --check), numbers
    masked; a changed word in a block fails it."""
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import tour

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tour.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"regenerate it: python scripts/tour.py\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    text = (ROOT / "docs" / "tour.md").read_text()
    assert tour.masked(text.replace("identical tokens", "token 3 differs", 1)) != tour.masked(text)
    assert tour.masked("TTFT 3.0 ms, 151.6 KiB") == tour.masked("TTFT 12.5 ms, 157.6 KiB")
    # a table's padding and rule follow its digits' widths; a row more or less still fails
    assert tour.masked("numpy  1e-05   ok\n-----  -----\n") == tour.masked("numpy  0.0001  ok\n-----  ------\n")
    assert tour.masked("numpy  1  ok\n") != tour.masked("numpy  1  ok\nnumpy  2  ok\n")


def test_the_readme_names_every_registered_pass():
    from kvc.passes.framework.registry import registered

    listed = re.search(r"one module per pass \(([^)]*)\)", (ROOT / "README.md").read_text()).group(1)
    own = {name for name, cls in registered().items() if cls.__module__.startswith("kvc.passes.")}  # not plugins
    assert len(own) >= 10 and set(re.findall(r"`([a-z-]+)`", listed)) == own
