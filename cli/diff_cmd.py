"""`kvc diff A B`: two models, two steps of a dump directory, or two dump or compiled
directories step by step, as text diffs headed by structural summaries.

    kvc diff A.xml B.xml                    one model against another
    kvc diff dumps/prefill/003-x.txt ...    two dump steps
    kvc diff run1/dumps run2/dumps          every step of every branch, paired by path
    kvc diff out1 out2                      every model of two compiled directories, paired
                                            by name, after their plans

Directories: each pair gets one line (identical, or its op-count delta and how many lines
differ); then the differing pairs' diffs (not with --summary-only). What only one side has is
listed. `--color auto` colours diffs on a terminal.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click

from kvc.cli.options import json_option
from kvc.cli.render import echo_json

STEP = re.compile(r"^\d{3}-.+\.txt$")


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


def _kind(path: Path) -> str:
    if path.is_dir() and (path / "manifest.json").is_file():
        return "compiled"
    if path.is_dir() and (any(path.glob("[0-9][0-9][0-9]-*.txt")) or any(path.glob("*/[0-9][0-9][0-9]-*.txt"))):
        return "dumps"
    return "model"


def _steps(root: Path) -> dict[str, Path]:
    """A dump directory's steps by path relative to it (branch/NNN-pass.txt)."""
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*.txt")) if STEP.match(p.name)}


def _models(root: Path) -> dict[str, Path]:
    from kvc.export.manifest import read_manifest

    manifest = read_manifest(root)
    return {name: root / entry["xml"] for name, entry in manifest["models"].items()}


def _pairs(a: Path, b: Path, kind: str) -> tuple[list[tuple[str, str, str]], list[str], list[str], list[str]]:
    """(name, text a, text b) for what both sides have, what only A has, only B has, and
    header lines."""
    header = []
    if kind == "dumps":
        left, right = _steps(a), _steps(b)
        text = lambda p: _text_of(p, None)  # noqa: E731
    else:
        left, right = _models(a), _models(b)
        text = lambda p: _text_of(p, _weights_for(p))  # noqa: E731
        from kvc.export.manifest import read_manifest

        manifests = [read_manifest(d) for d in (a, b)]
        for what, of in (("plan", lambda m: m["plan"]), ("deployment", _deployment)):
            sides = [of(m) for m in manifests]
            if sides[0] != sides[1]:
                header.append(f"{what} differs:")
                header += [f"  {line}" for line in _json_delta(sides[0], sides[1])]
    both = [n for n in left if n in right]
    return ([(n, text(left[n]), text(right[n])) for n in both], [n for n in left if n not in right],
            [n for n in right if n not in left], header)


def _deployment(manifest: dict) -> dict:
    """What a compiled directory runs with besides its models' graphs: its devices, the
    OpenVINO that made its blobs, each blob's compile and import configuration (the precision
    it computes at), and the files beside the models (tokenizer, generation and model config)
    by sha256. Two directories whose graphs are identical but whose blobs compute at bf16 and
    f32 were reported identical."""
    blobs = {name: {device: {"compile_config": blob.get("compile_config"),
                             "import_config": {k: v for k, v in blob["import_config"].items() if k != "WEIGHTS_PATH"}}
                    for device, blob in entry["blobs"].items()}
             for name, entry in manifest["models"].items()}
    used = {manifest["weights"]} | {e["xml"] for e in manifest["models"].values()} | {
        b["file"] for e in manifest["models"].values() for b in e["blobs"].values()}
    return {"devices": manifest["devices"], "openvino_version": manifest["openvino_version"], "blobs": blobs,
            "files": {name: f["sha256"] for name, f in manifest["files"].items() if name not in used}}


def _json_delta(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _json_delta(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    return [] if a == b else [f"{path}: {json.dumps(a)[:80]} -> {json.dumps(b)[:80]}"]


def colorize(body: str) -> str:
    """A unified diff coloured as git colours one."""
    out = []
    for line in body.splitlines(keepends=True):
        if line.startswith(("+++", "---")):
            out.append(click.style(line, bold=True))
        elif line.startswith("@@"):
            out.append(click.style(line, fg="cyan"))
        elif line.startswith("+"):
            out.append(click.style(line, fg="green"))
        elif line.startswith("-"):
            out.append(click.style(line, fg="red"))
        else:
            out.append(line)
    return "".join(out)


@click.command("diff")
@click.argument("a", type=click.Path(exists=True, path_type=Path))
@click.argument("b", type=click.Path(exists=True, path_type=Path))
@click.option("-U", "--context", type=click.IntRange(min=0), default=3, show_default=True, help="Lines of context.")
@click.option("--summary-only", is_flag=True, help="Print only the structural summary.")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
              help="Colour the diffs (auto: on a terminal).")
@json_option
def diff(a, b, context, summary_only, color, as_json):
    """Diff two models (directories, .xml, .onnx), two dump steps (NNN-<pass>.txt), or two
    dump or compiled directories step by step."""
    from kvc.ir.compare import diff_text, summarize_text

    colored = color == "always" or (color == "auto" and not as_json and sys.stdout.isatty())
    paint = colorize if colored else (lambda s: s)
    kinds = {_kind(a), _kind(b)}
    if kinds & {"dumps", "compiled"}:
        if len(kinds) != 1:
            raise click.UsageError(f"cannot compare a {_kind(a)} with a {_kind(b)}: give two dump directories, "
                                   f"two compiled directories, or two models")
        kind = kinds.pop()
        pairs, only_a, only_b, header = _pairs(a, b, kind)
        rows, bodies = [], []
        for name, ta, tb in pairs:
            summary = summarize_text(ta, tb)
            body = "" if ta == tb else diff_text(ta, tb, f"{a}/{name}", f"{b}/{name}", context)
            changed = sum(1 for line in body.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))
            rows.append({"name": name, "identical": ta == tb, "changed_lines": changed,
                         "op_delta": dict(summary.op_delta), "diff": "" if summary_only else body})
            if body and not summary_only:
                bodies.append(body)
        if as_json:
            echo_json({"kind": kind, "pairs": rows, "only_in_a": only_a, "only_in_b": only_b, "header": header})
            return
        for line in header:
            click.echo(line)
        for r in rows:
            delta = ", ".join(f"{op} {n:+d}" for op, n in sorted(r["op_delta"].items()))
            click.echo(f"{r['name']}: " + ("identical" if r["identical"] else
                                           f"{r['changed_lines']} lines differ" + (f" (ops {delta})" if delta else "")))
        for name in only_a:
            click.echo(f"{name}: only in {a}")
        for name in only_b:
            click.echo(f"{name}: only in {b}")
        for body in bodies:
            click.echo(paint(body), nl=False, color=colored)
        return
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
        click.echo(paint(body), nl=False, color=colored)
    elif text_a == text_b:
        click.echo("identical")
