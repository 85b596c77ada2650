"""ONNX's backend node tests, run through kvc's numpy interpreter.

Every test named in `onnx_backend_include.txt` is read by OpenVINO's ONNX frontend (through
`kvc.ir.load`, the path a user's `.onnx` takes), run by `kvc.runtime.interpreter.Interpreter`
on each of its data sets, and compared with the outputs ONNX expects. The include list holds
the node tests of the operator families kvc implements; its `# excluded:` section gives the
reason for every other test of those families (`test_include_list_accounts_for_every_family_test`
keeps it complete when onnx is upgraded).

Older onnx wheels carry the node tests as directories (`onnx/backend/test/data/node/test_*/`
with `model.onnx` and `test_data_set_*/{input,output}_*.pb`); newer ones (1.23 among them)
carry only their generators, `onnx.backend.test.case.node`. Then the included tests are written
out once per session, in the same layout, and read back from there.
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kvc.ir import load
from kvc.runtime.interpreter import Interpreter

INCLUDE_FILE = Path(__file__).with_name("onnx_backend_include.txt")
ONNX_NODE_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
CATEGORIES = {
    "rejected": "OpenVINO's ONNX frontend rejects the model",
    "op": "the converted graph uses an op kvc does not implement",
    "dtype": "the test uses an element type kvc does not implement",
    "converter": "the converted graph itself computes something else (OpenVINO's converter)",
}
_EXCLUDED_LINE = re.compile(r"^(test_\w+)\s+--\s+(" + "|".join(CATEGORIES) + r"):\s+\S.*$")


def read_filter(path: Path = INCLUDE_FILE) -> tuple[list[str], dict[str, str]]:
    """(included test names, {excluded test name: category}) from the filter file.

    One test name per line under `# <family>` headers; after the `# excluded:` header, one
    `test_name -- <category>: <reason>` per line."""
    included: list[str] = []
    excluded: dict[str, str] = {}
    in_excluded = False
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line.startswith("#"):
            in_excluded = in_excluded or line.lower().startswith("# excluded:")
            continue
        if not line:
            continue
        if in_excluded:
            m = _EXCLUDED_LINE.match(line)
            if not m:
                raise ValueError(f"{path.name}:{n}: expected 'test_name -- <{'|'.join(CATEGORIES)}>: reason', "
                                 f"found {line!r}")
            excluded[m.group(1)] = m.group(2)
        elif re.fullmatch(r"test_\w+", line):
            included.append(line)
        else:
            raise ValueError(f"{path.name}:{n}: expected a test directory name, found {line!r}")
    return included, excluded


INCLUDED, EXCLUDED = read_filter()


# -- where the node tests come from ------------------------------------------------------------
def _write_case(case, out: Path) -> None:
    """One generated test case as onnx's on-disk layout (as onnx's backend-test-tools writes it)."""
    out.mkdir(parents=True)
    (out / "model.onnx").write_bytes(case.model.SerializeToString())
    graph = case.model.graph
    for i, (inputs, outputs) in enumerate(case.data_sets):
        ds = out / f"test_data_set_{i}"
        ds.mkdir()
        for kind, values, infos in (("input", inputs, graph.input), ("output", outputs, graph.output)):
            for j, value in enumerate(values):
                vtype, vname = infos[j].type, infos[j].name
                if vtype.HasField("sequence_type"):
                    proto = numpy_helper.from_list(value, vname)
                elif vtype.HasField("optional_type"):
                    proto = numpy_helper.from_optional(value, vname)
                elif isinstance(value, onnx.TensorProto):
                    proto = value
                else:
                    proto = numpy_helper.from_array(np.asarray(value), vname)
                (ds / f"{kind}_{j}.pb").write_bytes(proto.SerializeToString())


@functools.cache
def _generated_cases() -> dict:
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():  # the generators overflow casts on purpose
        warnings.simplefilter("ignore")
        return {c.name: c for c in load_model_tests(kind="node")}


@pytest.fixture(scope="session")
def node_dirs(tmp_path_factory) -> dict[str, Path]:
    """Test name -> its directory, for every included test the installed onnx has."""
    if ONNX_NODE_DIR.is_dir():
        return {name: ONNX_NODE_DIR / name for name in INCLUDED if (ONNX_NODE_DIR / name).is_dir()}
    cases = _generated_cases()
    root = tmp_path_factory.mktemp("onnx-node-tests")
    dirs = {}
    for name in INCLUDED:
        if name in cases:
            _write_case(cases[name], root / name)
            dirs[name] = root / name
    return dirs


def _missing_message(names: list[str]) -> str:
    return (f"{len(names)} test(s) listed in {INCLUDE_FILE.name} are not node tests of the installed "
            f"onnx {onnx.__version__} ({ONNX_NODE_DIR} or onnx.backend.test.case.node): "
            f"{', '.join(names[:10])}{' …' if len(names) > 10 else ''}. Renamed or removed upstream? "
            f"Update the list.")


# -- comparing ---------------------------------------------------------------------------------
# kvc's representation of the element types numpy lacks (registry.DTYPES): bf16 is computed as
# f32 and 4-bit integers are unpacked one per byte. ONNX data of these types (ml_dtypes arrays)
# is compared and fed in that representation.
_KVC_DTYPE = {"bfloat16": np.dtype(np.float32), "int4": np.dtype(np.int8), "uint4": np.dtype(np.uint8)}

# Float tolerances, by the element type of ONNX's expected output.
_TOLERANCE = {
    "float64": (1e-5, 1e-6),
    "float32": (1e-5, 1e-6),
    # ONNX's data is coarser here: the expected values are themselves f16, rounded from a wider
    # computation (half an ulp), while kvc rounds at each f16 op's output. One f16 ulp (2**-10);
    # the largest difference seen is half of that (f16 attention).
    "float16": (2.0**-10, 2.0**-10),
    # Likewise bf16 (an ulp is 2**-7): kvc computes bf16 as f32 and rounds only at a Convert,
    # ONNX's values are rounded to bf16. One bf16 ulp; the largest seen is 0.75 of it.
    "bfloat16": (2.0**-7, 2.0**-7),
}


def _kvc_array(a: np.ndarray) -> np.ndarray:
    want = _KVC_DTYPE.get(a.dtype.name)
    return a.astype(want) if want is not None else a


def _read_pb(path: Path) -> np.ndarray:
    proto = onnx.TensorProto()
    proto.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(proto)


def _check_output(name: str, got: np.ndarray, expected: np.ndarray, where: str) -> None:
    got = np.asarray(got)
    kind = expected.dtype.name
    want = _kvc_array(expected)
    assert got.shape == want.shape, f"{where} {name}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{where} {name}: dtype {got.dtype}, expected {want.dtype} ({kind})"
    if kind in _TOLERANCE:
        rtol, atol = _TOLERANCE[kind]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{where} {name}")
    else:
        np.testing.assert_array_equal(got, want, err_msg=f"{where} {name}")


def run_node_test(test_dir: Path) -> None:
    """Convert, run every data set through kvc's interpreter, compare with ONNX's outputs."""
    graph = onnx.load(str(test_dir / "model.onnx"), load_external_data=False).graph
    for info in (*graph.input, *graph.output):
        assert info.type.HasField("tensor_type"), f"{info.name!r} is not a tensor: {info.type}"
    model = load(test_dir / "model.onnx")
    names = {n for p in model.get_parameters() for n in p.output(0).get_names()}
    interp = Interpreter(model)
    data_sets = sorted(test_dir.glob("test_data_set_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    assert data_sets, f"{test_dir.name} has no data sets"
    for ds in data_sets:
        feed = {}
        for j, info in enumerate(graph.input):
            value = _kvc_array(_read_pb(ds / f"input_{j}.pb"))
            if info.name in names:
                feed[info.name] = value
            else:
                # OpenVINO's frontend folds an empty input into a constant: its value is fully
                # given by its type and shape. Any other input must survive under its ONNX name.
                assert value.size == 0, (f"ONNX input {info.name!r} is not an input of the converted model "
                                         f"(inputs: {sorted(names)})")
        outputs = interp.run(feed)
        for j, info in enumerate(graph.output):
            assert info.name in outputs, f"ONNX output {info.name!r} missing; outputs: {list(outputs)}"
            _check_output(info.name, outputs[info.name], _read_pb(ds / f"output_{j}.pb"), ds.name)


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", INCLUDED, ids=str)
def test_onnx_node(name, node_dirs):
    if name not in node_dirs:
        pytest.fail(_missing_message([name]))
    run_node_test(node_dirs[name])


def test_include_list_names_installed_tests(node_dirs):
    missing = [n for n in INCLUDED if n not in node_dirs]
    assert not missing, _missing_message(missing)


def test_include_list_is_consistent():
    dup = sorted({n for n in INCLUDED if INCLUDED.count(n) > 1})
    assert not dup, f"listed twice in {INCLUDE_FILE.name}: {dup}"
    both = sorted(set(INCLUDED) & set(EXCLUDED))
    assert not both, f"both included and excluded in {INCLUDE_FILE.name}: {both}"


# The ONNX ops of the families kvc implements; a node test whose graph uses only these (and
# Constant/ConstantOfShape) must be included or excluded with a reason.
FAMILY_OPS = frozenset("""
    Add Sub Mul Div Pow Mod Max Min Sum Mean Equal Less Greater LessOrEqual GreaterOrEqual
    And Or Xor Not BitwiseAnd BitwiseOr BitwiseXor BitwiseNot BitShift
    Abs Neg Sqrt Exp Log Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh Acosh Atanh Erf Floor Ceil
    Round Sign Reciprocal IsNaN IsInf Clip
    Relu LeakyRelu PRelu Sigmoid HardSigmoid HardSwish Softplus Softsign Mish Gelu Elu Selu Celu
    ThresholdedRelu Tanh Swish
    Softmax LogSoftmax Hardmax
    ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum
    ReduceLogSumExp ReduceSumSquare ArgMax ArgMin
    MeanVarianceNormalization LayerNormalization RMSNormalization LpNormalization
    GroupNormalization InstanceNormalization BatchNormalization
    Reshape Squeeze Unsqueeze Transpose Concat Split Slice Gather GatherElements GatherND Scatter
    ScatterElements ScatterND Tile Expand Pad Range Shape Size Where Cast CastLike CumSum TopK
    OneHot Flatten Identity
    MatMul Gemm Einsum Attention
""".split())
HELPER_OPS = frozenset({"Constant", "ConstantOfShape"})


def family_tests(cases) -> list[str]:
    """Node tests whose graphs use only the families' ops (function-expanded tests included)."""
    out = []
    for name, case in cases.items():
        ops = {n.op_type for n in case.model.graph.node}
        if ops & FAMILY_OPS and ops <= FAMILY_OPS | HELPER_OPS:
            out.append(name)
    return sorted(out)


def test_include_list_accounts_for_every_family_test():
    if ONNX_NODE_DIR.is_dir():
        cases = {p.name: SimpleNamespace(model=onnx.load(str(p / "model.onnx"), load_external_data=False))
                 for p in ONNX_NODE_DIR.iterdir() if (p / "model.onnx").is_file()}
    else:
        cases = _generated_cases()
    unlisted = [n for n in family_tests(cases) if n not in set(INCLUDED) | set(EXCLUDED)]
    assert not unlisted, (f"{len(unlisted)} node test(s) of onnx {onnx.__version__} in kvc's op families are "
                          f"neither included nor excluded in {INCLUDE_FILE.name}; run and classify them: "
                          f"{', '.join(unlisted[:20])}")
