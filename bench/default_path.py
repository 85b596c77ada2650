"""What a user waits for on kvc's default path, against the peers, in one command (issue 14).

On the ~250M-parameter Llama of bench/build_model.py (fp32 stateful IR, as optimum-cli
exports it), with kvc's defaults and nothing tuned:

  compile      `kvc compile MODEL -o OUT` (CPU; verification on) and `kvc compile MODEL -o OUT
               --device NPU` (NPUW on its CPU backend), each in a fresh process: wall time and
               peak RSS; against NPUW_LLM's compile_model of the stateful model (bench/probe_npuw.py
               compile) and, for CPU, the stateful model's compile_model on CPU
  ready        from the model directory to a pipeline generating on the device (CPU, and NPU
               through NPUW's CPU backend), verification included, each round in fresh
               processes: `kvc compile` then `open_compiled(OUT)` (two processes, their times
               summed), and `compile_and_open` (one library call that serves the blobs its check
               imported); against NPUW_LLM's compile_model of the stateful model
  disk         bytes of OUT's models and blobs (tokenizer files left out) over weights.bin
  open         open_compiled(OUT) on OpenVINO CPU, in a fresh process: time, peak RSS and the
               RSS it then holds; against compile_model of the stateful model on CPU; then,
               ready to serve, both after a 16-token prompt and one step (the stateful model
               packs its weights at its first inference: 1044 -> 1457 MB here)
  ttft         time to first token at prompts of 16, 100, 512 and 1000 tokens: kvc's pipeline
               from OUT's CPU blobs (generate(prompt, 1)) against the stateful model on CPU
  decode       ms per generated token after a 512-token prompt, 32 steps: kvc's pipeline from
               OUT's CPU blobs (the default precision: the plugin's own, bf16 where the host
               has it) against the stateful model at the plugin's defaults; then, for TTFT and
               decode, tuned and said so, OUT compiled with --inference-precision f32 against
               the stateful model at f32 (INFERENCE_PRECISION_HINT f32)

TTFT and decode run each engine alone in a fresh process, as a user runs it (an engine compiled
first in a process that holds two ran slower here), kvc's process and the peer's back to back.
Ratios are kvc over the peer, medians of --reps runs (for TTFT and decode, the median of each
round's ratio); the machine is shared, so read ratios.

    /work/fxvenv/bin/python bench/build_model.py        # once: bench/.models/llama-250m-fp32
    python bench/default_path.py [--reps 3] [--only compile,ready,disk,open,ttft,decode]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from probe_npuw import NPUW_LLM, stateful_inputs

BENCH = Path(__file__).resolve().parent
MODEL = BENCH / ".models" / "llama-250m-fp32"
STEPS = ("compile", "ready", "disk", "open", "ttft", "decode")
EXACT = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def peak_rss_mb() -> float:
    """This process's peak RSS, or its process tree's when that was larger: kvc compile forks
    its device compiles (kvc.export.device_compile), so the sum of the tree's RSS, sampled
    every 10 ms by `TreeRss`, counts; so does the largest child's own peak, which sampling
    could miss."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return max(own, children, TreeRss.peak_mb)


class TreeRss:
    """Samples the summed VmRSS of this process and its descendants on a daemon thread."""

    peak_mb = 0.0

    @classmethod
    def start(cls) -> None:
        import threading

        threading.Thread(target=cls._run, daemon=True).start()

    @staticmethod
    def _tree(pid: int) -> list[int]:
        pids, i = [pid], 0
        while i < len(pids):
            try:
                for task in os.listdir(f"/proc/{pids[i]}/task"):
                    with open(f"/proc/{pids[i]}/task/{task}/children") as f:
                        pids += [int(c) for c in f.read().split()]
            except OSError:
                pass
            i += 1
        return pids

    @classmethod
    def _run(cls) -> None:
        while True:
            total = 0
            for pid in cls._tree(os.getpid()):
                try:
                    with open(f"/proc/{pid}/status") as f:
                        total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
                except OSError:
                    pass
            cls.peak_mb = max(cls.peak_mb, total / 1024)
            time.sleep(0.01)


# -- children: one measurement each, in a fresh process, printing one JSON line ---------------
def child(kind: str, model: Path, out: Path, device: str) -> dict:
    TreeRss.start()
    started, engine = time.perf_counter(), None
    if kind in ("kvc-compile", "kvc-compile-f32"):
        from kvc.cli.main import cli

        args = ["compile", str(model), "-o", str(out)] + (["--device", device] if device != "CPU" else [])
        args += ["--inference-precision", "f32"] if kind == "kvc-compile-f32" else []
        try:
            cli(args, prog_name="kvc")
        except SystemExit as exc:  # click exits when the command is done
            if exc.code:
                raise
    elif kind == "kvc-open":
        from kvc.export.load import BACKEND_OF_DEVICE, open_compiled

        engine = open_compiled(out, BACKEND_OF_DEVICE[device])
    elif kind == "kvc-compile-open":
        from kvc.export.compile import CompileOptions, compile_and_open, compile_static

        _, engine = compile_and_open(model, out, CompileOptions(compile_static((device,)), devices=(device,)))
    elif kind == "stateful-compile":
        import openvino as ov

        compiled = ov.Core().compile_model(str(model / "openvino_model.xml"), "CPU")
        engine = compiled, compiled.create_infer_request()
    elif kind == "npuw-compile":
        import openvino as ov

        ov.Core().compile_model(str(model / "openvino_model.xml"), "NPU", dict(NPUW_LLM)).create_infer_request()
    elif kind in ("kvc", "kvc-f32", "stateful", "stateful-f32"):
        return serve(kind, model, out)
    else:
        raise SystemExit(f"unknown child {kind}")
    measured = {"seconds": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb(), "rss_mb": rss_mb()}
    if kind in ("kvc-open", "kvc-compile-open", "stateful-compile"):  # then ready to serve: a token and a step
        prompt = np.arange(1, 17, dtype=np.int64)
        if kind != "stateful-compile":
            engine.generate(prompt.tolist(), 2)
        else:
            stateful_generate(engine[0], prompt, 2)
        measured.update(serving_peak_mb=peak_rss_mb(), serving_mb=rss_mb())
    del engine  # held until its RSS is read
    return measured


def rss_mb() -> float:
    """This process's RSS now (after an open: what it holds while it serves)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def run_child(kind: str, model: Path, out: Path, device: str = "CPU") -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, "--model", str(model), "--out", str(out),
                           "--device", device], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kvc_compile(model: Path, out: Path, *flags: str) -> None:
    """`kvc compile MODEL -o OUT FLAGS` in a fresh process (its summary discarded, its progress and
    errors shown), as a user runs it; for benchmarks that compare configurations
    (bench/compile_ab.py, bench/attention_forms.py)."""
    subprocess.run([sys.executable, "-c", "from kvc.cli.main import cli; cli(prog_name='kvc')", "compile", str(model),
                    "-o", str(out), *flags], check=True, stdout=subprocess.DEVNULL)


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


# -- steps ---------------------------------------------------------------------------------------
def measure_compile(model: Path, tmp: Path, reps: int) -> list[dict]:
    rows = []
    for device in ("CPU", "NPU"):
        ours, npuw, stateful = [], [], []
        for i in range(reps):  # alternating, so drift on the machine hits both sides
            out = tmp / f"compile-{device}-{i}"
            ours.append(run_child("kvc-compile", model, out, device))
            npuw.append(run_child("npuw-compile", model, out))
            if device == "CPU":
                stateful.append(run_child("stateful-compile", model, out))
            if i:
                subprocess.run(["rm", "-rf", str(out)], check=True)
        peers = [("NPUW_LLM compile_model (NPU, CPU backend)", npuw)]
        if device == "CPU":
            peers.append(("stateful compile_model (CPU)", stateful))
        for peer, theirs in peers:
            rows.append({"step": "compile", "what": f"kvc compile --device {device} (defaults, verification on)",
                         "peer": peer, "kvc_s": median_of(ours, "seconds"), "peer_s": median_of(theirs, "seconds"),
                         "kvc_rss_mb": median_of(ours, "peak_rss_mb"), "peer_rss_mb": median_of(theirs, "peak_rss_mb")})
    return rows


def measure_ready(model: Path, tmp: Path, reps: int) -> list[dict]:
    """Issue 14's target 3: from the model directory to a pipeline generating on the device,
    `kvc compile` then an open (each in a fresh process, summed per round) and the one library
    call, against NPUW_LLM's compile_model, alternating."""
    rows = []
    for device in ("CPU", "NPU"):
        two, one, npuw = [], [], []
        for i in range(reps):
            out, out2 = tmp / f"ready-{device}-{i}", tmp / f"ready-{device}-{i}-one"
            compiled = run_child("kvc-compile", model, out, device)
            opened = run_child("kvc-open", model, out, device)
            two.append({"seconds": compiled["seconds"] + opened["seconds"],
                        "peak_rss_mb": max(compiled["peak_rss_mb"], opened["peak_rss_mb"]),
                        "serving_mb": opened["serving_mb"]})
            one.append(run_child("kvc-compile-open", model, out2, device))
            npuw.append(run_child("npuw-compile", model, out))
            subprocess.run(["rm", "-rf", str(out), str(out2)], check=True)
        for what, ours in ((f"`kvc compile --device {device}`, then open_compiled(OUT) (two processes)", two),
                           (f"compile_and_open for {device} (one library call)", one)):
            rows.append({"step": "ready", "what": f"model directory to a pipeline: {what}",
                         "peer": "NPUW_LLM compile_model (NPU, CPU backend)", "kvc_s": median_of(ours, "seconds"),
                         "peer_s": median_of(npuw, "seconds"), "kvc_rss_mb": median_of(ours, "peak_rss_mb"),
                         "peer_rss_mb": median_of(npuw, "peak_rss_mb"),
                         # in the JSON: what it holds after a 16-token prompt and one step
                         "then_holds_mb": median_of(ours, "serving_mb")})
    return rows


def measure_disk(tmp: Path) -> list[dict]:
    rows = []
    for device in ("CPU", "NPU"):
        out = tmp / f"compile-{device}-0"
        manifest = json.loads((out / "manifest.json").read_text())
        ours = set()
        for entry in manifest["models"].values():
            ours.add(entry["xml"])
            ours.update(b["file"] for b in entry["blobs"].values())
        ours.add(manifest["weights"])
        total = sum((out / f).stat().st_size for f in ours)
        weights = (out / manifest["weights"]).stat().st_size
        rows.append({"step": "disk", "what": f"OUT for {device}: models, blobs and weights.bin", "peer": "weights.bin",
                     "kvc_bytes": total, "peer_bytes": weights})
    return rows


def measure_open(model: Path, tmp: Path, reps: int) -> list[dict]:
    out = tmp / "compile-CPU-0"
    ours, theirs = [], []
    for _ in range(reps):
        ours.append(run_child("kvc-open", model, out))
        theirs.append(run_child("stateful-compile", model, out))
    return [{"step": "open", "what": "open_compiled(OUT) on OpenVINO CPU", "peer": "stateful compile_model (CPU)",
             "kvc_s": median_of(ours, "seconds"), "peer_s": median_of(theirs, "seconds"),
             "kvc_rss_mb": median_of(ours, "peak_rss_mb"), "peer_rss_mb": median_of(theirs, "peak_rss_mb"),
             "kvc_held_mb": median_of(ours, "rss_mb"), "peer_held_mb": median_of(theirs, "rss_mb")},
            {"step": "open", "what": "the same, then a 16-token prompt and one step (ready to serve)",
             "peer": "stateful model: compile_model, the same prompt and step (it packs its weights at its first "
                     "inference)", "kvc_s": median_of(ours, "seconds"), "peer_s": median_of(theirs, "seconds"),
             "kvc_rss_mb": median_of(ours, "serving_peak_mb"), "peer_rss_mb": median_of(theirs, "serving_peak_mb"),
             "kvc_held_mb": median_of(ours, "serving_mb"), "peer_held_mb": median_of(theirs, "serving_mb")}]


def stateful_feed(names: set[str], ids: np.ndarray, seen: int) -> dict:
    """The stateful model's inputs for `ids` after `seen` tokens, those of `names` it has."""
    return {k: v for k, v in stateful_inputs(ids, seen).items() if k in names}


def stateful_generate(compiled, prompt: np.ndarray, new_tokens: int) -> tuple[float, list[float], list[int]]:
    """Greedy generation on the stateful model: TTFT, each later token's time, the tokens
    (bench/kv_precision.py and bench/ttft.py use it too)."""
    names = {name for port in compiled.inputs for name in port.get_names()}  # once, not in the timed steps
    request = compiled.create_infer_request()
    request.reset_state()
    start = time.perf_counter()
    out = request.infer(stateful_feed(names, prompt[None].astype(np.int64), 0))
    tokens = [int(np.argmax(out["logits"][0, -1]))]
    ttft, steps, seen = time.perf_counter() - start, [], len(prompt)
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        out = request.infer(stateful_feed(names, np.array([[tokens[-1]]], np.int64), seen))
        tokens.append(int(np.argmax(out["logits"][0, -1])))
        steps.append(time.perf_counter() - start)
        seen += 1
    return ttft, steps, tokens


def wall(call, *args) -> float:
    """The wall time of `call(*args)`: all a user waits for (kvc's `prefill_seconds` leaves out
    the request's checks and the cache's reset; the stateful side times its infer and argmax)."""
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


def in_turn(i: int, *engines):
    """The engines in round `i`'s order, each first in turn: on this host the first engine of a
    round ran about 4% slower (a fixed order made a bf16 KV cache look 13% faster than f16;
    rotated, it was 4% slower)."""
    k = i % len(engines)
    return engines[k:] + engines[:k]


PROMPTS = (16, 100, 512, 1000)
DECODE_PROMPT, DECODE_STEPS = 512, 32


def serve(engine: str, model: Path, out: Path) -> dict:
    """In a child: open one engine as a user would (nothing else compiled in the process), warm
    it up, then TTFT at each prompt length (median of 3) and the median step of a 32-token decode
    after a 512-token prompt."""
    import openvino as ov

    if engine.startswith("kvc"):
        from kvc.export.load import open_compiled

        pipeline = open_compiled(out, "openvino")
        first = lambda prompt: wall(pipeline.generate, prompt, 1)  # noqa: E731
        steps = lambda prompt, n: pipeline.generate(prompt, n).step_seconds  # noqa: E731
    else:
        compiled = ov.Core().compile_model(str(model / "openvino_model.xml"), "CPU",
                                           EXACT if engine.endswith("f32") else {})
        first = lambda prompt: stateful_generate(compiled, prompt, 1)[0]  # noqa: E731
        steps = lambda prompt, n: stateful_generate(compiled, prompt, n)[1]  # noqa: E731
    rng, ttft = np.random.default_rng(0), {}
    for n in PROMPTS:
        prompt = rng.integers(1, 32000, n).astype(np.int64)
        first(prompt)  # warm-up, not counted
        ttft[str(n)] = statistics.median(first(prompt) for _ in range(3))
    prompt = np.random.default_rng(1).integers(1, 32000, DECODE_PROMPT).astype(np.int64)
    steps(prompt, 3)
    return {"ttft_s": ttft, "step_s": statistics.median(steps(prompt, DECODE_STEPS + 1))}


def measure_serving(model: Path, tmp: Path, reps: int, only: list[str]) -> list[dict]:
    """TTFT and decode, each engine in its own fresh process as a user runs it, the two engines'
    processes back to back in each round (the first alternating); each ratio is the median of
    the rounds' ratios, so drift on the shared machine cancels within a round. In one process
    the engine compiled first ran slower here (two copies of the stateful model: 6%; kvc's
    pipeline opened before the stateful model: decode 1.22x, after it: 1.04x, alone: 1.03x)."""
    pairs = [("kvc", "stateful", tmp / "compile-CPU-0", "defaults")]
    if "decode" in only or "ttft" in only:
        run_child("kvc-compile-f32", model, tmp / "compile-CPU-f32")
        pairs.append(("kvc-f32", "stateful-f32", tmp / "compile-CPU-f32", "tuned: --inference-precision f32"))
    rows = []
    for ours_kind, peer_kind, out, label in pairs:
        runs = {ours_kind: [], peer_kind: []}
        for i in range(reps):
            for kind in in_turn(i, ours_kind, peer_kind):
                runs[kind].append(run_child(kind, model, out))
        ours, theirs = runs[ours_kind], runs[peer_kind]

        def row(step, what, peer, get):
            return {"step": step, "what": what, "peer": peer, "kvc_s": statistics.median(get(r) for r in ours),
                    "peer_s": statistics.median(get(r) for r in theirs),
                    "ratio": statistics.median(get(a) / get(b) for a, b in zip(ours, theirs))}

        if "ttft" in only:
            what, peer = (("TTFT", "stateful model on CPU (defaults)") if ours_kind == "kvc" else
                          (f"TTFT ({label})", "stateful model on CPU at f32"))
            rows += [row("ttft", f"{what}, {n}-token prompt", peer, lambda r, n=n: r["ttft_s"][str(n)])
                     for n in PROMPTS]
        if "decode" in only:
            blob = json.loads((out / "manifest.json").read_text())
            precision = blob["models"]["prefill"]["blobs"]["CPU"]["import_config"]["INFERENCE_PRECISION_HINT"]
            rows.append(row("decode", f"decode after a {DECODE_PROMPT}-token prompt, per token ({label}: {precision})",
                            f"stateful model on CPU at {'f32' if peer_kind.endswith('f32') else 'its default'}",
                            lambda r: r["step_s"]))
    return rows


def _figure(value: float) -> str:
    """Three significant digits, never in exponent form (2120, not 2.12e+03)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def table(rows: list[dict]) -> str:
    lines = ["| what the user waits for | kvc (defaults) | peer | ratio |", "|---|---:|---|---:|"]
    for r in rows:
        if "kvc_bytes" in r:
            kvc, peer = r["kvc_bytes"] / 2**20, r["peer_bytes"] / 2**20
            lines.append(f"| {r['what']} | {kvc:.1f} MiB | {r['peer']}: {peer:.1f} MiB | {kvc / peer:.3f}x |")
            continue
        scale, unit = (1e3, "ms") if r["step"] in ("ttft", "decode") else (1, "s")
        kvc, peer = r["kvc_s"] * scale, r["peer_s"] * scale
        cell = f"{_figure(kvc)} {unit}"
        peer_cell = f"{r['peer']}: {_figure(peer)} {unit}"
        ratio = f"{r.get('ratio', kvc / peer):.2f}x"
        if "kvc_rss_mb" in r:
            cell += f", peak RSS {r['kvc_rss_mb']:.0f} MB"
            peer_cell += f", {r['peer_rss_mb']:.0f} MB"
            ratio += f" (RSS {r['kvc_rss_mb'] / r['peer_rss_mb']:.2f}x)"
        if "kvc_held_mb" in r:
            cell += f"; then holds {r['kvc_held_mb']:.0f} MB"
            peer_cell += f"; then {r['peer_held_mb']:.0f} MB"
            ratio = ratio[:-1] + f", held {r['kvc_held_mb'] / r['peer_held_mb']:.2f}x)"
        lines.append(f"| {r['what']} | {cell} | {peer_cell} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default=",".join(STEPS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="CPU", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.out, args.device)))
        return 0
    if not (args.model / "openvino_model.xml").exists():
        raise SystemExit(f"{args.model} is missing: build it with bench/build_model.py (see its docstring)")
    only = args.only.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvc-default-path-", dir=os.environ.get("TMPDIR")) as name:
        tmp = Path(name)
        needs_out = [s for s in only if s not in ("compile", "ready")]
        if "compile" in only:
            rows += measure_compile(args.model, tmp, args.reps)
        elif needs_out:
            run_child("kvc-compile", args.model, tmp / "compile-CPU-0")
            if "disk" in only:
                run_child("kvc-compile", args.model, tmp / "compile-NPU-0", "NPU")
        if "ready" in only:
            rows += measure_ready(args.model, tmp, args.reps)
        for row in rows:
            print(json.dumps(row), flush=True)
        if "disk" in only:
            rows += measure_disk(tmp)
        if "open" in only:
            rows += measure_open(args.model, tmp, args.reps)
        if "ttft" in only or "decode" in only:
            rows += measure_serving(args.model, tmp, args.reps, only)
    print(json.dumps(rows))
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
