"""Saving is atomic and reproducible; the text form is canonical; diffs show exactly a change."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

import kvc.ir as ir
from kvc import fixtures
from tests.conftest import fixture_names, tiny_model


def _models():
    yield "tiny", tiny_model
    for name in fixture_names():
        yield name, lambda name=name: ir.load(fixtures.path(name))
        if "stateless" in fixtures.forms(name):
            yield name + "-stateless", lambda name=name: ir.load(fixtures.path(name, "stateless"))


MODELS = dict(_models())


@pytest.mark.parametrize("name", list(MODELS))
def test_load_save_load_round_trip(tmp_path, name):
    model = MODELS[name]()
    ir.save(model, tmp_path / "a" / "m.xml")
    again = ir.load(tmp_path / "a" / "m.xml")
    assert ir.to_text(again) == ir.to_text(model)
    assert ir.diff(model, again) == ""
    ir.save(again, tmp_path / "b" / "m.xml")
    for ext in (".xml", ".bin"):
        assert (tmp_path / "a" / f"m{ext}").read_bytes() == (tmp_path / "b" / f"m{ext}").read_bytes()


def test_save_is_atomic_on_failure(tmp_path, tiny, monkeypatch):
    target = tmp_path / "m.xml"
    ir.save(tiny, target)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ov, "save_model", boom)
    with pytest.raises(RuntimeError):
        ir.save(tiny_model(), target)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before, "a failed save must leave the old files and no temporaries"


def test_save_refuses_other_suffixes(tmp_path, tiny):
    from kvc.errors import UsageError

    with pytest.raises(UsageError):
        ir.save(tiny, tmp_path / "m.onnx")


def test_save_keeps_fp32_weights(tmp_path, tiny):
    ir.save(tiny, tmp_path / "m.xml")
    types = {op.get_output_element_type(0).get_type_name() for op in ir.load(tmp_path / "m.xml").get_ops()
             if op.get_type_name() == "Constant"}
    assert types == {"f32"}


_PRINT = "import sys, kvc.ir as ir; sys.stdout.write(ir.to_text(ir.load(sys.argv[1])))"


@pytest.mark.parametrize("name", fixture_names()[:1] or ["tiny"])
def test_text_is_identical_across_processes(tmp_path, name):
    path = fixtures.path(name) if name != "tiny" else tmp_path / "t.xml"
    if name == "tiny":
        ir.save(tiny_model(), path)
    runs = [subprocess.run([sys.executable, "-c", _PRINT, str(path)], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)]
    # A different history of the per-process friendly-name counter must not matter either.
    churn = "import openvino.opset13 as o, numpy as np; [o.constant(np.zeros(1)) for _ in range(999)]; "
    runs.append(subprocess.run([sys.executable, "-c", churn + _PRINT, str(path)], capture_output=True,
                               text=True, check=True).stdout)
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] == ir.to_text(ir.load(path))


def test_text_is_readable(tiny):
    text = ir.to_text(tiny)
    assert text.splitlines()[:3] == ["# kvc ir text v1", "input %x : f32[1,?,4]", "output y : f32[1,?,3]"]
    assert "%linear = MatMul<opset1>{transpose_a=false, transpose_b=true}(%x, %weight) : f32[1,?,3]" in text
    assert "%bias = Constant<opset1> [0.5,-0.5,1.0] : f32[3]" in text
    assert text.rstrip().endswith("return y = %y")


def _with_new_bias(model: ov.Model, values) -> ov.Model:
    clone = model.clone()
    add = next(n for n in clone.get_ops() if n.get_friendly_name() == "add_bias")
    new = ops.constant(np.array(values, np.float32), name="bias")
    add.input(1).replace_source_output(new.output(0))
    clone.validate_nodes_and_infer_types()
    return clone


def test_diff_of_a_model_with_itself_is_empty(tiny):
    assert ir.diff(tiny, tiny.clone()) == ""


def test_diff_shows_exactly_the_change(tiny):
    changed = _with_new_bias(tiny, [0.5, -0.5, 2.0])
    text = ir.diff(tiny, changed)
    changes = [ln for ln in text.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changes == ["-%bias = Constant<opset1> [0.5,-0.5,1.0] : f32[3]",
                       "+%bias = Constant<opset1> [0.5,-0.5,2.0] : f32[3]"]


def test_diff_summary_counts_ops_and_io(tiny):
    x = tiny.get_parameters()[0]
    extra = ops.parameter([1], np.float32, name="gain")
    extra.output(0).set_names({"gain"})
    y = tiny.outputs[0].get_node().input_value(0)
    scaled = ops.multiply(y, extra, name="scale")
    scaled.output(0).set_names({"scaled"})
    bigger = ov.Model([tiny.outputs[0].get_node().input_value(0), scaled.output(0)], [x, extra], "tiny")
    summary = ir.summarize(tiny, bigger)
    assert summary.op_delta == {"Multiply": 1, "Parameter": 1, "Result": 1}
    assert summary.inputs_added == ("gain",) and summary.outputs_added == ("scaled",)
    head = ir.diff(tiny, bigger).splitlines()[:3]
    assert head == ["# ops: +1 Multiply, +1 Parameter, +1 Result", "# inputs added: gain",
                    "# outputs added: scaled"]


def test_graph_view(tiny):
    g = ir.graph(tiny)
    assert set(g.nodes) == {"x", "weight", "linear", "bias", "add_bias", "y", "output:y"}
    assert g.nodes["linear"]["type"] == "MatMul"
    (edge,) = g.get_edge_data("x", "linear").values()
    assert (edge["src_port"], edge["dst_port"], edge["element_type"]) == (0, 0, "f32")
    assert g.has_edge("bias", "add_bias") and g.get_edge_data("bias", "add_bias")["0->1"]["dst_port"] == 1
