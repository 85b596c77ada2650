"""One session interface over three engines: kvc's numpy interpreter, OpenVINO, onnxruntime.

    session.infer({"input_ids": ids, ...}) -> outputs by tensor name (any alias works)
    session.reset()                           -> empty every variable
    session.state() / session.set_state(id, value)

The same inputs by tensor name give outputs by tensor name on every backend, so a pipeline
or a comparison never needs to know which engine it drives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Protocol

import numpy as np
import openvino as ov

from kvc.errors import DeviceError, UsageError, openvino_reason
from kvc.runtime.embeddings import Embedder, embedder_of
from kvc.runtime.interpreter import Interpreter, TensorMap, bind_input, input_dtype, port_names
from kvc.runtime.ops.registry import to_dtype

# OpenVINO CPU defaults to bf16/f16 inference and an f16 KV cache (models' rt_info asks for
# it); a reference comparison needs f32 throughout (REFERENCE.md §1).
# OpenVINO CPU computing what the model says: f32 arithmetic and KV cache (the defaults are bf16
# on hosts with AVX512_BF16 or AMX, and a u8 KV cache), and no dynamic quantization of the
# activations that meet int8/int4 weights (on by default where the host has AVX512-VNNI or AMX).
EXACT_CPU_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
# The NPU plugin on a machine without an NPU: NPUW with CPU as its backend (REFERENCE.md §5),
# computing in f32 whatever the host offers: left to its defaults the CPU computes in bf16 where
# it has AVX512_BF16 or AMX, so results would measure the host, not the model. NPUW forwards
# properties that are not its own to its devices (npuw/compiled_model.cpp,
# get_properties_per_device); an invalid value here is rejected by the CPU plugin's parser.
# The KV precision is what the static models' past/present ports declare.
NPUW_CPU_CONFIG = {"NPU_USE_NPUW": "YES", "NPUW_DEVICES": "CPU", "NPUW_ONLINE_PIPELINE": "NONE",
                   "INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
# The CPU plugin's properties among them (export.load sets them on the Core for blob imports).
CPU_EXACTNESS_KEYS = ("INFERENCE_PRECISION_HINT", "DYNAMIC_QUANTIZATION_GROUP_SIZE")


class Session(Protocol):
    backend: str

    @property
    def input_names(self) -> list[str]: ...

    def has_input(self, name: str) -> bool: ...

    def input_dtype(self, name: str) -> np.dtype: ...

    def bind(self, name: str, buffer: np.ndarray, rows: int, axis: int) -> None: ...

    def infer(self, inputs: Mapping[str, np.ndarray]) -> TensorMap: ...

    def reset(self) -> None: ...

    def state(self) -> dict[str, np.ndarray]: ...

    def set_state(self, variable_id: str, value: np.ndarray) -> None: ...


class NumpySession:
    """kvc's interpreter: the reference."""

    backend = "numpy"
    # What the model's constants point into when it was read over a shared mapping of its
    # weights (kvc.ir.reader.map_weights): held by the session so that it lives as long.
    weights_mapping: object | None = None
    embed: Embedder | None = None  # a model that takes inputs_embeds: its ids' rows (runtime/embeddings.py)

    def __init__(self, model: ov.Model, *, widen: bool = False, npuw: bool = False):
        self.embed = embedder_of(model)
        self.interpreter = Interpreter(model, widen=widen, npuw=npuw)  # see Interpreter
        self._bound: dict[str, np.ndarray] = {}

    @property
    def input_names(self) -> list[str]:
        return self.interpreter.input_names()

    def has_input(self, name: str) -> bool:
        return any(name in names for names, _, _ in self.interpreter._inputs)

    def input_dtype(self, name: str) -> np.dtype:
        """The array type input `name` takes: kvc's representation of its element type (bf16
        as f32 holding bf16 values)."""
        port = next(port for names, _, port in self.interpreter._inputs if name in names)
        return input_dtype(port, self.interpreter.widen)

    def bind(self, name: str, buffer: np.ndarray, rows: int, axis: int) -> None:
        """Input `name` reads the first `rows` rows (along `axis`) of `buffer` from now on,
        without copying, until rebound; `infer` then need not be given it."""
        index = [slice(None)] * buffer.ndim
        index[axis] = slice(0, rows)
        self._bound[name] = buffer[tuple(index)]

    def infer(self, inputs, *, trace=False):
        return self.interpreter.run({**self._bound, **inputs}, trace=trace)

    def capture(self, inputs, names=True) -> tuple[TensorMap, dict[str, np.ndarray]]:
        """`infer`, also returning every value (or those `names`) by its stable name."""
        return self.interpreter.run({**self._bound, **inputs}, capture=names)

    def reset(self) -> None:
        self.interpreter.reset()

    def state(self) -> dict[str, np.ndarray]:
        return dict(self.interpreter.state)

    def set_state(self, variable_id: str, value: np.ndarray) -> None:
        if variable_id not in self.interpreter._variables:
            raise KeyError(f"no variable {variable_id!r}")
        self.interpreter.state[variable_id] = np.asarray(value)


class OpenVINOSession:
    """An OpenVINO compiled model on any device; CPU defaults to exact f32 inference
    (`exact=False` keeps the plugin's own defaults, e.g. bf16 where the CPU has it)."""

    backend = "openvino"
    # What the model's constants point into when it was read over a shared mapping of its
    # weights (kvc.ir.reader.map_weights): held by the session so that it lives as long.
    weights_mapping: object | None = None
    # Called once, after the first inference (kvc.export.load: an imported blob's plugin frees
    # what its import held there, and the heap is trimmed).
    after_first_inference: Callable[[], None] | None = None
    # A model that takes inputs_embeds: its ids' rows (runtime/embeddings.py); a blob's session
    # is given it by its opener.
    embed: Embedder | None = None

    def __init__(self, model: ov.Model | ov.CompiledModel, device: str = "CPU", config: dict | None = None,
                 *, exact: bool = True):
        from kvc.ir.reader import core

        if isinstance(model, ov.CompiledModel):
            self.compiled = model
        else:
            self.embed = embedder_of(model)
            cfg = dict(EXACT_CPU_CONFIG if device == "CPU" and exact else {})
            cfg.update(config or {})
            try:
                self.compiled = core().compile_model(model, device, cfg)
            except RuntimeError as exc:
                raise DeviceError(f"cannot compile for {device}: {openvino_reason(exc)}") from None
        self.device = device
        self.request = self.compiled.create_infer_request()
        # Compiling adds internal tensor names to ports (e.g. "81" beside "input_ids"); the
        # model's own names lead when we have the model.
        source = model if isinstance(model, ov.Model) else None
        self._inputs = [(port_names(p, source.inputs[i] if source else None), p)
                        for i, p in enumerate(self.compiled.inputs)]
        self._outputs = [port_names(p, source.outputs[i] if source else None)
                         for i, p in enumerate(self.compiled.outputs)]
        self._dtypes = [array_dtype(p.get_element_type()) for _, p in self._inputs]
        self._bf16_outputs = [p.get_element_type() == ov.Type.bf16 for p in self.compiled.outputs]
        self._bound: set[int] = set()
        self._skipped: set[int] = set()  # inputs never fed (export/branches.py: the other body's)
        # Each output's part to copy out (export/branches.py: a body's own rows of the If's padded
        # outputs, cut before the copy); `...`: the whole tensor.
        self._cuts: list = [...] * len(self._outputs)
        self._parents: dict[int, tuple[np.ndarray, ov.Tensor]] = {}  # keeps shared buffers alive

    @property
    def input_names(self) -> list[str]:
        return [names[0] for names, _ in self._inputs]

    def has_input(self, name: str) -> bool:
        return any(name in names for names, _ in self._inputs)

    def input_dtype(self, name: str) -> np.dtype:
        """The array type input `name` takes (bf16: ml_dtypes.bfloat16, the device's own bytes)."""
        return array_dtype(next(port for names, port in self._inputs if name in names).get_element_type())

    def bind(self, name: str, buffer: np.ndarray, rows: int, axis: int) -> None:
        """Input `name` reads the first `rows` rows (along `axis`) of `buffer`, shared (an ROI
        tensor over it): no copy per inference, until rebound; `infer` need not be given it."""
        index = next(i for i, (names, _) in enumerate(self._inputs) if name in names)
        want = self._dtypes[index]
        if buffer.dtype != want or not buffer.flags["C_CONTIGUOUS"]:
            raise UsageError(f"cannot bind {name}: buffer must be C-contiguous {want}, got {buffer.dtype}")
        parent = self._parents.setdefault(id(buffer), (buffer, shared_tensor(buffer)))[1]
        end = list(buffer.shape)
        end[axis] = rows
        self.request.set_input_tensor(index, ov.Tensor(parent, ov.Coordinate([0] * buffer.ndim), ov.Coordinate(end)))
        self._bound.add(index)

    def infer(self, inputs):
        feed = {}
        for i, (names, port) in enumerate(self._inputs):
            if i in self._skipped:
                continue
            if i not in self._bound or any(n in inputs for n in names):
                value, want = bind_input(names, port, inputs), self._dtypes[i]
                feed[i] = value if value.dtype == want else shared_tensor(np.ascontiguousarray(value, want))
        try:
            result = self.request.infer(feed)
        except RuntimeError as exc:
            raise DeviceError(f"inference on {self.device} failed: {openvino_reason(exc)}") from None
        outputs = TensorMap((names, as_bf16(v[cut]) if bf16 else np.array(v[cut], copy=True))
                            for names, v, bf16, cut in zip(self._outputs, result.values(), self._bf16_outputs,
                                                           self._cuts))
        if self.after_first_inference is not None:
            hook, self.after_first_inference = self.after_first_inference, None
            hook()
        return outputs

    def reset(self) -> None:
        self.request.reset_state()

    def state(self) -> dict[str, np.ndarray]:
        return {s.name: np.array(s.state.data, copy=True) for s in self.request.query_state()}

    def set_state(self, variable_id: str, value: np.ndarray) -> None:
        for s in self.request.query_state():
            if s.name == variable_id:
                s.state = ov.Tensor(np.ascontiguousarray(value))
                return
        raise KeyError(f"no variable {variable_id!r}")


def array_dtype(etype: ov.Type) -> np.dtype:
    """The numpy type holding an OpenVINO tensor's bytes: ml_dtypes.bfloat16 for bf16 (OpenVINO's
    Python API shows bf16 data as float16, which reads the bits as another number)."""
    if etype == ov.Type.bf16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return etype.to_dtype()


def backend_dtype(element_type: str, backend: str) -> np.dtype:
    """The array type a `backend` session takes for an input of `element_type` (its name)."""
    if element_type == "bf16" and backend != "numpy":
        return array_dtype(ov.Type.bf16)
    return to_dtype(element_type)


def shared_tensor(array: np.ndarray) -> ov.Tensor:
    """An ov.Tensor over `array`'s memory (C-contiguous), bf16 included."""
    if array.dtype == array_dtype(ov.Type.bf16):
        return ov.Tensor(array.view(np.uint16), list(array.shape), ov.Type.bf16)
    return ov.Tensor(array, shared_memory=True)


def as_bf16(value: np.ndarray) -> np.ndarray:
    """A copy of a bf16 output's data (shown by OpenVINO as float16) as ml_dtypes.bfloat16."""
    return np.array(value, copy=True).view(np.uint16).view(array_dtype(ov.Type.bf16))


class OnnxRuntimeSession:
    """onnxruntime on CPU for ONNX models (stateless: no variables)."""

    backend = "onnxruntime"

    def __init__(self, path: str | Path):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self._types = {i.name: _ORT_TYPES.get(i.type) for i in self.session.get_inputs()}

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.session.get_inputs()]

    def has_input(self, name: str) -> bool:
        return name in self._types

    def infer(self, inputs):
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise UsageError(f"missing input(s) {', '.join(missing)}")
        feed = {n: np.asarray(inputs[n]).astype(self._types[n] or np.asarray(inputs[n]).dtype, copy=False)
                for n in self.input_names}
        names = [o.name for o in self.session.get_outputs()]
        return TensorMap(((n,), v) for n, v in zip(names, self.session.run(names, feed)))

    def reset(self) -> None:
        pass

    def state(self) -> dict[str, np.ndarray]:
        return {}

    def set_state(self, variable_id: str, value: np.ndarray) -> None:
        raise KeyError("onnxruntime sessions have no variables")


_ORT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(float16)": np.float16, "tensor(bool)": np.bool_}

BACKENDS = ("numpy", "openvino", "onnxruntime")


def open_session(model: str | Path | ov.Model, backend: str = "numpy", *, device: str = "CPU",
                 config: dict | None = None) -> Session:
    """A session for `model` (path or `ov.Model`) on `backend`; `device`/`config` for OpenVINO."""
    if backend == "onnxruntime":
        if isinstance(model, ov.Model) or Path(model).suffix != ".onnx":
            raise UsageError("the onnxruntime backend runs .onnx files")
        return OnnxRuntimeSession(model)
    if not isinstance(model, ov.Model):
        from kvc.ir.reader import load

        model = load(model)
    if backend == "numpy":
        return NumpySession(model)
    if backend == "openvino":
        return OpenVINOSession(model, device, config)
    raise UsageError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")

