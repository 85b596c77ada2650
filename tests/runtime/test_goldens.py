"""The numpy interpreter reproduces every fixture's goldens and agrees with real peers.

For each fixture and golden prompt: numpy vs OpenVINO CPU (f32) on the stateful and the
stateless IR, and numpy vs onnxruntime on the ONNX export: logits within 1e-4 + 1e-5 × their
magnitude (kvc.runtime.compare.f32_bound), identical greedy tokens over 24 steps; numpy matches
the recorded PyTorch goldens.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.runtime.compare import f32_bound, max_abs
from kvc.runtime.generate import greedy
from kvc.runtime.session import open_session
from tests.conftest import fixture_names, goldens_hold

CASES = [(name, form, peer) for name in fixture_names()
         for form, peer in (("stateful", "openvino"), ("stateless", "openvino"), ("onnx", "onnxruntime"))
         if form in fixtures.forms(name)]


@pytest.mark.parametrize("name,form,peer", CASES, ids=[f"{n}-{f}" for n, f, _ in CASES])
def test_numpy_matches_peer_and_torch(name, form, peer):
    path = fixtures.path(name, form)
    ours, theirs = open_session(path, "numpy"), open_session(path, peer)
    golden = fixtures.goldens(name)
    for prompt in golden["prompts"]:
        a = greedy(ours, prompt["ids"], golden["max_new_tokens"])
        b = greedy(theirs, prompt["ids"], golden["max_new_tokens"])
        assert a.tokens == b.tokens, prompt["name"]
        assert max_abs(a.first_logits, b.first_logits) <= f32_bound(b.first_logits)
        assert max_abs(np.stack(a.logits), np.stack(b.logits)) <= f32_bound(np.stack(b.logits))
        if goldens_hold(name):  # else this host's OpenVINO computes another function (BF16_OWN)
            assert a.tokens == prompt["tokens"]["torch"], prompt["name"]
            torch_logits = fixtures.golden_logits(name, prompt["name"], "torch")
            assert max_abs(a.first_logits, torch_logits) <= f32_bound(torch_logits), \
                "numpy must reproduce the PyTorch golden"


def test_goldens_agree_across_engines_as_recorded(fixture_name):
    """The build's own guarantee, re-checked on the committed files."""
    golden = fixtures.goldens(fixture_name)
    assert len(golden["prompts"]) >= 2
    lengths = sorted(len(p["ids"]) for p in golden["prompts"])
    assert lengths[0] <= 8 and lengths[-1] >= 40
    peer = fixtures.peer_engine(fixture_name)
    for prompt in golden["prompts"]:
        streams = prompt["tokens"]
        assert set(streams) == {"torch", "openvino"} | ({peer} if peer else set())
        assert all(tokens == streams["torch"] for tokens in streams.values())
        assert len(streams["torch"]) == golden["max_new_tokens"] == 24


@pytest.mark.parametrize("name", fixtures.COMPRESSED)
def test_numpy_reproduces_compressed_weight_goldens(name):
    """NNCF's weights (int8/int4: u8/i8/u4/i4 constants, zero points, f16 scales, group
    reshapes; nf4, mxfp4 (f4e2m1 over f8e8m0 scales), cb4 (u4 indices into an f8e4m3 codebook),
    nvfp4, fp8): kvc's interpreter gives OpenVINO CPU f32's tokens and first-step logits within
    f32_bound."""
    golden = fixtures.goldens(name)
    model = ir.load(fixtures.path(name))
    kinds = {op.get_output_element_type(0).get_type_name() for op in model.get_ops() if op.get_type_name() == "Constant"}
    assert kinds & {"u8", "i8", "u4", "i4", "nf4", "f4e2m1", "f8e4m3"}, "the fixture must hold compressed weights"
    ours = open_session(model, "numpy")
    for prompt in golden["prompts"]:
        got = greedy(ours, prompt["ids"], golden["max_new_tokens"])
        assert got.tokens == prompt["tokens"]["openvino"], prompt["name"]
        expected = fixtures.golden_logits(name, prompt["name"], "openvino")
        assert max_abs(got.first_logits, expected) <= f32_bound(expected)
