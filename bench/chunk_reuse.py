"""Chunk-level KV reuse on a RAG-like workload (issue 16 part 2).

The workload (`make_workload`, seeded): a pool of documents; each prompt is a fixed
instruction, `k` documents drawn from the pool in a random order, and a one-off question.
The instruction is an exact prefix every request shares; the documents recur at other
positions after other text, which only chunk reuse can serve.

1. The default CLI path, end to end, against the peer in the same run:
     kvc compile MODEL -o OUT                                   (defaults)
     kvc run OUT --requests W.jsonl --prefix-cache --json       (exact prefix only)
     kvc run OUT --requests W.jsonl --prefix-cache --chunk-reuse --json
     NPUW_LLM with NPUW_LLM_ENABLE_PREFIX_CACHING (same chunk, block size and block count)
   TTFT as each reports it (kvc: lookup, moves and prefill; NPUW: its prefill call).
2. Accuracy by repair length R (tokens recomputed after each seam) and by the fraction of the
   prompt reused approximately, against the same pipeline without any cache: first-step
   logit cosine and NRMSE, greedy agreement over the new tokens (fraction of positions equal;
   first divergence), TTFT. The accuracy-by-reuse table is the ground truth (seed 003).

    /work/fxvenv/bin/python bench/build_model.py        # once: bench/.models/llama-250m-fp32
    python bench/chunk_reuse.py [--requests 24] [--new-tokens 32] [--repairs 0,16,64,192]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
MODEL = BENCH / ".models" / "llama-250m-fp32"
sys.path.insert(0, str(BENCH))


def make_workload(seed: int, count: int, instruction: int = 64, documents: int = 8, doc_len: int = 192,
                  per_prompt: int = 3, question: tuple[int, int] = (16, 48), new_tokens: int = 32,
                  vocab: int = 32000) -> list[dict]:
    """Requests as `kvc run --requests` lines (dicts)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    head = tokens(instruction)
    pool = [tokens(doc_len) for _ in range(documents)]
    requests = []
    for i in range(count):
        prompt = list(head)
        for d in rng.sample(range(documents), per_prompt):
            prompt += pool[d]
        prompt += tokens(rng.randint(*question))
        requests.append({"id": i, "prompt_ids": prompt, "max_new_tokens": new_tokens})
    return requests


def cli_run(out: Path, workload: Path, *extra: str) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvc.cli.main", "run", str(out), "--requests", str(workload),
                           "--prefix-cache", *extra, "--json"], check=True, capture_output=True, text=True)
    data = json.loads(done.stdout)
    data["wall_s"] = time.perf_counter() - started
    return data


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def agreement(ref: list[int], got: list[int]) -> float:
    return sum(x == y for x, y in zip(ref, got)) / len(ref)


BUCKETS = ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.01))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--out", type=Path, default=None, help="a compiled OUT to reuse (default: compile one)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repairs", default="0,16,64,192")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from kvc.cache.chunks import ChunkReuse
    from kvc.cache.moves import calibrate, model_config
    from kvc.cache.prefix import DEFAULT_MAX_BLOCKS, PrefixCache
    from kvc.cache.serving import CachedPipeline
    from kvc.export.load import model_session, open_compiled
    from kvc.runtime.compare import first_divergence, nrmse
    from prefix_cache import compile_default, npuw_prefix_caching

    out = args.out or compile_default(args.model, "kvc-chunks-")
    requests = make_workload(args.seed, args.requests, new_tokens=args.new_tokens)
    workload = out.parent / "rag.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in requests))
    pipe = open_compiled(out, "openvino")
    L = pipe.lengths
    mean_len = statistics.mean(len(r["prompt_ids"]) for r in requests)
    print(f"{len(requests)} requests, mean prompt {mean_len:.0f} tokens (instruction 64 + 3 of 8 documents of 192 "
          f"+ a question of 16-48), {args.new_tokens} new tokens each; P {L.prompt}, chunk and block {L.chunk}, "
          f"{DEFAULT_MAX_BLOCKS} blocks")

    # 1. The default CLI path and the peer.
    prefix = cli_run(out, workload)
    chunks = cli_run(out, workload, "--chunk-reuse")
    npuw = npuw_prefix_caching(args.model, L, DEFAULT_MAX_BLOCKS)
    npuw_ttft = [npuw(r["prompt_ids"], 1) for r in requests]
    warm = slice(len(requests) // 4, None)
    print("\n| engine (default CLI path) | TTFT mean | after the first quarter | prompt tokens approximate |")
    print("|---|---:|---:|---:|")
    rows = [("kvc run --prefix-cache", [r["ttft_ms"] for r in prefix["requests"]], prefix["requests"]),
            ("kvc run --prefix-cache --chunk-reuse", [r["ttft_ms"] for r in chunks["requests"]], chunks["requests"]),
            ("NPUW_LLM, prefix caching", [1e3 * t for t in npuw_ttft], None)]
    total = sum(len(r["prompt_ids"]) for r in requests)
    for name, ttft, per in rows:
        approx = "-" if per is None else f"{sum(r['approximate_tokens'] for r in per) / total:.1%}"
        print(f"| {name} | {statistics.mean(ttft):.1f} ms | {statistics.mean(ttft[warm]):.1f} ms | {approx} |")

    # 2. Accuracy by R and by reuse fraction, against the same pipeline without a cache; each
    #    request runs on every engine in turn, so drift on the shared machine hits all alike.
    mover = calibrate(pipe, model_config(out), exact=model_session(out, "prefill", "numpy"))
    repairs = [int(x) for x in args.repairs.split(",")]
    engines = {"prefix": CachedPipeline(pipe, PrefixCache(L.chunk))}
    engines.update({R: CachedPipeline(pipe, PrefixCache(L.chunk), ChunkReuse(mover, R)) for R in repairs})
    reference, prefix_ttft, results = [], [], {R: [] for R in repairs}
    for r in requests:
        ref = pipe.generate(r["prompt_ids"], r["max_new_tokens"])
        reference.append(ref)
        for name, engine in engines.items():
            got = engine.generate(r["prompt_ids"], r["max_new_tokens"])
            if name == "prefix":
                prefix_ttft.append(1e3 * got.prefill_seconds)
                assert got.tokens == ref.tokens, "the exact prefix cache changed a generation"
                continue
            results[name].append({
                "fraction": got.placed_tokens / len(r["prompt_ids"]), "placed": got.placed_tokens,
                "ttft_ms": 1e3 * got.prefill_seconds, "cosine": cosine(ref.logits[0], got.logits[0]),
                "nrmse": nrmse(ref.logits[0], got.logits[0]), "agreement": agreement(ref.tokens, got.tokens),
                "divergence": first_divergence(ref.tokens, got.tokens)})
    base_ttft = statistics.mean(1e3 * g.prefill_seconds for g in reference)
    print(f"\nlibrary, interleaved per request: no cache TTFT mean {base_ttft:.1f} ms; exact prefix cache only "
          f"{statistics.mean(prefix_ttft):.1f} ms ({statistics.mean(prefix_ttft) / base_ttft:.2f}x, tokens identical)")
    print("\n| R (tokens recomputed after a seam) | reused approximately | TTFT mean | vs no cache | first-step cosine "
          "(min) | first-step NRMSE (max) | greedy agreement (mean) | identical generations |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for repair, per in results.items():
        print(f"| {repair} | {statistics.mean(p['fraction'] for p in per):.1%} | "
              f"{statistics.mean(p['ttft_ms'] for p in per):.1f} ms | "
              f"{statistics.mean(p['ttft_ms'] for p in per) / base_ttft:.2f}x | "
              f"{statistics.mean(p['cosine'] for p in per):.4f} ({min(p['cosine'] for p in per):.4f}) | "
              f"{max(p['nrmse'] for p in per):.3g} | {statistics.mean(p['agreement'] for p in per):.1%} | "
              f"{sum(p['divergence'] is None for p in per)}/{len(per)} |")
    print("\n| R | prompt reused approximately | requests | first-step cosine (mean) | greedy agreement (mean) | "
          "first divergence (median, of those that diverge) |")
    print("|---:|---|---:|---:|---:|---:|")
    for repair, per in results.items():
        for low, high in BUCKETS:
            group = [p for p in per if low <= p["fraction"] < high]
            if not group:
                continue
            div = [p["divergence"] for p in group if p["divergence"] is not None]
            print(f"| {repair} | {low:.0%}-{min(high, 1):.0%} | {len(group)} | "
                  f"{statistics.mean(p['cosine'] for p in group):.4f} | "
                  f"{statistics.mean(p['agreement'] for p in group):.1%} | "
                  f"{statistics.median(div) if div else '-'} |")
    print(json.dumps({"results": {str(k): v for k, v in results.items()},
                      "cli": {"prefix": [r["ttft_ms"] for r in prefix["requests"]],
                              "chunks": [r["ttft_ms"] for r in chunks["requests"]]},
                      "npuw_ttft_ms": [1e3 * t for t in npuw_ttft], "no_cache_ttft_ms": base_ttft}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
