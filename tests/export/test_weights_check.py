"""Every weight of every compiled model is the source's, byte for byte (kvc.verify.weights): an
expert its router never picks on the probes is read by none of them. Before this check such an
expert could be wrong in every compiled model and `kvc compile` published it."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import openvino as ov
import pytest

from kvc import fixtures
from kvc.export.build import build_static
from kvc.export.compile import compile_static, source_selects
from kvc.export.manifest import MANIFEST, dumps, file_entry
from kvc.ir.reader import load
from kvc.verify.weights import check_weights
from tests.cli.runner import SMALL, kvc
from tests.mutation.mutants import apply

EXPERTS = "self.model.layers.0.mlp.experts.gate_up_proj"  # gpt_oss: [4 experts, 64, 128]


def built(name: str):
    path = fixtures.path(name)
    return build_static(load(path), compile_static(("CPU",), max_prompt_len=64, min_response_len=64,
                                                   selects=source_selects(path)))


def constant(model, name: str):
    return next(op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"
                and op.get_friendly_name() == name)


def replace(op, data, name: str | None = None) -> None:
    tensor = ov.Tensor(op.get_element_type(), op.get_output_shape(0))
    tensor.data[:] = np.asarray(data).reshape(tensor.data.shape)  # packed low-bit types as they are held
    new = ov.op.Constant(tensor)
    new.set_friendly_name(op.get_friendly_name() if name is None else name)
    op.output(0).replace(new.output(0))


@pytest.mark.parametrize("name", ["llama", "gpt_oss", "qwen3_moe", "granitemoe_int4_sym_g16", "phi_int8",
                                  "qwen3_moe_int4_sym_g16"])
def test_a_clean_compile_has_every_weight_of_the_source(name):
    result = check_weights(load(fixtures.path(name)), built(name).models)
    assert result["ok"] and result["compared"] > 10, result


def test_an_expert_changed_in_place_is_named_with_where():
    static = built("gpt_oss")
    op = constant(static.models["generate-128"], EXPERTS)
    data = np.array(op.get_data(), copy=True)
    data[3, 10, 7] *= 1.01
    replace(op, data)
    result = check_weights(load(fixtures.path("gpt_oss")), static.models)
    assert not result["ok"] and result["model"] == "generate-128"
    assert result["reason"].startswith(f"model 'generate-128': its weight '{EXPERTS}' (f32 [4, 64, 128]) differs "
                                       "from the source's in 1 of 32768 values, first at [3, 10, 7] (max abs")


def test_a_weight_replaced_under_another_name_is_missing():
    static = built("qwen3_moe")
    op = constant(static.models["prefill"], "self.model.layers.1.mlp.experts.down_proj")
    replace(op, np.array(op.get_data()), name="down_proj_copy")
    result = check_weights(load(fixtures.path("qwen3_moe")), static.models)
    assert not result["ok"] and result["model"] == "prefill"
    assert "it has no weight named 'self.model.layers.1.mlp.experts.down_proj' (the source's f32 [4,64,64])" \
        in result["reason"]


def test_a_router_bias_with_a_counter_name_is_matched_and_compared():
    """gpt_oss's router bias is `Constant_21041` in the source IR, a hashed name in kvc's."""
    source = load(fixtures.path("gpt_oss"))
    assert any(re.fullmatch(r"Constant_\d+", op.get_friendly_name()) and list(op.get_output_shape(0)) == [1, 4]
               for op in source.get_ordered_ops() if op.get_type_name() == "Constant")
    static = built("gpt_oss")
    model = static.models["first-16"]
    op = next(op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"
              and list(op.get_output_shape(0)) == [1, 4])
    assert op.get_friendly_name().startswith("Constant#")
    replace(op, np.array(op.get_data()) + np.float32(0.5))
    result = check_weights(source, static.models)
    assert not result["ok"] and f"its weight '{op.get_friendly_name()}' (f32 [1, 4]) differs" in result["reason"]


def test_a_compressed_weight_changed_in_place_is_found():
    static = built("granitemoe_int4_sym_g16")
    model = static.models["prefill"]
    op = next(op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"
              and op.get_element_type().get_type_name() == "i4" and "output_linear" in op.get_friendly_name())
    data = np.array(op.get_data(), copy=True)
    data.reshape(-1)[5] ^= 1  # a bit of one packed int4 pair
    replace(op, data)
    result = check_weights(load(fixtures.path("granitemoe_int4_sym_g16")), static.models)
    assert not result["ok"] and f"its weight '{op.get_friendly_name()}' (i4 " in result["reason"]


def never_routed(tmp_path, experts=(3,)):
    """gpt_oss with its routers' bias for `experts` at -1e4: no token ever picks them."""
    source, path = fixtures.path("gpt_oss"), tmp_path / "never_routed"
    path.mkdir()
    for f in source.iterdir():
        if not f.name.startswith("openvino_model."):
            shutil.copy(f, path / f.name)
    model = ov.Core().read_model(source / "openvino_model.xml")
    biases = [op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"
              and list(op.get_output_shape(0)) == [1, 4]]
    assert len(biases) == 2  # one router per layer
    for op in biases:
        data = np.array(op.get_data(), copy=True)
        data[..., list(experts)] = -1e4
        replace(op, data)
    ov.save_model(model, path / "openvino_model.xml", compress_to_fp16=False)
    return path


def test_an_expert_no_probe_routes_to_is_refused_only_by_the_weights(tmp_path, monkeypatch):
    """The fault in expert 3 is invisible to every probe (the compile publishes it when the
    weights are not compared), and the weights check refuses it."""
    import kvc.verify.weights as weights

    source = never_routed(tmp_path)
    applied = apply("gen_expert_in_place_1e2", monkeypatch.setattr, monkeypatch.setenv, "ir")
    result = kvc("compile", source, "-o", tmp_path / "out", *SMALL, code=4)
    assert applied.edits == {"generate-128": 2}  # both layers' experts, in the generate model
    assert (f"does not reproduce {source}: model 'generate-128': its weight '{EXPERTS}' (f32 [4, 64, 128]) "
            "differs from the source's in 8192 of 32768 values, first at [3, 0, 0]") in result.output
    assert not (tmp_path / "out").exists()
    with monkeypatch.context() as m:
        m.setattr(weights, "check_weights", lambda *args: {"ok": True, "compared": 0, "reason": "off"})
        published = kvc("compile", source, "-o", tmp_path / "blind", *SMALL)
    assert "blobs: CPU" in published.output and (tmp_path / "blind" / MANIFEST).exists()


def test_kvc_verify_reads_every_weight_of_a_rewritten_weights_file(tmp_path):
    """weights.bin changed in expert 3 of a never-routed source, behind a consistent manifest:
    every probe agrees, the weights do not."""
    source, out = never_routed(tmp_path), tmp_path / "out"
    kvc("compile", source, "-o", out, *SMALL)
    xml = (out / "generate-128.xml").read_text()
    offset = int(re.search(rf'name="{re.escape(EXPERTS)}" type="Const".*?offset="(\d+)"', xml, re.S)[1])
    with open(out / "weights.bin", "r+b") as f:
        f.seek(offset + 4 * 64 * 128 * 3)  # expert 3's first row of 128 floats
        row = np.frombuffer(f.read(512), np.float32) * -1
        f.seek(offset + 4 * 64 * 128 * 3)
        f.write(row.tobytes())
    m = json.loads((out / MANIFEST).read_text())
    m["files"] = {name: file_entry(out / name) for name in m["files"]}
    (out / MANIFEST).write_text(dumps(m))
    result = kvc("verify", out, "--backends", "numpy", "--max-new-tokens", "2", code=4)
    assert f"kvc: error: mismatch in the weights: model 'first-16': its weight '{EXPERTS}'" in result.output
    report = json.loads(kvc("verify", out, "--backends", "numpy", "--max-new-tokens", "2", "--json",
                            code=4).stdout.split("\nkvc: error")[0])
    assert all(r["ok"] for r in report["results"])  # no probe reads expert 3
    assert not report["weights"]["ok"] and report["embedding"]["ok"]
