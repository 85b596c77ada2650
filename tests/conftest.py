"""Shared test helpers: tiny hand-built models and access to the committed fixtures."""

from __future__ import annotations

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
