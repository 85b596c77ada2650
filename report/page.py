"""The report as one HTML page (see `kvc.report` for the rules it keeps).

Sections, each with a stable id a reader (or a test) can find: ``plan``, ``models``,
``passes``, ``graphs``, ``verification``, ``timings``. Every value taken from the manifest,
a dump or a model goes through `_t` (html.escape) or a number formatter; the manifest's
verification rows are not checked by `read_manifest`, so their cells accept any JSON value
and print it escaped.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from kvc import __version__
from kvc.errors import InvalidModelError
from kvc.export.manifest import model_order, shared_with, token_input
from kvc.plan import chunk_label
from kvc.report.collect import Branch, ReportData, collect
from kvc.report.svg import bars_svg, steps_svg, subgraph_svg
from kvc.verify.compiled import UNREAD_CHECKS

CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
SECTIONS = (("plan", "Plan"), ("models", "Models and blobs"), ("passes", "Passes"),
            ("graphs", "KV subgraph"), ("verification", "Verification"), ("timings", "Timings and bytes"))

STYLE = """
:root { --fg:#1d1f21; --muted:#666; --line:#d8dbe0; --bg2:#f5f6f8; --add:#e6ffec; --del:#ffebe9; }
body { font: 14px/1.45 system-ui, sans-serif; color: var(--fg); margin: 0 auto; max-width: 1200px; padding: 0 20px 60px; }
header { border-bottom: 1px solid var(--line); margin-bottom: 8px; }
h1 { font-size: 22px; margin: 18px 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 18px 0 6px; }
nav a { margin-right: 14px; } .meta { color: var(--muted); margin: 2px 0; }
table { border-collapse: collapse; margin: 6px 0 12px; } th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: var(--bg2); font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font: 12px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; }
.absent { background: #fff8e1; border-left: 4px solid #f0b400; padding: 6px 10px; }
.ok { color: #1a7f37; font-weight: 600; } .bad { color: #cf222e; font-weight: 600; }
details.pass { border: 1px solid var(--line); border-radius: 4px; margin: 4px 0; }
details.pass > summary, div.pass { padding: 4px 8px; cursor: pointer; }
div.pass { border: 1px dashed var(--line); border-radius: 4px; margin: 4px 0; color: var(--muted); cursor: default; }
details.pass[open] > summary { background: var(--bg2); }
.delta { color: var(--muted); margin-left: 8px; } .secs { float: right; color: var(--muted); }
pre.diff { margin: 0; padding: 6px 8px; overflow-x: auto; max-height: 520px; }
pre.diff span { display: block; white-space: pre; }
.diff .add { background: var(--add); } .diff .del { background: var(--del); }
.diff .hunk { color: #0550ae; background: #ddf4ff; } .diff .file { font-weight: 700; }
.cut { color: var(--muted); font-style: italic; padding: 4px 8px; }
figure { margin: 10px 0 22px; overflow-x: auto; } figcaption { color: var(--muted); margin-bottom: 4px; }
svg text { font: 11px system-ui, sans-serif; }
svg.graph .node rect { stroke: #555; stroke-width: 1; fill: #fff; }
svg.graph .node text { text-anchor: middle; } svg.graph .node text.op { font-weight: 700; }
svg.graph .node text.name { fill: #555; font-size: 10px; }
svg.graph .past rect { fill: #ffe3c2; stroke: #c46a00; } svg.graph .present rect { fill: #ffd7d7; stroke: #b42318; }
svg.graph .kv rect { fill: #dbeafe; stroke: #1d4ed8; } svg.graph .attention rect { fill: #dcfce7; stroke: #15803d; }
svg.graph .context rect { fill: #f8f8f8; stroke: #aaa; stroke-dasharray: 4 3; } svg.graph .context text { fill: #888; }
svg.graph .edge { fill: none; stroke: #888; stroke-width: 1.2; }
.legend-row span { display: inline-block; padding: 1px 8px; margin-right: 6px; border: 1px solid #999; border-radius: 3px; font-size: 12px; }
.legend-row .past { background: #ffe3c2; } .legend-row .present { background: #ffd7d7; } .legend-row .kv { background: #dbeafe; }
.legend-row .attention { background: #dcfce7; } .legend-row .context { background: #f8f8f8; border-style: dashed; }
svg.plot .frame { fill: #fff; stroke: #999; } svg.plot .grid { stroke: #eee; } svg.plot .after { fill: #f3f3f3; }
svg.plot polyline { fill: none; stroke-width: 1.6; } svg.plot polyline.error, svg.plot line.error { stroke: #cf222e; }
svg.plot polyline.margin, svg.plot line.margin { stroke: #0969da; stroke-width: 1.6; }
svg.plot circle.error { fill: #cf222e; } svg.plot circle.margin { fill: #0969da; }
svg.plot .flip { stroke: #000; stroke-width: 2; } svg.plot .tick { fill: #555; }
svg.bars .bar { fill: #6e9bd1; } svg.bars .note, svg.bars .label { fill: #333; }
button { font: inherit; margin: 0 6px 6px 0; }
"""

SCRIPT = """
(function () {
  var all = function (sel) { return Array.prototype.slice.call(document.querySelectorAll(sel)); };
  all("button[data-toggle]").forEach(function (b) {
    b.addEventListener("click", function () {
      var open = b.getAttribute("data-toggle") === "open";
      all("#passes details.pass").forEach(function (d) { d.open = open; });
    });
  });
  document.documentElement.setAttribute("data-ready", "1");
})();
"""


def _t(value) -> str:
    return escape(str(value), quote=True)


def _cell(value) -> str:
    """A table cell from any JSON value: numbers formatted, the rest escaped."""
    if value is None:
        return "<td>–</td>"
    if isinstance(value, bool):
        return f'<td class="{"ok" if value else "bad"}">{"yes" if value else "no"}</td>'
    if isinstance(value, int):
        return f'<td class="num">{value}</td>'
    if isinstance(value, float):
        return f'<td class="num">{value:.4g}</td>' if math.isfinite(value) else f'<td class="num bad">{value}</td>'
    if isinstance(value, (list, dict)):
        return f"<td><code>{_t(json.dumps(value, sort_keys=True))}</code></td>"
    return f"<td>{_t(value)}</td>"


def _table(headers, rows) -> str:
    head = "".join(f"<th>{_t(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(c if isinstance(c, _Raw) else _cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class _Raw(str):
    """A cell already rendered as HTML (`<td>…</td>`)."""


def _absent(text: str) -> str:
    return f'<p class="absent">{_t(text)}</p>'


def _bytes(n: int) -> str:
    from kvc.cli.render import human_bytes

    return human_bytes(n)


def delta_text(delta: dict) -> str:
    """Op-count delta as `+2 Concat, -4 ReadValue` (sorted by op type)."""
    return ", ".join(f"{n:+d} {op}" for op, n in sorted(delta.items()))


def _checked(manifest: dict, directory: Path):
    """The manifest's verification and blob_check, which `read_manifest` does not check:
    their shape here (any value in a cell is printed escaped)."""
    v, rows = manifest.get("verification"), manifest.get("blob_check", [])
    ok = (v is None or (isinstance(v, dict) and isinstance(v.get("results"), list)
                        and all(isinstance(r, dict) for r in v["results"])))
    if not ok or not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise InvalidModelError("bad-manifest", str(directory / "manifest.json"),
                                "its verification or blob_check section is malformed",
                                expected='{"results": [{...}]} or null, and [{...}]')
    return v, rows


# --- sections ------------------------------------------------------------------------------------

def _header(d: ReportData) -> str:
    m = d.manifest
    source = m["source"] if isinstance(m["source"], dict) else {}
    hashes = source.get("sha256") if isinstance(source.get("sha256"), dict) else {}
    devices = ", ".join(map(str, m["devices"])) if isinstance(m["devices"], list) else str(m["devices"])
    nav = "".join(f'<a href="#{sid}">{_t(title)}</a>' for sid, title in SECTIONS)
    hash_rows = "".join(f"<li><code>{_t(name)}</code> sha256 <code>{_t(h)}</code></li>"
                        for name, h in sorted(hashes.items(), key=lambda kv: str(kv[0])))
    return (f"<header><h1>kvc report</h1>"
            f'<p class="meta">source <code id="source">{_t(source.get("path", "?"))}</code></p>'
            f'<ul class="meta">{hash_rows}</ul>'
            f'<p class="meta">compiled by kvc {_t(m.get("kvc_version", "?"))} with OpenVINO '
            f'{_t(m["openvino_version"])}, for {_t(devices)}; this page by kvc {_t(__version__)}</p>'
            f"<nav>{nav}</nav></header>")


def _plan(d: ReportData) -> str:
    plan = d.manifest["plan"]
    L = plan["lengths"]
    lengths = _table(["prompt P", "response R", "prefill chunk", "capacity", "tokens per step", "generate variants"],
                     [[L.get("max_prompt_len"), L.get("min_response_len"), chunk_label(L),
                       L.get("capacity"), L.get("tokens_per_step"), ", ".join(map(str, L.get("generate_sizes", [])))]])
    notes = "".join(f"<li>{_t(n)}</li>" for n in L.get("adjustments", []))
    options = _table(["option", "value"], sorted(plan.get("options", {}).items()))
    kv = _table(["layer", "kind", "input", "output", "element type", "shape (largest variant)", "sequence axis"],
                [[s.get("layer"), s.get("kind"), s.get("input"), s.get("output"), s.get("element_type"),
                  "×".join(map(str, s.get("shape", []))), s.get("seq_axis")] for s in plan.get("kv", [])])
    return (f'<section id="plan"><h2>Plan</h2><h3>Lengths</h3>{lengths}'
            + (f"<p>Adjustments (each also printed by the compile):</p><ul>{notes}</ul>" if notes else "")
            + f"<h3>KV layout</h3>{kv}<details><summary>Options</summary>{options}</details></section>")


def _models(d: ReportData) -> str:
    m = d.manifest
    rows = []
    ports, token = [], token_input(m)
    for name in model_order(m["models"]):
        entry = m["models"][name]
        shapes = {p["name"]: "×".join(map(str, p["shape"])) for p in entry["inputs"]}
        past = next((v for k, v in shapes.items() if k.startswith("past_key_values")), None)
        blobs = "; ".join(f"{dev} {_bytes(b['bytes']) if isinstance(b.get('bytes'), int) else '?'} "
                          f"{b['import_config'].get('INFERENCE_PRECISION_HINT', '')}".rstrip() + shared_with(name, b)
                          for dev, b in sorted(entry["blobs"].items()))
        rows.append([name, entry["xml"], shapes.get(token), shapes.get("attention_mask"), past, blobs or None])
        port_rows = [[side, p["name"], p["element_type"], "×".join(map(str, p["shape"]))]
                     for side in ("inputs", "outputs") for p in entry[side]]
        ports.append(f"<details><summary>{_t(name)}: {len(entry['inputs'])} inputs, {len(entry['outputs'])} "
                     f"outputs</summary>{_table(['', 'name', 'element type', 'shape'], port_rows)}</details>")
    weights = m["files"].get(m["weights"], {}).get("bytes")
    return ('<section id="models"><h2>Models and blobs</h2>'
            + _table(["model", "IR", token, "attention_mask", "past KV", "blobs"], rows)
            + f"<p>All models read one <code>{_t(m['weights'])}</code>"
            + (f" ({_t(_bytes(weights))})" if isinstance(weights, int) else "") + ".</p>"
            + "".join(ports) + "</section>")


def _diff_html(text: str) -> str:
    out = []
    for line in text.splitlines():
        cls = ("file" if line.startswith(("+++", "---")) else "hunk" if line.startswith("@@") else
               "add" if line.startswith("+") else "del" if line.startswith("-") else "ctx")
        out.append(f'<span class="{cls}">{_t(line) or " "}</span>')
    return '<pre class="diff">' + "".join(out) + "</pre>"


def _branch(b: Branch, where: str) -> str:
    items = []
    total = sum(r.seconds or 0.0 for r in b.passes)
    for r in b.passes:
        delta = delta_text(r.op_delta)
        secs = f"{r.seconds * 1000:.1f} ms" if r.seconds is not None else ""
        data = (f'data-branch="{_t(b.name)}" data-index="{r.index}" data-pass="{_t(r.name)}" '
                f'data-op-delta="{_t(json.dumps(r.op_delta, sort_keys=True))}"')
        head = (f'<code>{r.index:03d}</code> <b>{_t(r.spec)}</b> — {"changed" if r.changed else "unchanged"}'
                f'<span class="delta">{_t("ops: " + delta) if delta else "no op-count change"}</span>'
                f'<span class="secs">{_t(secs)}</span>')
        rules = ("<p>rules matched: " + _t(", ".join(f"{k} ×{v}" for k, v in r.rules.items())) + "</p>"
                 if r.rules else "")
        if r.diff is not None:
            cut = (f'<p class="cut">{r.diff_cut} more lines in {_t(where)}/{_t(b.name)}/{_t(r.diff_file)}</p>'
                   if r.diff_cut else "")
            items.append(f'<details class="pass" {data}><summary>{head}</summary>{rules}{_diff_html(r.diff)}{cut}'
                         f"</details>")
        else:
            items.append(f'<div class="pass" {data}>{head}{rules}</div>')
    return (f'<h3 id="branch-{_t(b.name)}">{_t(b.name)}: {len(b.passes)} passes, '
            f'{sum(r.changed for r in b.passes)} changed, {total * 1000:.1f} ms</h3>' + "".join(items))


def _passes(d: ReportData) -> str:
    body = []
    if d.branches:
        where = d.dumps_label or ("OUT/dumps" if d.dumps is not None
                                  and d.dumps.resolve() == (d.directory / "dumps").resolve() else str(d.dumps))
        body.append('<p><button type="button" data-toggle="open">expand all</button>'
                    '<button type="button" data-toggle="close">collapse all</button> '
                    f"Each pass with its op-count delta (from the dumps' index.json) and its IR diff; "
                    f"the common branch runs once, then one branch per static model. Dumps: "
                    f"<code>{_t(where)}</code>.</p>")
        body += [_branch(b, where) for b in d.branches]
    if "passes" in d.absent:
        body.append(_absent(d.absent["passes"]))
    return '<section id="passes"><h2>Passes</h2>' + "".join(body) + "</section>"


def _graphs(d: ReportData) -> str:
    legend = ('<p class="legend-row"><span class="past">cache in (past)</span><span class="kv">cache movement</span>'
              '<span class="attention">attention</span><span class="present">cache out (present)</span>'
              '<span class="context">input from elsewhere</span> Hover a box for its full name and types.</p>')
    figures = []
    for i, pic in enumerate(d.pictures):
        if pic.subgraph is None:
            figures.append(f"<figure><figcaption>{_t(pic.title)}</figcaption>{_absent(pic.absent or '')}</figure>")
            continue
        sub = pic.subgraph
        note = f"; {sub.omitted} more ops on these paths not drawn" if sub.omitted else ""
        figures.append(f'<figure class="subgraph"><figcaption>{_t(pic.title)}: {len(sub.nodes)} ops{_t(note)}'
                       f"</figcaption>{subgraph_svg(sub, f'g{i}')}</figure>")
    if not d.pictures:
        figures.append(_absent("pictures were not asked for"))
    return (f'<section id="graphs"><h2>KV subgraph of layer {d.layer}</h2>'
            "<p>The ops between the layer's cache and its attention, before the state is lifted and in the final "
            "models (constants and shape arithmetic left out).</p>" + legend + "".join(figures) + "</section>")


VERIFY_COLUMNS = ("prompt_tokens", "new_tokens", "ok", "max_abs", "nrmse", "top1", "first_divergent_token",
                  "margin_at_divergence", "noise", "reason")
VERIFY_HEADERS = ("prompt tokens", "new tokens", "ok", "max abs", "NRMSE", "top-1", "first divergent token",
                  "margin there", "noise before", "verdict")


def _probe_table(rows: list[dict]) -> str:
    """The IR's probe rows against the source, a row each."""
    return _table(["backend", *VERIFY_HEADERS], [[r.get("backend"), *(r.get(c) for c in VERIFY_COLUMNS)] for r in rows])


def _verification(d: ReportData) -> str:
    from kvc.verify.compiled import probe_label

    v, blob_rows = _checked(d.manifest, d.directory)
    parts = []
    if v is None:
        parts.append(_absent("the static IR was not verified against the source (compiled with --no-verify)"))
    else:
        parts.append(f"<h3>The static IR against the source</h3><p>{_t(v.get('against', ''))}; "
                     f"overall: {'<span class=ok>ok</span>' if v.get('ok') is True else '<span class=bad>FAILED</span>'}"
                     f"</p>")
        parts.append(_probe_table(v["results"]))
        checks = [(label, v[key]) for key, label in UNREAD_CHECKS if isinstance(v.get(key), dict)]
        if checks:
            parts.append("<ul>" + "".join(f"<li>{_t(label)}: {_t(c.get('reason', ''))}</li>" for label, c in checks)
                         + "</ul>")
        forced = v.get("experts")
        if isinstance(forced, dict) and isinstance(forced.get("results"), list):
            parts.append("<h3>Every expert: the probes again, each router forced, against the source forced alike</h3>")
            parts.append(_probe_table([r for r in forced["results"] if isinstance(r, dict)]))
    if blob_rows:
        parts.append("<h3>Every blob, imported as kvc run imports it, against the IR</h3>")
        parts.append(_table(["device", "variants", *VERIFY_HEADERS],
                            [[r.get("device"), r.get("variants"), *(r.get(c) for c in VERIFY_COLUMNS)]
                             for r in blob_rows]))
    parts.append("<h3>Per step</h3>")
    if d.probes:
        parts.append(f"<p>{_t(d.probes_against)}. Per generated token: the largest absolute logit error (red) and "
                     "the reference's margin, its top logit minus the runner-up (blue), on a log scale. A token may "
                     "differ only where the margin falls to the error's scale.</p>")
        for i, probe in enumerate(d.probes):
            errs = [(e, s) for s, e in enumerate(probe["error"]) if e is not None]
            margins = [(m, s) for s, m in enumerate(probe["margin"]) if m is not None]
            worst = max(errs) if errs else None
            closest = min(margins) if margins else None
            caption = (f"{probe_label(probe)}, {probe['new_tokens']} new: "
                       + (f"largest error {worst[0]:.3g} (step {worst[1]})" if worst else "no error measured")
                       + (f", smallest margin {closest[0]:.3g} (step {closest[1]})" if closest else "")
                       + ("" if probe["compared"] >= len(probe["error"]) else
                          f", tokens differ from step {probe['compared'] - 1}"))
            parts.append(f'<figure class="steps"><figcaption>{_t(caption)}</figcaption>{steps_svg(probe, f"p{i}")}'
                         "</figure>")
    if "steps" in d.absent:
        parts.append(_absent(d.absent["steps"]))
    return '<section id="verification"><h2>Verification</h2>' + "".join(parts) + "</section>"


def _timings(d: ReportData) -> str:
    parts = ["<h3>Compile phases</h3>"]
    if d.phases:
        total = sum(p["seconds"] or 0.0 for p in d.phases)
        parts.append(_table(["phase", "seconds", "share", "bytes written"],
                            [[p["phase"], _Raw(f'<td class="num">{(p["seconds"] or 0):.3f}</td>'),
                              _Raw(f'<td class="num">{100 * (p["seconds"] or 0) / (total or 1):.0f}%</td>'),
                              _Raw(f'<td class="num">{_t(_bytes(p["bytes"]))}</td>')] for p in d.phases]
                            + [[_Raw("<th>total</th>"), _Raw(f'<td class="num">{total:.3f}</td>'), None,
                                _Raw(f'<td class="num">{_t(_bytes(sum(p["bytes"] for p in d.phases)))}</td>')]]))
        parts.append(bars_svg([(p["phase"], p["seconds"] or 0.0, f"{(p['seconds'] or 0):.3f} s, "
                                f"{_bytes(p['bytes'])}") for p in d.phases], "s"))
    if "timings" in d.absent:
        parts.append(_absent(d.absent["timings"]))
    if d.branches:
        parts.append("<h3>Passes per branch</h3>")
        parts.append(bars_svg([(b.name, sum(r.seconds or 0.0 for r in b.passes) * 1000,
                                f"{sum(r.seconds or 0.0 for r in b.passes) * 1000:.1f} ms, {len(b.passes)} passes")
                               for b in d.branches], "ms"))
    files = d.manifest["files"]
    parts.append("<h3>Files</h3>")
    parts.append(_table(["file", "bytes", "sha256"],
                        [[name, _Raw(f'<td class="num">{_t(_bytes(e["bytes"]))}</td>'), e["sha256"][:16] + "…"]
                         for name, e in sorted(files.items())]
                        + [[_Raw("<th>total</th>"),
                            _Raw(f'<td class="num">{_t(_bytes(sum(e["bytes"] for e in files.values())))}</td>'),
                            None]]))
    return '<section id="timings"><h2>Timings and bytes</h2>' + "".join(parts) + "</section>"


def render(d: ReportData) -> str:
    """The page for `d`, as text."""
    source = d.manifest["source"].get("path", "") if isinstance(d.manifest["source"], dict) else ""
    title = f"kvc report: {Path(str(source)).name or 'model'}"
    body = "".join(section(d) for section in (_header, _plan, _models, _passes, _graphs, _verification, _timings))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_t(title)}</title><style>{STYLE}</style></head>\n<body>{body}\n"
            f"<script>{SCRIPT}</script></body></html>\n")


def write_report(directory, path, **kwargs) -> Path:
    """Collect (`kvc.report.collect.collect`'s keyword arguments), render and write the page
    atomically to `path`; an unwritable path is an OutputError (exit 7)."""
    from kvc.ir.writer import write_output

    path = Path(path)
    write_output(path, render(collect(directory, **kwargs)).encode("utf-8"), "report")
    return path
