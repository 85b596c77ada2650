"""Time to first token as a user gets it (issue 14, part 1): kvc's compiled pipeline against
the stateful model on OpenVINO CPU, same process, same prompts, alternating runs.

For each configuration, `kvc compile` (the CLI, CPU device, verification on) makes OUT once;
then for each prompt length the two engines alternate `--reps` times: the stateful model
(compile_model on CPU with the plugin's defaults, reset, one infer over the prompt) and kvc's
pipeline opened from OUT's blobs (`generate(prompt, 1)`: the prefill, padded or chunked).
TTFT is the median; the ratio is kvc over stateful. The first configuration is the default
path (no options); the others say what they change. Both engines share one process, the
stateful model compiled first (the engine compiled first in a process ran slower on this
host): compare configurations with each other; bench/default_path.py gives the user's ratio,
each engine in its own process.

    /work/fxvenv/bin/python bench/build_model.py          # once: bench/.models/llama-250m-fp32
    python bench/ttft.py                                  # default path, then chunk sizes
    python bench/ttft.py --config default --config "--prefill-chunk-size 128"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import openvino as ov

from default_path import stateful_generate, wall

BENCH = Path(__file__).resolve().parent
MODEL = BENCH / ".models" / "llama-250m-fp32"
PROMPTS = (16, 100, 512, 1000)
CONFIGS = ("default", "--prefill-chunk-size 64", "--prefill-chunk-size 128", "--prefill-chunk-size 256")


def stateful_ttft(compiled: ov.CompiledModel, prompt: np.ndarray) -> float:
    return stateful_generate(compiled, prompt, 1)[0]


def kvc_ttft(pipeline, prompt: np.ndarray) -> float:
    return wall(pipeline.generate, prompt, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--config", action="append", help="kvc compile options ('default' = none); repeatable")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)))
    args = ap.parse_args(argv)
    from kvc.export.load import open_compiled

    prompts = [int(p) for p in args.prompts.split(",")]
    rng = np.random.default_rng(0)
    core = ov.Core()
    stateful = core.compile_model(str(args.model / "openvino_model.xml"), "CPU")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvc-ttft-") as tmp:
        for i, config in enumerate(args.config or CONFIGS):
            out = Path(tmp) / f"out{i}"
            options = [] if config == "default" else shlex.split(config)
            started = time.perf_counter()
            subprocess.run([str(Path(sys.executable).with_name("kvc")), "compile", str(args.model), "-o", str(out), *options], check=True,
                           capture_output=True)
            compile_s = time.perf_counter() - started
            pipeline = open_compiled(out, "openvino")
            for n in prompts:
                prompt = rng.integers(1, 32000, n).astype(np.int64)
                kvc_ttft(pipeline, prompt), stateful_ttft(stateful, prompt)  # warm-up, not counted
                ours, theirs = [], []
                for _ in range(args.reps):
                    ours.append(kvc_ttft(pipeline, prompt))
                    theirs.append(stateful_ttft(stateful, prompt))
                row = {"config": config, "prompt": n, "kvc_ms": 1e3 * statistics.median(ours),
                       "stateful_ms": 1e3 * statistics.median(theirs), "compile_s": compile_s}
                row["ratio"] = row["kvc_ms"] / row["stateful_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
            del pipeline
    print("\n| configuration | prompt | kvc TTFT (ms) | stateful CPU (ms) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['prompt']} | {r['kvc_ms']:.1f} | {r['stateful_ms']:.1f} | {r['ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
