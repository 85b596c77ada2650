"""Generation as genai does it: greedy by default, seeded sampling, and stopping at the
model's end-of-sequence ids."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvc.cli.run_cmd import printable
from kvc.errors import ComputeError, UsageError
from kvc.runtime.sampling import JUDGED, Sampling, eos_ids, sample
from tests.cli.runner import kvc
from tests.runtime.test_static_pipeline import pipeline

PROMPT = [5, 17, 101, 9, 3]


def test_sampling_draws_from_the_softmax_at_the_temperature():
    logits = np.log(np.array([1.0, 2.0, 3.0]))  # softmax: 1/6, 2/6, 3/6
    rng = np.random.default_rng(0)
    draws = np.bincount([sample(logits, Sampling(temperature=1.0), rng) for _ in range(6000)], minlength=3)
    np.testing.assert_allclose(draws / 6000, [1 / 6, 2 / 6, 3 / 6], atol=0.02)
    hot = np.bincount([sample(logits * 2, Sampling(temperature=2.0), rng) for _ in range(6000)], minlength=3)
    np.testing.assert_allclose(hot / 6000, [1 / 6, 2 / 6, 3 / 6], atol=0.02)  # logits / T


def test_top_k_and_top_p_cut_the_tail():
    logits = np.log(np.array([0.2, 0.5, 0.3]))
    rng = np.random.default_rng(1)
    draw = lambda **kw: {sample(logits, Sampling(temperature=1.0, **kw), rng) for _ in range(400)}  # noqa: E731
    assert draw(top_k=1) == {1} and draw(top_k=2) == {1, 2} and draw() == {0, 1, 2}
    assert draw(top_p=0.5) == {1} and draw(top_p=0.6) == {1, 2} and draw(top_p=0.81) == {0, 1, 2}


def test_the_same_seed_gives_the_same_tokens_and_greedy_is_the_default():
    pipe = pipeline("llama", "chunked", "openvino")
    greedy = pipe.generate(PROMPT, 12)
    assert pipe.generate(PROMPT, 12, sampling=Sampling(temperature=1.0, top_k=1, seed=3)).tokens == greedy.tokens
    runs = [pipe.generate(PROMPT, 12, sampling=Sampling(temperature=1.5, seed=s)).tokens for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2] and runs[0] != greedy.tokens
    assert all(t == int(np.argmax(l)) for t, l in zip(greedy.tokens, greedy.logits))


def test_generation_stops_after_an_end_of_sequence_token():
    pipe = pipeline("llama", "chunked", "openvino")
    full = pipe.generate(PROMPT, 12)
    stop = full.tokens[3]
    first = full.tokens.index(stop)
    got = pipe.generate(PROMPT, 12, sampling=Sampling(stop=frozenset({stop})))
    assert got.tokens == full.tokens[:first + 1] and got.finish_reason == "stop"
    assert full.finish_reason == "length" and got.metrics()["finish_reason"] == "stop"


def test_bad_sampling_settings_are_refused():
    for kwargs, message in [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top-k"), ({"top_p": 0}, "top-p")]:
        with pytest.raises(UsageError, match=message):
            Sampling(**kwargs)


def test_eos_ids_come_from_generation_config_then_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_ids(tmp_path) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert eos_ids(tmp_path) == {2, 9}
    (tmp_path / "generation_config.json").write_text("{broken")
    assert eos_ids(tmp_path) == {7}
    assert eos_ids(tmp_path / "missing") == frozenset()


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampling") / "out"
    kvc("compile", "--max-prompt-len", "64", "--min-response-len", "64", "-o", path)
    return path


def test_kvc_run_stops_at_eos_samples_and_streams(out):
    ids = ",".join(map(str, PROMPT))
    full = json.loads(kvc("run", out, "--prompt-ids", ids, "--max-new-tokens", "12", "--ignore-eos", "--json").output)
    assert full["finish_reason"] == "length" and len(full["tokens"]) == 12 and full["eos_token_ids"] == []
    assert json.loads(kvc("run", out, "--prompt-ids", ids, "--json").output)["eos_token_ids"] == [0]  # the model's
    stop = full["tokens"][4]
    got = json.loads(kvc("run", out, "--prompt-ids", ids, "--max-new-tokens", "12", "--eos-token-id", stop,
                         "--json").output)
    assert got["tokens"] == full["tokens"][:full["tokens"].index(stop) + 1] and got["finish_reason"] == "stop"
    args = ("run", out, "--prompt-ids", ids, "--max-new-tokens", "8", "--ignore-eos", "--temperature", "1.2",
            "--top-p", "0.9", "--json")
    a, b = (json.loads(kvc(*args, "--seed", "11").output)["tokens"] for _ in range(2))
    assert a == b and a != full["tokens"][:8]
    streamed = kvc("run", out, "--prompt", "hello world", "--max-new-tokens", "6", "--ignore-eos", "--stream").output
    plain = json.loads(kvc("run", out, "--prompt", "hello world", "--max-new-tokens", "6", "--ignore-eos",
                           "--json").output)
    assert streamed.split("\nopenvino: ")[0] == printable(plain["text"])
    assert "TTFT" in streamed.splitlines()[-1] and "prompt (" not in streamed
    assert "--stream prints text" in kvc("run", out, "--prompt-ids", ids, "--stream", code=2).output


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, seed=1)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("bad, what", [(np.nan, "NaN"), (np.inf, "[+]Inf")])
def test_no_token_is_chosen_from_nan_or_inf_logits(sampling, bad, what):
    """argmax returned a NaN's index as a token (a model with a NaN weight printed tokens with
    exit 0): a NaN or +Inf anywhere in the row, or no finite logit, stops the generation."""
    choose = sampling.chooser()
    logits = np.array([0.5, 3.0, -np.inf, 1.0], np.float32)
    assert choose(logits) in (0, 1, 3)  # a masked token (-Inf) is fine
    logits[3] = bad
    with pytest.raises(ComputeError, match=what):
        choose(logits)
    with pytest.raises(ComputeError, match="every one is -Inf"):
        choose(np.full(4, -np.inf, np.float32))
    assert ComputeError.exit_code == 8


def test_judged_runs_leave_non_finite_logits_to_the_judge():
    """The verification's runs (`JUDGED`) report a NaN as a mismatch with where it is, so their
    greedy choice does not stop at it."""
    assert JUDGED.chooser()(np.array([0.0, np.nan, 1.0])) == 1


def test_a_tiny_temperature_samples_the_top_token_and_a_negative_seed_is_refused():
    """logits / 1e-310 overflowed and the probabilities were NaN (exit 1); numpy refused a
    negative seed with a ValueError (exit 1)."""
    logits = np.array([0.5, 3.0, -np.inf, 2.999], np.float32)
    rng = np.random.default_rng(0)
    assert {sample(logits, Sampling(temperature=1e-310), rng) for _ in range(20)} == {1}
    with pytest.raises(UsageError, match="seed must be a non-negative integer"):
        Sampling(temperature=1.0, seed=-1)
