"""`kvc verify OUT`: compiled pipeline versus the source model on other engines; goldens."""

from __future__ import annotations

from pathlib import Path

import click

from kvc.cli.options import json_option, load_prompts
from kvc.cli.render import echo_json, table
from kvc.errors import VerificationError
from kvc.verify.compiled import UNREAD_CHECKS


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(b.strip() for b in text.split(",") if b.strip())
    bad = [b for b in names if b not in ("numpy", "openvino", "npu")]
    if bad or not names:
        raise click.BadParameter(f"choose from numpy, openvino, npu (got {text!r})")
    return names


@click.command("verify")
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--against", type=click.Path(exists=True, path_type=Path), default=None,
              help="The original model (default: the source recorded in the manifest); with --goldens, read only "
                   "to check them at another arithmetic than the one that recorded them.")
@click.option("--backends", default=None,
              help="Comma-separated: numpy,openvino,npu. Default: numpy and the backend of each device OUT "
                   "has blobs for (openvino for CPU, npu for NPU; openvino with --from-ir); with --goldens, the "
                   "backend they were recorded on; with --record, the first device's (the blobs `kvc run` serves).")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON list of token-id lists (default: prompts of 1, P/2 and P tokens).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--reference", type=click.Choice(["openvino", "numpy"]), default="openvino", show_default=True,
              help="Engine that runs the original model.")
@click.option("--record", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write goldens (tokens and top logits) to this file, from the first of --backends (default: the "
                   "blobs of OUT's first device, what kvc run serves).")
@click.option("--goldens", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Check the compiled pipeline against a goldens file written by --record.")
@click.option("--from-ir", is_flag=True, help="Compile the IR instead of importing blobs.")
@json_option
def verify(out, against, backends, prompts_file, max_new_tokens, reference, record, goldens, from_ir, as_json):
    """Run OUT's pipeline and the original model; exit 4 on a mismatch.

    The prompts, then the compile's own probes (which reach every model's last positions and
    slots). Logits: exact (max abs ≤ 1e-4) on kvc's numpy runtime and with f32 KV; below f32
    (f16 KV, the NPU plugin, bf16 CPU blobs) by NRMSE and each step's error, and a token may
    differ only at a near-tie, which is reported with its step and margin.
    """
    from kvc.verify import goldens as golden_files
    from kvc.verify.compiled import verify_compiled

    prompts = load_prompts(prompts_file) if prompts_file else None
    if goldens is not None:
        # Each listed backend, else the one the goldens were recorded on (blobs recorded on
        # openvino were checked on numpy's IR run, which a bad blob does not change).
        report = golden_files.check_backends(out, goldens, _backends(backends) if backends else None,
                                             from_ir=from_ir, against=against)
        _finish(report, as_json, ["backend", "prompt", "tokens", "first divergent", "max logit drift", "result"],
                lambda r: (r["backend"], r["prompt"], r["prompt_tokens"], _dash(r["first_divergent_token"]),
                           f"{r['max_logit_drift']:.2g}", r["reason"]))
        return
    backend_list = _backends(backends) if backends else default_backends(out, from_ir)
    if record is not None:
        if prompts is None:
            from kvc.export.manifest import plan_of, read_manifest, vocab_of
            from kvc.verify.compiled import default_prompts, special_ids

            manifest = read_manifest(out)
            vocab = vocab_of(manifest)
            prompts = default_prompts(plan_of(manifest).lengths, vocab, specials=special_ids(out, vocab))
        # the blobs a deployment runs, so that checking the goldens where they were recorded runs
        # them (recorded on numpy by default, a check of them never read the blobs)
        source = backend_list[0] if backends or len(backend_list) < 2 else backend_list[1]
        data = golden_files.record(out, record, prompts, backend=source, new_tokens=max_new_tokens,
                                   from_ir=from_ir)
        if as_json:
            echo_json(data)
        else:
            click.echo(f"recorded {len(data['prompts'])} prompts from {source} into {record}")
        return
    report = verify_compiled(out, against=against, backends=backend_list, prompts=prompts,
                             new_tokens=max_new_tokens, reference_backend=reference, from_ir=from_ir)
    _finish(report, as_json, ["backend", "prompt", "tokens", "max abs", "NRMSE", "top-1", "first divergent",
                              "KV rows", "result"],
            lambda r: (r["backend"], r["prompt"], _tokens(r), f"{r['max_abs']:.2g}", f"{r['nrmse']:.2g}",
                       f"{r['top1']:.2f}", _dash(r["first_divergent_token"]),
                       f"{r['cache_error']:.2g}" if "cache_error" in r else "-", r["reason"]))


def default_backends(out: Path, from_ir: bool) -> tuple[str, ...]:
    """numpy, then the backend of each device OUT has blobs for (what `kvc run --backend` runs
    there); openvino with `from_ir`."""
    from kvc.export.load import blob_backends
    from kvc.export.manifest import read_manifest

    return ("numpy", "openvino") if from_ir else ("numpy", *blob_backends(read_manifest(out)))


def _tokens(row: dict) -> str:
    """A prompt's length, where a far probe starts (`probe_cases`), and an image's rows
    (`media_probe`)."""
    return (f"{row['prompt_tokens']}" + (f" from {row['from_position']}" if row.get("from_position") else "")
            + (" (far past)" if row.get("far_past") else "")
            + "".join(f" (image {start}-{start + m - 1})" for start, m in row.get("media", ())))


def _dash(v):
    return "-" if v is None else v




def _finish(report: dict, as_json: bool, headers, row) -> None:
    unread = [(label, report[key]) for key, label in UNREAD_CHECKS if report.get(key) is not None]
    if as_json:
        echo_json(report)
    else:
        click.echo(table(headers, [row(r) for r in report["results"]]))
        for label, check in unread:
            click.echo(f"{label}: {check['reason']}")
        click.echo("verification: " + ("OK" if report["ok"] else "MISMATCH"))
    if not report["ok"]:
        from kvc.verify.compiled import probe_label

        for label, check in unread:
            if not check["ok"]:
                raise VerificationError(f"mismatch in the {label}: {check['reason']}")
        bad = next(r for r in report["results"] if not r["ok"])
        where = ", ".join(w for w in (bad.get("backend"), probe_label(bad) if "prompt_tokens" in bad else None) if w)
        raise VerificationError(f"mismatch{' on ' + where if where else ''}: {bad['reason']}")
