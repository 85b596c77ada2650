"""The token embedding table of every compiled model, compared with the source's, whole.

A probe reads only the embedding rows of the ids it feeds: a few hundred of a vocabulary of
32000 or more. A fault in one row (a pass that zeroed the pad row, weights.bin rewritten
there) verified OK and bisected clean while every prompt holding that id generated other
tokens. Every other weight is read by every token (dense layers) or shows in every logit (the
lm_head, compared over the whole vocabulary), so the table that the token ids select from is
the one a probe cannot cover, and it is checked here instead, every row, for every model.

The table is what the Gather that `input_ids` indexes (through Converts and Reshapes) reads:
a Constant, or a weight-compression subgraph of Constants (Convert, Subtract, Multiply,
Reshape). Each compiled model's subgraph must be the source's, op for op, with every
Constant byte for byte (kvc's passes do not touch the embedding; a model whose table is not
found on either side is reported as not compared, never as equal). A float table that differs
names the first token ids whose rows differ. A model that takes inputs_embeds has no table:
its text embeddings model holds it, copied unchanged (kvc.runtime.embeddings).
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from kvc.ir.text_embeddings import TEXT_EMBEDDINGS, takes_embeds

_THROUGH = {"Convert", "Reshape", "Unsqueeze", "Squeeze"}  # from input_ids to the Gather's indices


def embedding_tables(model: ov.Model) -> list[list] | None:
    """The upstream subgraph of each Gather whose indices are `input_ids`, as nodes in a
    fixed order (depth first, inputs in order); None when the model has no input_ids or a
    table that is not made of Constants."""
    ids = [p for p in model.get_parameters() if "input_ids" in p.get_output_tensor(0).get_names()]
    if not ids:
        return None
    gathers, front = [], [ids[0]]
    while front:
        node = front.pop()
        for target in node.output(0).get_target_inputs():
            user = target.get_node()
            if user.get_type_name() == "Gather" and target.get_index() == 1:
                gathers.append(user)
            elif user.get_type_name() in _THROUGH:
                front.append(user)
    tables = []
    for gather in sorted(gathers, key=lambda g: g.get_friendly_name()):
        nodes, stack = [], [gather.input_value(0).get_node()]
        while stack:
            node = stack.pop()
            if node.get_type_name() == "Parameter":
                return None
            nodes.append(node)
            stack += [node.input_value(i).get_node() for i in reversed(range(node.get_input_size()))]
        tables.append(nodes)
    return tables or None


def _signature(nodes) -> list[tuple]:
    return [(n.get_type_name(), str(n.get_output_element_type(0)), tuple(n.get_output_partial_shape(0).to_shape())
             if n.get_output_partial_shape(0).is_static else None) for n in nodes]


def _bytes(a: np.ndarray) -> np.ndarray:
    """`a`'s bytes, without a copy where it is contiguous (a NaN compares equal to itself)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def compare_tables(source: list, compiled: list, equal: set | None = None) -> str | None:
    """None when the two tables are the same subgraph with the same bytes, else what differs.
    `equal`: the (source, compiled) buffers already found equal, by address and size (the
    static models share their constants: compared once)."""
    if _signature(source) != _signature(compiled):
        return "its embedding is computed by other ops than the source's"
    equal = set() if equal is None else equal
    for a, b in zip(source, compiled):
        if a.get_type_name() != "Constant":
            continue
        x, y = np.asarray(a.get_data()), np.asarray(b.get_data())
        key = (x.ctypes.data, y.ctypes.data, x.nbytes, y.nbytes)
        if key in equal:
            continue
        if x.shape == y.shape and x.dtype == y.dtype and np.array_equal(_bytes(x), _bytes(y)):
            equal.add(key)
            continue
        if x.ndim == 2 and x.dtype.kind == "f" and len(source) == 1:  # a plain table: name the rows
            rows = np.flatnonzero(np.any(x != y, axis=1))
            listed = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
            return (f"its embedding rows for {len(rows)} token id(s) differ from the source's ({listed}; "
                    f"max abs {float(np.max(np.abs(x[rows].astype(np.float64) - y[rows]))):.3g})")
        return f"its embedding constant {b.get_friendly_name()} differs from the source's"
    return None


def source_table(source: ov.Model) -> list | None:
    """The source's one token embedding table (`embedding_tables`), else None: not compared."""
    tables = embedding_tables(source)
    return tables[0] if tables is not None and len(tables) == 1 else None


def model_differs(reference: list, model: ov.Model, equal: set) -> str | None:
    """What differs between `model`'s token embedding table and the source's `reference`
    (`compare_tables`, `equal` its memo), or None."""
    tables = embedding_tables(model)
    if tables is None or len(tables) != 1:
        return "it gathers its token embeddings other than the source does"
    return compare_tables(reference, tables[0], equal)


def check_embeddings(source: ov.Model, compiled: dict[str, ov.Model], equal: set | None = None) -> dict:
    """Each compiled model's tables against the source's: {"ok", "compared", "reason"}.
    `compared` is False when the source's table is not found (nothing is claimed then).
    `equal`: buffers already found equal (`compare_tables`; kvc.verify.weights fills it)."""
    if not compiled:
        raise ValueError("no compiled model to compare")
    reference = source_table(source)
    if reference is None and takes_embeds(source):
        return {"ok": True, "compared": False,
                "reason": f"the model takes inputs_embeds: its table is {TEXT_EMBEDDINGS}'s, which kvc copies "
                          f"unchanged (kvc verify compares the copy with the source's)"}
    if reference is None:
        return {"ok": True, "compared": False,
                "reason": "the source's token embedding table was not found (an input_ids Gather over constants)"}
    equal = set() if equal is None else equal
    for name, model in sorted(compiled.items()):
        why = model_differs(reference, model, equal)
        if why is not None:
            return {"ok": False, "compared": True, "model": name, "reason": f"model {name!r}: {why}"}
    return {"ok": True, "compared": True, "reason": f"every row identical to the source's in {len(compiled)} models"}
