"""A/B of two `kvc compile` configurations, end to end as a user runs them.

Each side is compiled by `kvc compile MODEL -o OUT <its flags>` (in a fresh process; A's flags
and B's, either may be empty: the defaults), then served by bench/default_path.py's `kvc`
child, each side alone in a fresh process, the two back to back in each round and the first
alternating: TTFT at 16, 100, 512 and 1000 tokens and the median decode step after a
512-token prompt; and the peak RSS of opening OUT (`open_compiled`, a fresh process each).
Prints each round and the median of the rounds' B/A ratios (the machine is shared: read
ratios, not times).

    python bench/compile_ab.py --a "--kv-precision f16 --attention grouped" --b "" --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from default_path import MODEL, PROMPTS, in_turn, kvc_compile, run_child


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--a", default="", help="kvc compile flags of side A (default: none)")
    ap.add_argument("--b", default="", help="kvc compile flags of side B (default: none)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if not (args.model / "openvino_model.xml").exists():
        raise SystemExit(f"{args.model} is missing: build it with bench/build_model.py (see its docstring)")
    with tempfile.TemporaryDirectory(prefix="kvc-compile-ab-", dir=os.environ.get("TMPDIR")) as name:
        outs = {side: Path(name) / side for side in "AB"}
        for side, flags in (("A", args.a), ("B", args.b)):
            kvc_compile(args.model, outs[side], *shlex.split(flags))
        runs = {"A": [], "B": []}
        for i in range(args.rounds):
            for side in in_turn(i, "A", "B"):
                runs[side].append(run_child("kvc", args.model, outs[side]))
                runs[side][-1]["open"] = run_child("kvc-open", args.model, outs[side])
                print(side, json.dumps(runs[side][-1]), flush=True)

    def ratio(get):
        return statistics.median(get(b) / get(a) for a, b in zip(runs["A"], runs["B"]))

    print(f"A: {args.a or '(defaults)'}\nB: {args.b or '(defaults)'}")
    for n in PROMPTS:
        get = lambda r, n=n: r["ttft_s"][str(n)]  # noqa: E731
        print(f"TTFT {n:>4} tokens: A {1e3 * statistics.median(map(get, runs['A'])):.1f} ms, "
              f"B {1e3 * statistics.median(map(get, runs['B'])):.1f} ms, B/A {ratio(get):.3f}")
    get = lambda r: r["step_s"]  # noqa: E731
    print(f"decode step:      A {1e3 * statistics.median(map(get, runs['A'])):.2f} ms, "
          f"B {1e3 * statistics.median(map(get, runs['B'])):.2f} ms, B/A {ratio(get):.3f}")
    get = lambda r: r["open"]["peak_rss_mb"]  # noqa: E731
    print(f"opening, peak RSS: A {statistics.median(map(get, runs['A'])):.0f} MB, "
          f"B {statistics.median(map(get, runs['B'])):.0f} MB, B/A {ratio(get):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
