"""Run every baseline probe, each in a fresh process, and summarize (numbers for bench/BASELINES.md).

    /work/venv-fx/bin/python bench/build_model.py          # once: the models under bench/.models/
    /work/venv-dev/bin/python bench/run_baselines.py --reps 3 --rounds 5 --quiet 0.15 --max-wait 240
        # what BASELINES.md reports: all probes, ~10 min on a quiet machine
    /work/venv-dev/bin/python bench/run_baselines.py --only compile decode

Raw JSON lines go to bench/.results/baselines-<time>.jsonl (git-ignored); the summary to stdout.
The machine is shared: every probe records how busy the other processes kept the CPU during it
(others_busy_during, a share of all cores), --quiet waits for a calm machine before each probe,
and compile measurements are repeated (--reps) in separate processes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PY = sys.executable


QUIET = {"threshold": None, "max_wait": 600.0}


def cpu_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - idle) / hz, sum(fields[:8]) / hz


def others_busy(seconds: float = 2.0) -> float:
    """Fraction of all cores busy over `seconds` (call when none of our probes runs)."""
    b0, t0 = cpu_busy_seconds()
    time.sleep(seconds)
    b1, t1 = cpu_busy_seconds()
    return (b1 - b0) / max(t1 - t0, 1e-9)


def wait_quiet() -> float | None:
    """With --quiet, wait until other processes use less than the threshold of the machine."""
    if QUIET["threshold"] is None:
        return None
    deadline = time.monotonic() + QUIET["max_wait"]
    while True:
        busy = others_busy()
        if busy <= QUIET["threshold"] or time.monotonic() > deadline:
            return round(busy, 2)
        time.sleep(3)


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(script: str, args: list[str], log) -> list[dict]:
    cmd = [PY, str(BENCH / script), *args]
    shown = " ".join(["python", f"bench/{script}", *args])
    busy_before = wait_quiet()
    print(f"$ {shown}", flush=True)
    b0, t0 = cpu_busy_seconds()
    c0, w0 = child_cpu_seconds(), time.monotonic()
    proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    b1, t1 = cpu_busy_seconds()
    # CPU the rest of the machine used while the probe ran, as a share of all cores.
    others = ((b1 - b0) - (child_cpu_seconds() - c0)) / max(t1 - t0, 1e-9)
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            row["command"] = shown
            row["others_busy_before"] = busy_before
            row["others_busy_during"] = round(max(others, 0.0), 2)
            rows.append(row)
            log.write(json.dumps(row) + "\n")
    log.flush()
    if proc.returncode != 0 and not rows:
        print(f"  FAILED rc={proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
    return rows


def compile_probes(models: Path, reps: int, log) -> None:
    cases = [
        ("fp16", []), ("fp32", []), ("fp16", ["--pyramid", "YES"]), ("fp32", ["--pyramid", "YES"]),
        ("fp16", ["--pyramid", "NO"]), ("fp16", ["--prompt-len", "2048", "--pyramid", "NO"]),
        ("fp16", ["--prompt-len", "2048", "--pyramid", "YES"]),
    ]
    print("\n## NPUW_LLM compile (fresh process each)")
    for precision, extra in cases:
        rows = []
        for _ in range(reps):
            rows += run("probe_npuw.py", ["compile", "--model", str(models / f"llama-250m-{precision}"),
                                          "--request", *extra], log)
        ok = [r for r in rows if "error" not in r]
        if not ok:
            print(f"  {precision} {extra}: error {rows[0].get('error') if rows else '?'}")
            continue
        walls = [r["compile_s"] for r in ok]
        cpus = [r["compile_cpu_s"] for r in ok]
        hwm = [r["after_compile"]["vmhwm_mb"] for r in ok]
        hwm_req = [r["after_request"]["vmhwm_mb"] for r in ok]
        print(f"  {precision} {' '.join(extra) or 'default'}: compile wall min {min(walls):.2f} s "
              f"median {statistics.median(walls):.2f} s (cpu median {statistics.median(cpus):.2f} s); "
              f"peak RSS after compile {max(hwm):.0f} MB, after create_infer_request {max(hwm_req):.0f} MB; "
              f"others busy {[r['others_busy_during'] for r in ok]}")


def decode_probes(models: Path, rounds: int, log) -> None:
    cases = [
        ("cpu", "fp16", []), ("cpu-f32", "fp16", []), ("npuw", "fp16", []), ("npuw", "fp32", []),
        ("npuw", "fp16", ["--pyramid", "NO"]),
        ("npuw", "fp16", ["--prompt-len", "2048", "--pyramid", "NO"]),
        ("npuw", "fp16", ["--prompt-len", "2048", "--pyramid", "YES"]),
    ]
    print(f"\n## decode at a 512-token prompt, 32 steps (best of {rounds} rounds by median step)")
    for engine, precision, extra in cases:
        rows = run("probe_npuw.py", ["decode", "--engine", engine, "--model",
                                     str(models / f"llama-250m-{precision}"), "--rounds", str(rounds),
                                     *extra], log)
        for r in rows:
            b = r["best"]
            print(f"  {engine} {precision} {' '.join(extra)}: prefill {b['prefill_ms']:.0f} ms "
                  f"(cpu {b['prefill_cpu_ms']:.0f}), decode median {b['step_ms_median']:.1f} ms/token "
                  f"(min {b['step_ms_min']:.1f}, first {b['first_step_ms']:.1f}, cpu mean "
                  f"{b['step_cpu_ms_mean']:.1f}); all rounds {[x['step_ms_median'] for x in r['rounds']]}; "
                  f"compile {r['compile_s']:.1f} s; peak RSS {r['memory']['vmhwm_mb']:.0f} MB; "
                  f"others busy {r['others_busy_before']}/{r['others_busy_during']}")


def agree_probes(models: Path, log) -> None:
    print("\n## agreement with CPU f32 (teacher-forced on its greedy tokens)")
    for precision in ("fp16", "fp32"):
        for r in run("probe_npuw.py", ["agree", "--model", str(models / f"llama-250m-{precision}")], log):
            print(f"  {precision}: npuw {r['npuw']}; cpu default ({r['cpu_default_precision']}) {r['cpu']}; "
                  f"f32 logit range {r['ref_logit_range']}, median top-2 margin {r['ref_top2_margin_median']}")


def io_probes(models: Path, log) -> None:
    print("\n## NPUW_LLM compiled model I/O and export_model()")
    cases = [("fp16", []), ("fp32", []), ("fp16", ["--prompt-len", "2048", "--pyramid", "NO"]),
             ("fp16", ["--prompt-len", "2048", "--pyramid", "YES"])]
    for precision, extra in cases:
        label = f"{precision} {' '.join(extra)}".strip()
        for r in run("probe_npuw.py", ["io", "--model", str(models / f"llama-250m-{precision}"), *extra], log):
            print(f"  {label}: inputs {[(p['names'], p['type'], p['shape']) for p in r['inputs']]}")
            print(f"  {label}: outputs {[(p['names'], p['type'], p['shape']) for p in r['outputs']]}; "
                  f"states {r.get('states')}")
            print(f"  {label}: blob {r.get('blob_bytes')} bytes ({r.get('blob_type')}) in {r.get('export_s')} s; "
                  f".bin {r['bin_bytes']} bytes; import alone {r.get('import_plain')}; "
                  f"with WEIGHTS_PATH {r.get('import_weights_path')}; with MODEL_PTR {r.get('import_model_ptr')}")


def ir_probes(models: Path, log) -> None:
    print("\n## OpenVINO model operations")
    for cmd, precision in (("ops", "fp16"), ("ops", "fp32"), ("dedup", "fp16"), ("variants", "fp16")):
        for r in run("probe_ir_ops.py", [cmd, "--model", str(models / f"llama-250m-{precision}")], log):
            keep = {k: v for k, v in r.items() if k not in ("command", "op")}
            print(f"  [{precision}] {r['op']}: {json.dumps(keep)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=BENCH / ".models")
    parser.add_argument("--reps", type=int, default=3, help="compile repetitions (fresh processes)")
    parser.add_argument("--rounds", type=int, default=3, help="prefill+decode rounds per decode probe")
    parser.add_argument("--only", nargs="+", choices=["compile", "decode", "agree", "io", "ir"],
                        default=["compile", "decode", "agree", "io", "ir"])
    parser.add_argument("--quiet", type=float, metavar="FRACTION",
                        help="before each probe wait (up to --max-wait s) until other processes use "
                             "at most this fraction of the machine's CPU, e.g. 0.1")
    parser.add_argument("--max-wait", type=float, default=600.0)
    args = parser.parse_args(argv)
    QUIET.update(threshold=args.quiet, max_wait=args.max_wait)
    out = BENCH / ".results"
    out.mkdir(exist_ok=True)
    path = out / time.strftime("baselines-%Y%m%d-%H%M%S.jsonl")
    print(f"raw results: {path}")
    with path.open("w") as log:
        if "compile" in args.only:
            compile_probes(args.models, args.reps, log)
        if "decode" in args.only:
            decode_probes(args.models, args.rounds, log)
        if "agree" in args.only:
            agree_probes(args.models, log)
        if "io" in args.only:
            io_probes(args.models, log)
        if "ir" in args.only:
            ir_probes(args.models, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
