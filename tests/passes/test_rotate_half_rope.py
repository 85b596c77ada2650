"""rotate-half-rope: GPT-OSS's split-halves rotary becomes the rotate-half form, bit for bit,
and nothing else is touched."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

import kvc.ir as ir
from kvc import fixtures
from kvc.passes import PassManager, parse_pipeline
from kvc.runtime.session import NumpySession


def split_halves_model(shape=(1, 4, 5, 16), swapped: bool = False) -> ov.Model:
    """out = concat(x1*cos - x2*sin, x2*cos + x1*sin) over x [1, H, L, D], cos/sin [1, 1, L, D/2];
    `swapped`: the second half is x2*sin + x1*cos instead (another rotation)."""
    x = ops.parameter(list(shape), np.float32, name="x")
    cos = ops.parameter([1, 1, shape[2], shape[3] // 2], np.float32, name="cos")
    sin = ops.parameter([1, 1, shape[2], shape[3] // 2], np.float32, name="sin")
    halves = ops.split(x, -1, 2)
    x1, x2 = halves.output(0), halves.output(1)
    first = ops.subtract(ops.multiply(x1, cos), ops.multiply(x2, sin))
    second = (ops.add(ops.multiply(x2, sin), ops.multiply(x1, cos)) if swapped
              else ops.add(ops.multiply(x2, cos), ops.multiply(x1, sin)))
    out = ops.concat([first, second], -1)
    out.output(0).set_names({"out"})
    return ov.Model([out], [x, cos, sin], "split_halves")


def run(model):
    return PassManager(parse_pipeline("rotate-half-rope"), use_env=False).run(model)


def test_the_rewrite_is_bit_exact():
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((1, 4, 5, 16), np.float32) * 30,
            "cos": rng.standard_normal((1, 1, 5, 8), np.float32), "sin": rng.standard_normal((1, 1, 5, 8), np.float32)}
    before = NumpySession(split_halves_model()).infer(feed)["out"]
    result = run(split_halves_model())
    assert result.records[0].modified and result.records[0].rule_hits == {"rotate-half-rope/split-halves": 1}
    types = [op.get_type_name() for op in result.model.get_ordered_ops()]
    assert "Subtract" not in types and types.count("Concat") == 3 and "Negative" in types  # [cos,cos], [sin,sin], [-x2,x1]
    after = NumpySession(result.model).infer(feed)["out"]
    assert after.tobytes() == before.tobytes()


def test_gpt_oss_is_rewritten_and_llama_is_not():
    lifted = PassManager(parse_pipeline("lift-state"), use_env=False).run(ir.load(fixtures.path("gpt_oss"))).model
    assert run(lifted).records[0].rule_hits == {"rotate-half-rope/split-halves": 4}  # q and k of 2 layers
    llama = ir.load(fixtures.path("llama"))
    text = ir.to_text(llama)
    record = run(llama).records[0]
    assert not record.modified and record.rule_hits == {} and ir.to_text(llama) == text
    assert any("not Subtract and Add" in why for _, _, why in record.rule_misses)


def test_a_different_second_half_is_left_alone():
    """x2*sin + x1*cos in the second half is another rotation: no match, no change."""
    model = split_halves_model((1, 2, 3, 8), swapped=True)
    record = run(model).records[0]
    assert not record.modified
    assert [why for _, _, why in record.rule_misses] == ["the second half is not x2 * cos + x1 * sin"]
