"""kvc report / kvc compile --report: what the page holds, and its error paths."""

from __future__ import annotations

import json
import re
import shutil
from html import escape
from html.parser import HTMLParser

from kvc.report.page import SECTIONS, delta_text
from tests.cli.runner import kvc
from tests.report.conftest import HOSTILE


class Elements(HTMLParser):
    """Every start tag with its attributes, and the page's text."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag, **attrs):
        return [a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items())]

    def classed(self, tag, cls):
        return [a for t, a in self.tags if t == tag and cls in (a.get("class") or "").split()]


def test_every_section_is_there_with_its_content(compiled):
    out, page = compiled
    html = page.read_text()
    doc = Elements(html)
    for sid, _ in SECTIONS:
        assert doc.find("section", id=sid), sid
    text = " ".join(doc.text)
    manifest = json.loads((out / "manifest.json").read_text())
    lengths = manifest["plan"]["lengths"]
    # the plan: lengths, variants and every KV tensor of the layout
    assert f"{lengths['max_prompt_len']}" in text and "generate variants" in text
    for spec in manifest["plan"]["kv"]:
        assert spec["input"] in text and spec["output"] in text
    # three pictures of layer 0: source (stateful, ReadValue/Assign), final prefill and generate
    figures = re.findall(r'<figure class="subgraph"><figcaption>([^<]*)</figcaption>(.*?)</figure>', html, re.S)
    assert [f[0].split(":")[0] for f in figures] == ["before lifting", "final prefill model (layer 0)",
                                                      "final generate-256 model (layer 0)"]
    assert "ReadValue" in figures[0][1] and "Assign" in figures[0][1]
    for _, svg in figures:
        assert svg.count('<g class="node') >= 8 and '<path class="edge"' in svg
        assert "ScaledDotProductAttention" in svg or ("MatMul" in svg and "Softmax" in svg)
    assert '<g class="node past">' in figures[0][1] and "ReadValue" in figures[0][1]
    assert all('<g class="node present">' in svg for _, svg in figures)
    # verification: a table row and a per-step plot per probe
    probes = manifest["verification"]["results"]
    assert len(doc.classed("svg", "plot")) == len(probes)
    from kvc.verify.compiled import probe_label

    assert any(r.get("from_position") for r in probes)  # a far probe, named by where it starts
    for r in probes:
        assert f"{probe_label(r)}, {r['new_tokens']} new" in text
    # timings and bytes per phase, and every file with its size
    for phase in ("passes, save the IR", "compile for CPU, meanwhile verify the IR (numpy) against the source",
                  "check the CPU blobs"):
        assert phase in text
    assert all(name in text for name in manifest["files"])
    assert not doc.classed("p", "absent"), "a compile with --dumps --report leaves nothing out"


def test_the_page_fetches_nothing(compiled):
    html = compiled[1].read_text()
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:|//)""", html)
    assert "@import" not in html and "url(http" not in html


def test_op_count_deltas_and_diffs_are_the_dumps(compiled):
    out, page = compiled
    doc = Elements(page.read_text())
    shown = {(a["data-branch"], int(a["data-index"])): json.loads(a["data-op-delta"])
             for t, a in doc.tags if "data-op-delta" in a}
    expected = {}
    for index in sorted((out / "dumps").glob("*/index.json")):
        for row in json.loads(index.read_text()):
            expected[(index.parent.name, row["index"])] = row["op_delta"]
    assert shown == expected and len(expected) >= 10
    lift = next(r for r in json.loads((out / "dumps" / "common" / "index.json").read_text()) if r["pass"] == "lift-state")
    assert lift["op_delta"]["ReadValue"] < 0
    html = page.read_text()
    assert f'ops: {delta_text(lift["op_delta"])}' in html
    # each changed pass's diff, coloured line by line
    diff = (out / "dumps" / "common" / "001-lift-state.diff").read_text().splitlines()
    added = next(line for line in diff if line.startswith("+input"))
    assert f'<span class="add">{escape(added)}</span>' in html
    # a collapsible diff for every pass that changed the model, a plain line for the others
    assert len(doc.classed("details", "pass")) == len(list((out / "dumps").glob("*/[0-9][0-9][0-9]-*.diff")))


def test_the_same_directory_gives_the_same_bytes(compiled, tmp_path):
    out, page = compiled
    kvc("report", out, "-o", tmp_path / "a.html")
    kvc("report", out, "-o", tmp_path / "b.html")
    assert (tmp_path / "a.html").read_bytes() == (tmp_path / "b.html").read_bytes()
    # what compile --report wrote is what kvc report writes later from the directory (and its dumps)
    assert (tmp_path / "a.html").read_bytes() == page.read_bytes()


def test_report_says_what_a_directory_without_dumps_lacks(compiled, tmp_path):
    out = tmp_path / "plain"
    shutil.copytree(compiled[0], out, ignore=shutil.ignore_patterns("dumps"))
    result = kvc("report", out)
    assert f"report: {out / 'report.html'}" in result.output
    html = (out / "report.html").read_text()
    doc = Elements(html)
    absent = " ".join(doc.text)
    assert "recorded only when compiled with --dumps" in absent
    assert "kvc compile --dumps (written to OUT/dumps/timings.json)" in absent
    assert "per-step logit errors and margins are recorded by kvc compile --dumps" in absent
    assert len(doc.classed("p", "absent")) == 3
    assert not doc.classed("details", "pass") and not doc.classed("svg", "plot")
    # what the directory itself holds is still there: the plan, pictures, verification, files
    assert len(doc.classed("svg", "graph")) == 3 and "identical tokens" in html and "weights.bin" in html


def test_hostile_names_and_paths_are_escaped(hostile):
    out, page = hostile
    html = page.read_text()
    assert HOSTILE not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # the friendly name, in the picture's tooltip
    assert "&lt;img src=x onerror=alert(2)&gt;" in html  # the source path
    assert html.count("<script>") == 1
    doc = Elements(html)
    assert len(doc.find("script")) == 1 and not doc.find("img")


def test_a_corrupted_manifest_is_a_clean_error(compiled, tmp_path):
    out = tmp_path / "bad"
    shutil.copytree(compiled[0], out)
    manifest = out / "manifest.json"
    manifest.write_text(manifest.read_text()[:-40])
    result = kvc("report", out, code=3)
    assert "kvc: error:" in result.output and "manifest is not valid UTF-8 JSON" in result.output
    assert "Traceback" not in result.output and not (out / "report.html").exists()
    manifest.write_text(json.dumps({"format": 3, "files": {}}))
    assert "missing key" in kvc("report", out, code=3).output


def test_a_changed_file_or_malformed_dumps_are_clean_errors(compiled, tmp_path):
    out = tmp_path / "bad"
    shutil.copytree(compiled[0], out)
    index = out / "dumps" / "prefill" / "index.json"
    rows = json.loads(index.read_text())
    rows[0]["op_delta"] = {"Concat": "many"}
    index.write_text(json.dumps(rows))
    assert "[bad-dumps]" in kvc("report", out, code=3).output
    index.write_text("[{\"index\": 1, \"pass\": \"../../etc/passwd\", \"spec\": \"x\", \"changed\": true, "
                     "\"op_delta\": {}}]")
    assert "a pass entry is malformed" in kvc("report", out, code=3).output
    shutil.rmtree(out / "dumps")
    with open(out / "weights.bin", "ab") as f:
        f.write(b"\0")
    assert "[file-changed]" in kvc("report", out, code=3).output


def test_usage_and_output_errors(compiled, tmp_path):
    out = compiled[0]
    assert "--layer 7: the plan's KV cache has layers 0 to 1" in kvc("report", out, "--layer", "7", code=2).output
    (tmp_path / "file").write_text("")
    result = kvc("report", out, "-o", tmp_path / "file" / "report.html", code=7)
    assert "cannot write the report" in result.output
    assert "not a kvc compiled directory" in kvc("report", tmp_path, code=3).output


def test_the_escaping_check_catches_unescaped_names(hostile, monkeypatch):
    """The check above fails on a page that does not escape: with the picture's escaping
    switched off, the friendly name is markup again."""
    from kvc.report import page, svg
    from kvc.report.collect import collect

    monkeypatch.setattr(svg, "_t", str)
    assert HOSTILE in page.render(collect(hostile[0]))


def test_an_unchunked_prefill_and_another_layer_are_drawn(tmp_path):
    """A prefill without a chunk has no past inputs: its picture starts where this step's keys
    and values branch off to attention and present; --layer picks the layer."""
    out = tmp_path / "out"
    kvc("compile", "-o", out, "--max-prompt-len", "64", "--min-response-len", "64", "--prefill-chunk-size", "0",
        "--no-verify")
    kvc("report", out, "--layer", "1")
    html = (out / "report.html").read_text()
    figures = dict(re.findall(r'<figure class="subgraph"><figcaption>([^:<]*)[^<]*</figcaption>(.*?)</figure>', html,
                              re.S))
    assert list(figures) == ["before lifting", "final prefill model (layer 1)", "final generate-128 model (layer 1)"]
    prefill = figures["final prefill model (layer 1)"]
    assert '<g class="node past">' not in prefill and prefill.count('<g class="node present">') == 2
    attention = re.findall(r'<g class="node attention">.*?class="op">(\w+)<', prefill)
    assert sorted(attention) == ["MatMul", "MatMul", "Softmax"]  # Q·Kᵀ, Softmax, P·V
    assert "past_key_values.1.key" in figures["final generate-128 model (layer 1)"]
    assert "past_key_values.0.key" not in figures["final generate-128 model (layer 1)"]


def test_per_step_numbers_and_their_plot():
    """Per step: the largest logit error, the reference's top-two margin, the tokens; the plot
    marks the first differing token and shades the steps after it."""
    import numpy as np

    from kvc.report.collect import per_step
    from kvc.report.svg import steps_svg
    from kvc.runtime.generate import Generation

    ref = Generation([7], tokens=[2, 1, 0], logits=[np.array([0, 1, 3.0]), np.array([0, 2, 1.5]), np.array([4, 0, 0.0])])
    got = Generation([7], tokens=[2, 2, 0], logits=[np.array([0, 1.25, 3.0]), np.array([0, 1.5, 2]), np.array([4, 0, 0.0])])
    steps = per_step(ref, got)
    assert steps == {"error": [0.25, 0.5, 0.0], "margin": [2.0, 0.5, 4.0], "same_token": [True, False, True],
                     "compared": 2}
    svg = steps_svg({"prompt_tokens": 3, "new_tokens": 3, **steps}, "t")
    assert svg.count('<path class="flip"') == 1 and "step 1: the token differs" in svg
    assert '<rect class="after"' in svg
    assert '<rect class="after"' not in steps_svg({**steps, "same_token": [True] * 3, "compared": 3}, "t")


def test_one_branch_of_dumps_can_be_given(compiled, tmp_path):
    """--dumps DIR: any dump directory, here a single pipeline's (its timings.json lists passes,
    not the compile's phases)."""
    out = compiled[0]
    kvc("report", out, "--dumps", out / "dumps" / "prefill", "-o", tmp_path / "r.html")
    doc = Elements((tmp_path / "r.html").read_text())
    assert {a["data-branch"] for t, a in doc.tags if "data-branch" in a} == {"prefill"}
    assert "the time and bytes of each compile phase are recorded" in " ".join(doc.text)


def test_every_models_dumps_are_read_in_model_order(tmp_path):
    """Bulk and first-chunk models' dumps are branches of the report too, in model order."""
    from kvc.report.collect import read_dumps

    out = tmp_path / "out"
    kvc("compile", "-o", out, "--max-prompt-len", "64", "--min-response-len", "64", "--prefill-chunk-size", "16,32",
        "--prefill-first", "32", "--no-verify", "--dumps")
    assert [b.name for b in read_dumps(out / "dumps")] == ["common", "prefill", "prefill-32", "first-32",
                                                           "generate-128"]


def test_the_checks_of_what_no_probe_reads_and_the_forced_experts_are_shown(tmp_path):
    """The embedding and weights checks, and for a mixture of experts the probes run again with
    every router forced: their lines, and a table row per forced probe."""
    from kvc import fixtures

    out = tmp_path / "out"
    kvc("compile", fixtures.path("qwen3_moe"), "-o", out, "--max-prompt-len", "64", "--min-response-len", "64")
    kvc("report", out)
    html = (out / "report.html").read_text()
    v = json.loads((out / "manifest.json").read_text())["verification"]
    for key, label in (("embedding", "embedding table"), ("weights", "weights"), ("experts", "experts")):
        assert f"<li>{escape(label)}: {escape(v[key]['reason'])}</li>" in html
    section = html.split("Every expert: the probes again, each router forced, against the source forced alike")[1]
    table = section.split("</table>")[0]
    assert table.count("<tr>") == len(v["experts"]["results"]) + 1  # and the header
