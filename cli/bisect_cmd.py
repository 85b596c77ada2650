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
@click.option("--steps", type=click.IntRange(1, 256), default=3, show_default=True,
              help="Greedy steps compared for dynamic stages (at most 256: each step runs every stage again; "
                   "99999999999 ran for hours).")
@click.option("--device", "devices", multiple=True, type=click.Choice(["CPU", "NPU"]), default=("CPU",),
              show_default=True, help="The device `kvc compile --device` was given: the auto options resolve for it, "
                                      "so that bisect walks the models that compile builds (repeatable).")
@click.option("--inference-precision", type=click.Choice(["auto", "f32", "bf16", "f16"]), default="auto",
              show_default=True, help="The CPU blobs' arithmetic `kvc compile --inference-precision` was given (auto: "
                                      "the CPU plugin's default here): the auto options (chunk, first chunks, KV type, "
                                      "prefill MLP) resolve for it as the compile resolves them. Bisect itself runs "
                                      "kvc's numpy runtime.")
@json_option
def bisect(model, prompt_ids, steps, devices, inference_precision, as_json, **kwargs):
    """Run the compile pipeline pass by pass on kvc's numpy runtime, comparing every
    intermediate model with MODEL; name the pass after which the outputs are wrong and stay
    wrong, and the first tensor that diverges there. A pass whose divergence a later pass
    undoes (static-shape before mask-positions, on a sliding window) shows as "restored".
    Custom passes: --pass-plugin FILE.py --passes 'lift-state,my-pass'. Exit 4 when a pass
    changes the outputs."""
    import kvc.ir as ir
    from kvc.cli.options import parse_ids
    from kvc.verify.bisect import bisect as run_bisect

    from kvc.export.compile import fit_to_model, model_longrope, model_max_positions, source_image_rows, source_selects
    from kvc.ir.reader import resolve

    path = resolve_model(model)
    # The auto options resolved as `kvc compile` resolves them for the same arguments (CPU at the
    # plugin's own arithmetic by default), so that the pipeline bisected is the one it refused.
    static = pop_static(kwargs, devices, inference_precision, source_selects(path), source_image_rows(path))
    root = resolve(path).root
    options = fit_to_model(static, model_max_positions(root), model_longrope(root))
    from kvc.export.build import common_passes
    from kvc.passes import format_pipeline

    progress(f"bisecting {path}: {format_pipeline(common_passes(options))}, then each static branch")
    from kvc.ir.finite import check_no_nan_weights

    model = ir.load(path)
    check_no_nan_weights(model, str(resolve(path).model))  # else the first pass is blamed for the source's NaN
    report = run_bisect(model, options, prompt=parse_ids(prompt_ids) if prompt_ids else None, steps=steps,
                        file=str(path))
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo(table(["branch", "#", "pass", "max abs", "NRMSE", "result"],
                         [(s.branch, s.index, s.spec, f"{s.max_abs:.2g}", f"{s.nrmse:.2g}", _result(s))
                          for s in report.stages]))
    if report.ok:
        if not as_json:
            click.echo("no pass changes the outputs beyond tolerance")
        return
    bad, tensor = report.first_bad, report.first_tensor
    where = (f"; first diverging tensor: {tensor['tensor']} (max abs {tensor['max_abs']:.3g}, shape {tensor['shape']})"
             if tensor else "; no tensor to pair (the model before it is not static)" if bad.branch != "common" else "")
    what = f"the outputs (max abs {bad.max_abs:.3g})"
    if bad.reason:  # an embedding row or a weight (verify/weights.py): the probe's outputs need not show it
        what, where = "the model", f": {bad.reason}{where}"
    if not as_json:
        on = f", on a call of {bad.probe}" if bad.probe else ""
        click.echo(f"first bad pass: {bad.spec} ({bad.branch}, pass {bad.index}{on}){where}")
    raise VerificationError(f"pass {bad.spec} changes {what}{f' on a call of {bad.probe}' if bad.probe else ''}{where}")


def _result(stage) -> str:
    return "ok" if stage.ok else "changed, restored later" if stage.restored else "CHANGED"
