"""kv-io: rewrite a static model's KV inputs and outputs to the NPU's contract (REFERENCE.md §4).

* empty past inputs (a non-chunked prefill's, length 0) are removed: ``Concat(empty, new)`` is
  ``new``, and ``ShapeOf(past)`` becomes the constant shape it now is;
* present outputs of a model with a past (chunked prefill, generate) carry only this step's
  rows, as NPUW's RedirectNewKvToOutput does, so a step copies rows, not the cache;
* ``kv_type=f16`` / ``bf16``: KV inputs and outputs stored as f16 or bf16 (converted at the
  boundary; bf16 is what a CPU computing at bf16 reads without a conversion per step);
* ``kv_type=i8``: KV stored as int8 with one f16 scale per token and head (symmetric,
  ``scale = max|row| / 127`` over the head dimension, ``q = round(x / scale)`` clamped to
  ±127): each present output carries ``q`` and a new output ``<name>_scale`` its scales; each
  past input takes ``q`` and a new input ``<name>_scale``, dequantized (``q * scale``) before
  attention, in the graph, so the device runs it. This step's own rows enter attention
  unquantized; they are read back quantized from the next step on;
* ``transpose_v=true``: value tensors with the sequence axis last (``[B, H, D, S]``);
* ``slice_logits=true``: a prefill returns the logits of its last position only (of a
  model of dynamic rows too: a Gather of the row its ShapeOf says is last, static [1, 1, V]).

Names of every input and output are kept. Runs on the lifted form with Concat (or KVCache
without an indirect beam table) between each past input and its present output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.ir.kv_discovery import KVTensor, kv_layout
from kvc.passes.framework.base import Pass, PassResult, option, reinfer
from kvc.passes.fuse_kvcache import take_over
from kvc.passes.lift_state import set_name
from kvc.passes.framework.registry import register_pass


@dataclass
class _Cache:
    tensor: KVTensor
    param: ov.Node
    update: ov.Node  # the Concat or KVCache appending this step's rows
    result: ov.Node
    channels: ov.Output | None = None  # int8 keys: the calibrated channel magnitudes (`_channel_magnitudes`)


def _caches(model: ov.Model, fail) -> list[_Cache]:
    layout = kv_layout(model)
    params = {p.output(0).get_any_name(): p for p in model.get_parameters()}
    results = {model.output(i).get_any_name(): r for i, r in enumerate(model.get_results())}
    found = []
    for t in layout.tensors:
        param = params[t.input_name]
        result = results.get(t.output_name)
        if result is None:
            raise fail(f"KV input {t.input_name} has no matching output {t.output_name}", param)
        update = result.input_value(0).get_node()
        if update.get_type_name() == "Convert":
            update = update.input_value(0).get_node()
        if update.get_type_name() not in ("Concat", "KVCache") or update.get_input_size() < 2:
            raise fail(f"output {t.output_name} is not a Concat/KVCache of its past and new rows", update)
        if update.get_type_name() == "KVCache" and update.get_attributes()["indirect"]:
            raise fail("an indirect KVCache has no place in the batch-1 static contract; fuse with beam=gather",
                       update)
        found.append(_Cache(t, param, update, result))
    return found


def _seq_last_perm(rank: int, seq: int) -> list[int]:
    return [a for a in range(rank) if a != seq] + [seq]


@register_pass
@dataclass(frozen=True)
class KVIO(Pass):
    """Shape the KV inputs/outputs of a static model the way the NPU plugin expects them."""

    name: ClassVar[str] = "kv-io"
    requires: ClassVar[tuple[str, ...]] = ("stateless", "static-but-rows")
    ensures: ClassVar[tuple[str, ...]] = ("static-but-rows",)
    kv_type: str = option("f32", choices=("f32", "f16", "bf16", "i8"),
                          help="element type of KV inputs and outputs (i8: with per-token f16 scales)")
    transpose_v: bool = option(False, help="store values as [B, H, D, S] (sequence last)")
    slice_logits: bool = option(False, help="prefill: return only the last position's logits")
    new_rows_only: bool = option(True, help="present outputs carry only this step's rows when there is a past")

    def run(self, model: ov.Model) -> PassResult:
        caches = _caches(model, self.fail)
        touched: list[ov.Node] = []  # rewired: their types and shapes are inferred again
        if self.kv_type == "i8":  # read off the past inputs before an empty past is removed with them
            for c in caches:
                c.channels = self._channel_magnitudes(c)
        for c in caches:
            past_len = c.param.get_output_partial_shape(0)[c.tensor.seq_axis].get_length()
            if past_len == 0:
                touched += self._remove_empty_past(model, c)
            elif self.new_rows_only:
                self._present_new_rows(c)
                touched.append(c.result)
        if self.kv_type == "i8" and self.transpose_v:
            raise self.fail("transpose_v with int8 KV is not supported (its per-token scales assume the head "
                            "dimension last); use one or the other")
        for c in caches:
            if self.kv_type == "i8":
                touched += self._quantize(model, c)
            elif self.kv_type != c.result.get_output_element_type(0).get_type_name() or (
                    self.transpose_v and c.tensor.kind == "value"):
                touched += self._retype(model, c)
        if self.slice_logits:
            touched += self._slice_logits(model)
        reinfer(touched)
        return PassResult(model, bool(touched))

    # -- empty past ----------------------------------------------------------------------
    def _remove_empty_past(self, model: ov.Model, c: _Cache) -> list[ov.Node]:
        out = c.param.output(0)
        new_rows = c.update.input_value(1)
        rewired = [t.get_node() for t in c.update.output(0).get_target_inputs()]
        for target in list(out.get_target_inputs()):
            user = target.get_node()
            if user.get_type_name() == "ShapeOf":
                shape = np.array(c.param.get_output_shape(0), dtype=user.get_output_element_type(0).to_dtype())
                rewired += [t.get_node() for t in user.output(0).get_target_inputs()]
                take_over(user.output(0), ops.constant(shape).output(0))
            elif user == c.update or (user.get_type_name() == "Gather" and
                                      all(t.get_node() == c.update for t in user.output(0).get_target_inputs())):
                continue
            else:
                raise self.fail(f"the empty past {c.tensor.input_name} feeds {user.get_type_name()} "
                                f"'{user.get_friendly_name()}'; it cannot be removed", user)
        take_over(c.update.output(0), _as_shaped(new_rows, c.update.get_output_partial_shape(0)))
        model.remove_parameter(c.param)
        c.param = None  # type: ignore[assignment]
        return rewired

    # -- present = new rows ----------------------------------------------------------------
    def _present_new_rows(self, c: _Cache) -> None:
        stored = c.result.input_value(0)
        new_rows = c.update.input_value(1)
        if stored.get_node().get_type_name() == "Convert":  # keep the output's element type
            new_rows = ops.convert(new_rows, stored.get_element_type()).output(0)
        _reroute(c.result, new_rows)

    # -- element type and value layout -------------------------------------------------------
    def _retype(self, model: ov.Model, c: _Cache) -> list[ov.Node]:
        etype = {"f16": ov.Type.f16, "bf16": ov.Type.bf16}.get(self.kv_type, ov.Type.f32)
        transpose = self.transpose_v and c.tensor.kind == "value"
        t = c.tensor
        rank = len(c.result.get_output_partial_shape(0))
        perm = _seq_last_perm(rank, t.seq_axis)
        inverse = list(np.argsort(perm))
        if c.param is not None:
            old = c.param.output(0)
            shape = c.param.get_output_partial_shape(0)
            new_shape = ov.PartialShape([shape[a] for a in perm]) if transpose else shape
            param = ops.parameter(new_shape, etype)
            set_name(param.output(0), t.input_name)
            value = param.output(0)
            if transpose:
                value = ops.transpose(value, ops.constant(np.array(inverse, np.int64))).output(0)
            if etype != old.get_element_type():
                value = ops.convert(value, old.get_element_type()).output(0)
            rewired = [t.get_node() for t in old.get_target_inputs()]
            for target in list(old.get_target_inputs()):
                target.replace_source_output(value)
            model.replace_parameter(model.get_parameter_index(c.param), param)
            c.param = param
        else:
            rewired = []
        value = c.result.input_value(0)
        if transpose:
            value = ops.transpose(value, ops.constant(np.array(perm, np.int64))).output(0)
        if etype != value.get_element_type():
            value = ops.convert(value, etype).output(0)
        _reroute(c.result, value)
        return [*rewired, c.result]

    # -- int8 with per-token scales -----------------------------------------------------------
    def _quantize(self, model: ov.Model, c: _Cache) -> list[ov.Node]:
        t = c.tensor
        rank = len(c.result.get_output_partial_shape(0))
        depth = rank - 1  # the head dimension: one scale per (token, head)
        if t.seq_axis == depth:
            raise self.fail(f"{t.input_name}: int8 KV needs the head dimension last, not the sequence", c.result)
        f32 = ov.Type.f32
        rewired = []
        channels = c.channels
        if c.param is not None:
            old = c.param.output(0)
            shape = c.param.get_output_partial_shape(0)
            q = ops.parameter(shape, ov.Type.i8)
            set_name(q.output(0), t.input_name)
            scale_shape = ov.PartialShape([1 if a == depth else shape[a] for a in range(rank)])
            scale = ops.parameter(scale_shape, ov.Type.f16)
            set_name(scale.output(0), scale_name(t.input_name))
            value = ops.multiply(ops.convert(q, f32), ops.convert(scale, f32)).output(0)
            if channels is not None:
                value = ops.multiply(value, channels).output(0)
            value.get_node().set_friendly_name(dequantize_name(t.input_name))
            if old.get_element_type() != f32:
                value = ops.convert(value, old.get_element_type()).output(0)
            rewired = [u.get_node() for u in old.get_target_inputs()]
            for target in list(old.get_target_inputs()):
                target.replace_source_output(value)
            model.replace_parameter(model.get_parameter_index(c.param), q)
            model.add_parameters([scale])
            c.param = q
        rows = c.result.input_value(0)
        if rows.get_element_type() != f32:
            rows = ops.convert(rows, f32).output(0)
        if channels is not None:
            rows = ops.divide(rows, channels).output(0)
        absmax = ops.reduce_max(ops.abs(rows), ops.constant(np.array([depth], np.int64)), keep_dims=True)
        step = ops.maximum(ops.divide(absmax, ops.constant(np.float32(127))), ops.constant(np.float32(SCALE_FLOOR)))
        stored = ops.convert(step, ov.Type.f16)  # quantize with the scale as stored
        quantized = ops.convert(ops.clamp(ops.round(ops.divide(rows, ops.convert(stored, f32)), "half_to_even"),
                                          -127.0, 127.0), ov.Type.i8)
        quantized.set_friendly_name(f"{t.output_name}/quantize")
        _reroute(c.result, quantized.output(0))
        result = ops.result(stored)
        set_name(stored.output(0), scale_name(t.output_name))
        model.add_results([result])
        return [*rewired, c.result, result]

    @staticmethod
    def _channel_magnitudes(c: _Cache) -> ov.Output | None:
        """The calibrated magnitudes of a key cache per channel (every axis but batch and
        sequence), as a constant that broadcasts over its rows; None for values and for keys
        without a calibration. Read off the past input, so before an empty past (an unchunked
        prefill's) is removed: its present rows are quantized with the same channels as every
        other model's, or the generate models read back other keys than the prefill stored."""
        if c.tensor.kind != "key" or c.param is None:
            return None
        rt = c.param.get_rt_info()
        if CHANNEL_ABSMAX not in rt.keys():
            return None
        values = np.array([float(v) for v in rt[CHANNEL_ABSMAX].astype(str).split(",")], np.float32)
        shape = [d.get_length() for d in c.param.get_output_partial_shape(0)]
        shape[c.tensor.batch_axis] = shape[c.tensor.seq_axis] = 1
        if values.size != int(np.prod(shape)):
            return None
        values = values.reshape(shape)
        values = np.maximum(values, values.max() * 1e-3)  # a dead channel must not divide by ~0
        del rt[CHANNEL_ABSMAX]
        return ops.constant(values).output(0)

    # -- logits ------------------------------------------------------------------------------
    def _slice_logits(self, model: ov.Model) -> list[ov.Node]:
        for i, result in enumerate(model.get_results()):
            if "logits" not in model.output(i).get_names():
                continue
            shape = result.get_output_partial_shape(0)
            if shape[1].is_dynamic:  # a first chunk of dynamic rows: the row ShapeOf says is last
                value = result.input_value(0)
                one = ops.constant(np.array([1], np.int64))
                rows = ops.gather(ops.shape_of(value, "i64"), one, ops.constant(np.int64(0)))
                last = ops.gather(value, ops.subtract(rows, one), ops.constant(np.int64(1)))
                last.set_friendly_name("logits/last_position")
                _reroute(result, last.output(0))
                return [result]
            rows = shape[1].get_length()
            if rows == 1:
                return []
            # Exact bounds, not [-1, INT64_MAX): OpenVINO CPU's weightless blobs (CACHE_MODE
            # OPTIMIZE_SIZE) read that sentinel back wrong and slice nothing.
            last = ops.slice(result.input_value(0), ops.constant(np.array([rows - 1], np.int64)),
                             ops.constant(np.array([rows], np.int64)),
                             ops.constant(np.array([1], np.int64)), ops.constant(np.array([1], np.int64)))
            last.set_friendly_name("logits/last_position")
            _reroute(result, last.output(0))
            return [result]
        raise self.fail("slice_logits: the model has no output named logits")


CHANNEL_ABSMAX = "kvc_key_channel_absmax"  # rt_info of a key's past input: comma-separated [heads x depth]
SCALE_FLOOR = 2.0 ** -24  # the smallest f16 step: an all-zero row keeps a finite, non-zero scale


def _as_shaped(value: ov.Output, shape: ov.PartialShape) -> ov.Output:
    """`value` (the new rows that replace a cache update over an empty past), reshaped to what
    shape inference knew of the update, `shape`, when that is more: the past input, static
    but for its rows, told it the KV heads that an ONNX export's [B, L, -1, D] keys leave
    unknown beside dynamic rows; without it the heads were lost downstream (and every stale
    type after the pass disagreed with inference)."""
    if shape.rank.is_dynamic or sum(d.is_dynamic for d in shape) != 1 or value.get_partial_shape() == shape:
        return value
    dims = np.array([d.get_length() if d.is_static else -1 for d in shape], np.int64)
    pinned = ops.reshape(value, ops.constant(dims), False)
    pinned.set_friendly_name(f"{value.get_node().get_friendly_name()}/as_cache")
    return pinned.output(0)


def scale_name(name: str) -> str:
    """The scales of an int8 KV input or output: past_key_values.N.key -> past_key_values.N.key_scale
    (a name KV discovery does not take for a cache tensor)."""
    return f"{name}_scale"


def dequantize_name(name: str) -> str:
    """The friendly name of the node that dequantizes an int8 KV input (``q * scale``, times the
    key channels): what the model's attention reads of that input (kvc.verify.cache_rows reads
    the cache back through it)."""
    return f"{name}/dequantize"


def _reroute(result: ov.Node, value: ov.Output) -> None:
    """Make a Result return `value`, moving the output's names along (a model output keeps its
    name; the tensor it used to return loses it)."""
    old = result.input_value(0)
    names = old.get_names()
    result.input(0).replace_source_output(value)
    old.get_tensor().set_names(set())
    value.get_tensor().set_names(names)
