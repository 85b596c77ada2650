"""mlp-rows: gated MLPs over 2-D rows compute what they computed, and the CPU plugin no longer
fuses them into LLMMLP (whose f16 copy of the weights costs a compiled model 2 bytes per MLP
weight)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.export.build import build_static
from kvc.export.compile import compile_static
from kvc.passes import PassManager, parse_pipeline
from kvc.plan import StaticOptions
from kvc.runtime.session import NumpySession
from kvc.runtime.static_pipeline import host_has_amx

OPTIONS = dict(max_prompt_len=32, min_response_len=16, prefill_chunk_size=8, kv_precision="f32")


def prefill(name: str, mlp: str) -> ov.Model:
    return build_static(ir.load(fixtures.path(name)), StaticOptions(**OPTIONS, prefill_mlp=mlp),
                        use_env=False).models["prefill"]


def feed_for(model: ov.Model, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feed = {}
    for port in model.inputs:
        shape, name = list(port.get_shape()), port.get_any_name()
        if name == "input_ids":
            feed[name] = rng.integers(1, 100, shape)
        elif name == "attention_mask":
            feed[name] = np.ones(shape, np.int64)
        elif name == "position_ids":
            feed[name] = np.broadcast_to(np.arange(shape[-1]) + 3, shape).astype(np.int64)
        else:
            feed[name] = rng.standard_normal(shape).astype(np.float32)
    return feed


def layers(name: str) -> int:
    import json

    config = json.loads((Path(fixtures.path(name)) / "config.json").read_text())
    return config.get("num_hidden_layers") or config.get("n_layer") or config["num_layers"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama_int4_sym_g16"])
def test_gated_mlps_over_rows_compute_the_same(name):
    before, after = prefill(name, "as-is"), prefill(name, "rows")
    rewritten = PassManager(parse_pipeline("mlp-rows"), use_env=False).run(prefill(name, "as-is")).records[0]
    assert rewritten.rule_hits == {"mlp-rows/gated-mlp": layers(name)}  # one MLP a layer
    types = [op.get_type_name() for op in after.get_ordered_ops()]
    assert types.count("Reshape") == [op.get_type_name() for op in before.get_ordered_ops()].count("Reshape") \
        + 2 * layers(name)
    feed = feed_for(before)
    want, got = NumpySession(before).infer(feed), NumpySession(after).infer(feed)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", ["gpt2", "falcon", "phi3"])
def test_models_without_the_fused_pattern_are_left_alone(name):
    """gpt2 and falcon have ungated MLPs; phi3's gate and up are one MatMul split in two."""
    model = prefill(name, "as-is")
    text = ir.to_text(model)
    record = PassManager(parse_pipeline("mlp-rows"), use_env=False).run(model).records[0]
    assert not record.modified and record.rule_hits == {} and ir.to_text(model) == text


def test_generate_models_keep_their_mlp():
    """Only the prefill branches take the pass: a decode step measured no faster without LLMMLP."""
    models = build_static(ir.load(fixtures.path("llama")), StaticOptions(**OPTIONS, prefill_mlp="rows"),
                          use_env=False)
    for name, pipeline in models.pipelines.items():
        assert ("mlp-rows" in pipeline) == name.startswith("prefill"), name


def test_the_cpu_plugin_does_not_fuse_rows_into_llmmlp():
    """At bf16 on an AMX host the plugin fuses the exported MLP into LLMMLP and not the rows form;
    elsewhere it fuses neither (the fusion is registered only for AMX at bf16/f16)."""
    core = ov.Core()
    kinds = {}
    for mlp in ("as-is", "rows"):
        compiled = core.compile_model(prefill("llama", mlp), "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
        kinds[mlp] = [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()]
    assert "LLMMLP" not in kinds["rows"]
    assert ("LLMMLP" in kinds["as-is"]) == host_has_amx()


def test_kvc_compile_resolves_rows_for_cpu_at_bf16_only():
    assert compile_static(("CPU",), "bf16").prefill_mlp == "rows"
    assert compile_static(("CPU",), "f32").prefill_mlp == "as-is"
    assert compile_static(("CPU", "NPU"), "bf16").prefill_mlp == "as-is"
    assert compile_static(("CPU",), "bf16", prefill_mlp="as-is").prefill_mlp == "as-is"
    assert StaticOptions().prefill_mlp == "as-is"
