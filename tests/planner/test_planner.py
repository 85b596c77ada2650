"""kvc plan (issue 17 part 2): the cost model follows the runtime's variant rule, the search
finds what the costs favour within the budget, and plan files are checked and applied."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvc import fixtures
from kvc.errors import UsageError
from kvc.planner import (Budget, Costs, Workload, best_plan, blobs, decode_ms, load_workload, prefill_ms,
                         read_plan)
from tests.cli.runner import kvc

# NPU-like costs: a call pays a weight pass plus its tokens; a step grows with the variant.
STEEP = Costs({16: 28.0, 64: 40.0, 256: 88.0, 1024: 280.0}, {128: 10.0, 1024: 30.0, 4096: 100.0}, 1.0, 1000)
FLAT = Costs({16: 28.0, 64: 40.0, 256: 88.0, 1024: 280.0}, {128: 20.0, 4096: 20.5}, 1.0, 1000)
# A CPU's costs: a first-chunk call reads no past, so it costs less than a chunk call of its rows.
CPU = Costs({16: 30.0, 128: 60.0, 512: 200.0}, {256: 20.0, 2048: 26.0}, 1.0, 1000,
            first_ms={16: 22.0, 128: 45.0, 512: 170.0})


def workload(seed, count, prompts, responses) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload(rng.integers(*prompts, count), rng.integers(*responses, count), "test")


def simulated_decode(w: Workload, costs: Costs, R: int, sizes) -> float:
    """The runtime's rule step by step (kvc.runtime.static_pipeline.decode_from)."""
    total = []
    for n, m in zip(w.prompts, w.responses):
        variant = next((s for s in sizes if s >= n + R), sizes[-1])
        stored, t = n, 0.0
        for _ in range(m - 1):
            if stored > variant - 1:
                variant = next(s for s in sizes if s - 1 >= stored)
            t += float(costs.step(variant))
            stored += 1
        total.append(t)
    return float(np.mean(total))


@pytest.mark.parametrize("sizes", [(1152,), (320, 640, 1152), (192, 1152), (1088, 1152)])
def test_the_decode_model_follows_the_runtime_variant_rule(sizes):
    w = workload(0, 200, (1, 1024), (1, 129))
    assert decode_ms(w, STEEP, 128, sizes) == pytest.approx(simulated_decode(w, STEEP, 128, sizes), rel=1e-9)


def test_prefill_costs_chunk_calls():
    w = Workload(np.array([1, 64, 65, 200]), np.array([1, 1, 1, 1]))
    calls = np.array([1, 1, 2, 4])
    assert prefill_ms(w, STEEP, 256, 64) == pytest.approx(float(np.mean(calls * 40.0)))
    assert prefill_ms(w, STEEP, 256, 0) == pytest.approx(88.0)  # one call of P tokens whatever the prompt


def test_prefill_costs_follow_the_runtimes_bulk_calls():
    """With a bulk chunk the model counts the calls the runtime makes (prefill_calls): 1000
    tokens at P 1024 are two bulk calls of 512, 100 tokens two chunks of 64."""
    w = Workload(np.array([1000, 100]), np.array([1, 1]))
    assert prefill_ms(w, STEEP, 1024, 64, (512,)) == pytest.approx((2 * float(STEEP.call(512)) + 2 * 40.0) / 2)


def test_first_chunk_calls_cost_their_own_and_default_to_a_chunk_calls():
    """A first chunk's call is costed from first_ms; costs measured before kvc measured first
    chunks cost it as a chunk call of its rows (the first chunk then gains nothing)."""
    from kvc.runtime.static_pipeline import prefill_calls

    w = Workload(np.array([100, 300, 7]), np.array([1, 1, 1]))
    want = np.mean([sum(float(CPU.first(c.size) if c.first else CPU.call(c.size))
                        for c in prefill_calls(0, n, (), 1024, (16, 128), (128,))) for n in (100, 300, 7)])
    assert prefill_ms(w, CPU, 1024, 16, (128,), (128,)) == pytest.approx(float(want))
    assert prefill_ms(w, CPU, 1024, 16, (128,), (128,)) < prefill_ms(w, CPU, 1024, 16, (128,))
    older = Costs(CPU.call_ms, CPU.step_ms, 1.0, 1000)
    assert older.first(128) == older.call(128) == 60.0
    assert Costs.from_dict(CPU.to_dict()) == CPU and "first_ms" not in older.to_dict()


def test_a_first_chunk_of_dynamic_rows_costs_the_rows_it_computes():
    """On an f32 CPU kvc compile builds one first chunk of dynamic rows (1 to F tokens,
    unpadded): the planner costs its call by the rows the call computes, as the runtime splits
    the prompt (`prefill_calls(..., dynamic=True)`), not by F; the defaults it compares against
    and the plan it picks say so, and plan_lengths builds what it costed."""
    from kvc.plan import plan_lengths

    w = Workload(np.array([100, 300, 7]), np.array([1, 1, 1]))
    # 300 tokens: first 128, three chunks of 16, then a bulk call of the last 124 (the small ones first)
    want = np.mean([float(CPU.first(100)), float(CPU.first(128) + 3 * CPU.call(16) + CPU.call(128)),
                    float(CPU.first(7))])
    got = prefill_ms(w, CPU, 1024, 16, (128,), (128,), dynamic=True)
    assert got == pytest.approx(float(want))
    assert got < prefill_ms(w, CPU, 1024, 16, (128,), (128,))  # static: 100 and 7 tokens cost 128 rows each
    chat = workload(1, 80, (10, 200), (16, 64))
    result = best_plan(chat, CPU, Budget(max_models=3), (16, 128), None, (128,), "CPU", "dynamic")
    pyramid = next(b for b in result["baselines"] if b.name == "pyramid")
    assert pyramid.first == (128,) and pyramid.first_dynamic and pyramid.to_dict()["prefill_first_rows"] == "dynamic"
    static = best_plan(chat, CPU, Budget(max_models=3), (16, 128), None, (128,), "CPU")
    assert next(b for b in static["baselines"] if b.name == "pyramid").ttft_ms > pyramid.ttft_ms
    plan = result["plan"]
    assert plan.first and plan.first_dynamic
    L = plan_lengths(plan.prompt, plan.response, (plan.chunk, *plan.bulk), plan.sizes, first=plan.first,
                     first_rows="dynamic")
    assert (L.first, L.first_dynamic, L.notes) == (plan.first, True, ())
    assert "prefill_first_rows" not in static["plan"].to_dict()


def test_the_prefill_models_are_one_cpu_blob():
    """Blobs as kvc compile builds them (export/branches.py: on the CPU the chunk, bulk and first
    chunks are one If blob): compiling counts every model, the budget's models and memory
    count blobs."""
    assert blobs((128,), (128,), (1152,), "CPU") == (4, 2)
    assert blobs((128,), (128,), (1152,), "NPU") == (4, 4)
    assert blobs((), (64,), (320, 1152), "CPU") == (4, 3)
    assert blobs((256,), (), (1152,), "CPU") == (3, 2)
    assert blobs((), (), (1152,), "CPU") == (2, 2)
    c = best_plan(Workload(np.array([100]), np.array([10])), CPU, Budget(max_models=3), (16, 128), None, (128,),
                  "CPU")["baselines"][0]
    assert (c.chunk, c.bulk, c.first, c.models) == (16, (128,), (128,), 2)
    assert (c.compile_s, c.model_bytes) == (4 * CPU.compile_s, 2 * CPU.model_bytes)


@pytest.mark.parametrize("device", ["CPU", "NPU"])
def test_a_first_chunk_is_planned_where_it_shares_a_blob(device):
    """Chat turns with costs where a first call is cheaper: within two models the CPU's plan
    takes a first chunk (one blob with the chunk model); the NPU's, where a first chunk is a
    blob of its own, cannot; with a third model it can."""
    w = workload(2, 100, (10, 120), (20, 100))
    two = best_plan(w, CPU, Budget(max_models=2), device=device)["plan"]
    assert two.models == 2
    if device == "CPU":
        assert two.first and two.first[0] in (two.chunk, *two.bulk)
        alone = best_plan(w, Costs(CPU.call_ms, CPU.step_ms, 1.0, 1000), Budget(max_models=2))["plan"]
        assert two.request_ms < alone.request_ms and not alone.first
    else:
        assert two.first == ()
        assert best_plan(w, CPU, Budget(max_models=3), device=device)["plan"].first
    assert two.to_dict()["prefill_first"] == list(two.first)


def test_mixed_lengths_get_a_bulk_chunk_when_the_budget_allows_it():
    """Short chats and long documents: with room for a third model the NPU's plan adds a bulk
    chunk above a small one (each call pays a weight pass), and expects less than with two
    models; on the CPU, where the bulk chunk shares the chunk's blob, two models hold it. The
    plan file states both sizes and compile reads them."""
    w = Workload(np.array([20] * 50 + [1000] * 50), np.array([16] * 100))
    two, three = (best_plan(w, FLAT, Budget(max_models=m), device="NPU")["plan"] for m in (2, 3))
    assert not two.bulk and three.bulk and three.chunk < three.bulk[0] and three.models == 3
    cpu = best_plan(w, FLAT, Budget(max_models=2))["plan"]
    assert cpu.bulk and cpu.models == 2 and cpu.request_ms <= three.request_ms + 1e-9
    assert three.request_ms < two.request_ms
    assert three.to_dict()["prefill_chunk_size"] == [three.chunk, *three.bulk]


def test_long_documents_get_a_large_chunk_and_chat_turns_a_small_one():
    docs = workload(1, 100, (600, 1900), (50, 200))
    chat = workload(2, 100, (10, 120), (20, 100))
    assert best_plan(docs, FLAT)["plan"].chunk >= 256
    assert best_plan(chat, FLAT)["plan"].chunk <= 128


def test_variants_are_chosen_when_steps_grow_with_the_variant_and_the_budget_allows():
    w = workload(3, 300, (16, 3000), (16, 300))
    two = best_plan(w, STEEP, Budget(max_models=2), default_chunk=64)
    four = best_plan(w, STEEP, Budget(max_models=4), default_chunk=64)
    assert len(two["plan"].sizes) == 1 and len(four["plan"].sizes) == 3
    assert four["plan"].decode_ms < two["plan"].decode_ms
    pyramid = next(b for b in four["baselines"] if b.name == "pyramid")
    assert four["plan"].request_ms < pyramid.request_ms and four["plan"].models <= 4
    # the plan is the best the search space holds: no single other variant set beats it
    P, R = four["plan"].prompt, four["plan"].response
    for sizes in [(P + R,), (1088, P + R), (2112, P + R)]:
        assert decode_ms(w, STEEP, R, sizes) >= four["plan"].decode_ms - 1e-9


def test_the_budget_is_kept():
    w = workload(4, 50, (16, 500), (16, 100))
    assert best_plan(w, STEEP, Budget(max_models=6, max_compile_s=3.0))["plan"].models <= 3
    assert best_plan(w, STEEP, Budget(max_models=6, max_bytes=2000))["plan"].models == 2
    with pytest.raises(UsageError, match="no plan fits the budget"):
        best_plan(w, STEEP, Budget(max_models=2, max_compile_s=1.0))
    with pytest.raises(UsageError, match="at least 2 models"):
        Budget(max_models=1)


@pytest.mark.parametrize("seed", range(4))
def test_compile_builds_what_the_plan_costed(seed):
    """The search costs only what kvc compile builds: P is aligned to the bulk chunk as
    plan_lengths aligns it (P 192 with a bulk chunk of 128 was planned, which the static-shape
    pass refused), and best_plan refuses a plan whose lengths, as plan_lengths makes them, cost
    other than the search said."""
    from kvc.plan import plan_lengths

    w = workload(seed, 60, (16, 180 + 300 * seed), (16, 128))
    for device in ("CPU", "NPU"):
        plan = best_plan(w, CPU, Budget(max_models=4), device=device)["plan"]
        assert all(plan.prompt % b == 0 for b in plan.bulk)
        L = plan_lengths(plan.prompt, plan.response, (plan.chunk, *plan.bulk), plan.sizes, first=plan.first)
        assert (L.chunk, L.bulk, L.first, L.sizes, L.notes) == (plan.chunk, plan.bulk, plan.first, plan.sizes, ())
    mixed = Workload(np.array([20] * 50 + [1100] * 50), np.array([16] * 100))  # P 1152 at the chunk, 2048 at 1024
    plan = best_plan(mixed, FLAT, Budget(max_models=3))["plan"]
    assert (plan.prompt, plan.bulk) == (2048, (1024,))


def test_every_request_of_the_workload_fits_the_plan():
    w = workload(5, 100, (1, 700), (1, 900))
    c = best_plan(w, STEEP)["plan"]
    assert c.prompt >= w.prompts.max() and c.prompt + c.response >= (w.prompts + w.responses - 1).max()


@pytest.mark.parametrize("text,message", [
    ('{"requests": []}', "expected"),
    ('{"requests": [[10, 5]]}', r"requests\[0\]"),
    ('{"requests": [[0, 5, 1]]}', r"requests\[0\]"),
    ('{"requests": [[10, 5, true]]}', r"requests\[0\]"),
    ("[1, 2", "not a readable JSON histogram"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"requests": [[1000000000000, 50, 10]]}', r"requests\[0\] must be \[prompt_len 1-1048576"),
    # 200000 rows of a million each ran the machine out of memory (24 GB) expanding them
    ('{"requests": [[5, 5, 600000], [6, 6, 400000], [7, 7, 1]]}', r"more than 1000000 requests in all \(by requests\[2\]\)"),
])
def test_bad_histograms_are_refused(tmp_path, text, message):
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        load_workload(path)


def test_workloads_from_requests_and_histograms(tmp_path):
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text('{"prompt_ids": [1, 2, 3], "max_new_tokens": 4}\n{"prompt": "hello there", "max_new_tokens": 2}\n')
    with pytest.raises(UsageError, match="needs the model's tokenizer"):
        load_workload(jsonl)
    w = load_workload(jsonl, encode=lambda text: text.split())
    assert list(w.prompts) == [3, 2] and list(w.responses) == [4, 2]
    hist = tmp_path / "w.json"
    hist.write_text('{"requests": [[10, 5, 2], [20, 3, 1]]}')
    assert list(load_workload(hist).prompts) == [10, 10, 20]
    assert list(load_workload(hist).responses) == [5, 5, 3]


def test_malformed_costs_and_plans_are_refused(tmp_path):
    with pytest.raises(UsageError, match="not a kvc costs file"):
        Costs.from_dict({"call_ms": {}}, "c.json")
    ok = {"format": "kvc-costs/1", "call_ms": {"16": 1.0}, "step_ms": {"64": 1.0}}
    # NaN was written back as bare NaN, zeros divided by zero (exit 1), 1e308 summed to inf,
    # a boolean read as 1 ms, a list as the target skipped the check that the costs are the model's
    for bad_ms in (float("nan"), 0.0, 1e308, True, -1.0):
        with pytest.raises(UsageError, match="call_ms must map sizes 1-1048576 to milliseconds above 0 and at most 1e"):
            Costs.from_dict({**ok, "call_ms": {"16": bad_ms}})
    for field, value in (("compile_s", float("nan")), ("model_bytes", -1), ("compile_s", True)):
        with pytest.raises(UsageError, match="compile_s and model_bytes must be finite and not negative"):
            Costs.from_dict({**ok, field: value})
    with pytest.raises(UsageError, match="target must be an object, found list"):
        Costs.from_dict({**ok, "target": []})
    with pytest.raises(UsageError, match="first_ms must map"):
        Costs.from_dict({"format": "kvc-costs/1", "call_ms": {"16": 1.0}, "step_ms": {"64": 1.0},
                         "first_ms": {"16": -1.0}})
    with pytest.raises(UsageError, match="malformed costs"):
        Costs.from_dict({"format": "kvc-costs/1", "call_ms": {"16": 1.0}, "step_ms": {"64": 1.0}, "first_ms": [1]})
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"format": "kvc-plan/1", "lengths": {"max_prompt_len": 64, "min_response_len": 64,
                                                                    "prefill_chunk_size": 48, "variants": [128]}}))
    with pytest.raises(UsageError, match=f"^{re.escape(str(bad))}: prefill chunk size must be a power of two"):
        read_plan(bad)
    bad.write_text("{}")
    with pytest.raises(UsageError, match="not a kvc plan"):
        read_plan(bad)
    bad.write_text(json.dumps({"format": "kvc-plan/1", "lengths": {
        "max_prompt_len": 64, "min_response_len": 64, "prefill_chunk_size": 16, "prefill_first": [16, "x"],
        "variants": [128]}}))
    with pytest.raises(UsageError, match="malformed lengths"):
        read_plan(bad)
    for chunk in ([16, "x"], [], [16, -32]):
        bad.write_text(json.dumps({"format": "kvc-plan/1", "lengths": {
            "max_prompt_len": 64, "min_response_len": 64, "prefill_chunk_size": chunk, "variants": [128]}}))
        with pytest.raises(UsageError, match="malformed lengths"):
            read_plan(bad)


def test_compile_takes_bulk_and_first_chunks_from_a_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "kvc-plan/1", "lengths": {
        "max_prompt_len": 64, "min_response_len": 64, "prefill_chunk_size": [16, 32], "variants": [128]}}))
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "out", "--plan", plan, "--no-verify")
    assert "chunk 16 + bulk 32" in result.output and "chunk=16 + bulk 32" in result.output
    lengths = json.loads((tmp_path / "out" / "manifest.json").read_text())["plan"]["lengths"]
    assert (lengths["prefill_chunk_size"], lengths["prefill_bulk_chunks"]) == (16, [32])
    assert lengths["prefill_first_chunks"] == []  # a plan without first chunks: none, whatever auto would pick
    plan.write_text(json.dumps({"format": "kvc-plan/1", "lengths": {
        "max_prompt_len": 64, "min_response_len": 64, "prefill_chunk_size": [16, 32], "prefill_first": [32],
        "variants": [128]}}))
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "first", "--plan", plan, "--no-verify")
    assert "chunk 16 + bulk 32 + first 32" in result.output
    lengths = json.loads((tmp_path / "first" / "manifest.json").read_text())["plan"]["lengths"]
    assert lengths["prefill_first_chunks"] == [32]
    conflict = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "o2", "--plan", plan, "--prefill-first", "16",
                   code=2)
    assert "--plan sets --prefill-first" in conflict.output


def test_kvc_plan_measures_caches_and_compile_uses_the_plan(tmp_path):
    """On the llama fixture: costs measured and written, read back the second time; the plan
    file gives kvc compile its lengths; an option given beside --plan is a conflict."""
    requests = tmp_path / "w.jsonl"
    rng = np.random.default_rng(0)
    requests.write_text("".join(json.dumps({"prompt_ids": rng.integers(1, 384, n).tolist(), "max_new_tokens": m})
                                + "\n" for n, m in [(20, 30), (90, 10), (40, 60)]))
    costs, plan = tmp_path / "costs.json", tmp_path / "plan.json"
    first = kvc("plan", fixtures.path("llama"), "--workload", requests, "--costs", costs, "-o", plan,
                "--max-models", "3")
    assert "costs measured and written" in first.output and costs.is_file()
    data = json.loads(costs.read_text())
    assert data["format"] == "kvc-costs/1" and data["target"]["device"] == "CPU" and data["compile_s"] > 0
    assert data["first_ms"] and set(data["first_ms"]) <= set(data["call_ms"])  # first chunks of each chunk's rows
    from kvc.export.compile import resolve_attention, resolve_kv, resolve_prefill_mlp

    kv, attention = resolve_kv("auto", ("CPU",), "auto"), resolve_attention("auto", ("CPU",))
    assert (data["target"]["kv_precision"], data["target"]["attention"]) == (kv, attention)  # compile's
    assert data["target"]["prefill_mlp"] == resolve_prefill_mlp("auto", ("CPU",), "auto")
    from kvc.export.compile import resolve_chunk, resolve_first_rows

    rows = resolve_first_rows("auto", ("CPU",), "auto", resolve_chunk("auto", ("CPU",), "auto"))
    assert data["target"]["first_rows"] == rows  # first chunks timed as compile builds them here
    second = kvc("plan", fixtures.path("llama"), "--workload", requests, "--costs", costs, "--json",
                 "--max-models", "3")
    doc = json.loads(second.stdout)
    assert doc == json.loads(plan.read_text())
    L = doc["lengths"]
    assert L["max_prompt_len"] >= 90 and L["max_prompt_len"] + L["min_response_len"] >= 99
    assert {b["name"] for b in doc["against"]} == {"single", "pyramid"}
    pyramid = next(b for b in doc["against"] if b["name"] == "pyramid")  # the defaults, as kvc compile resolves them
    assert pyramid["prefill_first"] and pyramid.get("prefill_first_rows", "static") == rows
    out = tmp_path / "out"
    kvc("compile", fixtures.path("llama"), "-o", out, "--plan", plan, "--no-verify")
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["plan"]["options"]["kv_precision"], manifest["plan"]["options"]["attention"]) == (kv, attention)
    lengths = manifest["plan"]["lengths"]
    chunks = ([lengths["prefill_chunk_size"], *lengths["prefill_bulk_chunks"]] if lengths["prefill_bulk_chunks"]
              else lengths["prefill_chunk_size"])
    assert (lengths["max_prompt_len"], lengths["min_response_len"], chunks,
            lengths["generate_sizes"]) == (L["max_prompt_len"], L["min_response_len"], L["prefill_chunk_size"],
                                           L["variants"])
    conflict = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "o2", "--plan", plan, "--max-prompt-len",
                   "64", code=2)
    assert "--plan sets --max-prompt-len" in conflict.output
    foreign = kvc("plan", fixtures.path("qwen2"), "--workload", requests, "--costs", costs, code=2)
    assert "another model's files" in foreign.output
    other = "bf16" if kv == "f32" else "f32"
    data["target"]["kv_precision"] = other  # measured with another cache than compile's: not this target
    costs.write_text(json.dumps(data))
    stale = kvc("plan", fixtures.path("llama"), "--workload", requests, "--costs", costs, code=2)
    assert f"kv_precision '{other}'" in stale.output
    del data["target"]["kv_precision"]  # written before costs recorded it: measured with an f32 cache
    costs.write_text(json.dumps(data))
    legacy = kvc("plan", fixtures.path("llama"), "--workload", requests, "--costs", costs, code=0 if kv == "f32" else 2)
    assert ("kv_precision 'f32'" in legacy.output) == (kv != "f32")
    data["target"].update(kv_precision=kv, attention="sdpa")  # another attention than compile's
    costs.write_text(json.dumps(data))
    assert "attention 'sdpa'" in kvc("plan", fixtures.path("llama"), "--workload", requests, "--costs", costs,
                                     code=2).output
    # first chunks timed with other rows than compile builds (static where dynamic, or back): not this target
    flipped = "static" if rows == "dynamic" else "dynamic"
    data["target"].update(attention=attention, first_rows=flipped)
    costs.write_text(json.dumps(data))
    assert f"first_rows '{flipped}'" in kvc("plan", fixtures.path("llama"), "--workload", requests, "--costs", costs,
                                           code=2).output
    del data["target"]["first_rows"]  # written before costs recorded it: static first chunks
    costs.write_text(json.dumps(data))
    legacy = kvc("plan", fixtures.path("llama"), "--workload", requests, "--costs", costs,
                 code=0 if rows == "static" else 2)
    assert ("first_rows 'static'" in legacy.output) == (rows == "dynamic")


@pytest.mark.parametrize("n,m", [(5, 40), (15, 80), (40, 50), (64, 33)])
def test_the_decode_model_matches_the_variants_a_real_pipeline_runs(n, m):
    """The variants kvc's StaticPipeline actually ran (P 64, R 32, variants 80 and 96) cost
    what the planner predicts."""
    from tests.runtime.test_static_pipeline import pipeline

    pipe = pipeline("llama", "chunked", "numpy")
    gen = pipe.generate(list(range(1, n + 1)), m)
    ran = float(sum(STEEP.step(v) for v in gen.variants))
    predicted = decode_ms(Workload(np.array([n]), np.array([m])), STEEP, pipe.lengths.response, pipe.lengths.sizes)
    assert predicted == pytest.approx(ran, rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_the_plan_is_never_expected_slower_than_what_a_user_gets(seed):
    """Noisy measurements (a larger variant timed faster) must not make the plan lose to the
    defaults it could have chosen: costs are non-decreasing in size."""
    rng = np.random.default_rng(seed)
    noisy = Costs({32: float(rng.uniform(20, 40)), 128: float(rng.uniform(15, 60)), 512: float(rng.uniform(30, 90))},
                  {256: float(rng.uniform(10, 30)), 1024: float(rng.uniform(5, 30)), 2048: float(rng.uniform(5, 40))},
                  1.0, 1000)
    w = workload(seed, 100, (1, 900), (1, 200))
    result = best_plan(w, noisy, Budget(max_models=2), default_chunk=64)
    assert all(result["plan"].request_ms <= b.request_ms + 1e-9 for b in result["baselines"])
    first = Costs(noisy.call_ms, noisy.step_ms, 1.0, 1000, {32: float(rng.uniform(10, 40)),
                                                            128: float(rng.uniform(10, 60))})
    result = best_plan(w, first, Budget(max_models=3), (16, 128), None, (128,))  # the CPU's bf16 default
    assert result["baselines"][0].first == (128,)
    assert all(result["plan"].request_ms <= b.request_ms + 1e-9 for b in result["baselines"])
    assert noisy.step(300) >= noisy.step(256) and noisy.call(64) >= noisy.call(32)


def test_first_chunks_are_costed_as_compile_builds_them_for_the_model():
    """kvc compile builds static first chunks for a model with a TopK router (its CPU blob of
    dynamic rows cannot be imported): the planner costs them so, as compile resolves them."""
    from kvc.export.compile import resolve_chunk
    from kvc.planner import first_rows

    chunked = resolve_chunk("auto", ("CPU",), "f32")
    assert chunked and first_rows("CPU", "f32", fixtures.path("llama")) == "dynamic"
    assert first_rows("CPU", "f32", fixtures.path("qwen3_moe")) == "static"


def test_a_plan_past_the_models_positions_says_so(tmp_path):
    """gpt2 states 256 positions; a workload of 300-token prompts was planned at P 512 without
    a word (`kvc compile --plan` warned). Given costs, no target: taken as they are."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"format": "kvc-costs/1", "call_ms": {"16": 1.0, "512": 20.0},
                                 "step_ms": {"256": 1.0, "1024": 2.0}}))
    workload = tmp_path / "h.json"
    workload.write_text(json.dumps({"requests": [[300, 16, 4]]}))
    result = kvc("plan", fixtures.path("gpt2"), "--workload", workload, "--costs", costs, "-o", tmp_path / "plan.json")
    assert re.search(r"warning: P \d+ \+ R \d+ exceed the 256 positions the model's config.json states \(n_positions\)",
                     result.output)
    assert "exceed the 256 positions" in json.loads((tmp_path / "plan.json").read_text())["warning"]
