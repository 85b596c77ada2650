"""fuse-kvcache and lower-kvcache keep every number; indirect beams equal physical reorders."""

from __future__ import annotations

import io

import numpy as np
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.passes import Instrumentation, PassManager, parse_pipeline
from kvc.runtime.generate import greedy
from kvc.runtime.session import open_session
from tests.conftest import SAMPLE, fixture_names, host_golden
from tests.passes.models import kv_model

ATOL = 1e-4


def apply(model, spec):
    return PassManager(parse_pipeline(spec), use_env=False).run(model).model


def op_count(model, op):
    return sum(n.get_type_name() == op for n in model.get_ordered_ops())


# Every architecture in two forms; the other forms on the SAMPLE: what differs between forms is
# the beam handling and the backend, not the pattern each architecture's cache update must match
# (all of them took 150 s of the suite).


def every_fixture_in(forms, other_forms) -> list:
    return [(n, *f) for n in fixture_names() for f in forms] + [(n, *f) for n in SAMPLE for f in other_forms]


@pytest.mark.parametrize("fixture_name, spec, backend", every_fixture_in(
    [("lift-state,fuse-kvcache", "numpy"), ("fuse-kvcache", "openvino")],
    [("fuse-kvcache", "numpy"), ("lift-state,fuse-kvcache", "openvino")]))
def test_fused_model_gives_the_same_outputs(fixture_name, spec, backend):
    golden = fixtures.goldens(fixture_name)
    fused = apply(ir.load(fixtures.path(fixture_name)), spec)
    assert op_count(fused, "KVCache") == 2 * golden["config"]["num_hidden_layers"]
    assert op_count(fused, "Concat") < op_count(ir.load(fixtures.path(fixture_name)), "Concat")
    session = open_session(fused, backend)
    for prompt in golden["prompts"]:
        got = greedy(session, prompt["ids"], 24)
        tokens, logits = host_golden(fixture_name, prompt)
        assert got.tokens == tokens
        assert np.max(np.abs(got.first_logits - logits)) <= ATOL


def prompt_logits(name, prompt):
    return fixtures.golden_logits(name, prompt["name"], "openvino")


@pytest.mark.parametrize("fixture_name, beam, lifted", every_fixture_in(
    [("gather", False), ("indirect", True)], [("indirect", False), ("gather", True)]))
def test_fuse_then_lower_is_bit_identical_on_numpy(fixture_name, beam, lifted):
    prefix = "lift-state{beam=keep}," if lifted else ""
    original = open_session(apply(ir.load(fixtures.path(fixture_name)), prefix.rstrip(",") or "lift-state{beam=keep}")
                            if lifted else ir.load(fixtures.path(fixture_name)), "numpy")
    lowered = apply(ir.load(fixtures.path(fixture_name)), f"{prefix}fuse-kvcache{{beam={beam}}},lower-kvcache")
    assert op_count(lowered, "KVCache") == 0
    prompt = fixtures.goldens(fixture_name)["prompts"][1]["ids"]
    a, b = greedy(original, prompt, 6), greedy(open_session(lowered, "numpy"), prompt, 6)
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(np.stack(a.logits), np.stack(b.logits))
    np.testing.assert_array_equal(a.first_logits, b.first_logits)


def beam_search_logits(session, steps: int, batch: int, seed: int, lifted: bool) -> list[np.ndarray]:
    """Drive a session like beam search: each step picks a random beam_idx (with repeats),
    feeds one token per row, and returns every step's logits."""
    rng = np.random.default_rng(seed)
    session.reset()
    ids = rng.integers(1, 300, size=(batch, 5))
    past_len, logits = 0, []
    past = {}
    if lifted:
        for name in session.input_names:
            if name.startswith("past_key_values"):
                past[name] = np.zeros((batch, 2, 0, 16), np.float32)
            elif name == "past_beam_table":
                past[name] = np.zeros((batch, 0), np.int32)
    for step in range(steps):
        n = ids.shape[1]
        beam = np.arange(batch, dtype=np.int32) if step == 0 else rng.integers(0, batch, batch).astype(np.int32)
        feed = {"input_ids": ids, "attention_mask": np.ones((batch, past_len + n), np.int64),
                "position_ids": np.tile(np.arange(past_len, past_len + n), (batch, 1)), "beam_idx": beam, **past}
        out = session.infer({k: v for k, v in feed.items() if k in session.input_names})
        logits.append(out["logits"][:, -1].copy())
        if lifted:
            past = {k: out[k.replace("past_key_values", "present").replace("past_", "present_")] for k in past}
        past_len += n
        ids = rng.integers(1, 300, size=(batch, 1))
    return logits


@pytest.mark.parametrize("lifted", [False, True], ids=["stateful", "lifted"])
@pytest.mark.parametrize("backend", ["numpy", "openvino"])
def test_indirect_equals_physical_gather_under_random_beams(lifted, backend):
    prefix = "lift-state{beam=keep}," if lifted else ""
    physical = apply(ir.load(fixtures.path("llama")), f"{prefix}fuse-kvcache{{beam=gather}}")
    indirect = apply(ir.load(fixtures.path("llama")), f"{prefix}fuse-kvcache{{beam=indirect}}")
    assert op_count(indirect, "GatherElements") == 4
    a = beam_search_logits(open_session(physical, backend), 8, 3, seed=7, lifted=lifted)
    b = beam_search_logits(open_session(indirect, backend), 8, 3, seed=7, lifted=lifted)
    for step, (x, y) in enumerate(zip(a, b)):
        assert np.max(np.abs(x - y)) <= (0 if backend == "numpy" else ATOL), f"step {step}"


def test_physical_gather_fusion_matches_unfused_model_under_random_beams():
    original = beam_search_logits(open_session(fixtures.path("llama"), "numpy"), 8, 3, seed=3, lifted=False)
    fused = beam_search_logits(open_session(apply(ir.load(fixtures.path("llama")), "fuse-kvcache"), "numpy"),
                               8, 3, seed=3, lifted=False)
    for x, y in zip(original, fused):
        np.testing.assert_array_equal(x, y)


def test_kvcache_serialises_loads_back_and_runs(tmp_path, fixture_name):
    fused = apply(ir.load(fixtures.path(fixture_name)), "fuse-kvcache{beam=indirect}")
    ir.save(fused, tmp_path / "fused.xml")
    assert 'type="KVCache" version="kvc"' in (tmp_path / "fused.xml").read_text()
    again = ir.load(tmp_path / "fused.xml")
    assert ir.to_text(again) == ir.to_text(fused)
    prompt = fixtures.goldens(fixture_name)["prompts"][0]
    for backend in ("numpy", "openvino"):
        assert greedy(open_session(again, backend), prompt["ids"], 24).tokens == prompt["tokens"]["openvino"]


KV_IDS = ["past_key_values.0.keypresent.0.key", "past_key_values.0.valuepresent.0.value"]


def test_no_match_when_variable_ids_differ():
    model = kv_model(KV_IDS[:1], assign_other_variable=True)
    run = PassManager(parse_pipeline("fuse-kvcache"), use_env=False).run(model)
    assert not run.records[0].modified and op_count(model, "KVCache") == 0
    assert run.records[0].rule_hits == {}
    [(rule, node, reason)] = run.records[0].rule_misses
    assert rule == "fuse-kvcache/cache-update" and node.startswith("Assign")
    assert reason == ("variable ids differ: ReadValue reads past_key_values.0.keypresent.0.key, Assign writes "
                      "past_key_values.0.keypresent.0.key.other")


def test_no_match_when_the_reordered_past_has_another_consumer():
    model = kv_model(KV_IDS, extra_gather_user=True)
    stream = io.StringIO()
    run = PassManager(parse_pipeline("fuse-kvcache"), Instrumentation(debug_rules=True, stream=stream),
                      use_env=False).run(model)
    assert not run.records[0].modified
    # --debug-rules prints each miss with the rule, the node and the reason
    assert "// rule fuse-kvcache/cache-update did not match at Assign" in stream.getvalue()
    assert "the reordered past Gather 'reorder.0' also feeds Multiply" in stream.getvalue()
    assert "fusing it into KVCache would change what that consumer reads" in stream.getvalue()


def test_indirect_needs_beam_gathers():
    from kvc.passes import PassFailure

    with pytest.raises(PassFailure, match="beam=indirect needs every cache reordered"):
        apply(ir.load(fixtures.path("llama")), "lift-state,fuse-kvcache{beam=indirect}")


@pytest.mark.parametrize("spec", ["fuse-kvcache", "fuse-kvcache{beam=indirect}",
                                  "fuse-kvcache{beam=indirect},lower-kvcache", "lift-state,fuse-kvcache",
                                  "lift-state{beam=keep},fuse-kvcache{beam=indirect}"])
def test_fuse_golden_ir(golden, spec):
    model = kv_model(KV_IDS)
    golden(f"fuse-kvcache/{spec.replace('{', '.').replace('}', '').replace('=', '-').replace(',', '+')}",
           ir.to_text(apply(model, spec)))
