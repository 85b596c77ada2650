"""Baseline probes of OpenVINO's own NPU LLM path (NPUW_LLM on its CPU backend) and of CPU.

Run with /work/venv-dev/bin/python (openvino, numpy; no torch). Each subcommand measures one
thing in this process and prints one JSON object as its last line; run every measurement in a
fresh process (bench/run_baselines.py does) so that peak RSS belongs to that measurement alone.

    probe_npuw.py compile --model DIR [--pyramid YES|NO] [--prompt-len 1024] [--min-response 128]
        NPUW_LLM compile: wall time, peak RSS (VmHWM and ru_maxrss), RSS before compiling.
    probe_npuw.py decode --engine npuw|cpu|cpu-f32 --model DIR [--prompt 512] [--steps 32]
        prefill time and per-token decode time, driving the model like a stateful one
        (input_ids, attention_mask, position_ids, beam_idx).
    probe_npuw.py agree --model DIR [--prompt 512] [--steps 32]
        NPUW_LLM and CPU (default config, i.e. bf16 on this CPU) against CPU f32, teacher-forced on
        the f32 greedy tokens: max |logit diff| per step and where the argmax differs (with the
        f32 top-2 margin there, to tell a near-tie from a bug).
    probe_npuw.py io --model DIR [--blob PATH]
        the NPUW_LLM compiled model's inputs/outputs, export_model() blob size, and whether the
        blob imports without weights (it is weightless) or with WEIGHTS_PATH.

DIR is an optimum-cli output directory (openvino_model.xml inside) or the .xml itself.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov

NPUW_LLM = {
    "NPU_USE_NPUW": "YES",
    "NPUW_DEVICES": "CPU",
    "NPUW_LLM": "YES",
    "NPUW_LLM_MAX_PROMPT_LEN": 1024,
    "NPUW_LLM_MIN_RESPONSE_LEN": 128,
}
CPU_F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def model_xml(path: str) -> Path:
    p = Path(path)
    return p / "openvino_model.xml" if p.is_dir() else p


def status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory() -> dict:
    return {
        "rss_mb": round(status_kb("VmRSS") / 1024, 1),
        "vmhwm_mb": round(status_kb("VmHWM") / 1024, 1),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def npuw_config(args) -> dict:
    config = dict(NPUW_LLM)
    config["NPUW_LLM_MAX_PROMPT_LEN"] = args.prompt_len
    config["NPUW_LLM_MIN_RESPONSE_LEN"] = args.min_response
    if getattr(args, "pyramid", None):
        config["NPUW_LLM_GENERATE_PYRAMID"] = args.pyramid
    return config


def emit(result: dict) -> None:
    """Print the result as one JSON line, with the load average: the machine is shared."""
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------- compile


def cmd_compile(args) -> int:
    core = ov.Core()
    config = npuw_config(args)
    result = {"probe": "compile", "model": str(model_xml(args.model)), "config": config,
              "before": memory()}
    result["loadavg_1m_before"] = round(os.getloadavg()[0], 2)
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        compiled = core.compile_model(str(model_xml(args.model)), "NPU", config)
    except Exception as error:  # report, do not hide: e.g. an option this build rejects
        result.update(error=str(error).splitlines()[0][:500], compile_s=time.perf_counter() - started)
        emit(result)
        return 1
    result["compile_s"] = round(time.perf_counter() - started, 3)
    result["compile_cpu_s"] = round(time.process_time() - cpu_started, 3)
    result["after_compile"] = memory()
    if args.request:
        started = time.perf_counter()
        compiled.create_infer_request()
        result["create_request_s"] = round(time.perf_counter() - started, 3)
        result["after_request"] = memory()
    emit(result)
    return 0


# --------------------------------------------------------------------------- decode


def prompt_ids(n: int, vocab: int = 32000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=(1, n), dtype=np.int64)


def stateful_inputs(ids: np.ndarray, seen: int) -> dict:
    n = ids.shape[1]
    return {
        "input_ids": ids,
        "attention_mask": np.ones((1, seen + n), dtype=np.int64),
        "position_ids": np.arange(seen, seen + n, dtype=np.int64)[None],
        "beam_idx": np.zeros(1, dtype=np.int32),
    }


def cmd_decode(args) -> int:
    core = ov.Core()
    xml = str(model_xml(args.model))
    if args.engine == "npuw":
        device, config = "NPU", npuw_config(args)
    elif args.engine == "cpu":
        device, config = "CPU", {}
    else:
        device, config = "CPU", dict(CPU_F32)
    loadavg_before = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    compiled = core.compile_model(xml, device, config)
    compile_s = time.perf_counter() - started
    request = compiled.create_infer_request()
    input_names = {port.get_any_name() for port in compiled.inputs}
    ids = prompt_ids(args.prompt)
    rounds = []
    tokens_per_round = []
    for _ in range(args.rounds):
        if args.engine != "npuw":
            request.reset_state()
        # NPUW_LLM starts a new prefill whenever input_ids has >1 token and position_ids start at
        # the first position id it saw (0): no reset_state needed (its states are not KV).
        feed = {k: v for k, v in stateful_inputs(ids, 0).items() if k in input_names}
        t0, c0 = time.perf_counter(), time.process_time()
        logits = request.infer(feed)["logits"]
        prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        token = int(np.argmax(logits[0, -1]))
        tokens = [token]
        step_s = []
        c0 = time.process_time()
        seen = args.prompt
        for _ in range(args.steps):
            feed = {k: v for k, v in stateful_inputs(np.array([[token]], dtype=np.int64), seen).items()
                    if k in input_names}
            t0 = time.perf_counter()
            logits = request.infer(feed)["logits"]
            step_s.append(time.perf_counter() - t0)
            seen += 1
            token = int(np.argmax(logits[0, -1]))
            tokens.append(token)
        steps_cpu_s = time.process_time() - c0
        rounds.append({"prefill_ms": round(prefill_s * 1e3, 1),
                       "prefill_cpu_ms": round(prefill_cpu_s * 1e3, 1),
                       "step_cpu_ms_mean": round(steps_cpu_s / args.steps * 1e3, 2),
                       "first_step_ms": round(step_s[0] * 1e3, 2),
                       "step_ms_median": round(statistics.median(step_s) * 1e3, 2),
                       "step_ms_mean": round(statistics.mean(step_s) * 1e3, 2),
                       "step_ms_min": round(min(step_s) * 1e3, 2)})
        tokens_per_round.append(tokens)
    best = min(rounds, key=lambda r: r["step_ms_median"])
    emit({"probe": "decode", "engine": args.engine, "model": xml, "config": config,
          "prompt": args.prompt, "steps": args.steps, "loadavg_1m_before": loadavg_before, "compile_s": round(compile_s, 3),
          "inputs": sorted(input_names), "rounds": rounds, "best": best,
          "tokens_first_round": tokens_per_round[0],
          "rounds_agree": all(t == tokens_per_round[0] for t in tokens_per_round),
          "memory": memory()})
    return 0


def cmd_agree(args) -> int:
    core = ov.Core()
    xml = str(model_xml(args.model))
    engines = {"cpu-f32": core.compile_model(xml, "CPU", CPU_F32),
               "npuw": core.compile_model(xml, "NPU", npuw_config(args)),
               "cpu": core.compile_model(xml, "CPU", {})}
    ids = prompt_ids(args.prompt)
    forced: list[int] = []
    logits: dict[str, np.ndarray] = {}
    for name, compiled in engines.items():  # cpu-f32 first: its greedy tokens are forced on the others
        request = compiled.create_infer_request()
        names = {p.get_any_name() for p in compiled.inputs}

        def run(tokens: np.ndarray, seen: int) -> np.ndarray:
            feed = {k: v for k, v in stateful_inputs(tokens, seen).items() if k in names}
            return request.infer(feed)["logits"][0, -1].copy()

        rows = [run(ids, 0)]
        for i in range(args.steps):
            token = forced[i] if forced else int(np.argmax(rows[-1]))
            rows.append(run(np.array([[token]], dtype=np.int64), args.prompt + i))
        if not forced:
            forced = [int(np.argmax(r)) for r in rows[:-1]]
        logits[name] = np.array(rows)
    ref = logits["cpu-f32"]
    top2 = np.sort(ref, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    result = {"probe": "agree", "model": xml, "prompt": args.prompt, "steps": args.steps,
              "cpu_default_precision": engines["cpu"].get_property("INFERENCE_PRECISION_HINT").get_type_name(),
              "ref_logit_range": round(float(ref.max() - ref.min()), 3),
              "ref_top2_margin_median": round(float(np.median(margin)), 4)}
    for name in ("npuw", "cpu"):
        diff = np.abs(logits[name] - ref).max(axis=1)
        flips = [[i, round(float(margin[i]), 4)] for i in range(len(ref))
                 if logits[name][i].argmax() != ref[i].argmax()]
        result[name] = {"max_abs_diff": round(float(diff.max()), 4),
                        "median_step_max_abs_diff": round(float(np.median(diff)), 4),
                        "argmax_flips_step_margin": flips}
    emit(result)
    return 0


# --------------------------------------------------------------------------- io / export


def port_info(port) -> dict:
    return {"names": sorted(port.get_names()), "type": port.get_element_type().get_type_name(),
            "shape": str(port.get_partial_shape())}


def cmd_io(args) -> int:
    core = ov.Core()
    xml = model_xml(args.model)
    config = npuw_config(args)
    compiled = core.compile_model(str(xml), "NPU", config)
    result = {"probe": "io", "model": str(xml), "config": config,
              "inputs": [port_info(p) for p in compiled.inputs],
              "outputs": [port_info(p) for p in compiled.outputs],
              "bin_bytes": xml.with_suffix(".bin").stat().st_size}
    request = compiled.create_infer_request()
    result["states"] = [s.name for s in request.query_state()]
    try:
        started = time.perf_counter()
        blob = compiled.export_model()
        result["export_s"] = round(time.perf_counter() - started, 3)
        data = blob.getvalue() if isinstance(blob, io.BytesIO) else bytes(blob)
        result["blob_type"] = type(blob).__name__
        result["blob_bytes"] = len(data)
        if args.blob:
            Path(args.blob).write_bytes(data)
    except Exception as error:
        result["export_error"] = str(error).splitlines()[0][:500]
        emit(result)
        return 1

    # Does the blob import alone (weights inside) or only with the weights file?
    def try_import(label: str, props: dict) -> None:
        started = time.perf_counter()
        try:
            imported = core.import_model(io.BytesIO(data), "NPU", props)
            entry = {"ok": True, "s": round(time.perf_counter() - started, 3)}
            req = imported.create_infer_request()
            ids = prompt_ids(16)
            names = {p.get_any_name() for p in imported.inputs}
            out = req.infer({k: v for k, v in stateful_inputs(ids, 0).items() if k in names})
            entry["prefill_runs"] = True
            ref = request.infer({k: v for k, v in stateful_inputs(ids, 0).items() if k in names})
            entry["max_abs_diff_vs_compiled"] = float(
                np.max(np.abs(out["logits"][0, -1] - ref["logits"][0, -1])))
        except Exception as error:
            entry = {"ok": False, "s": round(time.perf_counter() - started, 3),
                     "error": str(error).strip().splitlines()[-1][:400]}
        result[f"import_{label}"] = entry

    try_import("plain", {"NPUW_DEVICES": "CPU"})
    try_import("weights_path", {"NPUW_DEVICES": "CPU", "WEIGHTS_PATH": str(xml.with_suffix(".bin"))})
    try_import("model_ptr", {"NPUW_DEVICES": "CPU", "MODEL_PTR": core.read_model(str(xml))})
    emit(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--model", required=True)
        p.add_argument("--prompt-len", type=int, default=1024, help="NPUW_LLM_MAX_PROMPT_LEN")
        p.add_argument("--min-response", type=int, default=128, help="NPUW_LLM_MIN_RESPONSE_LEN")
        # Unset by default: openvino 2026.4.1 reports NPUW_LLM_GENERATE_PYRAMID = True as its default.
        p.add_argument("--pyramid", choices=["YES", "NO"], help="set NPUW_LLM_GENERATE_PYRAMID")

    p = sub.add_parser("compile")
    common(p)
    p.add_argument("--request", action="store_true", help="also create an infer request")
    p.set_defaults(func=cmd_compile)
    p = sub.add_parser("decode")
    common(p)
    p.add_argument("--engine", choices=["npuw", "cpu", "cpu-f32"], required=True)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--steps", type=int, default=32, help="decode steps after prefill")
    p.add_argument("--rounds", type=int, default=3, help="prefill+decode rounds (best reported)")
    p.set_defaults(func=cmd_decode)
    p = sub.add_parser("agree")
    common(p)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--steps", type=int, default=32, help="decode steps after prefill")
    p.set_defaults(func=cmd_agree)
    p = sub.add_parser("io")
    common(p)
    p.add_argument("--blob", help="also write the exported blob here")
    p.set_defaults(func=cmd_io)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
