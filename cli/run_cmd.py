"""`kvc run OUT`: greedy generation through a compiled directory, as the NPU would run it."""

from __future__ import annotations

import time
from pathlib import Path

import click

from kvc.cli.options import json_option, parse_ids
from kvc.cli.render import echo_json
from kvc.errors import UsageError


def load_tokenizer(directory: Path):
    """The model's tokenizer.json, through the `tokenizers` package (the `text` extra)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"{directory} has no tokenizer.json; pass --prompt-ids instead of --prompt")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("text prompts need the tokenizers package: pip install 'kvc[text]'") from None
    return Tokenizer.from_file(str(path))


@click.command("run")
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt-ids", default=None, help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--prompt", "text", default=None, help="Prompt as text (uses OUT/tokenizer.json).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--backend", type=click.Choice(["numpy", "openvino", "npu"]), default="openvino", show_default=True,
              help="numpy: kvc's interpreter; openvino: CPU; npu: the NPU plugin (NPUW on CPU without an NPU).")
@click.option("--from-ir", is_flag=True, help="Compile the IR instead of importing blobs.")
@click.option("--check", is_flag=True,
              help="Check every file's sha256 against the manifest first (sizes are always checked).")
@json_option
def run(out, prompt_ids, text, max_new_tokens, backend, from_ir, check, as_json):
    """Generate greedily from a prompt through the compiled prefill and generate models."""
    from kvc.export.load import open_compiled

    if (prompt_ids is None) == (text is None):
        raise click.UsageError("give exactly one of --prompt-ids and --prompt")
    tokenizer = load_tokenizer(out) if text is not None else None
    ids = tokenizer.encode(text).ids if tokenizer else parse_ids(prompt_ids)
    started = time.perf_counter()
    pipeline = open_compiled(out, backend, from_ir=from_ir, sha256=check)
    load_seconds = time.perf_counter() - started
    gen = pipeline.generate(ids, max_new_tokens)
    decoded = tokenizer.decode(gen.tokens) if tokenizer else None
    metrics = gen.metrics(load_seconds)
    if as_json:
        echo_json({"prompt": ids, "tokens": gen.tokens, "text": decoded, "backend": backend,
                   "variants": metrics["variants"], "metrics": metrics})
        return
    click.echo(f"prompt ({len(ids)} tokens): {ids}")
    click.echo(f"generated ({len(gen.tokens)} tokens): {gen.tokens}")
    if decoded is not None:
        click.echo(f"text: {printable(decoded)}")
    click.echo(metrics_line(metrics, backend))


def metrics_line(m: dict, backend: str) -> str:
    """genai's PerfMetrics in one line: load, TTFT, TPOT (mean, p50, p90), throughput, variants."""
    parts = [f"{backend}: load {m['load_ms']:.0f} ms", f"TTFT {m['ttft_ms']:.1f} ms"]
    if m["tpot_ms"]:
        t = m["tpot_ms"]
        parts.append(f"TPOT {t['mean']:.2f} ms (p50 {t['p50']:.2f}, p90 {t['p90']:.2f})")
        parts.append(f"{m['throughput_tokens_per_s']:.1f} tokens/s")
    parts.append("variants " + (", ".join(map(str, m["variants"])) or "none"))
    return " · ".join(parts)


def printable(text: str) -> str:
    """Control characters (a random model decodes to anything, NUL included) as escapes."""
    return "".join(ch if ch in "\n\t" or ord(ch) >= 32 and ord(ch) != 127 else f"\\x{ord(ch):02x}" for ch in text)
