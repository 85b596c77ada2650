"""A/B of kvc compile's speed mechanisms on the default path (issue 14, part 7).

Each mechanism was built for an older "kvc's own work" figure; it stays only if the default
`kvc compile MODEL -o OUT` (CPU, verification on) is at least 5% faster end to end with it.
Configurations, each `compile_to` in a fresh process, alternating rounds:

  all-on       as shipped
  no-direct    the weights copy writes through the page cache (no O_DIRECT)

Measured on 2026-11-25 (250M Llama, AMX host, 3 rounds, medians; all-on 19.49 s): pausing
Python's cyclic GC during load and passes 1.012x without it, a helper process for the weights
copy 0.970x without it (a thread of the compiler), O_DIRECT 1.005x without it. None gained
5%: the GC pause and the helper process were removed then; O_DIRECT is next.

    python bench/ab_mechanisms.py [--rounds 3]
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

MODEL = Path(__file__).resolve().parent / ".models" / "llama-250m-fp32"
CONFIGS = ("all-on", "no-direct")


def child(config: str, model: Path, out: Path) -> dict:
    import kvc.ir.weights_stream as weights_stream
    from kvc.export.compile import CompileOptions, compile_to

    if config == "no-direct":
        weights_stream.set_direct = lambda fd, on: False
    started = time.perf_counter()
    compile_to(model, out, CompileOptions())
    return {"config": config, "seconds": time.perf_counter() - started}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.out)))
        return 0
    times = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="kvc-ab-") as tmp:
        for r in range(args.rounds):
            for c in CONFIGS:
                out = Path(tmp) / f"{c}-{r}"
                proc = subprocess.run([sys.executable, __file__, "--child", c, "--model", str(args.model),
                                       "--out", str(out)], capture_output=True, text=True, check=True)
                times[c].append(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])
                subprocess.run(["rm", "-rf", str(out)], check=True)
                print(c, round(times[c][-1], 2), flush=True)
    base = statistics.median(times["all-on"])
    print("\n| configuration | median compile (s) | runs | vs all-on |\n|---|---:|---|---:|")
    for c in CONFIGS:
        m = statistics.median(times[c])
        print(f"| {c} | {m:.2f} | {', '.join(f'{t:.2f}' for t in times[c])} | {m / base:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
