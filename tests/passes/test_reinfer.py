"""Passes that infer shapes only around what they rewired give the IR a whole-model
inference gives."""

from __future__ import annotations

import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.passes import PassFailure, PassManager, kv_io, parse_pipeline

STATIC = ["static-shape{kind=prefill,prompt=64,chunk=0}", "static-shape{kind=prefill,prompt=64,chunk=16}",
          "static-shape{kind=generate,size=80,tokens=1}"]
KV_IO = ["kv-io{kv_type=f16}", "kv-io{kv_type=f16,transpose_v=true,slice_logits=true}",
         "kv-io{new_rows_only=false}"]


@pytest.mark.parametrize("fixture", ["llama", "gpt2", "mistral", "bloom"])
def test_kv_io_local_inference_equals_whole_model_inference(fixture, monkeypatch):
    for static in STATIC:
        for kv in KV_IO:
            pipeline = parse_pipeline(f"lift-state,{static},mask-positions,unmask-pad-rows,{kv}")
            local = PassManager(pipeline, use_env=False).run(ir.load(fixtures.path(fixture))).model
            with monkeypatch.context() as m:
                m.setattr(kv_io, "reinfer", lambda nodes: None)
                whole = PassManager(pipeline, use_env=False, check=False).run(ir.load(fixtures.path(fixture))).model
            whole.validate_nodes_and_infer_types()
            assert ir.to_text(local) == ir.to_text(whole), f"{fixture}: {static}, {kv}"


def test_without_reinference_the_check_would_fail(monkeypatch):
    """The comparison above can fail: with no inference at all, the outputs keep stale shapes."""
    pipeline = parse_pipeline(f"lift-state,{STATIC[2]},{KV_IO[0]}")
    monkeypatch.setattr(kv_io, "reinfer", lambda nodes: None)
    stale = PassManager(pipeline, use_env=False, check=False).run(ir.load(fixtures.path("llama"))).model
    text = ir.to_text(stale)
    stale.validate_nodes_and_infer_types()
    assert ir.to_text(stale) != text


def test_check_mode_names_the_pass_that_left_a_stale_type(monkeypatch):
    pipeline = parse_pipeline(f"lift-state,{STATIC[2]},{KV_IO[0]}")
    monkeypatch.setattr(kv_io, "reinfer", lambda nodes: None)
    with pytest.raises(PassFailure, match=r"pass kv-io failed: check mode: output 0 of Result 'present\.1\.value' .* "
                                          r"was f32\[1,2,80,16\] before inference and f16\[1,2,1,16\] after"):
        PassManager(pipeline, use_env=False, check=True).run(ir.load(fixtures.path("llama")))
