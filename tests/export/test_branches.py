"""The prefill models (the chunk, the bulk chunks, the first chunks) are one CPU blob, an If
chain whose branches pack their weights once (export/branches.py): each branch computes exactly
what its model computes compiled alone, an open imports the blob once, and a manifest that
misdescribes it is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from kvc import fixtures
from kvc.export import load as load_module
from kvc.export.branches import BranchSession, branch_groups, branch_inputs, branch_selects
from kvc.export.compile import CompileOptions, compile_to
from kvc.export.load import open_compiled, pipeline_from
from kvc.export.manifest import MANIFEST, dumps, read_manifest
from kvc.ir.reader import load
from kvc.plan import StaticOptions
from kvc.runtime.session import OpenVINOSession
from tests.cli.runner import kvc
from tests.conftest import COMPRESSED_FORMATS, fixture_names, host_golden

CHUNKED = StaticOptions(max_prompt_len=64, min_response_len=64, prefill_chunk_size=(16, 32), prefill_first=(16, 32))
GROUP = ["prefill", "prefill-32", "first-32", "first-16"]
BLOB = "prefill+prefill-32+first-32+first-16.CPU.blob"


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    """The llama fixture compiled exact (f32) with chunks of 16, a bulk chunk of 32 and first
    chunks of 16 and 32 (P 64): prefill, prefill-32, first-32 and first-16 share one CPU blob."""
    out = tmp_path_factory.mktemp("branches") / "out"
    compile_to(fixtures.path("llama"), out, CompileOptions(CHUNKED, inference_precision="f32"))
    return out


def port(name, shape, element_type="i64"):
    return {"name": name, "element_type": element_type, "shape": shape}


def entry(rows, mask, past=None, present=None):
    inputs = [port("input_ids", [1, rows]), port("attention_mask", [1, mask]), port("position_ids", [1, rows])]
    if past:
        inputs.append(port("past_key_values.0.key", [1, 2, past, 16], "f16"))
    outputs = [port("logits", [1, 1, 50], "f32"), port("present.0.key", [1, 2, present or rows, 16], "f16")]
    return {"inputs": inputs, "outputs": outputs}


def test_every_prefill_model_groups_the_chunk_first_on_the_cpu_only():
    models = {"first-16": entry(16, 16), "prefill-32": entry(32, 64, 32), "first-32": entry(32, 32),
              "prefill": entry(16, 64, 48), "generate-80": entry(1, 80, 79)}
    assert branch_groups(models, "CPU") == [("prefill", "prefill-32", "first-32", "first-16")]
    assert branch_groups(models, "NPU") == []
    del models["first-32"], models["first-16"]  # a chunk and a bulk chunk share a packing too
    assert branch_groups(models, "CPU") == [("prefill", "prefill-32")]
    del models["prefill-32"]  # one model is no group
    assert branch_groups(models, "CPU") == []
    models["first-16"] = entry(16, 16)
    models["first-16"]["outputs"][1]["element_type"] = "f32"  # outputs of another type: kept apart
    assert branch_groups(models, "CPU") == []


def test_a_first_chunk_of_dynamic_rows_leads_the_chain():
    """Every prompt's first call is a first chunk of dynamic rows (its inputs [1, -1]): it is
    the outermost body, its outputs copied out once; the chunk and bulk chunk follow. Its
    outputs pad to its F rows at least (here 64, above the bulk chunk's 32)."""
    from kvc.export.branches import branch_ports

    models = {"prefill-32": entry(32, 64, 32), "first-64": entry(-1, -1), "prefill": entry(16, 64, 48),
              "generate-80": entry(1, 80, 79)}
    assert branch_groups(models, "CPU") == [("first-64", "prefill", "prefill-32")]
    ports = branch_ports({m: models[m] for m in ("first-64", "prefill", "prefill-32")})
    assert [p["shape"] for p in ports["outputs"]] == [[1, 1, 50], [1, 2, 64, 16]]
    assert {p["name"]: p["shape"] for p in ports["inputs"]}["first-64.input_ids"] == [1, -1]


def test_each_model_selects_its_own_if_and_no_other():
    assert branch_selects(["prefill-32", "first-32", "first-16"]) == {
        "prefill-32": {"kvc.select.0.prefill-32": True, "kvc.select.1.first-32": False},
        "first-32": {"kvc.select.0.prefill-32": False, "kvc.select.1.first-32": True},
        "first-16": {"kvc.select.0.prefill-32": False, "kvc.select.1.first-32": False}}


def test_inputs_both_models_have_alike_keep_their_names_and_the_rest_are_prefixed():
    names = branch_inputs({"first-32": entry(32, 32)["inputs"], "prefill-32": entry(32, 64, 32)["inputs"]})
    assert names == {
        "first-32": {"input_ids": "input_ids", "attention_mask": "first-32.attention_mask",
                     "position_ids": "position_ids"},
        "prefill-32": {"input_ids": "input_ids", "attention_mask": "prefill-32.attention_mask",
                       "position_ids": "position_ids", "past_key_values.0.key": "prefill-32.past_key_values.0.key"}}


def test_an_if_over_bodies_with_different_results_is_refused():
    """An If's bodies give its outputs one by one; bodies with a different number of results
    are refused rather than cut to the shorter (branch_model pads them alike beforehand)."""
    import openvino as ov
    from openvino import opset8 as ops

    from kvc.export.branches import _if

    def body(results: int) -> ov.Model:
        x = ops.parameter([2], ov.Type.f32, name="x")
        x.output(0).set_names({"x"})
        return ov.Model([ops.result(ops.relu(x)) for _ in range(results)], [x], f"r{results}")

    assert len(_if("kvc.select.0.a", body(2), body(2)).outputs) == 2
    with pytest.raises(ValueError, match="an If's bodies have 2 and 1 results"):
        _if("kvc.select.0.a", body(2), body(1))


def test_the_group_is_one_blob_named_in_every_entry(paired):
    models = read_manifest(paired)["models"]
    for name in GROUP:
        blob = models[name]["blobs"]["CPU"]
        assert blob["file"] == BLOB and blob["branches"] == GROUP
    assert "branches" not in models["generate-128"]["blobs"]["CPU"]
    assert not any((paired / f"{name}.CPU.blob").exists() for name in GROUP)


def feed(session, entry, rng, start):
    """Random inputs for a model by its manifest entry: tokens, a full mask, positions from
    `start`, a past of random values."""
    out = {}
    for p in entry["inputs"]:
        dtype = session.input_dtype(p["name"])
        if p["name"] == "input_ids":
            out[p["name"]] = rng.integers(1, 100, p["shape"]).astype(dtype)
        elif p["name"] == "position_ids":
            out[p["name"]] = (start + np.arange(p["shape"][-1]))[None].astype(dtype)
        elif p["name"] == "attention_mask":
            out[p["name"]] = np.ones(p["shape"], dtype)
        else:
            out[p["name"]] = rng.standard_normal(p["shape"]).astype(dtype)
    return out


def test_each_branch_computes_exactly_what_its_model_computes_compiled_alone(paired):
    manifest = read_manifest(paired)
    pipe = open_compiled(paired, "openvino")
    config = {k: v for k, v in manifest["models"]["prefill-32"]["blobs"]["CPU"]["import_config"].items()
              if k != "WEIGHTS_PATH"}
    rng = np.random.default_rng(0)
    for name, session, start in (("first-16", pipe.first_sessions[16], 0), ("first-32", pipe.first_sessions[32], 0),
                                 ("prefill-32", pipe.prefill_sessions[32], 32), ("prefill", pipe.prefill, 16)):
        assert isinstance(session, BranchSession)
        alone = OpenVINOSession(load(paired / manifest["models"][name]["xml"], weights=paired / "weights.bin"),
                                "CPU", config)
        inputs = feed(session, manifest["models"][name], rng, start)
        got, want = session.infer(inputs), alone.infer(inputs)
        for out in manifest["models"][name]["outputs"]:
            np.testing.assert_array_equal(got[out["name"]], want[out["name"]], err_msg=f"{name} {out['name']}")
        assert np.isfinite(got["logits"]).all() and np.abs(got["logits"]).max() > 0


@pytest.fixture
def imports(monkeypatch):
    """The blob files imported, in order."""
    done = []
    real = load_module._Imports._import

    def counting(self, name, blob, sweep):
        done.append(blob["file"])
        return real(self, name, blob, sweep)

    monkeypatch.setattr(load_module._Imports, "_import", counting)
    return done


def test_an_open_imports_the_if_blob_once_and_first(paired, imports):
    open_compiled(paired, "openvino")
    assert imports == [BLOB, "generate-128.CPU.blob"]


def test_a_lazy_if_blob_goes_with_its_last_session_and_comes_back_when_run(paired, imports):
    manifest = read_manifest(paired)
    pipe = pipeline_from(paired, manifest, "openvino", lazy=True)
    first, bulk = pipe.first_sessions[32], pipe.prefill_sessions[32]
    rng = np.random.default_rng(1)
    first.infer(feed(first, manifest["models"]["first-32"], rng, 0))
    bulk.infer(feed(bulk, manifest["models"]["prefill-32"], rng, 32))
    assert imports == [BLOB]
    first.release()
    # The first model's request lives on while the blob does: the plugin crashed running one
    # request of an If model after another was released.
    for _ in range(3):
        bulk.infer(feed(bulk, manifest["models"]["prefill-32"], rng, 32))
    assert imports == [BLOB]  # still held by the bulk session
    bulk.release()
    first.infer(feed(first, manifest["models"]["first-32"], rng, 0))
    assert imports == [BLOB] * 2


def test_the_compiled_pipeline_runs_both_branches_as_the_ir_does(paired):
    """A 50-token prompt runs the first chunk then chunks over its past; 64 the first chunk and
    the bulk one: the blobs' tokens are the IR's."""
    for prompt in ("1," * 49 + "7", "3," * 63 + "9"):
        args = ("run", paired, "--prompt-ids", prompt, "--max-new-tokens", "4", "--json")
        blobs = json.loads(kvc(*args, "--backend", "openvino").stdout)
        ir = json.loads(kvc(*args, "--backend", "numpy").stdout)
        assert blobs["tokens"] == ir["tokens"]


def damaged(paired, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(paired, out)
    m = json.loads((out / MANIFEST).read_text())
    damage(m["models"])
    (out / MANIFEST).write_text(dumps(m))
    return out


def swap(models):
    for name in GROUP:
        branches = models[name]["blobs"]["CPU"]["branches"]
        branches[0], branches[1] = branches[1], branches[0]


@pytest.mark.parametrize("damage,message", [
    (lambda m: m["first-32"]["blobs"]["CPU"].update(branches=["first-32"]),
     "model 'first-32''s CPU blob has malformed branches"),
    (lambda m: m["first-32"]["blobs"]["CPU"].update(branches=["first-32", "prefill-48"]),
     "model 'first-32''s CPU blob has malformed branches"),
    (lambda m: m["first-32"]["blobs"]["CPU"].update(branches=["first-32", "first-32"]),
     "model 'first-32''s CPU blob has malformed branches"),
    (lambda m: m["prefill-32"]["blobs"]["CPU"].pop("branches"),
     "disagree on their shared CPU blob"),
    (lambda m: m["first-32"]["blobs"]["CPU"].update(branches=["first-32", "prefill"]),
     "disagree on their shared CPU blob"),
    (lambda m: next(p for p in m["first-32"]["outputs"] if p["name"] == "logits").update(element_type="f16"),
     "model 'first-32' shares a CPU blob with 'prefill' but not its outputs"),
])
def test_a_manifest_misdescribing_the_pair_is_refused(paired, tmp_path, damage, message):
    out = damaged(paired, tmp_path, damage)
    result = kvc("run", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--backend", "numpy", code=3)
    assert message in result.output


def test_a_manifest_that_reordered_the_branches_is_refused_at_import(paired, tmp_path):
    """Reordered in every entry the manifest is consistent, but each If's selector names the
    model it selects and its place: the import's port check refuses it (else the bulk model
    would run a first chunk's body)."""
    out = damaged(paired, tmp_path, swap)
    result = kvc("run", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--backend", "openvino", code=3)
    assert "model 'prefill-32+prefill+first-32+first-16''s inputs differ from what the manifest lists" in result.output
    assert "kvc.select.0.prefill-32" in result.output


@pytest.mark.parametrize("name", fixture_names(compressed=True))
def test_every_fixture_compiles_with_the_defaults_and_runs_its_goldens(name, tmp_path):
    """kvc compile's defaults (`compile_static` as the CLI resolves it, at P 64) on every
    fixture and compressed weight format publish an If blob whose every probe passed; exact
    blobs (f32, no dynamic quantization) then reproduce the stateful model's goldens. Each
    default was once refused on part of the zoo: int8 and int4-per-channel weights judged as
    exact while the plugin quantizes their activations, qwen3_moe's blob of dynamic rows that
    the plugin cannot import."""
    from kvc.export.compile import compile_static, source_selects
    from kvc.runtime.compare import reduced_arithmetic

    out = tmp_path / "out"
    path = fixtures.path(name)
    static = compile_static(("CPU",), "auto", source_selects(path), max_prompt_len=64, min_response_len=64)
    manifest = compile_to(path, out, CompileOptions(static))
    blob = manifest["models"]["prefill"]["blobs"]["CPU"]
    assert len(blob["branches"]) > 1 and manifest["verification"]["ok"]
    assert all(r["ok"] for r in manifest["blob_check"])
    if reduced_arithmetic("openvino", blob["import_config"]):
        assert all("peer_nrmse" in r for r in manifest["blob_check"])  # judged by the plugin's own drift
        return
    pipe = open_compiled(out, "openvino")
    for prompt in fixtures.goldens(name)["prompts"]:
        assert pipe.generate(prompt["ids"], 24).tokens == host_golden(name, prompt)[0], prompt["name"]


FORMS = [(name, form) for form in ("onnx", "stateless") for name in fixtures.MODELS
         if (fixtures.ROOT / name / fixtures.FORMS[form]).exists()]


@pytest.mark.parametrize("name, form", FORMS, ids=[f"{n}-{f}" for n, f in FORMS])
def test_every_source_form_compiles_with_the_defaults_and_runs_its_goldens(name, form, tmp_path):
    """The defaults on each fixture's ONNX and stateless IR forms. Every ONNX one stopped with an
    internal error in the blob check: its first chunk of dynamic rows had lost its present
    outputs' KV heads to shape inference (and GPT-2 its logits' batch), and the If padded them
    to the rows' size (pin-rows). At f32, the defaults of a host without bf16 (with bf16 every
    first chunk is static)."""
    from kvc.export.compile import compile_static, source_selects

    out, path = tmp_path / "out", fixtures.path(name, form)
    static = compile_static(("CPU",), "f32", source_selects(path), max_prompt_len=64, min_response_len=64)
    assert static.prefill_first_rows == ("static" if source_selects(path) else "dynamic")
    manifest = compile_to(path, out, CompileOptions(static, inference_precision="f32"))
    assert all(sum(d < 0 for d in port["shape"]) <= 1 for entry in manifest["models"].values()
               for port in entry["outputs"])  # the rows of a first chunk at most
    assert manifest["verification"]["ok"] and all(r["ok"] for r in manifest["blob_check"])
    pipe = open_compiled(out, "openvino")
    peer = "onnxruntime" if form == "onnx" else "openvino"
    for prompt in fixtures.goldens(name)["prompts"]:
        assert pipe.generate(prompt["ids"], 24).tokens == prompt["tokens"][peer], prompt["name"]


@pytest.mark.parametrize("name", ["llama", "gpt_oss"] + list(COMPRESSED_FORMATS))
def test_static_first_chunks_run_the_goldens_through_the_if_blob(name, tmp_path):
    """At exact f32 the If blob's static branches reproduce the stateful model's goldens (the
    6-token prompt is one first-16 call, the 17-token one a first-32 call, the 54-token one
    first-32 then the bulk chunk; the chunk runs where a call ends off the bulk chunk's rows)."""
    out = tmp_path / "out"
    manifest = compile_to(fixtures.path(name), out,
                          CompileOptions(dataclasses.replace(CHUNKED, kv_precision="f32"), inference_precision="f32"))
    assert manifest["models"]["first-32"]["blobs"]["CPU"]["branches"] == GROUP
    assert all(r["ok"] for r in manifest["blob_check"])
    pipe = open_compiled(out, "openvino")
    for prompt in fixtures.goldens(name)["prompts"]:
        assert pipe.generate(prompt["ids"], 24).tokens == host_golden(name, prompt)[0], prompt["name"]
