"""`kvc plan` against the pyramid a user gets, measured (issue 17 part 2).

Two workloads (seeded): short chat turns (prompts 16-160 tokens, 16-128 new) and long
documents (prompts 600-1700 tokens, 32-128 new). For each, through the CLI:

    kvc plan MODEL --workload W.json --costs COSTS.json --max-models K -o plan.json
    kvc compile MODEL -o OUT_PLAN --plan plan.json
    kvc compile MODEL -o OUT_PYRAMID [--max-prompt-len P --min-response-len R]   (the defaults
        when they serve the workload; K = the pyramid's model count, so the plan may compile no more)

then a sample of the workload's requests is run through both compiled pipelines (OpenVINO CPU,
the default blobs), each request on both in turn: the measured time per request (TTFT + decode)
beside the planner's prediction. Costs are measured once by the first `kvc plan`.

    python bench/plan.py [--sample 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
MODEL = BENCH / ".models" / "llama-250m-fp32"

WORKLOADS = {
    "chat turns": {"prompts": (16, 161), "responses": (16, 129)},
    "long documents": {"prompts": (600, 1701), "responses": (32, 129)},
}


def histogram(seed: int, spec: dict, count: int = 200) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(rng.integers(*spec["prompts"])), int(rng.integers(*spec["responses"])), 1] for _ in range(count)]


def kvc(*args: str) -> tuple[str, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvc.cli.main", *map(str, args)], check=True, capture_output=True,
                          text=True)
    return done.stdout, time.perf_counter() - started


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--sample", type=int, default=16, help="requests of each workload run through both")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from kvc.export.load import open_compiled
    from kvc.export.compile import compile_static
    from kvc.plan import DEFAULT_MAX_PROMPT_LEN, DEFAULT_MIN_RESPONSE_LEN, chunk_label
    from kvc.planner import blobs

    tmp = Path(tempfile.mkdtemp(prefix="kvc-plan-"))
    costs = tmp / "costs.json"
    rows = []
    for i, (name, spec) in enumerate(WORKLOADS.items()):
        requests = histogram(args.seed + i, spec)
        w = tmp / f"w{i}.json"
        w.write_text(json.dumps({"requests": requests}))
        prompts = [r[0] for r in requests]
        need = max(r[0] + r[1] - 1 for r in requests)
        serves = max(prompts) <= DEFAULT_MAX_PROMPT_LEN and need <= DEFAULT_MAX_PROMPT_LEN + DEFAULT_MIN_RESPONSE_LEN
        lengths = [] if serves else ["--max-prompt-len", str(max(prompts)),
                                     "--min-response-len", str(max(64, need - max(prompts)))]
        asked = dict(zip(("max_prompt_len", "min_response_len"), map(int, lengths[1::2])))
        L = compile_static(("CPU",), "auto", **asked).lengths()  # what kvc compile builds with them
        budget = blobs(L.bulk, L.first, L.sizes, "CPU")[1]  # the pyramid's blobs
        _, plan_s = kvc("plan", args.model, "--workload", w, "--costs", costs, "--max-models", budget,
                        "-o", tmp / f"plan{i}.json")
        plan = json.loads((tmp / f"plan{i}.json").read_text())
        outs = {"plan": tmp / f"plan{i}", "pyramid": tmp / f"pyramid{i}"}
        _, plan_compile = kvc("compile", args.model, "-o", outs["plan"], "--plan", tmp / f"plan{i}.json")
        _, pyramid_compile = kvc("compile", args.model, "-o", outs["pyramid"], *lengths)
        pipes = {k: open_compiled(v, "openvino") for k, v in outs.items()}
        rng = np.random.default_rng(100 + i)
        measured = {k: [] for k in pipes}
        for n, m, _ in requests[:args.sample]:
            prompt = rng.integers(1, 32000, n).tolist()
            for k, pipe in pipes.items():
                gen = pipe.generate(prompt, m)
                measured[k].append(1e3 * (gen.prefill_seconds + sum(gen.step_seconds)))
        del pipes
        predicted = {"plan": plan["expected"]["expected_ms"]["request"],
                     "pyramid": next(b for b in plan["against"] if b["name"] == "pyramid")["expected_ms"]["request"]}
        pyr = next(b for b in plan["against"] if b["name"] == "pyramid")
        rows.append({"workload": name, "plan": plan["lengths"], "pyramid": {k: pyr[k] for k in plan["lengths"]},
                     "models": {"plan": plan["expected"]["models"], "pyramid": pyr["models"]},
                     "compile_s": {"plan": plan_compile, "pyramid": pyramid_compile}, "plan_s": plan_s,
                     "predicted_ms": predicted,
                     "measured_ms": {k: statistics.mean(v) for k, v in measured.items()}})
    print(f"model {args.model.name}, costs measured by the first kvc plan ({costs}); {args.sample} requests of each "
          f"workload run through both, OpenVINO CPU, default blobs\n")
    print("| workload | configuration | P, R, chunk, variants | models | kvc compile s | predicted ms/request | "
          "measured ms/request | measured vs pyramid |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        for k in ("plan", "pyramid"):
            L = r[k]
            print(f"| {r['workload']} | {k} | {L['max_prompt_len']}, {L['min_response_len']}, "
                  f"{chunk_label(L['prefill_chunk_size'], first=L.get('prefill_first', ()))}, "
                  f"{','.join(map(str, L['variants']))} | {r['models'][k]} | "
                  f"{r['compile_s'][k]:.1f} | {r['predicted_ms'][k]:.0f} | {r['measured_ms'][k]:.0f} | "
                  f"{r['measured_ms'][k] / r['measured_ms']['pyramid']:.2f}x |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
