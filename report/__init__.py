"""kvc's HTML report: one self-contained page about a compiled directory.

    kvc compile MODEL -o OUT --report report.html      during a compile
    kvc report OUT [-o report.html]                     later, from OUT alone

The page holds the plan (lengths, variants, KV layout), the models and their blobs, each
pass with its op-count delta and its diff, a picture of one layer's attention/KV subgraph
before lifting and in the final prefill and generate models, the verification table with
per-step logit errors and margins, and the time and bytes of each compile phase.

Rules the page keeps:

* self-contained: one file, inline CSS, JS and SVG; nothing is fetched (a Content Security
  Policy forbids every network source, so a stray fetch would be a console error);
* every string from a model, a manifest or a dump is escaped (node names can be hostile);
* deterministic: the same inputs give the same bytes (no clock, sorted iteration; the only
  times shown are the ones recorded by the compile);
* what is absent is said, with how to get it, rather than failing (pass diffs need
  ``--dumps`` or ``compile --report``); a damaged compiled directory or dump is an error
  (exit 3), and the page is written atomically.

`collect` gathers, `graph` cuts the KV subgraph, `svg` draws, `page` writes the HTML.
"""

from kvc.report.collect import CompileRecorder, collect
from kvc.report.page import render, write_report

__all__ = ["CompileRecorder", "collect", "render", "write_report"]
