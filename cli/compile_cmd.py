"""`kvc compile [MODEL] -o OUT`: the static pipeline, blobs and manifest of a model."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

import click

from kvc.cli.options import (ir_print_options, json_option, model_argument, pop_instrumentation, pop_static, progress,
                             resolve_model, static_options)
from kvc.cli.render import echo_json, human_bytes, table
from kvc.verify.compiled import UNREAD_CHECKS


@click.command("compile")
@model_argument
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Output directory (complete or absent).")
@static_options
@click.option("--device", "devices", multiple=True, type=click.Choice(["CPU", "NPU"]), default=("CPU",),
              show_default=True, help="Compile and export a blob per model for this device (repeatable).")
@click.option("--inference-precision", type=click.Choice(["auto", "f32", "bf16", "f16"]), default="auto",
              show_default=True,
              help="Arithmetic of the CPU blobs (INFERENCE_PRECISION_HINT). auto: the CPU plugin's own default, what a "
                   "user deploying on this machine gets (bf16 with AVX512_BF16 or AMX, else f32); f32: exact. "
                   "Blobs below f32 are judged by the reduced-precision rule (docs/verification.md).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check the static pipeline (kvc's numpy runtime) against the source model on OpenVINO CPU f32.")
@click.option("--dumps", is_flag=True, help="Write pass-by-pass IR dumps into OUT/dumps.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (only once the new one is complete).")
@click.option("--report", "report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write one self-contained HTML page about this compile (docs/report.md); "
                   "kvc report OUT writes it later, completely when compiled with --dumps.")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Take P, R, the prefill chunk and the variants from a plan written by kvc plan -o.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep each blob here and reuse it when a later compile has the same model for the same device, "
                   "configuration and OpenVINO version (as OpenVINO's CACHE_DIR): adding a variant or a device "
                   "compiles only what is new (docs/blob-cache.md).")
@ir_print_options
@json_option
@click.pass_context
def compile_(ctx, model, out, devices, inference_precision, verify, dumps, force, report, plan_path, cache_dir,
             as_json, **kwargs):
    """Compile MODEL into static prefill and generate models for an NPU, with blobs and a manifest.

    MODEL is an optimum-intel directory, an OpenVINO .xml, or an .onnx with past/present
    inputs and outputs; without it, the model bundled with kvc.
    """
    from kvc.export.compile import CompileOptions, compile_to, source_image_rows, source_selects

    if plan_path is not None:
        apply_plan(ctx, kwargs, plan_path)
    path = resolve_model(model)
    static = pop_static(kwargs, devices, inference_precision, source_selects(path), source_image_rows(path))
    instrumentation = pop_instrumentation(kwargs)
    name = source_name(path, bundled=model is None)
    if report is not None:
        from kvc.ir.writer import check_writable

        check_writable(report, "report")
    for note in static.lengths().notes:
        progress(f"note: {note}")
    with contextlib.ExitStack() as stack:
        recorder, temporary = None, False
        if report is not None or dumps:  # with --dumps, recorded beside them for a later `kvc report OUT`
            from kvc.report import CompileRecorder

            recorder = CompileRecorder()
        if report is not None and not dumps and instrumentation.dump_dir is None:  # the passes, for the page only
            instrumentation = dataclasses.replace(
                instrumentation, dump_dir=Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvc-report-"))))
            temporary = True
        options = CompileOptions(static, tuple(dict.fromkeys(devices)), inference_precision, verify, force=force,
                                 dumps=dumps, instrumentation=instrumentation, recorder=recorder,
                                 cache_dir=cache_dir)
        manifest = compile_to(path, out, options, progress=lambda m: progress(m.replace(str(path), name)))
        if report is not None:
            from kvc.report import write_report

            write_report(out, report, dumps=out / "dumps" if dumps else instrumentation.dump_dir,
                         record=recorder.to_dict(), source=path,
                         dumps_label="a temporary directory, removed after the compile (--dumps keeps them in "
                                     "OUT/dumps)" if temporary else None)
            progress(f"report: {report}")
    if as_json:
        echo_json(manifest)
        return
    render_summary(out, manifest, name)


PLANNED = ("max_prompt_len", "min_response_len", "prefill_chunk_size", "prefill_first", "variants")


def apply_plan(ctx: click.Context, kwargs: dict, path: Path) -> None:
    """Put a plan's lengths in place of the options; an option given too is a conflict."""
    from kvc.plan import chunk_label
    from kvc.planner import read_plan

    given = [k for k in PLANNED if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"--plan sets {', '.join('--' + k.replace('_', '-') for k in given)}: give one or the "
                               f"other")
    lengths = read_plan(path)
    kwargs.update({k: lengths[k] for k in PLANNED[:4]})
    kwargs["variants"] = ",".join(map(str, lengths["variants"]))
    progress(f"plan {path}: P {lengths['max_prompt_len']}, R {lengths['min_response_len']}, chunk "
             f"{chunk_label(lengths['prefill_chunk_size'], first=lengths['prefill_first'])}, "
             f"variants {kwargs['variants']}")


def source_name(path: Path, bundled: bool) -> str:
    """How the logs name the source: the bundled model by its name, not by its path in
    site-packages."""
    return f"the bundled model ({path.parent.name})" if bundled else str(path)


def image_rule(manifest: dict) -> str:
    """Where a prompt's image may lie in the compiled models of a vision-language model
    (`kvc.runtime.embeddings.Media`): anywhere, unless they read `token_type_ids`."""
    from kvc.export.manifest import plan_of
    from kvc.runtime.static_pipeline import image_end_limit

    if not any(p["name"] == "token_type_ids" for p in manifest["models"]["prefill"]["inputs"]):
        return "anywhere in a prompt (kvc run --image START:ROWS.npy)"
    L = plan_of(manifest).lengths
    end = image_end_limit(L)
    why = "token_type_ids: an image attends itself both ways only in a prefill call over no past"
    if not end:
        return (f"none: no first prefill call over no past holds one ({why}); compile with --prefill-first "
                f"or --prefill-chunk-size 0")
    return f"in the first prefill call, ending by position {end} in a prompt of {L.prompt} tokens ({why})"


def render_summary(out: Path, manifest: dict, source: str | None = None) -> None:
    from kvc.export.manifest import model_order, shared_with, token_input
    from kvc.plan import chunk_label
    from kvc.verify.compiled import probe_label

    L = manifest["plan"]["lengths"]
    click.echo(f"compiled {source or manifest['source']['path']} -> {out}")
    click.echo(f"lengths: prompt P={L['max_prompt_len']}, response R={L['min_response_len']}, "
               f"chunk={chunk_label(L)}, capacity={L['capacity']}, "
               f"generate variants {', '.join(map(str, L['generate_sizes']))}")
    for note in L["adjustments"]:
        click.echo(f"  adjusted: {note}")
    rows = []
    token = token_input(manifest)
    for name in model_order(manifest["models"]):
        m = manifest["models"][name]
        shapes = {i["name"]: "x".join(str(d) if d >= 0 else "?" for d in i["shape"]) for i in m["inputs"]}
        past = next((v for k, v in shapes.items() if k.startswith("past_key_values")), "-")
        blobs = ", ".join(f"{d} {human_bytes(b['bytes'])} {b['import_config'].get('INFERENCE_PRECISION_HINT', '')}".rstrip()
                          + shared_with(name, b) for d, b in m["blobs"].items()) or "-"
        rows.append((name, shapes.get(token, "-"), shapes.get("attention_mask", "-"), past, blobs))
    click.echo(table(["model", token, "attention_mask", "past KV", "blobs"], rows))
    if token == "inputs_embeds":
        click.echo(f"images: {image_rule(manifest)}")
    weights = out / manifest["weights"]
    click.echo(f"weights: {manifest['weights']} ({human_bytes(weights.stat().st_size)} on disk: every constant of every "
               f"model once, each 64-byte aligned), shared by every model")
    v = manifest["verification"]
    if v is None:
        click.echo("verification: skipped (--no-verify)")
    else:
        for r in v["results"]:
            click.echo(f"verification: {probe_label(r)}, {r['new_tokens']} new: {r['reason']} "
                       f"(max abs {r['max_abs']:.2g})")
        for key, label in UNREAD_CHECKS:
            if isinstance(v.get(key), dict):
                click.echo(f"verification: {label}: {v[key].get('reason')}")
    for r in manifest.get("blob_check", []):
        click.echo(f"blobs: {r['device']}, {probe_label(r)}, {r['new_tokens']} new "
                   f"(variants {', '.join(map(str, r['variants'])) or '-'}): {r['reason']}")
