"""Check a static pipeline against its source model."""

from __future__ import annotations

import numpy as np

from kvc.export.build import StaticModels
from kvc.runtime.session import NumpySession

def verify_static(source_model, static: StaticModels, tokens: int = 8) -> dict:
    """The compile-time check: kvc's static pipeline on the numpy runtime against the original
    model on the numpy runtime, on two deterministic prompts."""
    from kvc.runtime.compare import judge
    from kvc.runtime.generate import greedy
    from kvc.runtime.static_pipeline import StaticPipeline, max_new_tokens

    pipeline = StaticPipeline(NumpySession(static.models["prefill"]),
                              {size: NumpySession(static.models[name]) for size, name in static.generate_names.items()},
                              static.plan, static.kv)
    reference = NumpySession(source_model)
    vocab = static.models["prefill"].output("logits").get_partial_shape()[-1].get_length()
    rng = np.random.default_rng(0)
    f16 = any(k.element_type == "f16" for k in static.kv)
    results = []
    for length in sorted({min(static.plan.prompt, 7), min(static.plan.prompt, 33)}):
        prompt = rng.integers(1, vocab, length)
        n = min(tokens, max_new_tokens(static.plan, length))
        verdict = judge(greedy(reference, prompt, n), pipeline.generate(prompt, n), reduced=f16)
        results.append({"backend": "numpy", "prompt_tokens": length, "new_tokens": n, **verdict.to_dict()})
    return {"against": "source model on kvc's numpy runtime", "ok": all(r["ok"] for r in results),
            "results": results}




def default_prompts(plan, vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic prompts spanning the prefill: 1 token, half of P, and P."""
    rng = np.random.default_rng(seed)
    lengths = sorted({1, max(1, plan.prompt // 2), plan.prompt})
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def reference_session(source, backend: str = "openvino"):
    """The source model on another engine: OpenVINO CPU at f32, or kvc's numpy runtime."""
    from kvc.runtime.session import open_session

    return open_session(source, backend)


def verify_compiled(directory, *, against=None, backends=("numpy", "openvino"), prompts=None,
                    new_tokens: int = 16, reference_backend: str = "openvino", from_ir: bool = False) -> dict:
    """Run a compiled directory on each backend and the source model on `reference_backend`;
    judge every prompt (REFERENCE.md §7 tolerances; f16 KV judged by NRMSE and near-ties)."""
    from pathlib import Path

    from kvc.export.load import open_compiled, plan_from
    from kvc.export.manifest import check_files, read_manifest, recorded_source, source_hashes
    from kvc.runtime.compare import judge
    from kvc.runtime.generate import greedy
    from kvc.runtime.static_pipeline import max_new_tokens

    directory = Path(directory)
    manifest = read_manifest(directory)
    check_files(directory, manifest, sha256=True)
    source = Path(against) if against else recorded_source(manifest, directory)
    is_recorded_source = against is None or source_hashes(source) == manifest["source"]["sha256"]
    plan = plan_from(manifest)
    ref = reference_session(source, reference_backend)
    vocab = next(o["shape"][-1] for o in manifest["models"]["prefill"]["outputs"] if o["name"] == "logits")
    prompts = prompts or default_prompts(plan, vocab)
    f16 = any(k["element_type"] == "f16" for k in manifest["kv"])
    references = {}
    rows = []
    for backend in backends:
        pipe = open_compiled(directory, backend, from_ir=from_ir)
        for i, prompt in enumerate(prompts):
            n = min(new_tokens, max_new_tokens(plan, len(prompt)))
            if (i, n) not in references:
                references[(i, n)] = greedy(ref, prompt, n)
            verdict = judge(references[(i, n)], pipe.generate(prompt, n), reduced=f16 or backend == "npu")
            rows.append({"backend": backend, "prompt": i, "prompt_tokens": len(prompt), "new_tokens": n,
                         **verdict.to_dict()})
    return {"directory": str(directory), "against": str(source), "against_recorded_source": is_recorded_source,
            "reference_backend": reference_backend,
            "ok": all(r["ok"] for r in rows), "results": rows}
