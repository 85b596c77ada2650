"""`kvc run OUT`: greedy generation through a compiled directory, as the NPU would run it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from kvc.cli.options import json_option, parse_ids
from kvc.cli.render import echo_json, table
from kvc.errors import InvalidModelError, UsageError


def load_tokenizer(directory: Path):
    """The model's tokenizer.json, through the `tokenizers` package (the `text` extra)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"{directory} has no tokenizer.json; pass --prompt-ids instead of --prompt")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises its own exception type
        raise InvalidModelError("bad-tokenizer", str(path), f"cannot read the tokenizer: {exc}") from None


def token_ids(tokenizer, text: str, where: str) -> list[int]:
    """`text` through the tokenizer; text that is not Unicode (a lone surrogate: bytes a shell
    passed that are not UTF-8, or a JSON "\\ud800") is a usage error naming `where` (the
    tokenizer raised a TypeError: exit 1, "internal error")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{where}: the prompt is not valid UTF-8 text ({exc.reason}, character {exc.start})") \
            from None
    return tokenizer.encode(text).ids


@click.command("run")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--compile-from", "source", type=click.Path(exists=True, path_type=Path), default=None,
              help="Make OUT from this model first, unless OUT's manifest records this model's files' sha256 for "
                   "--backend's device and a verification by this kvc (its build): kvc compile's defaults, "
                   "verification on, and the pipeline then serves the blobs the compile checked, in this process "
                   "(nothing imported twice). An OUT compiled otherwise is refused unless --force.")
@click.option("--force", is_flag=True, help="With --compile-from: compile into OUT whatever it holds.")
@click.option("--prompt-ids", default=None, help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--prompt", "text", default=None, help="Prompt as text (uses OUT/tokenizer.json).")
@click.option("--image", "images", multiple=True, metavar="START:ROWS.npy",
              help="A vision-language model's image: its rows (an f32 .npy [m, H], from the vision encoder) in "
                   "place of the prompt's tokens [START, START + m). Repeatable.")
@click.option("--image-positions", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The prompt's mRoPE positions with its images (an integer .npy [3, n]: Qwen2-VL's t, h, w).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0: greedy (the default, and what verification uses); above 0: sample.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
              help="Sample among the k most likely tokens (0: all).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
              help="Sample among the most likely tokens whose probability reaches p.")
@click.option("--seed", type=int, default=None, help="Seed of the sampler: the same seed gives the same tokens.")
@click.option("--eos-token-id", "eos", type=click.IntRange(min=0), multiple=True,
              help="Stop after this token (repeatable; default: eos_token_id of OUT/generation_config.json).")
@click.option("--ignore-eos", is_flag=True, help="Generate --max-new-tokens whatever tokens come.")
@click.option("--stream/--no-stream", default=None,
              help="Print the text as it is generated (default: on a terminal, for text prompts).")
@click.option("--backend", type=click.Choice(["numpy", "openvino", "npu"]), default=None,
              help="numpy: kvc's interpreter; openvino: CPU; npu: the NPU plugin (NPUW on CPU without an NPU). "
                   "Default: openvino where OUT has CPU blobs (or is yet to be compiled), else npu.")
@click.option("--from-ir", is_flag=True, help="Compile the IR instead of importing blobs.")
@click.option("--check", is_flag=True,
              help="Check every file's sha256 against the manifest first (sizes are always checked).")
@click.option("--requests", "requests_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Replay a workload: one JSON request a line (id, prompt_ids or prompt, max_new_tokens, "
                   "session, retention, decode_priority; docs/kv-cache.md).")
@click.option("--prefix-cache", is_flag=True,
              help="With --requests: cache KV blocks across requests (NPUW_LLM_ENABLE_PREFIX_CACHING; needs a "
                   "chunked prefill).")
@click.option("--prefix-caching-block-size", type=click.IntRange(min=1), default=None,
              help="Tokens per cached block, a multiple of the prefill chunk (default: the chunk).")
@click.option("--prefix-caching-max-num-blocks", type=click.IntRange(min=1), default=128, show_default=True,
              help="Blocks the prefix cache holds.")
@click.option("--prefix-caching-max-bytes", type=click.IntRange(min=1), default=None,
              help="Bytes of KV rows the prefix cache holds (default: no byte limit).")
@click.option("--retention-policy", type=click.Choice(["priority", "lru"]), default="priority", show_default=True,
              help="Eviction order: request priorities, then least recently used; or LRU alone.")
@click.option("--events", "events_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --prefix-cache: write the KV cache events (stored, removed, updated) as JSON lines.")
@click.option("--chunk-reuse", is_flag=True,
              help="With --prefix-cache: reuse cached blocks found anywhere in the prompt, moved to their new "
                   "positions, seams recomputed (approximate, reported per request; docs/chunk-reuse.md).")
@click.option("--chunk-repair", type=click.IntRange(min=0), default=None,
              help="With --chunk-reuse: tokens recomputed after each seam (default: one prefill chunk).")
@json_option
def run(out, source, force, prompt_ids, text, max_new_tokens, temperature, top_k, top_p, seed, eos, ignore_eos,
        stream, backend, from_ir, check, requests_path, prefix_cache, prefix_caching_block_size,
        prefix_caching_max_num_blocks, prefix_caching_max_bytes, retention_policy, events_path, chunk_reuse,
        chunk_repair, as_json, images, image_positions):
    """Generate from a prompt through the compiled prefill and generate models in OUT (greedy
    unless --temperature; stopping at the model's end-of-sequence ids), or replay a workload of
    requests (--requests) with a prefix cache and chat sessions. With --compile-from MODEL, OUT
    is compiled from MODEL first when it is not already a compile of it."""
    from kvc.runtime.sampling import Sampling, eos_ids

    if source is None and force:
        raise click.UsageError("--force goes with --compile-from")
    if source is None and not out.is_dir():
        raise click.BadParameter(f"Directory '{out}' does not exist.", param_hint="'OUT'")
    if requests_path is not None and (prompt_ids is not None or text is not None):
        raise click.UsageError("--requests replays its own prompts: leave out --prompt-ids and --prompt")
    if requests_path is None and (prefix_cache or events_path is not None or chunk_reuse):
        raise click.UsageError("--prefix-cache, --chunk-reuse and --events go with --requests")
    if requests_path is None and (prompt_ids is None) == (text is None):
        raise click.UsageError("give exactly one of --prompt-ids and --prompt")
    if events_path is not None and not prefix_cache:
        raise click.UsageError("--events needs --prefix-cache (events describe its blocks)")
    if events_path is not None and requests_path is not None and events_path.resolve() == requests_path.resolve():
        raise click.UsageError(f"--events {events_path} is the --requests file: writing the events would replace it")
    if events_path is not None:  # before the requests run, not after (a path that cannot be written lost the run)
        from kvc.ir.writer import check_writable

        check_writable(events_path, "KV events")
    if chunk_reuse and not prefix_cache:
        raise click.UsageError("--chunk-reuse needs --prefix-cache (the chunks are its blocks)")
    if chunk_repair is not None and not chunk_reuse:
        raise click.UsageError("--chunk-repair goes with --chunk-reuse")
    if requests_path is not None and (images or image_positions is not None):
        raise click.UsageError("--image and --image-positions go with one prompt, not --requests")
    media = read_media(images, image_positions)
    if stream and (text is None or as_json):
        raise click.UsageError("--stream prints text: it needs --prompt (a text prompt) and no --json")
    ids = parse_ids(prompt_ids) if prompt_ids is not None else None
    backend = backend or default_backend(out)
    started = time.perf_counter()
    pipeline, compiled = compile_if_needed(out, source, force, backend, from_ir, check)
    if pipeline is None:  # OUT's files checked before any is read (tokenizer.json, generation_config.json too)
        from kvc.export.manifest import check_files, read_manifest

        check_files(out, read_manifest(out), sha256=check)
    load_seconds = time.perf_counter() - started
    stop = frozenset() if ignore_eos else (frozenset(eos) or eos_ids(out))
    sampling = Sampling(temperature, top_k, top_p, seed, stop)
    if requests_path is not None:
        return run_requests(out, requests_path, backend, from_ir, as_json, prefix_cache,
                            prefix_caching_block_size, prefix_caching_max_num_blocks, prefix_caching_max_bytes,
                            retention_policy, events_path, sampling, chunk_reuse, chunk_repair, pipeline)
    tokenizer = load_tokenizer(out) if text is not None else None
    ids = token_ids(tokenizer, text, "--prompt") if tokenizer else ids
    if pipeline is None:
        from kvc.export.load import open_compiled

        started = time.perf_counter()
        pipeline = open_compiled(out, backend, from_ir=from_ir)  # (hashed above with --check)
        load_seconds += time.perf_counter() - started
    if stream is None:
        stream = tokenizer is not None and not as_json and sys.stdout.isatty()
    streamer = TextStreamer(tokenizer) if stream else None
    gen = pipeline.generate(ids, max_new_tokens, sampling=sampling, on_token=streamer, media=media)
    if streamer is not None:
        streamer.finish()
    decoded = tokenizer.decode(gen.tokens) if tokenizer else None
    metrics = gen.metrics(load_seconds)
    if as_json:
        echo_json({"prompt": ids, "tokens": gen.tokens, "text": decoded, "backend": backend, "compiled": compiled,
                   "finish_reason": gen.finish_reason, "eos_token_ids": sorted(stop),
                   "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed},
                   "variants": metrics["variants"], "metrics": metrics,
                   **({} if media is None else {"images": media.extents()})})
        return
    if streamer is None:
        click.echo(f"prompt ({len(ids)} tokens): {ids}")
        click.echo(f"generated ({len(gen.tokens)} tokens{', stopped at end of sequence' if gen.finish_reason == 'stop' else ''}): {gen.tokens}")
        if decoded is not None:
            click.echo(f"text: {printable(decoded)}")
    click.echo(metrics_line(metrics, backend))


def read_media(images: tuple[str, ...], positions: Path | None):
    """`--image START:ROWS.npy` ... and `--image-positions POSITIONS.npy` as a `Media` (None
    without them). A .npy is read without pickles; what it holds is checked against the prompt
    when the pipeline runs it (`Media.check`)."""
    from kvc.runtime.embeddings import Media, read_npy

    if not images and positions is None:
        return None
    spans = []
    for image in images:
        start, sep, path = image.partition(":")
        if not sep or not (start.isascii() and start.isdigit()):
            raise UsageError(f"--image {image!r}: expected START:ROWS.npy (START the prompt position of its first row)")
        spans.append((int(start), read_npy(Path(path), "--image")))
    return Media(tuple(sorted(spans, key=lambda span: span[0])),
                 None if positions is None else read_npy(positions, "--image-positions"))


def default_backend(out: Path) -> str:
    """The backend `kvc run` serves OUT on unless told: openvino where OUT has CPU blobs (or
    does not exist yet: --compile-from compiles it for the CPU), else npu (an NPU-only
    directory ran on openvino from its IR, the blobs never read)."""
    from kvc.export.load import blob_backends
    from kvc.export.manifest import read_manifest

    if not (out / "manifest.json").is_file():
        return "openvino"
    return (*blob_backends(read_manifest(out)), "openvino")[0]


def compile_if_needed(out: Path, source: Path | None, force: bool, backend: str, from_ir: bool, check: bool = False):
    """--compile-from: compile `source` into `out` for the backend's device (CPU for numpy) with
    `kvc compile`'s defaults, unless `out` already holds a compile of it for that device.
    Returns (the pipeline the compile opened on its blobs, or None when `out` is to be opened:
    not compiled, or a backend that runs the IR, numpy or --from-ir; whether it compiled). A
    directory compiled from other files, for another device, or without verification (a
    --no-verify compile of the same files, which --compile-from served as if verified) is
    refused without --force, never replaced: the user may have kept it on purpose."""
    from kvc.cli.options import progress
    from kvc.export.compile import (CompileOptions, compile_and_open, compile_static, compile_to,
                                    source_image_rows, source_selects)
    from kvc.export.load import DEVICE_OF_BACKEND
    from kvc.export.manifest import kvc_build, read_manifest, same_source

    if source is None:
        return None, False
    device = DEVICE_OF_BACKEND.get(backend, "CPU")  # numpy runs the IR of a compile for the CPU
    runs_ir = backend == "numpy" or from_ir  # any compile's IR serves
    if out.exists() and not force:
        manifest = read_manifest(out)
        if not same_source(manifest, source):
            raise UsageError(f"{out} holds a compile of other files than {source}; pass --force to compile {source} "
                             f"into it, or give another OUT")
        if manifest.get("kvc_build") != kvc_build():  # verified by this kvc, with the checks it has
            made = manifest.get("kvc_build") or "none recorded"
            raise UsageError(f"{out} is a compile of {source} that another kvc verified (its build {made}, this one "
                             f"{kvc_build()}), and --compile-from serves only what this kvc verified; pass --force to "
                             f"compile it again, or run {out} without --compile-from to serve it as it is (`kvc "
                             f"verify {out}` checks it with this kvc)")
        if not (manifest.get("verification") or {}).get("ok"):  # --compile-from promises a verified compile
            raise UsageError(f"{out} is a compile of {source} without a verification (kvc compile --no-verify), and "
                             f"--compile-from serves only a compile verified against its source; pass --force to "
                             f"compile it again with verification on, or run {out} without --compile-from to serve it "
                             f"unverified")
        devices = manifest["devices"] if isinstance(manifest["devices"], list) else []
        if not runs_ir and device not in devices:
            raise UsageError(f"{out} is a compile of {source} for {', '.join(map(str, devices)) or 'no device'}, not "
                             f"{device} (--backend {backend}); pass --force to compile it again for {device}")
        progress(f"{out}'s manifest records {source} as its source, unchanged: running it (its own files are "
                 f"checked by size{', and by sha256 (--check)' if check else '; --check hashes them'})")
        return None, False
    options = CompileOptions(compile_static((device,), selects=source_selects(source),
                                            image_rows=source_image_rows(source)),
                             (device,), force=force)
    if runs_ir:
        compile_to(source, out, options, progress=progress)
        return None, True
    return compile_and_open(source, out, options, progress=progress)[1], True


class TextStreamer:
    """Prints generated text as tokens arrive: the decoded text so far, less what was printed
    (a token that completes no character prints nothing until one that does)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.printed = tokenizer, [], ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            click.echo(printable(text[len(self.printed):]), nl=False)
            self.printed = text

    def finish(self) -> None:
        text = self.tokenizer.decode(self.tokens)
        if text.startswith(self.printed):
            click.echo(printable(text[len(self.printed):]), nl=False)
        click.echo()


def run_requests(out: Path, path: Path, backend: str, from_ir: bool, as_json: bool, prefix_cache: bool,
                 block_size, max_blocks: int, max_bytes, policy: str, events_path: Path | None, sampling,
                 chunk_reuse: bool = False, chunk_repair: int | None = None, pipeline=None) -> None:
    from kvc.cache.prefix import PrefixCache
    from kvc.cache.requests import read_requests
    from kvc.cache.serving import CachedPipeline, replay
    from kvc.export.load import open_compiled

    entries = read_requests(path)
    needs_text = any(getattr(e, "prompt", None) is not None for e in entries)
    tokenizer = load_tokenizer(out) if needs_text else None
    if pipeline is None:
        pipeline = open_compiled(out, backend, from_ir=from_ir)  # (its files checked by `run` first)
    cache = None
    if prefix_cache:
        cache = PrefixCache(block_size or pipeline.lengths.chunk or 1, max_blocks, max_bytes,
                            event_buffer_size=1 << 20 if events_path is not None else 0, policy=policy)
    chunks = None
    if chunk_reuse:
        from kvc.cache.chunks import ChunkReuse
        from kvc.cache.moves import calibrate, model_config
        from kvc.export.load import model_session

        exact = None if backend == "numpy" else model_session(out, "prefill", "numpy")
        chunks = ChunkReuse(calibrate(pipeline, model_config(out), exact=exact), chunk_repair)
    served = CachedPipeline(pipeline, cache, chunks)
    events: list[dict] = []

    def drain(result):
        if cache is not None and events_path is not None:
            events.extend(e.to_dict() for e in cache.get_latest_events())

    results = replay(served, entries, (lambda t: token_ids(tokenizer, t, str(path))) if tokenizer else None, str(path), drain,
                     sampling)
    if events_path is not None:
        from kvc.ir.writer import write_output

        write_output(events_path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in events).encode(), "KV events")
    # "blocks": the chained blocks, the set the events replay to; chunk-reuse blocks apart (no events)
    summary = ({"blocks": cache.chain_keys(), "chunk_blocks": cache.chunk_keys(), **cache.stats.to_dict()}
               if cache is not None else None)
    if as_json:
        echo_json({"backend": backend, "requests": results, "cache": summary})
        return
    approx = ["approx"] if chunk_reuse else []
    click.echo(table(["id", "session", "prompt", "cached", *approx, "new", "TTFT ms", "TPOT ms"],
                     [(r["id"], r["session"] or "-", r["prompt_tokens"], r["cached_tokens"],
                       *([r["approximate_tokens"]] if chunk_reuse else []), len(r["tokens"]),
                       f"{r['ttft_ms']:.1f}", "-" if r["tpot_ms"] is None else f"{r['tpot_ms']:.2f}")
                      for r in results]))
    if summary is not None:
        chunk_blocks = (f" (and {len(summary['chunk_blocks'])} chunk-reuse blocks, "
                        f"{summary['chunk_evicted_blocks']} evicted)" if chunk_reuse else "")
        click.echo(f"prefix cache: {len(summary['blocks'])} blocks, hit rate {summary['hit_rate']:.1%} "
                   f"({summary['hit_tokens']} of {summary['prompt_tokens']} prompt tokens), "
                   f"{summary['evicted_blocks']} evicted{chunk_blocks}")
    if chunk_reuse:
        placed = sum(r["approximate_tokens"] for r in results)
        click.echo(f"chunk reuse: {placed} prompt tokens placed from other positions (approximate: their rows were "
                   f"computed after other text)")


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
