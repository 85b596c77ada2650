"""lift-state matches OpenVINO's StatefulToStateless exactly and keeps the model's numbers."""

from __future__ import annotations

import numpy as np
import pytest
from openvino._offline_transformations import stateful_to_stateless_transformation

import kvc.ir as ir
from kvc import fixtures
from kvc.passes import PassFailure, PassManager, parse_pipeline
from kvc.runtime.generate import greedy
from kvc.runtime.session import open_session
from tests.conftest import SAMPLE, fixture_names, host_golden
from tests.passes.models import counter_model, kv_model


def lift(model, spec="lift-state"):
    return PassManager(parse_pipeline(spec), use_env=False).run(model).model


def signature(model):
    def ports(ps):
        return [(sorted(p.get_names()), p.get_element_type().get_type_name(), str(p.get_partial_shape()))
                for p in ps]
    return ports(model.inputs), ports(model.outputs)


def openvino_lifted(model):
    stateful_to_stateless_transformation(model)
    return model


def test_fixture_matches_openvino(fixture_name):
    ours = lift(ir.load(fixtures.path(fixture_name)))
    theirs = openvino_lifted(ir.load(fixtures.path(fixture_name)))
    assert signature(ours) == signature(theirs)
    assert ir.to_text(ours) == ir.to_text(theirs)
    assert not ours.get_variables() and not ours.get_sinks()
    ir.core().compile_model(ours, "CPU")


@pytest.mark.parametrize("fixture_name, backend", [(n, "numpy") for n in fixture_names()]
                         + [(n, "openvino") for n in SAMPLE])
def test_lifted_fixture_reproduces_stateful_tokens(fixture_name, backend):
    golden = fixtures.goldens(fixture_name)
    lifted = open_session(lift(ir.load(fixtures.path(fixture_name))), backend)
    stateful = open_session(fixtures.path(fixture_name), "openvino")
    for prompt in golden["prompts"]:
        ref = greedy(stateful, prompt["ids"], 24)
        got = greedy(lifted, prompt["ids"], 24)
        assert got.tokens == ref.tokens == host_golden(fixture_name, prompt)[0]
        assert np.max(np.abs(got.first_logits - ref.first_logits)) <= 1e-4


ODD_IDS = [f"past_key_values.{i}.{k}present.{i}.{k}" for i in (0, 1, 10, 2, 11, 3) for k in ("key", "value")] + [
    "zeta", "past_key_values.5.valuepresent.5.key",  # openvino.genai's GGUF naming (sic)
    "past_key_values.3.keypresent.7.key", "alpha"]


def test_naming_and_order_match_openvino_on_odd_variable_ids():
    ours = lift(kv_model(ODD_IDS))
    theirs = openvino_lifted(kv_model(ODD_IDS))
    assert signature(ours) == signature(theirs)
    assert [p.get_any_name() for p in ours.inputs] == ["x"] + [
        f"past_key_values.{i}.{k}" for i in (0, 1, 2, 3) for k in ("key", "value")] + [
        "past_key_values.5.value",  # index 2*5+1 from its input half
        *(f"past_key_values.{i}.{k}" for i in (10, 11) for k in ("key", "value")),
        "input_restored.zeta", "past_key_values.3.key", "input_restored.alpha"]  # the rest in sink order
    assert "present.5.key" in [p.get_any_name() for p in ours.outputs]


def test_counter_state_lifts_with_fallback_names():
    lifted = lift(counter_model())
    assert [p.get_any_name() for p in lifted.inputs] == ["x", "input_restored.counter"]
    assert [p.get_any_name() for p in lifted.outputs] == ["total", "output_restored.counter"]
    session = open_session(lifted, "numpy")
    state = np.zeros(2, np.float32)
    for step in range(3):
        out = session.infer({"x": np.array([1.0, 2.0], np.float32), "input_restored.counter": state})
        state = out["output_restored.counter"]
    np.testing.assert_array_equal(state, [3.0, 6.0])


def test_beam_keep_keeps_beam_idx_and_gathers():
    ids = ["past_key_values.0.keypresent.0.key", "past_key_values.0.valuepresent.0.value"]
    kept = lift(kv_model(ids), "lift-state{beam=keep}")
    assert [p.get_any_name() for p in kept.inputs] == ["x", "beam_idx", "past_key_values.0.key",
                                                       "past_key_values.0.value"]
    gathers = [n for n in kept.get_ordered_ops() if n.get_type_name() == "Gather"
               and n.input_value(1).get_node().get_friendly_name() == "beam_idx"]
    assert len(gathers) == 2
    # Beam reordering still happens: row order of the past follows beam_idx.
    x = np.random.default_rng(0).standard_normal((3, 2, 1, 4)).astype(np.float32)
    past = np.random.default_rng(1).standard_normal((3, 2, 2, 4)).astype(np.float32)
    feed = {"x": x, "beam_idx": np.array([2, 0, 1], np.int32), "past_key_values.0.key": past,
            "past_key_values.0.value": past}
    out = open_session(kept, "numpy").infer(feed)
    np.testing.assert_array_equal(out["present.0.key"][:, :, :2], past[[2, 0, 1]])


def test_models_without_beam_idx_are_accepted():
    ids = ["past_key_values.0.keypresent.0.key", "past_key_values.0.valuepresent.0.value"]
    lifted = lift(kv_model(ids, beam=False))
    assert [p.get_any_name() for p in lifted.inputs] == ["x", "past_key_values.0.key", "past_key_values.0.value"]
    with pytest.raises(RuntimeError, match="beam_idx"):
        openvino_lifted(kv_model(ids, beam=False))  # OpenVINO's pass refuses these


@pytest.mark.parametrize("name", [n for n in fixture_names() if "stateless" in fixtures.forms(n)])
def test_unchanged_when_stateless(name):
    model = ir.load(fixtures.path(name, "stateless"))
    before = ir.to_text(model)
    run = PassManager(parse_pipeline("lift-state"), use_env=False).run(model)
    assert not run.records[0].modified
    assert ir.to_text(run.model) == before


def test_lift_state_golden_ir(golden):
    model = kv_model(["past_key_values.0.keypresent.0.key", "past_key_values.0.valuepresent.0.value"])
    golden("lift-state/toy.input", ir.to_text(model))
    golden("lift-state/toy.drop", ir.to_text(lift(model.clone())))
    golden("lift-state/toy.keep", ir.to_text(lift(model.clone(), "lift-state{beam=keep}")))


def test_error_names_pass_node_and_reason():
    model = kv_model(["past_key_values.0.keypresent.0.key"], assign_other_variable=True)
    with pytest.raises(PassFailure) as info:
        lift(model)
    text = str(info.value)
    assert text.startswith("pass lift-state failed at Assign")
    assert "is assigned but never read" in text and "passes run before it: none" in text
