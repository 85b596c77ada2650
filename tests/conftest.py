"""Shared test helpers: tiny hand-built models and access to the committed fixtures."""

from __future__ import annotations

import functools

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from pathlib import Path

from kvc import fixtures

# Tests read the fixtures of this source tree, whether kvc is installed editable or not
# (an installed package carries only the bundled model).
fixtures.ROOT = Path(__file__).resolve().parents[1] / "fixtures"


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite the golden IR texts (tests/passes/goldens) from current output; review the diff")


def tiny_model() -> ov.Model:
    """y = relu(x @ W^T + b): small enough to corrupt by hand, real enough to load and run."""
    x = ops.parameter([1, -1, 4], np.float32, name="x")
    x.output(0).set_names({"x"})
    w = ops.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, name="weight")
    b = ops.constant(np.array([0.5, -0.5, 1.0], dtype=np.float32), name="bias")
    mm = ops.matmul(x, w, False, True, name="linear")
    add = ops.add(mm, b, name="add_bias")
    y = ops.relu(add, name="relu")
    y.output(0).set_names({"y"})
    return ov.Model([y], [x], "tiny")


@pytest.fixture
def tiny() -> ov.Model:
    return tiny_model()


def fixture_names(compressed: bool = False) -> list[str]:
    """Every fixture (with `compressed`, also the NNCF-compressed ones, which have only the
    stateful form and OpenVINO goldens); a missing one fails its tests rather than silently
    skipping them."""
    return list(fixtures.MODELS) + (list(fixtures.COMPRESSED) if compressed else [])


# One compressed fixture per weight format (int8, int4 grouped symmetric, int4 channel-wise with
# zero points), each on another of the three compressed bases: for tests of what the weights'
# subgraphs do not change (the KV cache's type, the If blob's selection), where all nine took
# 4-5 s each. All nine still run the goldens, the compile with its blob check, the static
# pipeline and the NPU plugin's paths.
COMPRESSED_FORMATS = ("llama_int8", "phi_int4_sym_g16", "granitemoe_int4_asym_cw")


# One fixture of each kind the cache layer and the runtimes' inputs and outputs vary by: GQA with
# RoPE, MHA with learned positions, ALiBi, MQA, grouped experts, a sliding window, and a mixture of
# experts with attention sinks and alternating windows. Tests whose point is kvc's own logic run it
# on every fixture on kvc's numpy runtime and on this sample (with COMPRESSED_FORMATS) on OpenVINO:
# OpenVINO's agreement on every fixture is the static pipeline's, the default compile's and the NPU
# plugin's tests' (the zoo on both took 250 s of the suite).
SAMPLE = ("llama", "gpt2", "bloom", "gpt_bigcode", "granitemoe", "mistral", "gpt_oss")


@pytest.fixture(params=fixture_names(), ids=str)
def fixture_name(request) -> str:
    return request.param


# Fixtures whose own arithmetic is bf16 (falcon_alibi: Falcon's ALiBi positions and slopes).
# Their goldens were recorded where the CPU rounds bf16, as torch does; a host whose CPU does
# not (AVX2: `kvc.runtime.interpreter.cpu_rounds_bf16`) computes the positions unrounded in
# OpenVINO CPU, another function (falcon_alibi's first logits 1.9e-3 off torch's, a token at
# step 23 another), which kvc's interpreter mirrors there. On such a host the tests compare
# with OpenVINO CPU's run of the source (`host_golden`), not with the recorded goldens.
BF16_OWN = ("falcon_alibi",)


def goldens_hold(name: str) -> bool:
    """Whether fixture `name`'s recorded goldens hold on this host (`BF16_OWN`)."""
    from kvc.runtime.interpreter import cpu_rounds_bf16

    return name not in BF16_OWN or cpu_rounds_bf16()


@functools.cache
def _openvino_runs(name: str) -> dict:
    from kvc.runtime.generate import greedy
    from kvc.runtime.session import open_session

    golden = fixtures.goldens(name)
    session = open_session(fixtures.path(name), "openvino")
    return {p["name"]: greedy(session, p["ids"], golden["max_new_tokens"]) for p in golden["prompts"]}


def host_golden(name: str, prompt: dict) -> tuple[list[int], np.ndarray]:
    """The OpenVINO tokens and first-step logits of golden `prompt` of fixture `name`: as
    recorded where they hold on this host (`goldens_hold`), else OpenVINO CPU's run of the
    stateful source here."""
    if goldens_hold(name):
        return prompt["tokens"]["openvino"], fixtures.golden_logits(name, prompt["name"], "openvino")
    run = _openvino_runs(name)[prompt["name"]]
    return run.tokens, run.first_logits


def _cpu_computes_bf16() -> bool:
    from kvc.export.compile import cpu_precision

    return cpu_precision("auto") == "bf16"


# Tests of blobs computing at bf16: OpenVINO CPU computes bf16 only on a host that has it
# (AVX512_BF16 or AMX); elsewhere (AVX2) it computes f32 whatever is asked, and a blob
# "at bf16" is an f32 blob, whose checks other tests cover.
BF16_CPU = pytest.mark.skipif(not _cpu_computes_bf16(), reason="OpenVINO CPU computes bf16 only where the host has it")
