"""Options and arguments several commands share."""

from __future__ import annotations

from pathlib import Path

import click

model_argument = click.argument("model", required=False, type=click.Path(exists=True, path_type=str))


def resolve_model(model: str | None) -> Path:
    """The user's model path, or the bundled default model when none is given."""
    if model:
        return Path(model)
    from kvc import fixtures

    path = fixtures.bundled_model()
    if not path.exists():
        raise click.UsageError("no MODEL given and the bundled model is missing from this installation")
    return path
