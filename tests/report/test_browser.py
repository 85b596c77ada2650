"""The report in a real headless Chromium (Debian's chromium package): it loads with no
console errors, its sections render, and a screenshot is saved and named in the output.

Without a Chromium the test is skipped, saying why, unless KVC_REQUIRE_BROWSER=1 (set by
.ci/run, which installs one), when it fails instead: CI cannot skip it silently.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.report import browser

# Run in the page after load: what rendered, measured by the browser's own layout.
PROBE = """(function () {
  var box = function (el) { var r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
  // a line over steps: a flat one (two steps of the same error) has no height
  var line = function (el) { var r = el.getBoundingClientRect(); return r.width > 0; };
  var q = function (sel) { return Array.prototype.slice.call(document.querySelectorAll(sel)); };
  var sections = {};
  q("section[id]").forEach(function (s) { sections[s.id] = Math.round(s.getBoundingClientRect().height); });
  var before = q("#passes details.pass[open]").length;
  var expand = document.querySelector('button[data-toggle="open"]');
  if (expand) expand.click();
  return JSON.stringify({
    ready: document.documentElement.getAttribute("data-ready"),
    sections: sections,
    graphs: q("svg.graph").filter(box).length,
    nodes: q("svg.graph g.node rect").filter(box).length,
    edges: q("svg.graph path.edge").filter(box).length,
    plots: q("svg.plot polyline").filter(line).length,
    bars: q("svg.bars rect.bar").filter(box).length,
    passes: q("#passes details.pass").length,
    opened: q("#passes details.pass[open]").length - before,
    diffLines: q("#passes pre.diff span.add").filter(box).length,
    scripts: document.scripts.length
  });
})()"""


def _browser():
    found = browser.find()
    if found is None:
        if os.environ.get("KVC_REQUIRE_BROWSER") == "1":
            pytest.fail("KVC_REQUIRE_BROWSER=1 but no Chromium found (apt-get install chromium, or set KVC_CHROMIUM)")
        pytest.skip("no Chromium (apt-get install chromium, or set KVC_CHROMIUM); KVC_REQUIRE_BROWSER=1 makes this fail")
    return found


def test_the_report_renders_in_chromium_without_console_errors(compiled, tmp_path, capsys):
    exe = _browser()
    shot = tmp_path / "report.png"
    run = browser.load(compiled[1], expression=PROBE, screenshot=shot, browser=exe)
    with capsys.disabled():
        print(f"\nreport screenshot: {shot} ({run.seconds:.1f} s in Chromium)")
    assert run.errors == [], run.errors
    seen = json.loads(run.value)
    assert seen["ready"] == "1", "the page's script did not run to its end"
    assert set(seen["sections"]) == {"plan", "models", "passes", "graphs", "verification", "timings"}
    assert all(h > 100 for h in seen["sections"].values()), seen["sections"]
    assert seen["graphs"] == 3 and seen["nodes"] >= 30 and seen["edges"] >= 30
    probes = json.loads((compiled[0] / "manifest.json").read_text())["verification"]["results"]
    assert seen["plots"] == 2 * len(probes) >= 6  # error and margin, per probe (a far one among them)
    assert seen["bars"] >= 6
    assert seen["passes"] >= 5 and seen["opened"] == seen["passes"] and seen["diffLines"] > 20
    assert shot.stat().st_size > 50_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_hostile_page_runs_only_its_own_script(hostile, tmp_path):
    run = browser.load(hostile[1], expression=PROBE, browser=_browser())
    assert run.errors == [] and json.loads(run.value)["scripts"] == 1


@pytest.mark.parametrize("injected, expected", [
    ("<script>throw new Error('injected failure')</script>", "injected failure"),
    ("<script>console.error('injected console error')</script>", "injected console error"),
    ('<img src="https://example.com/pixel.png">', "Content Security Policy"),
])
def test_the_browser_check_sees_errors(compiled, tmp_path, injected, expected):
    """The check fails on a broken page: an uncaught exception, a console error, a fetch
    from the network (refused by the page's Content Security Policy)."""
    exe = _browser()
    page = tmp_path / "broken.html"
    page.write_text(compiled[1].read_text().replace("</body>", injected + "</body>"))
    run = browser.load(page, expression="1", browser=exe)
    assert any(expected in e for e in run.errors), run.errors


def test_without_chromium_it_skips_or_fails_as_ci_says(monkeypatch):
    monkeypatch.setattr(browser, "find", lambda: None)
    monkeypatch.delenv("KVC_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no Chromium"):
        _browser()
    monkeypatch.setenv("KVC_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="KVC_REQUIRE_BROWSER=1"):
        _browser()
