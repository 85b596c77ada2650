"""Attention of a prefill chunk over a padded past, three graph forms side by side (issue 14).

What a 16-layer stack of the bench Llama's attention costs on OpenVINO CPU for one prefill call
of C rows over a cache of P = 1024 rows (16 query heads, 4 KV heads, head size 64), with
nothing else in the graph (each layer's output plus its query feeds the next):

* grouped: kvc's group-attention (without split_past): queries as [B, Hkv, rep, C, D], the
  cache unsqueezed to [B, Hkv, 1, P, D], rank-5 MatMuls that broadcast the repeat axis;
* fold: the repeat folded into the query rows, [B, Hkv, rep * C, D] against the cache as it
  is, [B, Hkv, P, D], the mask tiled rep times along the rows: rank-4 MatMul, Softmax, MatMul,
  the pattern the CPU plugin's Snippets MHA tokenization takes (mha_supported_transpose_ranks
  = {4} in transformation_pipeline.cpp), without expanding the cache;
* sdpa: ScaledDotProductAttention over the GQA-expanded cache (Broadcast), as exported.

The three are the same arithmetic: at f32 their outputs must agree (checked first), and at
bf16 (the CPU's default on AMX hosts) they are timed round-robin in one process, medians.

    python bench/attention_fold.py [--rows 16 128 512] [--calls 30] [--precision bf16]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np
import openvino as ov
import openvino.opset13 as ops

P, HEADS, KV_HEADS, D, LAYERS = 1024, 16, 4, 64, 16
REP = HEADS // KV_HEADS
FORMS = ("grouped", "fold", "sdpa")


def _shape(*dims) -> ov.Node:
    return ops.constant(np.array(dims, np.int64))


def stack(form: str, rows: int) -> ov.Model:
    q = ops.parameter([1, HEADS, rows, D], np.float32, name="q")
    mask = ops.parameter([1, 1, rows, P], np.float32, name="mask")
    keys = [ops.parameter([1, KV_HEADS, P, D], np.float32, name=f"k{i}") for i in range(LAYERS)]
    values = [ops.parameter([1, KV_HEADS, P, D], np.float32, name=f"v{i}") for i in range(LAYERS)]
    scale = ops.constant(np.float32(D ** -0.5))
    tiled = ops.reshape(ops.tile(ops.unsqueeze(mask, ops.constant(np.int64(1))), _shape(1, 1, REP, 1, 1)),
                        _shape(1, 1, REP * rows, P), False)
    x = q
    for k, v in zip(keys, values):
        if form == "grouped":
            q5 = ops.reshape(x, _shape(1, KV_HEADS, REP, rows, D), False)
            k5, v5 = (ops.unsqueeze(t, ops.constant(np.int64(2))) for t in (k, v))
            s = ops.add(ops.multiply(ops.matmul(q5, k5, False, True), scale), ops.unsqueeze(mask, ops.constant(np.int64(1))))
            out = ops.reshape(ops.matmul(ops.softmax(s, -1), v5, False, False), _shape(1, HEADS, rows, D), False)
        elif form == "fold":
            qf = ops.reshape(x, _shape(1, KV_HEADS, REP * rows, D), False)
            s = ops.add(ops.multiply(ops.matmul(qf, k, False, True), scale), tiled)
            out = ops.reshape(ops.matmul(ops.softmax(s, -1), v, False, False), _shape(1, HEADS, rows, D), False)
        else:
            def expand(t):
                b = ops.broadcast(ops.unsqueeze(t, ops.constant(np.int64(2))), _shape(1, KV_HEADS, REP, P, D))
                return ops.reshape(b, _shape(1, HEADS, P, D), False)
            out = ops.scaled_dot_product_attention(x, expand(k), expand(v), mask, scale, causal=False)
        x = ops.add(out, q)
    return ov.Model([x], [q, mask, *keys, *values], form)


def requests(rows: int, precision: str):
    core, made, arrays = ov.Core(), {}, []
    for form in FORMS:
        rng = np.random.default_rng(0)  # every form gets the same inputs
        compiled = core.compile_model(stack(form, rows), "CPU", {"INFERENCE_PRECISION_HINT": precision})
        request = compiled.create_infer_request()
        for port in compiled.inputs:
            value = rng.standard_normal(list(port.get_shape())).astype(np.float32)
            if port.get_any_name() == "mask":  # the prompt's rows at the end of the past, as a chunk sees it
                value[...] = 0
                value[..., :P - rows - 5] = -1e9
            arrays.append(value)
            request.set_tensor(port, ov.Tensor(value, shared_memory=True))
        request.infer()
        made[form] = request
    return made, arrays


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args(argv)
    for rows in args.rows:
        exact, _ = requests(rows, "f32")
        want = exact["grouped"].get_output_tensor(0).data
        for form in FORMS[1:]:
            got = exact[form].get_output_tensor(0).data
            err = float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))
            assert err < 1e-5, f"{form} differs from grouped at f32: NRMSE {err}"
        del exact
        timed, _arrays = requests(rows, args.precision)
        times = {form: [] for form in FORMS}
        for i in range(args.calls):
            for form in (FORMS if i % 2 else FORMS[::-1]):
                started = time.perf_counter()
                timed[form].infer()
                times[form].append(time.perf_counter() - started)
        for form in FORMS:
            kinds = Counter(op.get_rt_info()["layerType"].astype(str)
                            for op in timed[form].get_compiled_model().get_runtime_model().get_ops())
            print(f"{rows:>4} rows  {form:<8} {1e3 * float(np.median(times[form])):8.2f} ms   "
                  f"runtime nodes: {dict(kinds.most_common(4))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
