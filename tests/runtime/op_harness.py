"""One-op models run by kvc's numpy interpreter and by OpenVINO CPU (f32), compared.

    check(lambda x, y: ops.add(x, y), {"x": a, "y": b})

`make` receives one Parameter per entry of `inputs` (same name, dtype and shape; dimensions
dynamic with `dynamic=True`, or `dynamic=("x",)` for some) and returns an op, an output, or a
list of outputs.
Shape, axis and other non-data inputs are Constants built inside `make` (numpy arrays passed
to an opset function become Constants). Integer and bool outputs must match exactly, floats
within `rtol`/`atol` (NaN where the peer has NaN), and element types and shapes always.

`interpret(make, inputs)` runs only kvc's interpreter, for the cases where OpenVINO CPU
disagrees with OpenVINO's specification and a test names the spec's answer explicitly;
`ov_reference(make, inputs)` runs OpenVINO core's own reference implementation of the op
(`Node.evaluate`, what constant folding uses), a second witness for such cases.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import openvino as ov
import openvino.opset15 as ops

from kvc.runtime.interpreter import Interpreter
from kvc.runtime.session import OpenVINOSession

F32 = dict(rtol=1e-5, atol=1e-6)
F16 = dict(rtol=1e-3, atol=1e-5)  # one f16 ulp is 2**-10 relative: both peers compute in f32 and round once


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(seed: int, shape, dtype=np.float32, scale: float = 1.0) -> np.ndarray:
    return (rng(seed).standard_normal(shape) * scale).astype(dtype)


def randint(seed: int, shape, lo: int, hi: int, dtype=np.int32) -> np.ndarray:
    return rng(seed).integers(lo, hi, size=shape, endpoint=False).astype(dtype)


def _outputs(made) -> list[ov.Output]:
    if isinstance(made, ov.Output):
        return [made]
    if isinstance(made, ov.Node):
        return list(made.outputs())
    return [o for m in made for o in _outputs(m)]


def build(make: Callable, inputs: Mapping[str, np.ndarray], *, dynamic: bool | tuple[str, ...] = False) -> ov.Model:
    """The one-op model; `dynamic`: every dimension of every Parameter (True) or of those named is dynamic."""
    params = {}
    for name, value in inputs.items():
        value = np.asarray(value)
        dyn = dynamic is True or (not isinstance(dynamic, bool) and name in dynamic)
        shape = ov.PartialShape([-1] * value.ndim) if dyn else ov.PartialShape(list(value.shape))
        p = ops.parameter(shape, ov.Type(value.dtype) if value.dtype != np.bool_ else ov.Type.boolean, name=name)
        p.output(0).set_names({name})
        params[name] = p
    outs = _outputs(make(**params))
    for i, o in enumerate(outs):
        o.set_names({f"out{i}"})
    return ov.Model([ops.result(o) for o in outs], list(params.values()), "one_op")


def interpret(make: Callable, inputs: Mapping[str, np.ndarray], *,
              dynamic: bool | tuple[str, ...] = False) -> list[np.ndarray]:
    model = build(make, inputs, dynamic=dynamic)
    res = Interpreter(model).run(dict(inputs))
    return [res[f"out{i}"] for i in range(len(model.outputs))]


def ov_reference(make: Callable, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """OpenVINO core's reference `evaluate` of the op `make` returns (its inputs: Parameters, Constants)."""
    model = build(make, inputs)
    node = model.get_results()[0].input_value(0).get_node()
    args = []
    for inp in node.inputs():
        src = inp.get_source_output().get_node()
        if src.get_type_name() == "Parameter":
            args.append(ov.Tensor(np.array(inputs[src.get_friendly_name()], order="C")))
        else:
            args.append(ov.Tensor(np.array(src.get_data(), order="C")))
    outs = [ov.Tensor(node.get_output_element_type(i), ov.Shape([0])) for i in range(node.get_output_size())]
    assert node.evaluate(outs, args), f"{node.get_type_name()} has no reference evaluate for these inputs"
    return [np.array(t.data, copy=True) for t in outs]


def openvino_cpu(make: Callable, inputs: Mapping[str, np.ndarray], *,
                 dynamic: bool | tuple[str, ...] = False) -> list[np.ndarray]:
    model = build(make, inputs, dynamic=dynamic)
    res = OpenVINOSession(model).infer(dict(inputs))
    return [res[f"out{i}"] for i in range(len(model.outputs))]


def assert_same(ours: np.ndarray, theirs: np.ndarray, *, rtol: float, atol: float, what: str = "") -> None:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.dtype == theirs.dtype, f"{what}dtype: kvc {ours.dtype}, expected {theirs.dtype}"
    assert ours.shape == theirs.shape, f"{what}shape: kvc {ours.shape}, expected {theirs.shape}"
    if np.issubdtype(theirs.dtype, np.floating):
        np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), rtol=rtol, atol=atol,
                                   equal_nan=True, err_msg=what)
    else:
        np.testing.assert_array_equal(ours, theirs, err_msg=what)


def check(make: Callable, inputs: Mapping[str, np.ndarray], *, rtol: float | None = None,
          atol: float | None = None, dynamic: bool | tuple[str, ...] = False) -> list[np.ndarray]:
    """kvc's interpreter and OpenVINO CPU agree on `make(**params)`; returns kvc's outputs.

    The default tolerance is F32, or F16 for an f16 output."""
    model = build(make, inputs, dynamic=dynamic)
    feeds = {k: np.asarray(v) for k, v in inputs.items()}
    ours = Interpreter(model).run(feeds)
    theirs = OpenVINOSession(model).infer(feeds)
    results = []
    for i in range(len(model.outputs)):
        a, b = ours[f"out{i}"], theirs[f"out{i}"]
        tol = F16 if np.asarray(b).dtype == np.float16 else F32
        assert_same(a, b, rtol=tol["rtol"] if rtol is None else rtol, atol=tol["atol"] if atol is None else atol,
                    what=f"output {i}: ")
        results.append(a)
    return results


def check_expected(make: Callable, inputs: Mapping[str, np.ndarray], expected, *, rtol: float = 1e-5,
                   atol: float = 1e-6, dynamic: bool | tuple[str, ...] = False) -> None:
    """kvc's interpreter gives `expected` (one array or a list, one per output)."""
    got = interpret(make, inputs, dynamic=dynamic)
    expected = expected if isinstance(expected, (list, tuple)) else [expected]
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_same(a, np.asarray(b), rtol=rtol, atol=atol, what=f"output {i}: ")
