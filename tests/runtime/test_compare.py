"""The verdict policy (kvc.runtime.compare, docs/verification.md): it must never say OK on
wrong output, and must allow a flip only at a true near-tie."""

import numpy as np
import pytest

from kvc.runtime.compare import (F16_NRMSE, INT8_KV_NRMSE, SELECTING_NRMSE, STEP_ERROR, f32_bound, judge,
                                 nonfinite_mismatch, nrmse_limit, step_error, step_limit)
from kvc.runtime.generate import Generation

V = 1024  # wide enough that one wrong logit leaves NRMSE small: the token rule decides


def run(steps: int = 4, seed: int = 0) -> Generation:
    """A reference run: random logits with a clear winner at every step."""
    rng = np.random.default_rng(seed)
    logits = [rng.normal(0, 1, V).astype(np.float32) for _ in range(steps)]
    for t, row in enumerate(logits):
        row[t + 1] = 5.0  # winner at a margin of several units
    return Generation([1, 2], [int(np.argmax(r)) for r in logits], logits)


def edit(gen: Generation, step: int, token: int, value: float, noise: float = 0.0, seed: int = 1,
         above: int | None = None) -> Generation:
    """`gen` with every logit moved by up to `noise`, then one logit set to `value` (or to
    `value` above the moved logit of token `above`); tokens re-derived."""
    rng = np.random.default_rng(seed)
    logits = [r + rng.uniform(-noise, noise, V).astype(np.float32) for r in gen.logits]
    logits[step][token] = value + (logits[step][above] if above is not None else 0.0)
    return Generation(gen.prompt, [int(np.argmax(r)) for r in logits], logits)


@pytest.mark.parametrize("reduced", [False, True])
def test_identical_runs_pass(reduced):
    ref = run()
    assert judge(ref, edit(ref, 0, 0, ref.logits[0][0]), reduced=reduced).ok


def test_the_exact_bound_grows_with_the_logits_magnitude():
    """Exact paths: 1e-4 plus 1e-5 of the largest |reference logit|. An error of 1.4e-4 (two
    correct f32 engines on logits near 15) passes there and fails on logits near 1; 3e-4
    fails at either scale."""
    ref = run()  # winner at 5
    small = Generation(ref.prompt, ref.tokens, [r / 5 for r in ref.logits])  # winner at 1
    large = Generation(ref.prompt, ref.tokens, [r * 3 for r in ref.logits])  # winner at 15
    assert f32_bound(small.logits) == pytest.approx(1.1e-4)
    assert f32_bound(large.logits) == pytest.approx(2.5e-4)
    assert f32_bound([np.nan, np.inf, -2.0]) == pytest.approx(1.2e-4)  # finite values only
    assert judge(large, edit(large, 1, 9, float(large.logits[1][9]) + 1.4e-4)).ok
    assert not judge(small, edit(small, 1, 9, float(small.logits[1][9]) + 1.4e-4)).ok
    for ref in (small, large):
        v = judge(ref, edit(ref, 1, 9, float(ref.logits[1][9]) + 3e-4))
        assert not v.ok and v.reason.startswith("logits differ by 0.0003 > ")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("reduced", [False, True])
def test_a_non_finite_logit_is_a_mismatch(value, reduced):
    ref = run()
    # On a token that is not the winner: tokens stay identical, only the value is wrong.
    got = edit(ref, 2, 0, value)
    if value == -np.inf:
        assert got.tokens == ref.tokens
    v = judge(ref, got, reduced=reduced)
    assert not v.ok
    assert "non-finite" in v.reason and "step 2, token 0" in v.reason


def test_nan_everywhere_is_a_mismatch_even_where_tokens_agree():
    ref = run()
    logits = [np.full(V, np.nan, np.float32) for _ in ref.logits]
    got = Generation(ref.prompt, list(ref.tokens), logits)  # tokens forged equal
    for reduced in (False, True):
        v = judge(ref, got, reduced=reduced)
        assert not v.ok and "non-finite" in v.reason


def test_the_same_masked_entry_on_both_sides_is_not_a_mismatch():
    ref = run()
    ref.logits[1][3] = -np.inf  # a masked vocabulary entry
    got = Generation(ref.prompt, list(ref.tokens), [r.copy() for r in ref.logits])
    assert judge(ref, got).ok
    got.logits[1][3] = np.inf  # the other sign is a different value
    assert not judge(ref, got).ok


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_or_plus_inf_fails_even_when_the_reference_holds_the_same(value):
    """A source model with NaN weights gives NaN logits on both sides: that is a broken
    model, never a verified one."""
    ref = run()
    ref.logits[2][0] = value
    got = Generation(ref.prompt, list(ref.tokens), [r.copy() for r in ref.logits])
    assert nonfinite_mismatch(np.stack(ref.logits), np.stack(got.logits)) is None  # the metric sees no difference
    for reduced in (False, True):
        v = judge(ref, got, reduced=reduced)
        assert not v.ok and "non-finite (NaN/+Inf) logit(s), first at step 2, token 0" in v.reason


def test_a_reference_nan_that_the_actual_lacks_is_a_mismatch():
    ref = run()
    got = Generation(ref.prompt, list(ref.tokens), [r.copy() for r in ref.logits])
    ref.logits[0][0] = np.nan
    assert not judge(ref, got, reduced=True).ok


@pytest.mark.parametrize("reduced", [False, True])
def test_a_wrong_token_at_a_large_margin_is_a_mismatch(reduced):
    ref = run()
    # Step 1's winner is token 2 at 5.0 and token 7 the runner-up at 4.5; token 7 is pushed
    # just above it while every other logit moves by 1e-4 at most.
    ref.logits[1][7] = 4.5
    got = edit(ref, 1, 7, 0.1, noise=1e-4, above=2)
    assert got.tokens[1] == 7 and ref.tokens[1] == 2
    v = judge(ref, got, reduced=reduced)
    assert not v.ok
    assert v.comparison.first_divergent_token == 1
    assert v.comparison.margin_at_divergence == pytest.approx(0.5)
    assert v.comparison.nrmse < 0.01  # the token rule, not NRMSE, catches it
    assert "token 1 differs" in v.reason


def test_a_wrong_token_is_a_mismatch_even_when_the_noise_is_large_at_that_one_place():
    """The swapped pair is not its own evidence: a flip needs error on those two logits, so
    the noise bound is measured on every other logit."""
    ref = run()
    got = edit(ref, 0, 9, 6.0, noise=1e-3)  # margin ~5 crossed by an error of ~6 on one logit
    v = judge(ref, got, reduced=True)
    assert not v.ok and v.comparison.noise < 0.01


def test_a_flip_at_a_true_near_tie_is_allowed_on_reduced_precision_and_reported():
    ref = run()
    ref.logits[2][11] = ref.logits[2][3] - 0.002  # token 3 wins step 2 by 0.002 over token 11
    got = edit(ref, 2, 11, 0.001, noise=0.005, above=3)
    assert got.tokens[2] == 11 and ref.tokens[2] == 3
    v = judge(ref, got, reduced=True)
    assert v.ok, v.reason
    assert v.comparison.first_divergent_token == 2
    assert v.comparison.margin_at_divergence == pytest.approx(0.002, abs=1e-5)
    assert "near-tie" in v.reason and "token 2" in v.reason
    # Exact backends allow no flip at all.
    assert not judge(ref, got, reduced=False).ok
    # The same flip with no noise measured elsewhere is not explained by rounding.
    quiet = edit(ref, 2, 11, 0.001, noise=0.0, above=3)
    assert not judge(ref, quiet, reduced=True).ok


def test_the_noise_bound_never_swallows_a_big_margin():
    """A flip at margin 0.4 needs noise above 0.2 everywhere else, which NRMSE then refuses."""
    ref = run()
    ref.logits[1][9] = ref.logits[1][2] - 0.4
    got = edit(ref, 1, 9, 0.01, noise=0.19, above=2)
    v = judge(ref, got, reduced=True)
    assert not v.ok


def test_fewer_tokens_than_expected_is_a_mismatch():
    ref = run()
    got = Generation(ref.prompt, ref.tokens[:2], ref.logits[:2])
    for reduced in (False, True):
        v = judge(ref, got, reduced=reduced)
        assert not v.ok and "2 tokens generated, 4 expected" in v.reason


def test_logit_drift_beyond_tolerance_with_equal_tokens():
    ref = run()
    got = edit(ref, 0, 0, float(ref.logits[0][0]) + 1e-3)
    assert got.tokens == ref.tokens
    assert not judge(ref, got).ok
    assert judge(ref, got, reduced=True).ok  # NRMSE ~1e-4


def test_a_reduced_precision_pass_says_each_measure_against_its_bound():
    """What `kvc compile` prints of every blob probe: the margin a pass had, not only that it passed."""
    ref = run()
    got = edit(ref, 0, 0, ref.logits[0][0], noise=0.01)
    v = judge(ref, got, reduced=True, limit=0.004, step_bound=0.03)
    c = v.comparison
    assert v.ok and v.reason == (f"identical tokens, NRMSE {c.nrmse:.3g} (at most 0.004), worst step "
                                 f"{c.step_error:.3g} (at most 0.03)")
    assert judge(ref, got, reduced=True, limit=0.004, step_bound=None).reason.endswith("(at most 0.004)")


def test_a_selecting_graph_widens_the_bound_only_for_reduced_arithmetic():
    """A TopK turns rounding into another expert where the arithmetic is below f32; kvc's numpy
    runtime and f32 CPU blobs compute in f32 and keep the f16 bound whatever the KV type."""
    bf16_cpu = {"INFERENCE_PRECISION_HINT": "bf16"}
    assert nrmse_limit(["f16"], True, "openvino", bf16_cpu) == SELECTING_NRMSE
    assert nrmse_limit(["f16"], True, "npu") == SELECTING_NRMSE
    assert nrmse_limit(["bf16"], True, "numpy") == F16_NRMSE
    assert nrmse_limit(["f16"], True, "openvino", {"INFERENCE_PRECISION_HINT": "f32"}) == F16_NRMSE
    assert nrmse_limit(["f16"], False, "openvino", bf16_cpu) == F16_NRMSE


def test_step_error_measures_a_step_against_the_spread_of_the_reference():
    rng = np.random.default_rng(3)
    ref = rng.normal(0, 2, V)
    assert step_error(ref, ref) == 0.0
    assert step_error(ref, ref + 7.0) == pytest.approx(0.0, abs=1e-12)  # a constant shift changes no probability
    assert step_error(ref, ref + rng.normal(0, 0.2, V)) == pytest.approx(0.1, rel=0.1)
    assert step_error(ref, rng.normal(0, 2, V)) == pytest.approx(2 ** 0.5, rel=0.1)  # unrelated logits
    assert step_error(ref, np.where(np.arange(V) == 5, np.nan, ref)) == 0.0  # finite positions only


@pytest.mark.parametrize("error, margin, ok", [(0.4, 0.5, False), (0.03, 0.05, True)])
def test_a_wrong_step_cannot_excuse_a_flip_as_noise(error, margin, ok):
    """A step whose logits are off by 0.4 of their spread (an int8 cache read back with other
    key scales did this) makes its own error large enough to explain a flip at a margin of 0.5
    as noise, and averaged with an exact step its NRMSE stays under int8's 0.05: only the step
    bound refuses it. A rounding-sized error (0.03 of the spread) and a flip at a margin it can
    explain is still a near-tie."""
    ref = run(steps=3)
    ref.logits[1][9] = ref.logits[1][2] - margin
    rng = np.random.default_rng(4)
    logits = [r.copy() for r in ref.logits]
    logits[1] = logits[1] + rng.normal(0, error * float(ref.logits[1].std()), V).astype(np.float32)
    logits[1][9] = logits[1][2] + 0.01
    got = Generation(ref.prompt, [int(np.argmax(r)) for r in logits], logits)
    assert got.tokens[1] == 9 and ref.tokens[1] == 2
    v = judge(ref, got, reduced=True, limit=INT8_KV_NRMSE)
    assert v.ok == ok, v.reason
    assert v.comparison.nrmse < INT8_KV_NRMSE and v.comparison.step_error_at == 1
    if not ok:
        assert v.reason.startswith("step 1's logits are not the reference's")
        assert judge(ref, got, reduced=True, limit=INT8_KV_NRMSE, step_bound=None).ok  # what fooled the aggregate


def test_only_a_selecting_graph_below_f32_or_with_int8_kv_goes_without_the_step_bound():
    bf16_cpu = {"INFERENCE_PRECISION_HINT": "bf16"}
    assert step_limit(["f16"], True, "openvino", bf16_cpu) is None and step_limit(["f16"], True, "npu") is None
    assert step_limit(["i8", "f16"], True, "numpy") is None
    assert (step_limit(["f16"], True, "numpy") == step_limit(["i8"], False, "numpy") == step_limit(["f16"], False, "npu")
            == step_limit(["bf16"], False, "openvino", bf16_cpu) == STEP_ERROR)


def test_a_near_tie_claims_at_most_the_noise_an_independent_run_measured():
    """A run whose own error is large excuses the flips it causes by that error: with the noise
    capped by a run that does not depend on it (the plugin's own run of the source,
    kvc.verify.peer_drift), the same flip is refused; a cap above the run's own noise changes
    nothing."""
    ref = run()
    ref.logits[2][11] = ref.logits[2][3] - 0.05  # token 3 wins step 2 by 0.05 over token 11
    got = edit(ref, 2, 11, 0.001, noise=0.04, above=3)  # wrong everywhere by up to 0.04
    assert got.tokens[2] == 11
    assert judge(ref, got, reduced=True).ok  # excused by its own noise (~0.04 > 0.05 / 2)
    capped = judge(ref, got, reduced=True, noise_cap=0.01)
    assert not capped.ok
    assert "not below twice the logit noise 0.01 (this run's own 0.04, capped)" in capped.reason
    assert judge(ref, got, reduced=True, noise_cap=1.0).ok


def test_logit_noise_stops_at_the_peers_own_divergence_without_its_swapped_tokens():
    from kvc.verify.peer_drift import logit_noise

    ref = run()
    peer = edit(ref, 0, 0, ref.logits[0][0], noise=0.01)
    assert peer.tokens == ref.tokens
    noise, own = logit_noise(ref, peer, upto=3)
    assert own is None and 0.009 < noise <= 0.01
    assert logit_noise(ref, peer, upto=0)[0] <= noise  # only the steps up to the judged run's divergence
    flipped = edit(ref, 1, 40, 1.0, noise=0.01, above=ref.tokens[1])  # the peer flips step 1 itself
    noise, own = logit_noise(ref, flipped, upto=3)
    assert own == 1 and noise <= 0.01  # its steps after 1 condition on another token; its swap left out


def test_small_logits_get_an_exact_bound_their_size():
    """Logits scaled down (Cohere's logit_scale) are computed as precisely relative to their
    size: an error of 5e-5 on logits reaching 0.2 is 0.025% of them, refused; the same run
    scaled up to logits of 20 keeps f32_bound (1e-4 + 1e-5 x 20), where 5e-5 is rounding."""
    from kvc.runtime.compare import logit_bound

    ref = run()
    big = max(float(np.abs(r).max()) for r in ref.logits)
    for scale, ok in ((0.2 / big, False), (20 / big, True)):
        scaled = Generation(ref.prompt, ref.tokens, [r * np.float32(scale) for r in ref.logits])
        off = Generation(ref.prompt, ref.tokens, [r.copy() for r in scaled.logits])
        off.logits[1][7] += np.float32(5e-5)
        assert judge(scaled, off).ok == ok
    assert logit_bound(np.array([0.2])) == pytest.approx(1e-4 * 0.2 + 1e-5 * 0.2)
    assert logit_bound(np.array([20.0])) == f32_bound(np.array([20.0]))


def test_one_wrong_logit_at_every_step_cannot_excuse_its_own_flip():
    """A fault in one token's logit (a wrong lm_head row) is there at every step: counted as
    noise at the earlier steps, it excused the flip it causes at margin 30 on the NPU's bounds.
    The swapped pair is left out of the noise at every step."""
    rng = np.random.default_rng(0)
    vocab, a, b = 32000, 7, 11
    ref_logits = [rng.normal(0, 3, vocab) for _ in range(3)]
    for step, row in enumerate(ref_logits):
        row[a] = row.max() + 30.0
        row[b] = row[a] - (30.0 if step == 2 else 45.0)  # b is 30 below a at step 2
    got_logits = [row.copy() for row in ref_logits]
    for row in got_logits:
        row[b] += 40.0  # one wrong output row: b's logit 40 too high at every step
    ref = Generation([1], [int(np.argmax(r)) for r in ref_logits], ref_logits)
    got = Generation([1], [int(np.argmax(r)) for r in got_logits], got_logits)
    assert ref.tokens == [a, a, a] and got.tokens == [a, a, b]
    npu = {"kv": ["f16"], "selects": False, "backend": "npu", "config": {}}
    v = judge(ref, got, reduced=True, limit=nrmse_limit(*npu.values()), step_bound=step_limit(*npu.values()))
    assert not v.ok and "not below twice the logit noise" in v.reason, v.reason
    assert v.comparison.noise == 0.0  # nothing else differs
