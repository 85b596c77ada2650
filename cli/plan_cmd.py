"""`kvc plan [MODEL] --workload FILE`: lengths, chunk and generate variants for a workload."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import click

from kvc import jsontext
from kvc.cli.options import json_option, model_argument, progress, resolve_model
from kvc.cli.render import echo_json, human_bytes, table


def costs_cache(path: Path, device: str, precision: str) -> Path:
    """Where measured costs are kept: per model files, device, precision, the KV cache's type,
    the attention's and prefill MLP's forms, the first chunks' rows and OpenVINO version."""
    from kvc.export.compile import auto_cache
    from kvc.export.manifest import openvino_version, source_hashes
    from kvc.planner import first_rows

    cache = auto_cache(device, precision)
    key = json.dumps([source_hashes(path), device, precision, openvino_version(), cache["kv_precision"],
                      cache["attention"], cache["prefill_mlp"], "first_ms", first_rows(device, precision, path)],
                     sort_keys=True)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvc" / "costs"
    return root / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def check_target(costs, path: Path, device: str, precision: str, where: Path) -> None:
    """Costs measured for another model, device or precision are refused (a hand-written file
    without a target is taken as given)."""
    from kvc.errors import UsageError
    from kvc.export.compile import auto_cache
    from kvc.export.manifest import source_hashes
    from kvc.planner import first_rows

    t = dict(costs.target)
    if t and "kv_precision" not in t:  # measured before costs recorded it: with an f32 cache
        t["kv_precision"] = "f32"
    if t and "attention" not in t:  # measured before costs recorded it: grouped
        t["attention"] = "grouped"
    if t and "prefill_mlp" not in t:  # measured before costs recorded it: as exported
        t["prefill_mlp"] = "as-is"
    if t and "first_rows" not in t:  # measured before costs recorded it: static
        t["first_rows"] = "static"
    expected = (("device", device), ("precision", precision), *auto_cache(device, precision).items(),
                ("first_rows", first_rows(device, precision, path)))
    wrong = [f"{k} {t[k]!r}, not {v!r}" for k, v in expected if k in t and t[k] != v]
    if "model" in t and t["model"] != source_hashes(path):
        wrong.append("another model's files")
    if wrong:
        raise UsageError(f"{where}: costs measured for {'; '.join(wrong)}: remove the file to measure again, or "
                         f"give another --costs")


@click.command("plan")
@model_argument
@click.option("--workload", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Requests (.jsonl, as kvc run --requests) or a histogram (.json: "
                   '{"requests": [[prompt_len, response_len, count], ...]}).')
@click.option("--device", type=click.Choice(["CPU", "NPU"]), default="CPU", show_default=True,
              help="The target whose costs are measured (NPU: NPUW on its CPU backend without an NPU).")
@click.option("--inference-precision", type=click.Choice(["auto", "f32", "bf16", "f16"]), default="auto",
              show_default=True, help="Arithmetic of the CPU blobs, as kvc compile's.")
@click.option("--costs", "costs_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Costs to use (kvc's costs JSON); measured and written there when the file does not exist. "
                   "Default: measured once and cached under ~/.cache/kvc/costs.")
@click.option("--max-models", type=click.IntRange(min=2), default=2, show_default=True,
              help="Budget: models (blobs per device), the prefill counted.")
@click.option("--max-compile-seconds", type=click.FloatRange(min=0), default=None,
              help="Budget: estimated seconds to compile every model.")
@click.option("--max-memory-bytes", type=click.IntRange(min=1), default=None,
              help="Budget: estimated device memory of the compiled models.")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the plan here, for kvc compile --plan.")
@json_option
def plan(model, workload, device, inference_precision, costs_path, max_models, max_compile_seconds,
         max_memory_bytes, out, as_json):
    """Choose P, the prefill chunk and the generate variants that minimize the expected time per
    request of a workload within a budget, from the measured cost of the static models on the
    target; compare with the single and pyramid variants at the default chunk."""
    from kvc.errors import OutputError, UsageError
    from kvc.ir.writer import write_output
    from kvc.planner import Budget, Costs, best_plan, load_workload, measure_costs, plan_document

    path = resolve_model(model)
    encode, root = None, path if path.is_dir() else path.parent
    if (root / "tokenizer.json").is_file():  # text prompts are tokenized as kvc run tokenizes them
        from kvc.cli.run_cmd import load_tokenizer, token_ids

        tok = load_tokenizer(root)
        encode = lambda text: token_ids(tok, text, str(workload))  # noqa: E731
    load = load_workload(workload, encode)
    budget = Budget(max_models, max_compile_seconds, max_memory_bytes)
    target = costs_path or costs_cache(path, device, inference_precision)
    if target.is_file():
        try:
            data = jsontext.loads(jsontext.read_text(target))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"{target}: not a readable costs file ({exc})") from None
        costs = Costs.from_dict(data, str(target))
        check_target(costs, path, device, inference_precision, target)
        progress(f"costs: {target}")
    else:
        costs = measure_costs(path, device, inference_precision, progress=progress)
        try:
            write_output(target, (json.dumps(costs.to_dict(), indent=2, sort_keys=True) + "\n").encode(), "costs")
            progress(f"costs measured and written to {target}")
        except OutputError as exc:
            if costs_path is not None:  # the file the user named
                raise
            progress(f"costs measured, not kept in the cache ({exc})")  # the plan needs no cache
    from kvc.export.compile import model_max_positions, resolve_chunk, resolve_first
    from kvc.ir.reader import resolve
    from kvc.planner import first_rows as default_rows

    # as kvc compile resolves its defaults (--prefill-first-rows auto: dynamic on an f32 CPU, for a
    # model without a TopK router)
    default_chunk = resolve_chunk("auto", (device,), inference_precision)
    first_rows = default_rows(device, inference_precision, path)
    default_first = resolve_first("auto", (device,), default_chunk, first_rows)
    stated = model_max_positions(resolve(path).root)
    result = best_plan(load, costs, budget, default_chunk, stated[1] if stated else None, default_first, device,
                       first_rows)
    document = plan_document(result, load, costs, budget)
    chosen = result["plan"]
    if stated and chosen.prompt + chosen.response > stated[1]:  # as kvc compile --plan warns
        document["warning"] = (f"P {chosen.prompt} + R {chosen.response} exceed the {stated[1]} positions the model's "
                               f"config.json states ({stated[0]}): the workload's requests are longer than the "
                               f"model was built for")
        progress(f"warning: {document['warning']}")
    if out is not None:
        write_output(out, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode(), "plan")
    if as_json:
        echo_json(document)
        return
    from kvc.plan import chunk_label

    s = load.summary()
    click.echo(f"workload: {s['requests']} requests, prompt {s['prompt_tokens']['mean']:.0f} tokens on average "
               f"(max {s['prompt_tokens']['max']}), {s['new_tokens']['mean']:.0f} new (max {s['new_tokens']['max']})")
    rows = []
    for c in (result["plan"], *result["baselines"]):
        rows.append((c.name, c.prompt, c.response, chunk_label(c.chunk, c.bulk, c.first, c.first_dynamic),
                     ",".join(map(str, c.sizes)), f"{c.ttft_ms:.1f}", f"{c.decode_ms:.1f}", f"{c.request_ms:.1f}",
                     c.models, f"{c.compile_s:.1f}", human_bytes(c.model_bytes)))
    click.echo(table(["", "P", "R", "chunk", "variants", "TTFT ms", "decode ms", "request ms", "models",
                      "compile s", "memory"], rows))
    best = result["plan"]
    for b in result["baselines"]:
        click.echo(f"plan vs {b.name}: {best.request_ms / b.request_ms:.2f}x the expected time per request")
    if out is not None:
        click.echo(f"plan written to {out}: kvc compile MODEL --plan {out}")
