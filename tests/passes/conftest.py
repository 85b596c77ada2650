"""Golden IR tests: expected text forms checked in beside the tests, regenerated on demand."""

from __future__ import annotations

from pathlib import Path

import pytest

GOLDENS = Path(__file__).parent / "goldens"


@pytest.fixture
def golden(request):
    """`golden("name", text)`: compare with goldens/name.txt, or rewrite it with --update-goldens."""
    update = request.config.getoption("--update-goldens")

    def check(name: str, text: str) -> None:
        path = GOLDENS / f"{name}.txt"
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        assert path.exists(), f"missing golden {path}; run pytest --update-goldens and review it"
        assert text == path.read_text(), f"{path} differs; run pytest --update-goldens and review the diff"

    return check


@pytest.fixture(autouse=True)
def check_passes(monkeypatch):
    """Every PassManager in the pass tests runs in check mode: invariants, no stale types,
    and `modified` true exactly when the model's text changed."""
    monkeypatch.setenv("KVC_CHECK_PASSES", "1")
