"""What the CPU blob's If chain costs a prefill call (export/branches.py), against the same
static model compiled alone: medians of alternating calls in one process.

A compiled directory's prefill IRs (`kvc compile MODEL -o OUT`; OUT holds prefill.xml,
prefill-512.xml, first-16.xml, ... beside weights.bin) are compiled for the CPU once alone and
once per chain given (models in the If's order, as `branch_model` builds them); `--call`
names the model whose body runs (its selector true, every input ones).

    kvc compile bench/.models/llama-250m-fp32 -o /tmp/f32 --no-verify
    python bench/if_chain.py /tmp/f32 --call first-16 \\
        prefill,prefill-512,first-128,first-16 prefill,first-128,first-16 prefill,first-16
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import openvino as ov

from kvc.export.branches import branch_model, select_input

TYPES = {"i64": np.int64, "i32": np.int32, "boolean": bool, "f16": np.float16, "f32": np.float32}


def request_for(compiled: ov.CompiledModel, call: str, order: list[str], rows: int = 16):
    """An infer request whose inputs are set once, over arrays it shares (as kvc's runtime binds
    the cache: `OpenVINOSession.bind`), so a call copies nothing in from Python; and the arrays,
    which must outlive it. A dynamic dimension (a first chunk of dynamic rows) is `rows`."""
    request, arrays = compiled.create_infer_request(), []
    for i, port in enumerate(compiled.inputs):
        name = port.get_any_name()
        if name.startswith("kvc.select."):
            array = np.array(name == select_input(order, call))
        else:
            shape = [d.get_length() if d.is_static else rows for d in port.get_partial_shape()]
            array = np.ones(shape, TYPES[port.get_element_type().get_type_name()])
        arrays.append(array)
        request.set_input_tensor(i, ov.Tensor(array, shared_memory=True) if array.ndim else ov.Tensor(array))
    return request, arrays


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="a compiled directory")
    ap.add_argument("chains", nargs="+", help="models in the If's order, comma-separated")
    ap.add_argument("--call", required=True, help="the model whose body runs")
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--rows", type=int, default=16, help="the rows of a dynamic dimension (first-F of dynamic rows)")
    ap.add_argument("--precision", default="f32")
    args = ap.parse_args(argv)
    core = ov.Core()

    def load(name: str) -> ov.Model:
        return core.read_model(f"{args.out}/{name}.xml", f"{args.out}/weights.bin")

    config = {"INFERENCE_PRECISION_HINT": args.precision}
    runs = {}
    alone = core.compile_model(load(args.call), "CPU", config)
    runs["alone"] = request_for(alone, args.call, [], args.rows)
    for chain in args.chains:
        order = chain.split(",")
        compiled = core.compile_model(branch_model({name: load(name) for name in order}), "CPU", config)
        runs[chain] = request_for(compiled, args.call, order, args.rows)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.calls + 2):
        for key, (request, _) in runs.items():
            start = time.perf_counter()
            request.infer()
            if i >= 2:  # two warm-up rounds
                times[key].append((time.perf_counter() - start) * 1000)
    for key, values in times.items():
        print(f"{statistics.median(values):8.1f} ms  {args.call} {'alone' if key == 'alone' else 'via ' + key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
