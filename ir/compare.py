"""Diff two models as text, headed by a structural summary.

The summary says what changed in shape terms (op counts per type, inputs, outputs and
variables added or removed) so a reader knows what to look for before the line diff.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass, field

import openvino as ov

from kvc.ir.text import to_text


@dataclass(frozen=True)
class Summary:
    """What differs between two models, beyond the text lines."""

    op_delta: dict[str, int] = field(default_factory=dict)  # type -> count(b) - count(a), nonzero only
    inputs_added: tuple[str, ...] = ()
    inputs_removed: tuple[str, ...] = ()
    outputs_added: tuple[str, ...] = ()
    outputs_removed: tuple[str, ...] = ()
    variables_added: tuple[str, ...] = ()
    variables_removed: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not any((self.op_delta, self.inputs_added, self.inputs_removed, self.outputs_added,
                        self.outputs_removed, self.variables_added, self.variables_removed))

    def lines(self) -> list[str]:
        out = []
        if self.op_delta:
            out.append("# ops: " + ", ".join(f"{n:+d} {t}" for t, n in sorted(self.op_delta.items())))
        for label, names in (("inputs added", self.inputs_added), ("inputs removed", self.inputs_removed),
                             ("outputs added", self.outputs_added), ("outputs removed", self.outputs_removed),
                             ("variables added", self.variables_added),
                             ("variables removed", self.variables_removed)):
            if names:
                out.append(f"# {label}: " + ", ".join(names))
        return out


def op_counts(model: ov.Model) -> Counter:
    return Counter(n.get_type_name() for n in model.get_ordered_ops())


def _io_names(ports) -> list[str]:
    return [",".join(sorted(p.get_names())) or "<unnamed>" for p in ports]


def count_delta(before: Counter, after: Counter) -> dict[str, int]:
    """after - before per op type, nonzero only, sorted by type."""
    return {t: after[t] - before[t] for t in sorted(set(before) | set(after)) if after[t] != before[t]}


def summarize(a: ov.Model, b: ov.Model) -> Summary:
    delta = count_delta(op_counts(a), op_counts(b))

    def added_removed(xa: list[str], xb: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(x for x in xb if x not in xa), tuple(x for x in xa if x not in xb)

    ia, ir_ = added_removed(_io_names(a.inputs), _io_names(b.inputs))
    oa, or_ = added_removed(_io_names(a.outputs), _io_names(b.outputs))
    va, vr = added_removed(sorted(v.get_info().variable_id for v in a.get_variables()),
                           sorted(v.get_info().variable_id for v in b.get_variables()))
    return Summary(delta, ia, ir_, oa, or_, va, vr)


_OP_LINE = re.compile(r"^(?:%[^=]+= |sink )([A-Za-z0-9_]+)<")


def summarize_text(text_a: str, text_b: str) -> Summary:
    """The structural summary from two text forms (e.g. two steps of a dump directory)."""
    def parts(text: str):
        ops, ins, outs, var = Counter(), [], [], []
        for line in text.splitlines():
            if m := _OP_LINE.match(line):
                ops[m.group(1)] += 1
            elif line.startswith("input %"):
                ins.append(line.split()[1][1:])
            elif line.startswith("output "):
                outs.append(line.split()[1])
            elif line.startswith("variable "):
                var.append(line.split()[1])
        return ops, ins, outs, var

    (ca, ia, oa, va), (cb, ib, ob, vb) = parts(text_a), parts(text_b)
    added = lambda x, y: tuple(n for n in y if n not in x)  # noqa: E731
    return Summary(count_delta(ca, cb), added(ia, ib), added(ib, ia), added(oa, ob), added(ob, oa), added(va, vb), added(vb, va))


def diff_text(text_a: str, text_b: str, name_a: str = "a", name_b: str = "b", context: int = 3) -> str:
    return "".join(difflib.unified_diff(text_a.splitlines(keepends=True), text_b.splitlines(keepends=True),
                                        fromfile=name_a, tofile=name_b, n=context))


def diff(a: ov.Model, b: ov.Model, name_a: str = "a", name_b: str = "b", context: int = 3) -> str:
    """Summary lines then a unified diff of the text forms; empty when the models print the same."""
    body = diff_text(to_text(a), to_text(b), name_a, name_b, context)
    head = summarize(a, b).lines()
    if not body and not head:
        return ""
    return "".join(line + "\n" for line in head) + body
