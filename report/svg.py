"""Inline SVG drawn in Python: a layered picture of a subgraph, a per-step plot, bars.

Every text is escaped here (`_t`); ids are made from a caller's prefix so that several
pictures live in one page. Coordinates are rounded to 0.1 so the same data gives the same
bytes.
"""

from __future__ import annotations

import math
from html import escape

from kvc.report.graph import Subgraph

NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 176, 38, 22, 34, 16
ROLE_ORDER = {"past": 0, "context": 1, "kv": 2, "op": 3, "attention": 4, "present": 5}


def _t(text) -> str:
    return escape(str(text), quote=True)


def _n(x: float) -> str:
    x = round(x, 1)
    return str(int(x)) if x == int(x) else f"{x:.1f}"


def _short(text: str, limit: int) -> str:
    """The tail of a long name (what differs between ops is usually at its end)."""
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def layers(sub: Subgraph) -> list[list[str]]:
    """Nodes in rows: a node one row below its lowest drawn input (longest path), an input from
    elsewhere just above its first consumer; within a row ordered by the mean position of their
    inputs (two sweeps), ties by role and name."""
    preds: dict[str, list[str]] = {n.key: [] for n in sub.nodes}
    for a, b in sub.edges:
        preds[b].append(a)
    depth: dict[str, int] = {}

    def level(key: str, seen=()) -> int:
        if key not in depth:
            depth[key] = 1 + max((level(p, seen + (key,)) for p in preds[key] if p not in seen), default=-1)
        return depth[key]

    for n in sub.nodes:
        level(n.key)
    role = {n.key: n.role for n in sub.nodes}
    consumers: dict[str, list[str]] = {n.key: [] for n in sub.nodes}
    for a, b in sub.edges:
        consumers[a].append(b)
    for key in sorted(depth):  # an input from elsewhere sits just above its first consumer
        if role[key] == "context" and not preds[key] and consumers[key]:
            depth[key] = max(0, min(depth[c] for c in consumers[key]) - 1)
    rows: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for key in sorted(depth, key=lambda k: (ROLE_ORDER.get(role[k], 9), k)):
        rows[depth[key]].append(key)
    for _ in range(2):
        pos = {k: i for row in rows for i, k in enumerate(row)}
        for r in range(1, len(rows)):
            def bary(k: str, r=r) -> float:
                ps = [pos[p] for p in preds[k] if depth[p] < r]
                return sum(ps) / len(ps) if ps else pos[k]
            rows[r].sort(key=lambda k: (bary(k), ROLE_ORDER.get(role[k], 9), k))
            pos.update({k: i for i, k in enumerate(rows[r])})
    return rows


def subgraph_svg(sub: Subgraph, prefix: str) -> str:
    """The subgraph top to bottom: a box per op (type; the tail of its name; the full name
    and output types as a tooltip), arrows along the data flow."""
    rows = layers(sub)
    widest = max((len(r) for r in rows), default=1)
    width = PAD * 2 + widest * NODE_W + (widest - 1) * GAP_X
    height = PAD * 2 + len(rows) * NODE_H + max(len(rows) - 1, 0) * GAP_Y
    at = {}
    for r, row in enumerate(rows):
        span = len(row) * NODE_W + (len(row) - 1) * GAP_X
        x0 = (width - span) / 2
        for i, key in enumerate(row):
            at[key] = (x0 + i * (NODE_W + GAP_X), PAD + r * (NODE_H + GAP_Y))
    by_key = {n.key: n for n in sub.nodes}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" width="{_n(width)}" height="{_n(height)}" '
           f'viewBox="0 0 {_n(width)} {_n(height)}" role="img" aria-label="KV subgraph">',
           f'<defs><marker id="{prefix}-arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#666"/></marker></defs>']
    for a, b in sub.edges:
        (xa, ya), (xb, yb) = at[a], at[b]
        x1, y1, x2, y2 = xa + NODE_W / 2, ya + NODE_H, xb + NODE_W / 2, yb
        dy = max((y2 - y1) / 2, 12)
        out.append(f'<path class="edge" d="M{_n(x1)},{_n(y1)} C{_n(x1)},{_n(y1 + dy)} {_n(x2)},{_n(y2 - dy)} '
                   f'{_n(x2)},{_n(y2)}" marker-end="url(#{prefix}-arrow)"/>')
    for key in sorted(at):
        n, (x, y) = by_key[key], at[key]
        tip = f"{n.type} {n.key}" + (f" (friendly name {n.friendly_name})" if n.friendly_name != n.key else "") + \
              (f" : {n.out_type}" if n.out_type else "")
        out.append(f'<g class="node {n.role}"><title>{_t(tip)}</title>'
                   f'<rect x="{_n(x)}" y="{_n(y)}" width="{NODE_W}" height="{NODE_H}" rx="5"/>'
                   f'<text x="{_n(x + NODE_W / 2)}" y="{_n(y + 15)}" class="op">{_t(_short(n.type, 26))}</text>'
                   f'<text x="{_n(x + NODE_W / 2)}" y="{_n(y + 30)}" class="name">{_t(_short(n.key, 30))}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def _log_ticks(lo: float, hi: float) -> list[float]:
    return [10.0 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]


def steps_svg(probe: dict, prefix: str) -> str:
    """Per step, on a log scale: the largest logit error and the reference's margin (its top
    logit minus the runner-up). A token may flip only where the margin falls below the
    error's scale; a differing token is marked, and the steps after it (not comparable) shaded."""
    error, margin = probe["error"], probe["margin"]
    n = len(error)
    w, h, left, right, top, bottom = 600, 230, 58, 130, 14, 34
    values = [v for v in error + margin if v is not None and v > 0]
    lo = min(values, default=1e-6)
    hi = max(values, default=1.0)
    lo, hi = 10.0 ** math.floor(math.log10(lo)), 10.0 ** math.ceil(math.log10(hi))
    if hi <= lo:
        hi = lo * 10
    span_x = max(n - 1, 1)

    def X(i: float) -> float:
        return left + (w - left - right) * (i / span_x if n > 1 else 0.5)

    def Y(v: float) -> float:
        v = min(max(v, lo), hi)
        return top + (h - top - bottom) * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           f'role="img" aria-label="per-step logit error and margin">',
           f'<rect class="frame" x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}"/>']
    compared = probe["compared"]
    if compared < n:
        x = X(compared - 1)
        out.append(f'<rect class="after" x="{_n(x)}" y="{top}" width="{_n(w - right - x)}" '
                   f'height="{h - top - bottom}"><title>after the first differing token: not comparable</title></rect>')
    for tick in _log_ticks(lo, hi):
        y = Y(tick)
        out.append(f'<line class="grid" x1="{left}" y1="{_n(y)}" x2="{w - right}" y2="{_n(y)}"/>'
                   f'<text class="tick" x="{left - 4}" y="{_n(y + 3)}" text-anchor="end">1e{round(math.log10(tick))}</text>')
    step = max(1, math.ceil(n / 12))
    for i in range(0, n, step):
        out.append(f'<text class="tick" x="{_n(X(i))}" y="{h - bottom + 14}" text-anchor="middle">{i}</text>')
    out.append(f'<text class="tick" x="{_n((left + w - right) / 2)}" y="{h - 4}" text-anchor="middle">'
               f'generated token (step)</text>')
    for cls, series, label in (("error", error, "max |logit error|"), ("margin", margin, "reference margin")):
        points = [(X(i), Y(v)) for i, v in enumerate(series) if v is not None and v > 0]
        if points:
            out.append(f'<polyline class="{cls}" points="{" ".join(f"{_n(x)},{_n(y)}" for x, y in points)}"/>')
        for i, v in enumerate(series):
            if v is not None and v > 0:
                out.append(f'<circle class="{cls}" cx="{_n(X(i))}" cy="{_n(Y(v))}" r="2.5">'
                           f'<title>step {i}: {label} {v:.4g}</title></circle>')
    for i, same in enumerate(probe["same_token"]):
        if not same:
            x = X(i)
            out.append(f'<path class="flip" d="M{_n(x - 5)},{top + 4} l10,10 m0,-10 l-10,10">'
                       f'<title>step {i}: the token differs</title></path>')
            break
    lx = w - right + 10
    out.append(f'<line class="error" x1="{lx}" y1="30" x2="{lx + 18}" y2="30"/>'
               f'<text class="legend" x="{lx + 22}" y="34">max |error|</text>'
               f'<line class="margin" x1="{lx}" y1="50" x2="{lx + 18}" y2="50"/>'
               f'<text class="legend" x="{lx + 22}" y="54">margin</text>')
    out.append("</svg>")
    return "\n".join(out)


def bars_svg(rows: list[tuple[str, float, str]], unit: str) -> str:
    """Horizontal bars: (label, value, annotation) per row, scaled to the largest value."""
    w, bar_h, gap, label_w, note_w = 760, 16, 6, 230, 190
    h = len(rows) * (bar_h + gap) + gap
    top = max((v for _, v, _ in rows), default=0.0) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="bars" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           f'role="img" aria-label="bars">']
    for i, (label, value, note) in enumerate(rows):
        y = gap + i * (bar_h + gap)
        length = (w - label_w - note_w) * max(value, 0.0) / top
        out.append(f'<text class="label" x="{label_w - 6}" y="{y + 12}" text-anchor="end">{_t(_short(label, 34))}</text>'
                   f'<rect class="bar" x="{label_w}" y="{y}" width="{_n(max(length, 1))}" height="{bar_h}">'
                   f'<title>{_t(label)}: {value:.3f} {_t(unit)}</title></rect>'
                   f'<text class="note" x="{_n(label_w + length + 6)}" y="{y + 12}">{_t(note)}</text>')
    out.append("</svg>")
    return "\n".join(out)
