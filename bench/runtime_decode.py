"""Benchmark kvc's numpy interpreter against onnxruntime and OpenVINO CPU (issue 3).

Decode throughput and prefill time on the ~250M-parameter random-weight Llama that
`bench/build_model.py` builds (hidden 1024, 16 layers, vocab 32000, fp32 weights), after a
512-token prompt. All three engines run the same network: the stateless IR on kvc's numpy
runtime and on OpenVINO CPU (f32), the ONNX export on onnxruntime. The engines are measured
round-robin in one process, so a noisy neighbour slows them alike; the result is a ratio.

    /work/venv-fx/bin/python bench/build_model.py       # once: builds bench/.models/
    python bench/runtime_decode.py [--prompt 512] [--steps 32] [--rounds 3]

Prints one JSON object: per engine prefill seconds and decode ms/token (median over rounds),
and numpy's decode throughput as a fraction of onnxruntime's (target ≥ 0.8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from kvc.runtime.generate import empty_past, step_inputs
from kvc.runtime.session import open_session

MODELS = Path(__file__).resolve().parent / ".models"


def decode(session, prompt: np.ndarray, steps: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) for one greedy run with an explicit past."""
    past = empty_past(session, 1)
    ids = prompt[None]
    start = time.perf_counter()
    out = session.infer({**step_inputs(session, ids, 0), **past})
    prefill = time.perf_counter() - start
    past_len = ids.shape[1]
    times = []
    for _ in range(steps):
        past = {n: out[n.replace("past_key_values", "present")] for n in past}
        token = np.array([[int(np.argmax(out["logits"][0, -1]))]])
        start = time.perf_counter()
        out = session.infer({**step_inputs(session, token, past_len), **past})
        times.append(time.perf_counter() - start)
        past_len += 1
    return prefill, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", type=Path, default=MODELS)
    args = ap.parse_args()
    ir = args.models / "llama-250m-fp32-stateless"
    sessions = {"numpy": open_session(ir, "numpy"), "onnxruntime": open_session(args.models / "llama-250m.onnx",
                                                                                    "onnxruntime"),
                "openvino": open_session(ir, "openvino")}
    prompt = np.random.default_rng(0).integers(1, 32000, args.prompt)
    results = {name: {"prefill_s": [], "decode_ms": []} for name in sessions}
    for _ in range(args.rounds):
        for name, session in sessions.items():
            prefill, per_token = decode(session, prompt, args.steps)
            results[name]["prefill_s"].append(prefill)
            results[name]["decode_ms"].append(per_token * 1e3)
    summary = {name: {k: round(statistics.median(v), 4) for k, v in r.items()} for name, r in results.items()}
    ratio = summary["onnxruntime"]["decode_ms"] / summary["numpy"]["decode_ms"]
    print(json.dumps({"prompt_tokens": args.prompt, "decode_steps": args.steps, "rounds": args.rounds,
                      "engines": summary, "numpy_decode_throughput_vs_onnxruntime": round(ratio, 3),
                      "numpy_decode_throughput_vs_openvino": round(
                          summary["openvino"]["decode_ms"] / summary["numpy"]["decode_ms"], 3)}, indent=1))


if __name__ == "__main__":
    main()
