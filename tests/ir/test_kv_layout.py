"""kv_layout finds every fixture's KV cache from the graph alone and matches its config."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.errors import InvalidModelError


@pytest.mark.parametrize("fixture_name,form", [(n, f) for n in fixtures.MODELS for f in fixtures.forms(n)])
def test_layout_matches_config(fixture_name, form):
    cfg = fixtures.goldens(fixture_name)["config"]
    layout = ir.kv_layout(ir.load(fixtures.path(fixture_name, form)))
    assert layout.stateful == (form == "stateful")
    assert layout.num_layers == cfg["num_hidden_layers"]
    kv_heads = cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    head_dim = cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert [(t.layer, t.kind) for t in layout.tensors] == [
        (i, k) for i in range(cfg["num_hidden_layers"]) for k in ("key", "value")]
    for t in layout.tensors:
        assert (t.batch_axis, t.seq_axis, t.heads, t.head_size) == (0, 2, kv_heads, head_dim), t
        assert t.element_type == "f32"
        if form == "stateful":
            assert t.variable_id == f"past_key_values.{t.layer}.{t.kind}present.{t.layer}.{t.kind}"
        else:
            assert (t.input_name, t.output_name) == (f"past_key_values.{t.layer}.{t.kind}",
                                                     f"present.{t.layer}.{t.kind}")


def _seq_first_cache_model(seq_axis: int, names: bool) -> ov.Model:
    """A one-layer stateless model with the cache laid out [S, B, H, D] (ChatGLM-style) and
    optionally without optimum's names, so only attention wiring can label it."""
    shape = [-1, -1, 2, 8] if seq_axis == 0 else [-1, 2, -1, 8]
    q = ops.parameter([1, 2, 1, 8], np.float32, name="q")
    past_k = ops.parameter(shape, np.float32, name="pk")
    past_v = ops.parameter(shape, np.float32, name="pv")
    new = ops.parameter([1, 1, 2, 8] if seq_axis == 0 else [1, 2, 1, 8], np.float32, name="new")
    k = ops.concat([past_k, new], seq_axis)
    v = ops.concat([past_v, new], seq_axis)
    perm = ops.constant(np.array([1, 2, 0, 3] if seq_axis == 0 else [0, 1, 2, 3], np.int64))
    attn = ops.scaled_dot_product_attention(q, ops.transpose(k, perm), ops.transpose(v, perm), causal=False)
    for node, n in ((past_k, "cache_a"), (past_v, "cache_b"), (q, "q"), (new, "new")):
        node.output(0).set_names({f"past_key_values.0.{'key' if n == 'cache_a' else 'value'}"
                                  if names and n.startswith("cache") else n})
    k.output(0).set_names({"out_a"})
    v.output(0).set_names({"out_b"})
    return ov.Model([attn, k, v], [q, past_k, past_v, new], "m")


def test_sequence_first_layout_and_attention_wiring():
    layout = ir.kv_layout(_seq_first_cache_model(seq_axis=0, names=False))
    key, value = layout.tensors
    assert (key.kind, key.input_name, key.output_name) == ("key", "cache_a", "out_a")
    assert (value.kind, value.input_name) == ("value", "cache_b")
    assert (key.seq_axis, key.batch_axis, key.heads, key.head_size) == (0, 1, 2, 8)


def test_model_without_kv_cache_is_a_clear_error(tiny):
    with pytest.raises(InvalidModelError) as info:
        ir.kv_layout(tiny)
    assert info.value.code == "no-kv-cache"
    assert "found 1 inputs (x)" in str(info.value)


def test_a_state_no_attention_reads_is_named_as_such():
    """A hybrid model (granitemoehybrid: Mamba layers beside attention) keeps convolution and
    SSM states of a fixed size beside its KV cache. They were refused as KV tensors kvc could
    not label; they are states kvc does not compile, and the error says so, naming each by
    its past name. A state that grows along a sequence (a KV cache kvc failed to trace to an
    attention op) stays `kv-unlabelled`."""
    def hybrid(conv_shape):
        model = _seq_first_cache_model(seq_axis=2, names=True)
        conv = ops.parameter(conv_shape, np.float32, name="conv")
        conv.output(0).set_names({"cache_params.past.conv.0"})
        rows = ops.parameter([-1, 16, 1], np.float32, name="rows")
        state = ops.concat([conv, rows], 2)
        state.output(0).set_names({"cache_params.present.conv.0"})
        return ov.Model([*model.outputs, state.output(0)], [*model.get_parameters(), conv, rows], "hybrid")

    with pytest.raises(InvalidModelError) as info:
        ir.kv_layout(hybrid([-1, 16, 4]))
    assert info.value.code == "not-kv-state" and info.value.exit_code == 3
    assert "no attention reads" in str(info.value) and info.value.found == "cache_params.past.conv.0"
    assert info.value.expected == "states read as key or value by the model's 1 attention op"
    with pytest.raises(InvalidModelError) as info:
        ir.kv_layout(hybrid([-1, 16, -1]))
    assert info.value.code == "kv-unlabelled"


def test_a_model_of_recurrent_state_alone_is_named_as_such():
    """A pure Mamba (mamba, falcon_mamba) has convolution and SSM states and no attention op:
    it was refused as `kv-unlabelled` ("cannot tell the layer and key/value"), as if kvc had
    failed to trace a KV cache; it is `not-kv-state`, and the error says the model has no
    attention."""
    conv = ops.parameter([-1, 16, 4], np.float32, name="conv")
    conv.output(0).set_names({"cache_params.past.conv.0"})
    rows = ops.parameter([-1, 16, 1], np.float32, name="rows")
    state = ops.concat([conv, rows], 2)
    state.output(0).set_names({"cache_params.present.conv.0"})
    with pytest.raises(InvalidModelError) as info:
        ir.kv_layout(ov.Model([state.output(0)], [conv, rows], "mamba"))
    assert info.value.code == "not-kv-state" and info.value.found == "cache_params.past.conv.0"
    assert info.value.expected == "states read as key or value by an attention op (the model has none)"
