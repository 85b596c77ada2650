"""`kvc diff A B`: two models, or two steps of a dump directory, as a text diff with a summary."""

from __future__ import annotations

import re
from pathlib import Path

import click

from kvc.cli.options import json_option
from kvc.cli.render import echo_json


def _text_of(path: Path, weights: Path | None) -> str:
    """A dump step (.txt written by kvc) as is, an unchanged step as the step it repeats;
    anything else loaded as a model and printed."""
    import kvc.ir as ir

    if path.suffix != ".txt":
        return ir.to_text(ir.load(path, weights=weights))
    text = path.read_text()
    if text.startswith("# kvc ir text"):
        return text
    if "unchanged" in text and re.match(r"\d{3}-", path.name):
        earlier = sorted(p for p in path.parent.glob("[0-9][0-9][0-9]-*.txt") if p.name < path.name)
        if earlier:
            return _text_of(earlier[-1], None)
    raise click.UsageError(f"{path} is not a kvc IR dump")


def _weights_for(path: Path) -> Path | None:
    """Models of a compiled directory read its shared weights.bin."""
    shared = path.parent / "weights.bin"
    return shared if path.suffix == ".xml" and not path.with_suffix(".bin").exists() and shared.exists() else None


@click.command("diff")
@click.argument("a", type=click.Path(exists=True, path_type=Path))
@click.argument("b", type=click.Path(exists=True, path_type=Path))
@click.option("-U", "--context", type=click.IntRange(min=0), default=3, show_default=True, help="Lines of context.")
@click.option("--summary-only", is_flag=True, help="Print only the structural summary.")
@json_option
def diff(a, b, context, summary_only, as_json):
    """Diff two models (directories, .xml, .onnx) or two dump steps (NNN-<pass>.txt)."""
    from kvc.ir.compare import diff_text, summarize_text

    text_a, text_b = _text_of(a, _weights_for(a)), _text_of(b, _weights_for(b))
    summary = summarize_text(text_a, text_b)
    body = "" if summary_only else diff_text(text_a, text_b, str(a), str(b), context)
    if as_json:
        echo_json({"summary": {k: (list(v) if isinstance(v, tuple) else v) for k, v in summary.__dict__.items()},
                   "diff": body, "identical": text_a == text_b})
        return
    for line in summary.lines():
        click.echo(line)
    if body:
        click.echo(body, nl=False)
    elif text_a == text_b:
        click.echo("identical")
