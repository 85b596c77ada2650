"""group-attention computes ScaledDotProductAttention's specification over the grouped cache."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.passes import PassManager, parse_pipeline
from kvc.runtime.session import NumpySession, OpenVINOSession
from tests.conftest import fixture_names


def _attention_model(causal: bool, mask: str | None, scale: bool, rep: int = 2, past: int = 0):
    """SDPA over a GQA-expanded cache, the way optimum exports it; with `past`, the keys and
    values are each a Concat of that many past rows (inputs k_past, v_past) and the rest."""
    B, Hkv, L, S, D = 1, 2, 3, 5, 4
    H = Hkv * rep
    q = ops.parameter([B, H, L, D], np.float32, name="q")
    k = ops.parameter([B, Hkv, S - past, D], np.float32, name="k")
    v = ops.parameter([B, Hkv, S - past, D], np.float32, name="v")
    params = [q, k, v]
    if past:
        pasts = [ops.parameter([B, Hkv, past, D], np.float32, name=n) for n in ("k_past", "v_past")]
        params += pasts
        k, v = (ops.concat([p, x], 2) for p, x in zip(pasts, (k, v)))

    def expand(x):
        u = ops.unsqueeze(x, ops.constant(np.array([2], np.int64)))
        b = ops.broadcast(u, ops.constant(np.array([B, Hkv, rep, S, D], np.int64)))
        return ops.reshape(b, ops.constant(np.array([B, H, S, D], np.int64)), False)

    args = [q, expand(k), expand(v)]
    if mask == "float":
        m = ops.parameter([B, 1, L, S], np.float32, name="m")
        params.append(m)
        args.append(m)
    elif mask == "bool":
        m = ops.parameter([B, H, L, S], np.bool_, name="m")
        params.append(m)
        args.append(m)
    if scale:
        args.append(ops.constant(np.float32(0.3)))
    for p in params:
        p.output(0).set_names({p.get_friendly_name()})
    out = ops.scaled_dot_product_attention(*args, causal=causal)
    out.output(0).set_names({"out"})
    return ov.Model([out], params, "attn")


def _feed(rng, mask: str | None, past: int = 0) -> dict:
    """Random inputs for `_attention_model` (S = 5 keys, `past` of them in k_past/v_past)."""
    feed = {"q": rng.standard_normal((1, 4, 3, 4), np.float32)}
    for name, rows in (("k", 5 - past), ("v", 5 - past)) + ((("k_past", past), ("v_past", past)) if past else ()):
        feed[name] = rng.standard_normal((1, 2, rows, 4), np.float32)
    if mask == "float":
        feed["m"] = np.where(rng.random((1, 1, 3, 5)) < 0.3, -1e9, 0).astype(np.float32)
    elif mask == "bool":
        feed["m"] = rng.random((1, 4, 3, 5)) > 0.3
        feed["m"][..., 0] = True
    return feed


@pytest.mark.parametrize("spec", ["group-attention", "group-attention{fold=true}"])
@pytest.mark.parametrize("causal,mask,scale", [(False, None, False), (True, None, False), (False, "float", True),
                                               (False, "bool", False), (True, "float", True)])
def test_matches_the_specification(causal, mask, scale, spec):
    """Grouped (rank 5, the repeat axis broadcast) and folded (rank 4, the repeat in the query
    rows, the mask tiled or reshaped to match) both compute the specification."""
    model = _attention_model(causal, mask, scale)
    feed = _feed(np.random.default_rng(0), mask)
    before = OpenVINOSession(model).infer(feed)["out"]
    grouped = PassManager(parse_pipeline(spec), use_env=False).run(model.clone()).model
    if "fold" in spec:
        ranks = {len(n.get_output_partial_shape(0)) for n in grouped.get_ops() if n.get_type_name() == "MatMul"}
        assert ranks == {4}, "the attention's MatMuls are rank 4"
    assert not [n for n in grouped.get_ops() if n.get_type_name() == "ScaledDotProductAttention"]
    assert not [n for n in grouped.get_ops() if n.get_type_name() == "Broadcast"], "the cache is never expanded"
    for session in (NumpySession(grouped), OpenVINOSession(grouped)):
        np.testing.assert_allclose(session.infer(feed)["out"], before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal,mask,scale", [(False, None, False), (True, "float", True), (False, "bool", False)])
def test_split_past_matches_the_specification(causal, mask, scale):
    """split_past reads the past and the new rows apart: no Concat of keys or values is left,
    and the result is the specification's."""
    model = _attention_model(causal, mask, scale, past=3)
    feed = _feed(np.random.default_rng(2), mask, past=3)
    before = OpenVINOSession(model).infer(feed)["out"]
    split = PassManager(parse_pipeline("group-attention{split_past=true}"), use_env=False).run(model.clone()).model
    concats = [n for n in split.get_ops() if n.get_type_name() == "Concat"]
    assert [c.get_output_partial_shape(0)[-1].get_length() for c in concats] == [5], "one Concat: the scores'"
    for session in (NumpySession(split), OpenVINOSession(split)):
        np.testing.assert_allclose(session.infer(feed)["out"], before, rtol=1e-5, atol=1e-6)


def test_split_past_needs_two_parts_on_the_sequence_axis():
    """Keys and values that are not a past/new Concat on axis 2 keep the plain grouped form."""
    model = _attention_model(False, None, False)
    split = PassManager(parse_pipeline("group-attention{split_past=true}"), use_env=False).run(model.clone()).model
    assert not [n for n in split.get_ops() if n.get_type_name() in ("Concat", "VariadicSplit")]


@pytest.mark.parametrize("name", fixture_names())
def test_folded_prefill_chunk_unchanged_on_fixtures(name):
    """fold on a prefill chunk over a past (rows that see part of the past and part of their
    chunk, every fixture's mask and GQA form): the logits and the new cache rows unchanged."""
    spec = ("lift-state,dense-experts,static-shape{kind=prefill,prompt=64,chunk=16},mask-positions,"
            "unmask-pad-rows")
    model = PassManager(parse_pipeline(spec), use_env=False).run(ir.load(fixtures.path(name))).model
    folded = PassManager(parse_pipeline("group-attention{fold=true}"), use_env=False).run(model.clone()).model
    rng = np.random.default_rng(3)
    feed = {}
    for p in model.inputs:
        shape, dtype, name_ = list(p.get_shape()), p.get_element_type().to_dtype(), p.get_any_name()
        if name_ == "attention_mask":  # 20 rows of past, then the chunk's last 9 rows
            feed[name_] = np.zeros(shape, dtype)
            feed[name_][..., :20] = 1
            feed[name_][..., -9:] = 1
        elif name_ == "position_ids":
            feed[name_] = np.broadcast_to(np.arange(shape[-1]) + 13, shape).astype(dtype)
        elif dtype == np.int64:
            feed[name_] = rng.integers(1, 300, shape)
        else:
            feed[name_] = rng.standard_normal(shape).astype(dtype)
    a, b = NumpySession(model).infer(feed), NumpySession(folded).infer(feed)
    for key in a:
        np.testing.assert_allclose(b[key][..., -9:, :] if key == "logits" else b[key],
                                   a[key][..., -9:, :] if key == "logits" else a[key], atol=1e-4, err_msg=key)


@pytest.mark.parametrize("split_past", [False, True])
@pytest.mark.parametrize("name", fixture_names())
def test_static_generate_step_unchanged_on_fixtures(name, split_past):
    spec = "lift-state,dense-experts,static-shape{kind=generate,size=96},mask-positions,unmask-pad-rows"
    model = PassManager(parse_pipeline(spec), use_env=False).run(ir.load(fixtures.path(name))).model
    grouped = PassManager(parse_pipeline(f"group-attention{{split_past={str(split_past).lower()}}}"),
                          use_env=False).run(model.clone()).model
    if split_past:  # every attention rewritten reads its past apart (xglm has none, gpt_oss keeps its sinks')
        count = lambda m: sum(n.get_type_name() == "ScaledDotProductAttention" for n in m.get_ops())  # noqa: E731
        split = [n for n in grouped.get_ops() if n.get_type_name() == "VariadicSplit"
                 and n.input_value(0).get_node().get_type_name() == "Softmax"]
        assert len(split) == count(model) - count(grouped)
    rng = np.random.default_rng(1)
    feed = {}
    for p in model.inputs:
        shape, dtype = list(p.get_shape()), p.get_element_type().to_dtype()
        feed[p.get_any_name()] = (np.ones(shape, dtype) if dtype == np.int64 and "mask" in p.get_any_name()
                                  else rng.integers(1, 300, shape) if dtype == np.int64
                                  else rng.standard_normal(shape).astype(dtype))
    a, b = NumpySession(model).infer(feed)["logits"], NumpySession(grouped).infer(feed)["logits"]
    np.testing.assert_allclose(b, a, atol=1e-4)
