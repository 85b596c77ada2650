"""`kvc inspect MODEL`: inputs and outputs, KV layout, variables, op counts, weights."""

from __future__ import annotations

import click

from kvc.cli.options import model_argument, resolve_model
from kvc.cli.render import echo_json, human_bytes, table


@click.command()
@model_argument
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def inspect(model: str | None, as_json: bool) -> None:
    """Show what MODEL is: I/O, KV cache layout, variables, op counts, parameter count.

    MODEL is an optimum-intel model directory, an OpenVINO .xml, an .onnx, or a directory
    written by `kvc compile`; without it, the model bundled with kvc.
    """
    import kvc.ir as ir
    from kvc.ir.describe import describe

    path = resolve_model(model)
    if (path / "manifest.json").is_file():  # a compiled directory: its manifest says it all
        from kvc.cli.compile_cmd import render_summary
        from kvc.export.manifest import read_manifest

        manifest = read_manifest(path)
        echo_json(manifest) if as_json else render_summary(path, manifest)
        return
    info = describe(ir.load(path), str(path))
    info["path"] = str(path)
    if as_json:
        echo_json(info)
        return
    click.echo(f"model   {path}")
    click.echo(f"weights {info['parameters']:,} parameters, {human_bytes(info['weight_bytes'])} of constants "
               f"(the sum of their sizes; a compiled weights.bin adds the passes' constants and alignment)\n")
    click.echo(table(["input", "type"], [(",".join(p["names"]), p["type"]) for p in info["inputs"]]))
    click.echo()
    click.echo(table(["output", "type"], [(",".join(p["names"]), p["type"]) for p in info["outputs"]]))
    layout = info["kv_layout"]
    click.echo()
    if layout is None:
        click.echo("kv cache: none found")
    else:
        kind = "stateful (variables)" if layout["stateful"] else "stateless (inputs/outputs)"
        click.echo(f"kv cache: {layout['num_layers']} layers, {kind}")
        click.echo(table(["layer", "kind", "where", "type", "shape", "batch", "seq", "heads", "head size"],
                         [(t["layer"], t["kind"], t["variable_id"] or f"{t['input_name']} -> {t['output_name']}",
                           t["element_type"], t["shape"], t["batch_axis"], t["seq_axis"], t["heads"],
                           t["head_size"]) for t in layout["tensors"]]))
    click.echo()
    click.echo(table(["op", "count"], sorted(info["op_counts"].items(), key=lambda kv: (-kv[1], kv[0]))))
