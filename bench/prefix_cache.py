"""Prefix caching and priority retention on a shared-prefix workload (issue 15, parts 3 and 6).

The workload (`make_workload`, seeded): a long system prompt every request starts with,
several shared contexts (a document, a tool list) that most requests add after it, and a
one-off user turn to finish; a few new tokens each. Requests give the system prompt priority
100 and their context 70 (TensorRT-LLM's retention API), and their one-off turn and decode
phase priority 0. The cache holds fewer blocks than the system prompt and every context, so
it must evict.

Engines, one request at a time, each request run on every engine in turn (drift on the shared
machine hits all alike), TTFT per request:

  kvc, no cache         OUT's CPU blobs (`kvc compile MODEL -o OUT`, the defaults)
  kvc, LRU              the same pipeline with kvc's prefix cache, eviction by LRU alone
  kvc, priority         the same cache evicting by the requests' priorities, then LRU
  NPUW_LLM, prefix      the NPU plugin's own LLM path on its CPU backend with
                        NPUW_LLM_ENABLE_PREFIX_CACHING (same chunk, block size and block count)

The hit rate is the fraction of prompt tokens restored from the cache (NPUW does not report
its own). With `--simulate N`, the two policies' hit rates on N requests of the same
generator, cache bookkeeping only (no model), follow.

    /work/fxvenv/bin/python bench/build_model.py        # once: bench/.models/llama-250m-fp32
    python bench/prefix_cache.py [--requests 48] [--max-blocks 24] [--simulate 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
MODEL = BENCH / ".models" / "llama-250m-fp32"


def make_workload(seed: int, count: int, system: int = 256, contexts: int = 8, context_len: int = 256,
                  user: tuple[int, int] = (16, 96), p_context: float = 0.9, new_tokens: int = 4,
                  vocab: int = 32000) -> list[dict]:
    """Requests as `kvc run --requests` lines (dicts)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    head = tokens(system)
    shared = [tokens(context_len) for _ in range(contexts)]
    requests = []
    for i in range(count):
        prompt, retention = list(head), [{"start": 0, "end": system, "priority": 100}]
        if rng.random() < p_context:
            ctx = shared[min(int(rng.expovariate(1.0)), contexts - 1)]  # some contexts are hotter
            retention.append({"start": len(prompt), "end": len(prompt) + len(ctx), "priority": 70})
            prompt += ctx
        turn = tokens(rng.randint(*user))
        retention.append({"start": len(prompt), "end": len(prompt) + len(turn), "priority": 0})
        prompt += turn
        requests.append({"id": i, "prompt_ids": prompt, "max_new_tokens": new_tokens, "retention": retention,
                         "decode_priority": 0})
    return requests


def retention_of(request: dict):
    from kvc.cache.requests import parse_line

    return parse_line(request, 1).retention


def simulate(requests: list[dict], block: int, max_blocks: int) -> dict[str, float]:
    """Hit rates of both policies, bookkeeping only (rows are empty arrays)."""
    from kvc.cache.prefix import PrefixCache

    rates = {}
    for policy in ("lru", "priority"):
        cache = PrefixCache(block, max_blocks, policy=policy)
        for r in requests:
            prompt = r["prompt_ids"]
            hit = cache.lookup(prompt, len(prompt) - 1)
            cache.record_lookup(len(prompt), len(hit) * block)
            retention = retention_of(r)
            cache.use(hit, retention, len(prompt))
            count = len(prompt) + r["max_new_tokens"] - 1
            cache.store(prompt + [0] * (count - len(prompt)), count, lambda a, b: {"kv": np.empty(0)}, retention,
                        len(prompt))
        rates[policy] = cache.stats.hit_rate
    return rates


def compile_default(model: Path, prefix: str) -> Path:
    """`kvc compile MODEL -o OUT` with the defaults, into a new temporary directory."""
    out = Path(tempfile.mkdtemp(prefix=prefix)) / "out"
    subprocess.run([sys.executable, "-m", "kvc.cli.main", "compile", str(model), "-o", str(out)], check=True,
                   capture_output=True)
    return out


def npuw_prefix_caching(model: Path, lengths, max_blocks: int):
    """NPUW_LLM on its CPU backend with prefix caching at kvc's P, R and chunk (block = chunk):
    a function (prompt, new tokens) -> TTFT seconds."""
    import openvino as ov

    config = {"NPU_USE_NPUW": "YES", "NPUW_DEVICES": "CPU", "NPUW_LLM": "YES",
              "NPUW_LLM_MAX_PROMPT_LEN": lengths.prompt, "NPUW_LLM_MIN_RESPONSE_LEN": lengths.response,
              "NPUW_LLM_PREFILL_CHUNK_SIZE": lengths.chunk, "NPUW_LLM_ENABLE_PREFIX_CACHING": "YES",
              "NPUW_LLM_PREFIX_CACHING_BLOCK_SIZE": lengths.chunk,
              "NPUW_LLM_PREFIX_CACHING_MAX_NUM_BLOCKS": max_blocks}
    return npuw_request(ov.Core().compile_model(str(model / "openvino_model.xml"), "NPU", config))


def npuw_request(compiled):
    request = compiled.create_infer_request()

    def run(prompt: list[int], new_tokens: int) -> float:
        request.reset_state()
        n = len(prompt)
        feed = {"input_ids": np.asarray(prompt, np.int64)[None], "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)}
        start = time.perf_counter()
        out = request.infer(feed)
        ttft = time.perf_counter() - start
        token, seen = int(np.argmax(out["logits"][0, -1])), n
        for _ in range(new_tokens - 1):
            out = request.infer({"input_ids": np.array([[token]], np.int64),
                                 "attention_mask": np.ones((1, seen + 1), np.int64),
                                 "position_ids": np.array([[seen]], np.int64), "beam_idx": np.zeros(1, np.int32)})
            token, seen = int(np.argmax(out["logits"][0, -1])), seen + 1
        return ttft
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--out", type=Path, default=None, help="a compiled OUT to reuse (default: compile one)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-blocks", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate", type=int, default=2000, help="requests for the bookkeeping-only hit rates")
    args = ap.parse_args(argv)

    from kvc.cache.prefix import PrefixCache
    from kvc.cache.serving import CachedPipeline
    from kvc.export.load import open_compiled

    out = args.out or compile_default(args.model, "kvc-prefix-")
    pipe = open_compiled(out, "openvino")
    chunk = pipe.lengths.chunk
    requests = make_workload(args.seed, args.requests)
    engines = {"kvc, no cache": CachedPipeline(pipe)}
    caches = {}
    for policy in ("lru", "priority"):
        caches[policy] = PrefixCache(chunk, args.max_blocks, policy=policy)
        engines[f"kvc, {policy}"] = CachedPipeline(pipe, caches[policy])
    npuw = npuw_prefix_caching(args.model, pipe.lengths, args.max_blocks)
    ttft: dict[str, list[float]] = {name: [] for name in (*engines, "NPUW_LLM, prefix caching")}
    for r in requests:
        retention = retention_of(r)
        for name, engine in engines.items():
            gen = engine.generate(r["prompt_ids"], r["max_new_tokens"], retention=retention)
            ttft[name].append(gen.prefill_seconds)
        ttft["NPUW_LLM, prefix caching"].append(npuw(r["prompt_ids"], r["max_new_tokens"]))
    warm = slice(len(requests) // 4, None)  # the first quarter fills the caches
    rows = []
    for name, times in ttft.items():
        policy = name.split(", ")[1] if name.startswith("kvc, ") and name != "kvc, no cache" else None
        rows.append({"engine": name, "ttft_ms_mean": 1e3 * statistics.mean(times),
                     "ttft_ms_mean_warm": 1e3 * statistics.mean(times[warm]),
                     "ttft_ms_p50": 1e3 * statistics.median(times),
                     "hit_rate": caches[policy].stats.hit_rate if policy else None})
    base = rows[0]["ttft_ms_mean"]
    mean_len = statistics.mean(len(r["prompt_ids"]) for r in requests)
    print(f"{len(requests)} requests (mean prompt {mean_len:.0f} tokens), chunk and block {chunk}, "
          f"{args.max_blocks} blocks, P {pipe.lengths.prompt}")
    print("| engine | hit rate | TTFT mean | after the first quarter | p50 | vs kvc, no cache |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        rate = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.1%}"
        print(f"| {row['engine']} | {rate} | {row['ttft_ms_mean']:.1f} ms | {row['ttft_ms_mean_warm']:.1f} ms | "
              f"{row['ttft_ms_p50']:.1f} ms | {row['ttft_ms_mean'] / base:.2f}x |")
    if args.simulate:
        rates = simulate(make_workload(args.seed + 1, args.simulate), chunk, args.max_blocks)
        print(f"\nbookkeeping only, {args.simulate} requests: hit rate LRU {rates['lru']:.1%}, "
              f"priority {rates['priority']:.1%} (prompt tokens computed: {1 - rates['priority']:.1%} against "
              f"{1 - rates['lru']:.1%}, {(1 - rates['priority']) / (1 - rates['lru']):.2f}x)")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
