"""Small hand-built stateful models: the inputs of golden IR tests and of edge-case tests."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.op.util import Variable, VariableInfo


def _variable(var_id: str, shape, etype=ov.Type.f32) -> Variable:
    info = VariableInfo()
    info.data_shape = ov.PartialShape(shape)
    info.data_type = etype
    info.variable_id = var_id
    return Variable(info)


def _named(node, name: str):
    node.set_friendly_name(name)
    node.output(0).set_names({name})
    return node


def kv_model(var_ids: list[str], *, beam: bool = True, heads: int = 2, head_size: int = 4,
             extra_gather_user: bool = False, assign_other_variable: bool = False) -> ov.Model:
    """A toy decoder: per variable, ReadValue(init zeros [B,H,0,D]) -> [Gather(beam_idx)] ->
    Concat(seq) -> Assign, and attention over the concatenated cache.

    `x` is [B, H, S, D] (both query and new keys/values, to keep the graph small).
    """
    x = _named(ops.parameter([-1, heads, -1, head_size], np.float32), "x")
    params = [x]
    beam_idx = None
    if beam:
        beam_idx = _named(ops.parameter([-1], np.int32), "beam_idx")
        params.append(beam_idx)
    variables, sinks, outs = [], [], []
    batch = ops.gather(ops.shape_of(x), ops.constant(np.array([0], np.int64)), ops.constant(np.int64(0)))
    init_shape = ops.concat([batch, ops.constant(np.array([heads, 0, head_size], np.int64))], 0)
    init = ops.broadcast(ops.constant(np.float32(0)), init_shape)
    for i, var_id in enumerate(var_ids):
        var = _variable(var_id, [-1, heads, -1, head_size])
        variables.append(var)
        read = ops.read_value(init, var)
        read.set_friendly_name(f"read.{i}")
        past = ops.gather(read, beam_idx, ops.constant(np.int64(0))) if beam else read
        past.set_friendly_name(f"reorder.{i}")
        cache = ops.concat([past, x], 2)
        cache.set_friendly_name(f"cache.{i}")
        written = var
        if assign_other_variable and i == 0:
            written = _variable(var_id + ".other", [-1, heads, -1, head_size])
            variables.append(written)
        sinks.append(ops.assign(cache, written))
        attn = ops.scaled_dot_product_attention(x, cache, cache, causal=False)
        attn.set_friendly_name(f"attention.{i}")
        outs.append(attn)
        if extra_gather_user and beam:
            outs.append(ops.multiply(past, ops.constant(np.float32(2))))
    total = outs[0]
    for o in outs[1:2]:
        total = ops.add(total, o) if o.get_output_partial_shape(0) == total.get_output_partial_shape(0) else total
    _named(total, "y")
    results = [total.output(0)] + [o.output(0) for o in outs[2:] if extra_gather_user]
    return ov.Model(results, [s.output(0) for s in sinks], params, variables, "toy")


def counter_model() -> ov.Model:
    """A stateful model whose state is not a KV cache: a running sum of its input."""
    x = _named(ops.parameter([2], np.float32), "x")
    var = _variable("counter", [2])
    read = ops.read_value(ops.constant(np.zeros(2, np.float32)), var)
    total = ops.add(read, x)
    _named(total, "total")
    return ov.Model([total.output(0)], [ops.assign(total, var).output(0)], [x], [var], "counter")
