"""Golden-output tests a user keeps in their own repository and CI.

`record` runs a compiled directory on one backend and writes, per prompt, the greedy tokens
and each step's top-5 logits; `check` runs it again and fails on any token change or logit
drift beyond tolerance (1e-4 for f32 KV; f16 KV: 1e-2 absolute, a generous bound for its
rounding); a NaN or Inf anywhere in the logits fails, and is never recorded. The file names the kvc and OpenVINO versions that recorded it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvc import __version__
from kvc.errors import InvalidModelError, VerificationError
from kvc.export.load import open_compiled
from kvc.export.manifest import openvino_version
from kvc.ir.writer import write_bytes_atomic
from kvc.runtime.compare import count_nonfinite, first_divergence, reduced_precision
from kvc.runtime.static_pipeline import max_new_tokens

TOP = 5
FORMAT = "kvc-goldens/1"


def record(directory, path, prompts, *, backend: str = "numpy", new_tokens: int = 16, from_ir: bool = False) -> dict:
    pipe = open_compiled(directory, backend, from_ir=from_ir)
    entries = []
    for prompt in prompts:
        n = min(new_tokens, max_new_tokens(pipe.lengths, len(prompt)))
        gen = pipe.generate(prompt, n)
        if count_nonfinite(gen.logits):
            raise VerificationError(f"{directory} on {backend}, prompt of {len(prompt)} tokens: non-finite logits; "
                                    f"refusing to record them as goldens")
        steps = []
        for logits in gen.logits:
            top = np.argsort(-logits, kind="stable")[:TOP]
            steps.append([[int(t), round(float(logits[t]), 6)] for t in top])
        entries.append({"ids": [int(t) for t in prompt], "tokens": gen.tokens, "top_logits": steps})
    data = {"format": FORMAT, "kvc_version": __version__, "openvino_version": openvino_version(),
            "backend": backend, "kv_element_type": pipe.plan.kv[0].element_type, "prompts": entries}
    write_bytes_atomic(path, (json.dumps(data, indent=1) + "\n").encode())
    return data


def _at(tokens, i):
    return tokens[i] if i < len(tokens) else "(none)"


def load_goldens(path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidModelError("bad-goldens", str(path), f"cannot read goldens: {exc}") from None
    if data.get("format") != FORMAT:
        raise InvalidModelError("bad-goldens", str(path), "not a kvc goldens file",
                                expected=FORMAT, found=str(data.get("format")))
    return data


def check(directory, path, *, backend: str | None = None, from_ir: bool = False) -> dict:
    data = load_goldens(path)
    backend = backend or data["backend"]
    atol = 1e-2 if reduced_precision([data["kv_element_type"]], backend) else 1e-4
    pipe = open_compiled(directory, backend, from_ir=from_ir, sha256=True)
    rows = []
    for i, entry in enumerate(data["prompts"]):
        gen = pipe.generate(entry["ids"], len(entry["tokens"]))
        div = first_divergence(entry["tokens"], gen.tokens)
        drifts = [abs(float(gen.logits[k][t]) - v) for k, step in enumerate(entry["top_logits"][:len(gen.logits)])
                  for t, v in step]
        drift = float(np.max(drifts, initial=0.0))  # NaN-propagating, unlike max()
        nonfinite = count_nonfinite(gen.logits)
        ok = div is None and not nonfinite and drift <= atol
        reason = (f"{nonfinite} non-finite logit(s)" if nonfinite
                  else f"token {div} changed: {_at(entry['tokens'], div)} -> {_at(gen.tokens, div)}" if div is not None
                  else f"logit drift {drift:.3g} > {atol}" if not drift <= atol else "matches")
        rows.append({"prompt": i, "prompt_tokens": len(entry["ids"]), "ok": ok, "first_divergent_token": div,
                     "max_logit_drift": drift, "reason": reason})
    return {"goldens": str(path), "backend": backend, "recorded_with": data["openvino_version"],
            "ok": all(r["ok"] for r in rows), "results": rows}
