"""`kvc bisect MODEL`: the first pass that changes the model's outputs, and the first tensor."""

from __future__ import annotations

import click

from kvc.cli.options import json_option, model_argument, pop_static, progress, resolve_model, static_options
from kvc.cli.render import echo_json, table
from kvc.errors import VerificationError


@click.command("bisect")
@model_argument
@static_options
@click.option("--prompt-ids", default=None, help="Prompt to probe with (default: 8 deterministic tokens).")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Greedy steps compared for dynamic stages.")
@json_option
def bisect(model, prompt_ids, steps, as_json, **kwargs):
    """Run the compile pipeline pass by pass on kvc's numpy runtime, comparing every
    intermediate model with MODEL; report the first pass beyond tolerance and the first
    tensor that diverges there. Exit 4 when a pass changes the outputs."""
    import kvc.ir as ir
    from kvc.cli.options import parse_ids
    from kvc.verify.bisect import bisect as run_bisect

    options = pop_static(kwargs)
    path = resolve_model(model)
    progress(f"bisecting {path}: {options.common_pipeline()}, then each static branch")
    report = run_bisect(ir.load(path), options, prompt=parse_ids(prompt_ids) if prompt_ids else None, steps=steps)
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo(table(["branch", "#", "pass", "max abs", "NRMSE", "result"],
                         [(s.branch, s.index, s.spec, f"{s.max_abs:.2g}", f"{s.nrmse:.2g}", "ok" if s.ok else "CHANGED")
                          for s in report.stages]))
    if report.ok:
        if not as_json:
            click.echo("no pass changes the outputs beyond tolerance")
        return
    bad, tensor = report.first_bad, report.first_tensor
    where = (f"; first diverging tensor: {tensor['tensor']} (max abs {tensor['max_abs']:.3g}, shape {tensor['shape']})"
             if tensor else "")
    if not as_json:
        click.echo(f"first bad pass: {bad.spec} ({bad.branch}, pass {bad.index}){where}")
    raise VerificationError(f"pass {bad.spec} changes the outputs (max abs {bad.max_abs:.3g}){where}")
