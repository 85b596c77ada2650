"""Constants of the element types numpy lacks, decoded as OpenVINO defines them: every code of
every packed and low-bit floating-point type NNCF writes (optimum-intel's --weight-format nf4,
mxfp4 and cb4; NNCF's fp8, fp4, nvfp4, int3 and int2 modes) against OpenVINO's own constant
folding of a Convert to f32 (the core's definition of the type, which kvc did not write)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from openvino import passes

from kvc.runtime.ops.lowbit import constant_array

TYPES = ("u1", "u2", "u3", "u4", "i4", "u6", "nf4", "f4e2m1", "f8e4m3", "f8e5m2", "f8e8m0")


def constant(etype: str, seed: int, count: int) -> ov.Node:
    """A Constant of `count` values of `etype` over random bytes (every byte value, for 8 bits)."""
    tensor = ov.Tensor(getattr(ov.Type, etype), [count])
    data = np.asarray(tensor.data).view(np.uint8).reshape(-1)
    data[:] = (np.arange(data.size, dtype=np.uint8) if getattr(ov.Type, etype).bitwidth == 8
               else np.random.default_rng(seed).integers(0, 256, data.size).astype(np.uint8))
    return ops.constant(tensor)


def openvino_values(node: ov.Node) -> np.ndarray:
    """The Constant converted to f32 by OpenVINO's ConstantFolding."""
    model = ov.Model([ops.convert(node, "f32")], [], "decode")
    manager = passes.Manager()
    manager.register_pass(passes.ConstantFolding())
    manager.run_passes(model)
    (folded,) = [op for op in model.get_ops() if op.get_type_name() == "Constant"]
    return np.asarray(folded.get_data())


@pytest.mark.parametrize("etype", TYPES)
def test_every_code_decodes_as_openvino_decodes_it(etype):
    bits = getattr(ov.Type, etype).bitwidth
    count = 1 << bits if bits == 8 else (1 << bits) * 24  # every code, several times over for the packed ones
    node = constant(etype, bits, count)
    ours = constant_array(node).astype(np.float32)
    theirs = openvino_values(node)
    assert ours.shape == theirs.shape == (count,)
    np.testing.assert_array_equal(ours, theirs)  # NaN where OpenVINO has NaN (f8e4m3, f8e5m2, f8e8m0)
    if bits < 8:
        assert len(np.unique(ours.view(np.uint32))) == 1 << bits  # every code was met (f4e2m1's -0 too)


@pytest.mark.parametrize("etype", ("u3", "u6", "nf4", "f4e2m1"))
def test_a_count_that_fills_no_whole_group(etype):
    """7 u3 values, 5 u6 values: the last group is read in part."""
    node = constant(etype, 7, 7 if etype == "u3" else 5)
    np.testing.assert_array_equal(constant_array(node).astype(np.float32), openvino_values(node))
