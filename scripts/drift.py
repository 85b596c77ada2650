"""How far a correct compile's own check drifts: the calibration of kvc's verification bounds.

    python scripts/drift.py [--prompt 64] [--response 64] [FIXTURE ...]

Compiles every fixture (or those named) as `kvc compile` would for each of these forms, with
its verification and blob check on, and prints, per form, the worst of each metric the checks
bound (kvc.runtime.compare, kvc.verify.cache_rows) over every probe, with where it was:

* cpu: the CPU's defaults on this host (`compile_static`: bf16 cache and blobs where the host
  computes bf16);
* cpu-f16: the same with an f16 cache;
* cpu-i8: the same with an int8 cache;
* cpu-f32-f16, cpu-f32-bf16: exact (f32) CPU blobs over an f16 or bf16 cache;
* cpu-f32-i8, npu-i8: exact CPU blobs and the NPU's over an int8 cache (judged against the IR
  over the same int8 cache: kvc.runtime.compare.same_quantization);
* npu: the NPU's defaults (unchunked prefill, f16 cache; NPUW on its CPU backend).

The numpy rows are kvc's interpreter (f32 arithmetic; over an f16 or bf16 cache widened, the
cache unrounded, as the compile runs it: kvc.verify.compiled.widens) against the source on
OpenVINO CPU f32; with --rounded the cache is rounded to its type as stored (how the check ran
before widening: docs/verification.md). The blob rows are the blobs against the IR; blobs
computing below f32 also against the plugin's own run of the source (`<metric> / peer`, the
ratios kvc.verify.peer_drift bounds by PEER_FACTOR; the noise's only where a token differs); blobs
over an int8 cache in f32 arithmetic against int8's own rounding (`<metric> / rounding`, which
kvc.verify.compiled.judge_same_quantization bounds at 1 above the peer floors). A
bound is worth what this shows: set from the worst measured here, with room, and shown to
refuse a fault.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

FORMS = {  # name: (the static options given, the devices, the CPU blobs' precision)
    "cpu": ({}, ("CPU",), "auto"),
    "cpu-f16": ({"kv_precision": "f16"}, ("CPU",), "auto"),
    "cpu-i8": ({"kv_precision": "i8"}, ("CPU",), "auto"),
    "cpu-f32-f16": ({"kv_precision": "f16"}, ("CPU",), "f32"),
    "cpu-f32-bf16": ({"kv_precision": "bf16"}, ("CPU",), "f32"),
    "cpu-f32-i8": ({"kv_precision": "i8"}, ("CPU",), "f32"),
    "npu-i8": ({"kv_precision": "i8"}, ("NPU",), "auto"),
    "npu": ({}, ("NPU",), "auto"),
}
METRICS = ("nrmse", "step_error", "cache_error")
# Blobs judged by the plugin's own drift (kvc.verify.peer_drift): how far they are from it.
PEER_RATIOS = ("nrmse", "step_error", "cache_error", "noise")  # each beside its `peer_` twin in a row
# Blobs over an int8 cache judged by its own rounding (kvc.verify.compiled.judge_same_quantization).
ROUNDING_RATIOS = ("nrmse", "step_error")  # each beside its `rounding_` twin


def main() -> int:
    from kvc import fixtures
    from kvc.errors import KvcError
    from kvc.export.compile import CompileOptions, compile_static, compile_to

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", nargs="*")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--rounded", action="store_true", help="the numpy check over the cache as stored")
    args = parser.parse_args()
    if args.rounded:
        import kvc.verify.compiled

        kvc.verify.compiled.widens = lambda kv_types: False
    names = args.fixtures or (*fixtures.MODELS, *fixtures.COMPRESSED)
    worst: dict[tuple[str, str, str], tuple[float, str]] = {}
    for form in args.forms.split(","):
        fields, devices, precision = FORMS[form]
        for name in names:
            static = compile_static(devices, precision, max_prompt_len=args.prompt, min_response_len=args.response,
                                    **fields)
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    manifest = compile_to(fixtures.path(name), Path(tmp) / "out",
                                          CompileOptions(static, devices=devices, inference_precision=precision))
                except KvcError as exc:
                    print(f"{form} {name}: FAILED {exc}", flush=True)
                    continue
            rows = [("numpy", r) for r in manifest["verification"]["results"]]
            rows += [("blobs", r) for r in manifest["blob_check"]]
            for engine, row in rows:
                where = f"{name} prompt {row['prompt_tokens']}" + (
                    f" from {row['from_position']}" if row.get("from_position") else "")
                ratios = {f"{m} / {twin}": row[m] / max(row[f"{twin}_{m}"], 1e-12)
                          for twin, metrics in (("peer", PEER_RATIOS), ("rounding", ROUNDING_RATIOS)) for m in metrics
                          if row.get(m) is not None and row.get(f"{twin}_{m}") is not None}
                for metric in (*METRICS, *ratios):
                    value = ratios[metric] if metric in ratios else row.get(metric)
                    key = (form, engine, metric)
                    if value is not None and value > worst.get(key, (-1.0, ""))[0]:
                        worst[key] = (float(value), where)
            print(f"{form} {name}: ok", flush=True)
    print("\n| form | engine | metric | worst | where |\n|---|---|---|---:|---|")
    for (form, engine, metric), (value, where) in sorted(worst.items()):
        print(f"| {form} | {engine} | {metric} | {value:.3g} | {where} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
