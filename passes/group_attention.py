"""group-attention: ScaledDotProductAttention as grouped MatMuls, without expanding the cache.

optimum's exports expand grouped KV heads before attention (``Reshape(Broadcast(Unsqueeze(kv,
2)))``: each of H_kv heads repeated `rep` times), and OpenVINO CPU, outside its stateful
KV-cache fusion, decomposes ScaledDotProductAttention with an explicit transpose of the
expanded keys. On a static generate step that copies and transposes the whole cache H/H_kv
times per layer, every token (on the benchmark model: 14 ms of a 49 ms step).

This pass writes the op's specification directly over the *grouped* cache:

    q5 = reshape(q, [B, H_kv, rep, L, D]);  k5, v5 = unsqueeze(k, v, 2)   # [B, H_kv, 1, S, D]
    w  = softmax(matmul(q5, k5, transpose_b) * scale + bias, -1)          # bias: mask or causal
    out = reshape(matmul(w, v5), [B, H, L, D])

MatMul broadcasts the `rep` axis, so the cache is read in place. Head h of the expanded form
is head h // rep of the cache, exactly as the Unsqueeze/Broadcast/Reshape built it, so the
result is the specification's (`tests/passes/test_group_attention.py` checks it on every
fixture). Needs static shapes (run after static-shape).

`split_past=true` (the generate models of CPU-only compiles, `--attention fold`; every model
with `--attention split-past`): where the keys and values are each a
Concat of the past and this call's rows, attention reads the two apart instead of the
concatenation, so a call never copies the whole past (OpenVINO CPU materializes the Concat,
converting the past into it, every call):

    s = concat(q5 @ k_past^T, q5 @ k_new^T) * scale + bias;  w_past, w_new = split(softmax(s))
    out = w_past @ v_past + w_new @ v_new

The same scores, softmax and weighted sum, summed in two parts. On the 250M Llama a generate
step took 24.5 ms against 25.9 with the Concat (bf16 cache; bench/attention_forms.py). Split,
prefill chunks with their MLPs off LLMMLP (mlp-rows) took 16 / 64 / 128 / 512 rows 44.3 /
71.1 / 118.7 / 340 ms against 52.3 / 74.2 / 124.8 / 348 ms with the Concat (one process
alternating, a slow phase of the host; docs/kv-precision.md); folded (below) they are faster
still from 128 rows on.

`fold=true` (the prefill models of CPU-only compiles): the repeat goes into the query rows
instead of an axis of its own, so attention is rank 4 over the cache as it is:

    qf = reshape(q, [B, H_kv, rep * L, D])        # heads h = kv * rep + r are contiguous
    out = reshape(softmax(qf @ k^T * scale + bias') @ v, [B, H, L, D])

where bias' is the mask with its rows tiled rep times (folded row r * L + l is head r's row
l), or a per-head mask reshaped the same way. That is the MatMul-Softmax-MatMul pattern the
CPU plugin's Snippets MHA tokenization fuses (it takes rank 4 only), so the scores are never
written out whole; it needs the Concat of past and new rows (split_past is not applied). A
16-layer stack alone (bench/attention_fold.py): 16 / 128 / 512 rows 9.7 / 38 / 140 ms against
14.5 / 47 / 214 grouped; in the bench Llama's prefill models, against grouped with split_past:
128 rows 173 against 215 ms, 512 rows 573 against 711, 16 rows the same (86 against 83).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult, describe_node, name_new
from kvc.passes.fuse_kvcache import take_over
from kvc.passes.framework.registry import register_pass
from kvc.passes.framework.rules import NoMatch, Rule

log = logging.getLogger(__name__)


def grouped_source(out: ov.Output, heads: int) -> tuple[ov.Output, int]:
    """The cache behind a GQA expansion `Reshape(Broadcast(Unsqueeze(kv, 2)))` and its repeat
    factor; the value itself with factor 1 when it is not one."""
    reshape = out.get_node()
    if reshape.get_type_name() != "Reshape":
        return out, 1
    broadcast = reshape.input_value(0).get_node()
    if broadcast.get_type_name() != "Broadcast":
        return out, 1
    unsqueeze = broadcast.input_value(0).get_node()
    if unsqueeze.get_type_name() != "Unsqueeze" or unsqueeze.input_value(1).get_node().get_type_name() != "Constant":
        return out, 1
    axes = np.asarray(unsqueeze.input_value(1).get_node().get_data()).reshape(-1).tolist()
    kv = unsqueeze.input_value(0)
    shape = kv.get_partial_shape()
    if axes != [2] or shape.rank.get_length() != 4 or not shape.is_static:
        return out, 1
    kv_heads = shape[1].get_length()
    if heads % kv_heads:
        return out, 1
    return kv, heads // kv_heads


def _plain_sdpa(node: ov.Node) -> ov.Node:
    if node.get_input_size() > 5:
        raise NoMatch("it has an attention sink (input 5); kept as ScaledDotProductAttention")
    return node


def _i64(values) -> ov.Output:
    return ov.op.Constant(np.array(values, np.int64)).output(0)  # 3x cheaper than ops.constant


@register_pass
@dataclass(frozen=True)
class GroupAttention(Pass):
    """Rewrite ScaledDotProductAttention as MatMul/Softmax over the grouped (unexpanded) cache."""

    name: ClassVar[str] = "group-attention"
    split_past: bool = False  # read the past and the new rows apart (no Concat of the keys and values)
    fold: bool = False  # the repeat folded into the query rows: rank-4 attention over [B, H_kv, rep * L, D]

    requires: ClassVar[tuple[str, ...]] = ("static",)

    def run(self, model: ov.Model) -> PassResult:
        reinfer = []  # whether each rewrite changed what consumers see (never, so far)
        rule = Rule("group-attention/sdpa", anchors=("ScaledDotProductAttention",), match=_plain_sdpa,
                    rewrite=lambda sdpa: reinfer.append(self._rewrite(sdpa)))
        rewritten = rule.apply(model.get_ordered_ops())
        if any(reinfer):
            model.validate_nodes_and_infer_types()
        return PassResult(model, rewritten > 0)

    def _rewrite(self, sdpa: ov.Node) -> bool:
        """Replace one SDPA; True when its consumers must infer their types again."""
        q = sdpa.input_value(0)
        qs = q.get_partial_shape()
        if not qs.is_static or qs.rank.get_length() != 4:
            raise self.fail("attention inputs must be static and 4-D", sdpa)
        B, H, L, D = (d.get_length() for d in qs)
        k, rep_k = grouped_source(sdpa.input_value(1), H)
        v, rep_v = grouped_source(sdpa.input_value(2), H)
        if rep_k != rep_v:
            k, v, rep_k = sdpa.input_value(1), sdpa.input_value(2), 1
        rep = rep_k
        kv_heads = H // rep
        S = k.get_partial_shape()[2].get_length()
        if self.fold:  # heads h = kv * rep + r are contiguous: [B, H, L, D] is [B, H_kv, rep * L, D]
            q5, k5, v5 = ops.reshape(q, _i64([B, kv_heads, rep * L, D]), False), k, v
        else:
            q5 = ops.reshape(q, _i64([B, kv_heads, rep, L, D]), False)
            k5, v5 = ops.unsqueeze(k, _i64([2])), ops.unsqueeze(v, _i64([2]))
        parts = self._past_and_new(k, v) if self.split_past and not self.fold else None
        if parts is None:
            scores = ops.matmul(q5, k5, False, True)
        else:
            (k_past, k_new), _ = parts
            scores = ops.concat([ops.matmul(q5, ops.unsqueeze(part, _i64([2])), False, True)
                                 for part in (k_past, k_new)], -1)
        if sdpa.get_input_size() > 4:
            scale = ops.convert_like(sdpa.input_value(4), scores).output(0)
        else:
            scale = ops.constant(np.array(1.0 / np.sqrt(D), q.get_element_type().to_dtype())).output(0)
        scores = ops.multiply(scores, scale)
        bias = self._bias(sdpa, B, H, kv_heads, rep, L, S)
        if self.fold and bias is not None:
            bias = self._folded(bias, rep)
        if bias is not None:
            if bias.get_element_type() == ov.Type.boolean:
                neg = ops.convert_like(ops.constant(np.float32(-np.inf)), scores)
                scores = ops.select(bias, scores, neg)
            else:
                scores = ops.add(scores, ops.convert_like(bias, scores))
        weights = ops.softmax(scores, -1)
        if parts is None:
            out = ops.matmul(weights, v5, False, False)
        else:
            (k_past, _), (v_past, v_new) = parts
            rows = k_past.get_partial_shape()[2].get_length()
            w = ops.variadic_split(weights, _i64(-1), _i64([rows, S - rows]))
            out = ops.add(*(ops.matmul(w.output(i), ops.unsqueeze(part, _i64([2])), False, False)
                            for i, part in enumerate((v_past, v_new))))
        out = ops.reshape(out, _i64([B, H, L, D]), False)
        out.set_friendly_name(sdpa.get_friendly_name())
        name_new(out, sdpa.get_friendly_name(), {v.get_node() for v in (*sdpa.input_values(), k, v)})
        stale = (out.get_output_partial_shape(0) != sdpa.get_output_partial_shape(0)
                 or out.get_output_element_type(0) != sdpa.get_output_element_type(0))
        take_over(sdpa.output(0), out.output(0))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("group-attention: %s over %d KV heads (x%d)", describe_node(sdpa), kv_heads, rep)
        return stale

    @staticmethod
    def _past_and_new(k: ov.Output, v: ov.Output):
        """((k_past, k_new), (v_past, v_new)) when the keys and the values are each a Concat of
        two parts along the sequence axis (2) with the same rows; else None."""
        parts = []
        for x in (k, v):
            node = x.get_node()
            if node.get_type_name() != "Concat" or node.get_input_size() != 2:
                return None
            if node.get_attributes()["axis"] % 4 != 2:
                return None
            parts.append(tuple(node.input_values()))
        rows = [p[0].get_partial_shape()[2].get_length() for p in parts]
        return tuple(parts) if rows[0] == rows[1] else None

    def _bias(self, sdpa: ov.Node, B: int, H: int, kv_heads: int, rep: int, L: int, S: int) -> ov.Output | None:
        """The mask (or the causal triangle) shaped to broadcast against [B, H_kv, rep, L, S]."""
        if bool(sdpa.get_attributes().get("causal", False)):
            return ops.constant(np.tril(np.ones((L, S), bool))).output(0)  # the spec's triu(-inf, 1)
        if sdpa.get_input_size() < 4:
            return None
        mask = sdpa.input_value(3)
        ms = mask.get_partial_shape()
        if ms.rank.get_length() < 3:
            return mask  # [L, S] or [S]: broadcasts as is
        if ms.rank.get_length() == 3:
            mask = ops.unsqueeze(mask, _i64([0])).output(0)
            ms = mask.get_partial_shape()
        heads = ms[1].get_length()
        if heads == 1:
            return ops.unsqueeze(mask, _i64([2])).output(0)
        if heads != H:
            raise self.fail(f"attention mask with {heads} heads against {H} query heads", sdpa)
        return ops.reshape(mask, _i64([ms[0].get_length(), kv_heads, rep, ms[2].get_length(), ms[3].get_length()]),
                           False).output(0)

    @staticmethod
    def _folded(bias: ov.Output, rep: int) -> ov.Output:
        """`_bias`'s mask, which broadcasts against [B, H_kv, rep, L, S], as one that broadcasts
        against the folded scores [B, H_kv, rep * L, S] (folded row r * L + l is head r's row
        l): a mask with a repeat axis is reshaped; one without (of L rows or 1) is tiled rep
        times along its rows when it has L."""
        shape = [d.get_length() for d in bias.get_partial_shape()]
        if len(shape) == 5:
            if shape[2] == rep:
                return ops.reshape(bias, _i64([shape[0], shape[1], rep * shape[3], shape[4]]), False).output(0)
            bias = ops.reshape(bias, _i64([shape[0], shape[1], *shape[3:]]), False).output(0)  # its repeat axis is 1
            shape = [shape[0], shape[1], *shape[3:]]
        if len(shape) < 2 or shape[-2] == 1:
            return bias  # [S], or one row for every query row: broadcasts as is
        return ops.tile(bias, _i64([1] * (len(shape) - 2) + [rep, 1])).output(0)
