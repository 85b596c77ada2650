"""Options and arguments several commands share."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import click

from kvc import jsontext
from kvc.errors import UsageError

model_argument = click.argument("model", required=False, type=click.Path(exists=True, path_type=str))


def resolve_model(model: str | None) -> Path:
    """The user's model path, or the bundled default model when none is given."""
    if model:
        return Path(model)
    from kvc import fixtures

    path = fixtures.bundled_model()
    if not path.exists():
        raise click.UsageError("no MODEL given and the bundled model is missing from this installation")
    return path


COUNTED = re.compile(r"^(?P<phase>.*?) \((?P<done>\d+)/(?P<total>\d+)\)(?:: (?P<detail>.*))?$")
BAR = 24


class Progress:
    """Progress lines on stderr: `[kvc] message`. A message `phase (i/n)` or `phase (i/n):
    detail` says i of the phase's n steps are done (device compiles, verification probes); on a
    terminal the steps of one phase redraw a single bar line, elsewhere (logs, pipes, --json
    runs captured to a file) each is a plain line. A reader that went away
    (`kvc compile ... 2>&1 | head`) must not stop the work: the rest goes to /dev/null."""

    def __init__(self, stream=None):
        self.stream = stream
        self.open_phase: str | None = None
        self._lock = threading.Lock()  # a compile tells its device compiles from a second thread

    def _terminal(self) -> bool:
        stream = self.stream or sys.stderr
        return bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, message: str) -> None:
        try:
            with self._lock:
                self._write(message)
        except BrokenPipeError:
            import os
            import sys

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())

    def _write(self, message: str) -> None:
        stream = self.stream or sys.stderr
        m = COUNTED.match(message)
        if not self._terminal() or m is None:
            self._close(stream)
            click.echo(f"[kvc] {message}", file=stream)
            return
        done, total = int(m["done"]), max(int(m["total"]), 1)
        filled = BAR * done // total
        if self.open_phase not in (None, m["phase"]):
            self._close(stream)
        detail = f" {m['detail']}" if m["detail"] else ""
        click.echo(f"\r\x1b[K[kvc] {m['phase']} [{'#' * filled}{'.' * (BAR - filled)}] {done}/{total}{detail}",
                   file=stream, nl=False)
        self.open_phase = m["phase"]
        if done >= total:
            self._close(stream)

    def _close(self, stream) -> None:
        if self.open_phase is not None:
            click.echo("", file=stream)
            self.open_phase = None


progress = Progress()


def parse_variants(text: str) -> str | tuple[int, ...]:
    if text in ("single", "pyramid"):
        return text
    try:
        return tuple(int(v) for v in text.replace(":", ",").split(",") if v.strip())
    except ValueError:
        raise UsageError(f"--variants takes 'single', 'pyramid' or sizes like 256,512; found {text!r}") from None


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--prompt-ids takes comma-separated token ids, found {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    bad = next((t for t in ids if not 0 <= t < 2 ** 63), None)
    if bad is not None:
        raise UsageError(f"--prompt-ids: token id {bad} is not a token id (0 to 2^63 - 1, and below the vocabulary size)")
    return ids


def load_prompts(path: str) -> list[list[int]]:
    """A prompts file: a JSON list of token-id lists, or of {"ids": [...]} objects."""
    try:
        data = jsontext.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise UsageError(f"{path}: cannot read prompts: {exc}") from None
    if isinstance(data, dict) and "prompts" in data:
        data = data["prompts"]
    entries = data if isinstance(data, list) else []
    prompts = [entry.get("ids") if isinstance(entry, dict) else entry for entry in entries]
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in p) for p in prompts):
        raise UsageError(f"{path}: expected a JSON list of token-id lists (or of {{\"ids\": [...]}})")
    return prompts


def _load_plugins(ctx, param, values):
    from kvc.passes.framework.plugins import load_plugin

    for path in values:
        load_plugin(path)


def pass_plugin_option(f):
    return click.option("--pass-plugin", multiple=True, metavar="FILE.py", expose_value=False, is_eager=True,
                        callback=_load_plugins,
                        help="Import a Python file that registers passes (then usable in --passes); repeatable.")(f)


def _sizes(value, expected: str) -> tuple[int, ...]:
    """Comma-separated sizes >= 0, or a BadParameter naming what was `expected`."""
    try:
        sizes = tuple(int(v) for v in str(value).split(","))
    except ValueError:
        sizes = (-1,)
    if any(s < 0 for s in sizes):
        raise click.BadParameter(f"expected {expected}, found {value!r}")
    return sizes


def _chunk_value(ctx, param, value):
    """auto, one size, or sizes like 64,512 (the smallest the chunk, the others bulk chunks)."""
    if value == "auto":
        return value
    sizes = tuple(sorted(set(_sizes(value, "auto, a size >= 0 or sizes like 64,512"))))  # "0,0" is 0
    return sizes[0] if len(sizes) == 1 else sizes


def _first_value(ctx, param, value):
    """auto, 0 (none), or sizes like 128 or 64,128."""
    if value == "auto":
        return value
    sizes = _sizes(value, "auto, 0 or sizes like 128 or 64,128")
    if len(sizes) > 1 and 0 in sizes:
        raise click.BadParameter(f"expected auto, 0 or sizes like 128 or 64,128, found {value!r}")
    return () if sizes == (0,) else sizes


def static_options(f):
    """The options that shape the static pipeline, named after NPUW's properties."""
    options = [
        pass_plugin_option,
        click.option("--max-prompt-len", type=click.IntRange(min=1), default=None,
                     help="Longest prompt the prefill takes (NPUW_LLM_MAX_PROMPT_LEN); aligned up to 64. "
                          "Default 1024, lowered so that P + R fits the positions the model's config.json "
                          "states when neither length is given."),
        click.option("--min-response-len", type=click.IntRange(min=1), default=None,
                     help="Tokens guaranteed after a full prompt (NPUW_LLM_MIN_RESPONSE_LEN); aligned up to 64. "
                          "Default 128."),
        click.option("--prefill-chunk-size", default="auto", show_default=True, callback=_chunk_value,
                     help="Chunked prefill size, a power of two (0: the whole prompt at once); several, like "
                          "64,512: the smallest is the chunk, each larger one a bulk prefill model that long "
                          "prompts run in fewer calls. auto: when compiling for CPU only, 32,256 for f32 CPU blobs "
                          "and 16,128 for bf16 or f16 ones (a bulk chunk dropped when P is not above it), else 0 "
                          "(NPUW's default: up to 1024 at once)."),
        click.option("--prefill-first", default="auto", show_default=True, callback=_first_value,
                     help="First-chunk prefill models: a prompt's first F tokens in one call that reads no past "
                          "(a chunk model's attention reads all its P - C past slots, empty or not); F below P, "
                          "any size; several like 16,128; 0: none. auto: when compiling for CPU only with a "
                          "chunked prefill, the largest chunk with --prefill-first-rows dynamic, else 16,128; "
                          "otherwise none."),
        click.option("--prefill-first-rows", type=click.Choice(["auto", "static", "dynamic"]), default="auto",
                     show_default=True,
                     help="dynamic: one first-chunk model that takes a prompt's first 1 to F tokens unpadded "
                          "(CPU only: the NPU runs static shapes); static: each first chunk F rows, a shorter "
                          "prompt left-padded. auto: dynamic when compiling for CPU only at f32 with a chunked "
                          "prefill, else static."),
        click.option("--variants", default="pyramid", show_default=True,
                     help="Generate variants: 'pyramid' (NPUW_LLM_GENERATE_PYRAMID, on by default in the NPU plugin: "
                          "1024*2^k+R up to P+R), 'single' (P+R), or sizes like 256,512."),
        click.option("--kv-precision", type=click.Choice(["auto", "f16", "bf16", "f32", "int8"]), default="auto",
                     show_default=True,
                     help="Element type of KV inputs/outputs (the NPU plugin stores f16; bf16 for CPU only); int8: "
                          "with one f16 scale per token and head, dequantized in the graph (docs/kv-precision.md). "
                          "auto: when compiling for CPU only, the CPU blobs' own arithmetic (f32 or bf16: "
                          "--inference-precision), else f16."),
        click.option("--transpose-v", is_flag=True, help="Store V as [B, H, D, S] (NPUW's OPTIMIZE_V_TENSORS)."),
        click.option("--slice-logits/--no-slice-logits", default=True, show_default=True,
                     help="Prefill returns only the last position's logits (as NPUW does)."),
        click.option("--beam", type=click.Choice(["drop", "keep", "indirect"]), default="drop", show_default=True,
                     help="beam_idx handling: drop it (OpenVINO). keep and indirect are refused: the static "
                          "contract runs batch 1."),
        click.option("--attention", type=click.Choice(["auto", "grouped", "split-past", "fold", "sdpa"]),
                     default="auto", show_default=True,
                     help="grouped: attention as MatMuls over the unexpanded GQA cache (no per-step copy of "
                          "the cache); split-past: grouped, and every model with a past reads it and the new "
                          "rows apart (no Concat of the cache every call); fold: the generate models as "
                          "split-past, the prefill models' attention rank 4 with the GQA repeat folded into "
                          "the query rows (which the CPU plugin fuses); sdpa: keep ScaledDotProductAttention. "
                          "auto: fold when compiling for CPU only, else grouped."),
        click.option("--prefill-mlp", type=click.Choice(["auto", "rows", "as-is"]), default="auto", show_default=True,
                     help="rows: the prefill models' gated MLPs multiply 2-D rows, which the CPU plugin does not "
                          "fuse into LLMMLP (which keeps an f16 copy of f32 MLP weights beside its own: 2 "
                          "bytes per MLP weight); as-is: as exported. auto: rows when compiling for CPU only at bf16."),
        click.option("--passes", "passes_", default=None, metavar="PIPELINE",
                     help="Common pipeline run before static shaping, e.g. 'lift-state,fuse-kvcache'."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


STATIC_KEYS = ("max_prompt_len", "min_response_len", "prefill_chunk_size", "prefill_first", "prefill_first_rows",
               "variants", "kv_precision",
               "transpose_v", "slice_logits", "beam", "attention", "prefill_mlp", "passes_")


def pop_static(kwargs: dict, devices=("CPU",), precision: str = "f32", selects: bool = False, image_rows: int = 0):
    """The StaticOptions of the command's options; `auto` values resolved for `devices`, the
    CPU blobs' `precision`, a model that `selects` and one whose images take `image_rows`
    (`compile_static`, what the library offers for the same)."""
    from kvc.export.compile import compile_static

    fields = {k.rstrip("_"): kwargs.pop(k) for k in STATIC_KEYS}
    fields["variants"] = parse_variants(fields["variants"])
    fields["kv_precision"] = {"int8": "i8"}.get(fields["kv_precision"], fields["kv_precision"])
    return compile_static(devices, precision, selects, image_rows, **fields)


def ir_print_options(f):
    options = [
        click.option("--print-ir-before", multiple=True, metavar="GLOB", help="Print the IR before matching passes."),
        click.option("--print-ir-after", multiple=True, metavar="GLOB", help="Print the IR after matching passes."),
        click.option("--print-ir-after-all", is_flag=True, help="Print the IR after every pass."),
        click.option("--print-ir-after-change", is_flag=True,
                     help="With --print-ir-after[-all]: one status line for a pass that changed nothing."),
        click.option("--print-ir-diff", is_flag=True, help="Print diffs instead of whole IR."),
        click.option("--dump-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Write NNN-<pass>.txt/.diff and index.json per model branch here."),
        click.option("--debug-rules", is_flag=True,
                     help="Print each rewrite rule's matches, and why it did not match at each node it tried."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def pop_instrumentation(kwargs: dict):
    import sys

    from kvc.passes import Instrumentation

    after = tuple(kwargs.pop("print_ir_after")) + (("*",) if kwargs.pop("print_ir_after_all") else ())
    return Instrumentation(print_before=tuple(kwargs.pop("print_ir_before")), print_after=after,
                           after_change=kwargs.pop("print_ir_after_change"), print_diff=kwargs.pop("print_ir_diff"),
                           dump_dir=kwargs.pop("dump_dir"), stream=sys.stderr,
                           debug_rules=kwargs.pop("debug_rules"))


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")(f)
