"""dense-experts: MoE layers whose expert rows are data get static shapes, computing the same
numbers (the rule docstrings in kvc/passes/dense_experts.py)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.passes import PassManager, parse_pipeline
from kvc.runtime.generate import greedy
from kvc.runtime.interpreter import Interpreter
from kvc.runtime.session import open_session

EXPERTS, WIDTH = 4, 8


def dense(model: ov.Model):
    return PassManager(parse_pipeline("dense-experts"), use_env=False).run(model)


def routed_model(slots: str, tail: str = "scatter") -> ov.Model:
    """transformers 4's Mixtral block in miniature (optimum-intel's patched forward): per expert
    `slot, row = NonZero(Transpose(OneHot(indices))[e])`, the expert on `x[row]` times
    `weights[row, slot]`, added back by a summing scatter. `slots` "topk": one TopK of 2, whose
    indices differ within a row; "two-top1": two TopKs of 1 over the same scores, concatenated,
    so a row's two slots hold the same expert (PhiMoE's sparsemixer concatenates two). `tail`
    "reduce": the expert's rows are also summed; "split": its first half of rows added to its
    second; neither is row by row."""
    rng = np.random.default_rng(7)
    x = ops.parameter([-1, WIDTH], np.float32, name="x")
    x.output(0).set_names({"x"})
    scores = ops.matmul(x, ops.constant(rng.standard_normal((WIDTH, EXPERTS)).astype(np.float32)), False, False)
    if slots == "topk":
        top = ops.topk(scores, ops.constant(np.int64(2)), -1, "max", "value", "i64")
        weights, indices = top.output(0), top.output(1)
    else:
        first = ops.topk(scores, ops.constant(np.int64(1)), -1, "max", "value", "i64")
        second = ops.topk(ops.multiply(scores, ops.constant(np.float32(0.5))), ops.constant(np.int64(1)), -1, "max",
                          "value", "i64")
        weights = ops.concat([first.output(0), second.output(0)], -1).output(0)
        indices = ops.concat([first.output(1), second.output(1)], -1).output(0)
    k = indices.get_partial_shape()[1].get_length()
    hot = ops.transpose(ops.one_hot(indices, ops.constant(np.int64(EXPERTS)), ops.constant(np.int64(1)),
                                    ops.constant(np.int64(0)), -1), ops.constant(np.array([2, 1, 0], np.int64)))
    flat = ops.reshape(weights, ops.constant(np.array([-1], np.int64)), False)
    out = ops.broadcast(ops.constant(np.float32(0)), ops.shape_of(x))
    for e in range(EXPERTS):
        pairs = ops.non_zero(ops.gather(hot, ops.constant(np.int64(e)), ops.constant(np.int64(0))), "i64")
        halves = ops.split(pairs, ops.constant(np.int64(0)), 2).outputs()
        slot, row = (ops.squeeze(p, ops.constant(np.int64(0))) for p in halves)
        y = ops.matmul(ops.gather(x, row, ops.constant(np.int64(0))),
                       ops.constant(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)), False, False)
        w = ops.gather(flat, ops.add(ops.multiply(row, ops.constant(np.int64(k))), slot), ops.constant(np.int64(0)))
        y = ops.multiply(ops.swish(y), ops.unsqueeze(w, ops.constant(np.int64(1))))
        if tail == "reduce":
            y = ops.add(y, ops.reduce_sum(y, ops.constant(np.int64(0)), keep_dims=True))
        elif tail == "split":  # row m added to row m + M / 2: which rows meet is data
            halves = ops.split(y, ops.constant(np.int64(0)), 2)
            y = ops.add(halves.output(0), halves.output(1))
            row = ops.split(row, ops.constant(np.int64(0)), 2).output(0)
        index = ops.broadcast(ops.unsqueeze(row, ops.constant(np.int64(1))), ops.constant(np.array([1, WIDTH], np.int64)),
                              broadcast_spec="BIDIRECTIONAL")
        out = ops.scatter_elements_update(out, index, y, ops.constant(np.int64(0)), "sum", True)
    out.output(0).set_names({"y"})
    return ov.Model([out], [x], f"routed_{slots}")


def outputs(model: ov.Model, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(OpenVINO CPU at f32, kvc's interpreter) on `rows` random rows."""
    x = np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)
    compiled = ir.core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled({"x": x})[0], Interpreter(model).run({"x": x})["y"]


@pytest.mark.parametrize("slots,form", [("topk", "one_pair_per_row"), ("two-top1", "every_index")])
def test_routed_rows_are_static_and_exact(slots, form):
    """Every row one pair where a row's slots are distinct; every index tuple where nothing
    shows them distinct: the same terms added in the same order as from NonZero's pairs, on
    rows where some expert gets none (1 row, top-2 of 4) and on many. OpenVINO CPU computes a
    MatMul row the same whatever the row count, so its bits are the source's; numpy's BLAS
    does not (a row of 5 gathered differs from the same row of all 5 by an ulp or so)."""
    result = dense(routed_model(slots))
    assert result.records[0].rule_hits == {"dense-experts/routed-rows": EXPERTS}
    model = result.model
    assert not [n for n in model.get_ops() if n.get_type_name() == "NonZero"]
    assert len([n for n in model.get_ops() if n.get_friendly_name().endswith(form)]) == EXPERTS
    model.reshape({"x": [5, WIDTH]})  # what static-shape needs: every shape static
    assert model.output(0).get_partial_shape().is_static and all(
        n.get_output_partial_shape(i).is_static for n in model.get_ops() for i in range(n.get_output_size()))
    for rows in (1, 5, 33):
        source, rewritten = routed_model(slots), dense(routed_model(slots)).model
        for seed in range(3):
            want_cpu, want_numpy = outputs(source, rows, seed)
            got_cpu, got_numpy = outputs(rewritten, rows, seed)
            np.testing.assert_array_equal(got_cpu, want_cpu)
            np.testing.assert_allclose(got_numpy, want_numpy, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(want_numpy, want_cpu, rtol=1e-5, atol=1e-5)


def test_one_pair_per_row_is_wrong_where_a_row_repeats_an_expert(monkeypatch):
    """The distinct-slots test is what keeps one pair per row exact: forced on two top-1s that
    pick the same expert, a row adds its expert once where the source adds it twice."""
    import kvc.passes.dense_experts as de

    monkeypatch.setattr(de, "_distinct_slots", lambda mask: True)
    want, _ = outputs(routed_model("two-top1"), 5, 0)
    got, _ = outputs(dense(routed_model("two-top1")).model, 5, 0)
    assert np.abs(got - want).max() > 0.1


@pytest.mark.parametrize("tail", ["reduce", "split"])
def test_routed_rows_used_across_rows_are_left_alone(tail):
    """A sum over the routed rows, or a split of them by their count, is not row by row: one
    pair per row would compute something else, so the model stays as it is (and static-shape
    refuses it by name)."""
    result = dense(routed_model("topk", tail=tail))
    assert result.records[0].modified is False
    assert len([n for n in result.model.get_ops() if n.get_type_name() == "NonZero"]) == EXPERTS


def test_dbrx_routes_every_row_exactly():
    """DBRX as optimum-intel exports it under transformers 4.57 (NonZero per expert, index_add):
    every expert of both layers rewritten, the same tokens and logits to the bit on OpenVINO."""
    model = ir.load(fixtures.path("dbrx"))
    prompt = fixtures.goldens("dbrx")["prompts"][1]["ids"]
    reference = greedy(open_session(model.clone(), "openvino"), prompt, 8)
    result = dense(model)
    assert result.records[0].rule_hits == {"dense-experts/routed-rows": 8}
    got = greedy(open_session(result.model, "openvino"), prompt, 8)
    assert got.tokens == reference.tokens
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(reference.logits))


def test_dense_experts_rewrites_every_expert_block_exactly():
    model = ir.load(fixtures.path("granitemoe"))
    reference = greedy(open_session(model.clone(), "openvino"), fixtures.goldens("granitemoe")["prompts"][1]["ids"], 8)
    result = dense(model)
    assert result.records[0].rule_hits == {"dense-experts/expert-blocks": 4}  # input and output linear, 2 layers
    got = greedy(open_session(result.model, "openvino"), fixtures.goldens("granitemoe")["prompts"][1]["ids"], 8)
    assert got.tokens == reference.tokens
    np.testing.assert_array_equal(got.logits[0], reference.logits[0])  # Select copies: bit-exact
    assert dense(ir.load(fixtures.path("llama"))).records[0].modified is False
