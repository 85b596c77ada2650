"""One static model call per KV cache type and attention form, side by side (issue 14).

Compiles MODEL four times with `kvc compile --no-verify` (--kv-precision f16 or bf16,
--attention grouped or split-past; CPU blobs at the plugin's default precision), then compiles
each directory's generate model and chunked prefill model from its IR on OpenVINO CPU in one
process, every input bound once to a zeroed array (as the pipeline binds its buffers), and
times the calls round-robin, the order reversed every round: medians per form. One process for
the four is on purpose here, so that each call meets the same host state; it is not what a user
runs (bench/compile_ab.py is).

    python bench/attention_forms.py [--calls 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from default_path import MODEL, kvc_compile

FORMS = [("f16", "grouped"), ("f16", "split-past"), ("bf16", "grouped"), ("bf16", "split-past")]


def request_for(xml: Path):
    """A CPU infer request over `xml` (its directory's weights.bin), every input bound to zeros
    (the attention mask all ones); the arrays it shares are returned with it."""
    import openvino as ov

    from kvc.runtime.session import array_dtype, shared_tensor

    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(xml), str(xml.parent / "weights.bin")), "CPU")
    request, arrays = compiled.create_infer_request(), []
    for port in compiled.inputs:
        value = np.zeros(list(port.get_shape()), array_dtype(port.get_element_type()))
        if port.get_any_name() == "attention_mask":
            value[...] = 1
        arrays.append(value)
        request.set_tensor(port, shared_tensor(value))
    return request, arrays


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvc-attention-forms-", dir=os.environ.get("TMPDIR")) as name:
        requests = {}
        for kv, attention in FORMS:
            out = Path(name) / f"{kv}-{attention}"
            kvc_compile(args.model, out, "--no-verify", "--kv-precision", kv, "--attention", attention)
            models = json.loads((out / "manifest.json").read_text())["models"]
            generate = max((n for n in models if n.startswith("generate-")), key=lambda n: int(n.split("-")[1]))
            for model in ("prefill", generate):
                requests[(kv, attention, model.split("-")[0])] = request_for(out / models[model]["xml"])
        times = {key: [] for key in requests}
        keys = list(requests)
        for i in range(args.calls + 2):
            for key in keys if i % 2 == 0 else keys[::-1]:
                started = time.perf_counter()
                requests[key][0].infer()
                if i >= 2:  # two warm-up rounds
                    times[key].append(time.perf_counter() - started)
        print("| KV cache | attention | generate step | prefill chunk |\n|---|---|---:|---:|")
        for kv, attention in FORMS:
            step, chunk = (1e3 * statistics.median(times[(kv, attention, m)]) for m in ("generate", "prefill"))
            print(f"| {kv} | {attention} | {step:.2f} ms | {chunk:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
