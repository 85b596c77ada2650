"""`kvc report OUT`: one self-contained HTML page about a compiled directory."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the page (default: DIRECTORY/report.html).")
@click.option("--dumps", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Pass dumps to show (default: DIRECTORY/dumps, written by kvc compile --dumps).")
@click.option("--source", type=click.Path(exists=True, path_type=Path), default=None,
              help="The model before lifting, for its picture (default: the source the manifest records, "
                   "when it is still there and unchanged).")
@click.option("--layer", type=click.IntRange(min=0), default=0, show_default=True,
              help="The layer whose attention/KV subgraph is drawn.")
def report(directory, out, dumps, source, layer):
    """Write one self-contained HTML page about the compiled DIRECTORY: the plan, each pass with
    its op-count delta and diff, the KV subgraph of one layer before lifting and in the final
    models, the verification with per-step errors and margins, and the time and bytes of each
    phase. What the directory does not hold (pass dumps, timings: compile with --dumps) is said
    in the page."""
    from kvc.report import write_report

    path = write_report(directory, out or directory / "report.html", dumps=dumps, source=source, layer=layer)
    click.echo(f"report: {path}")
