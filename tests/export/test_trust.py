"""A compiled directory is checked before it is trusted (issue 11): sizes on every open,
sha256 on `kvc verify` and `kvc run --check`, the source found from anywhere and checked
unchanged, and a verification that cannot be fooled by NaN weights behind a consistent
manifest."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from kvc import fixtures
from kvc.export.manifest import MANIFEST, dumps, file_entry, read_manifest
from kvc.verify.compiled import directory_selects
from tests.cli.runner import SMALL, kvc



@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A private copy of the llama fixture, so tests may move or edit it."""
    src = tmp_path_factory.mktemp("src") / "llama"
    shutil.copytree(fixtures.path("llama"), src)
    return src


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, source):
    out = tmp_path_factory.mktemp("trust") / "out"
    kvc("compile", source, "-o", out, *SMALL, "--device", "CPU")
    return out


@pytest.fixture
def compiled(pristine, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(pristine, out)
    return out


def rehash(directory) -> None:
    """Update the manifest's sizes and hashes to the files as they are now: a consistent lie."""
    m = json.loads((directory / MANIFEST).read_text())
    m["files"] = {name: file_entry(directory / name) for name in m["files"]}
    (directory / MANIFEST).write_text(dumps(m))


def embedding_region(directory) -> tuple[int, int]:
    xml = (directory / "prefill.xml").read_text()
    found = re.search(r'name="self\.model\.embed_tokens\.weight" type="Const".*?offset="(\d+)" size="(\d+)"', xml, re.S)
    return int(found[1]), int(found[2])


def run(directory, *extra, code=0):
    return kvc("run", directory, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--backend", "numpy", *extra,
               code=code)


def test_untouched_directory_opens_and_checks(compiled):
    run(compiled, "--check")


def test_truncated_weights_are_refused_on_every_open(compiled):
    weights = compiled / "weights.bin"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 64)
    for backend in ("numpy", "openvino"):
        out = kvc("run", compiled, "--prompt-ids", "1,2", "--backend", backend, code=3).output
        assert "weights.bin" in out and f"expected {size} bytes, found {size - 64} bytes" in out
        assert "[file-changed]" in out and "Traceback" not in out


def test_altered_weights_are_refused_by_run_check_and_verify(compiled):
    offset, _ = embedding_region(compiled)
    with open(compiled / "weights.bin", "r+b") as f:
        f.seek(offset)
        f.write(b"\x7f" * 16)
    out = run(compiled, "--check", code=3).output
    assert "weights.bin" in out and "sha256 differs" in out
    assert "sha256 differs" in kvc("verify", compiled, "--backends", "numpy", code=3).output


def test_a_missing_blob_is_refused(compiled):
    blob = read_manifest(compiled)["models"]["prefill"]["blobs"]["CPU"]["file"]  # with first-16's on a bf16 host
    (compiled / blob).unlink()
    out = kvc("run", compiled, "--prompt-ids", "1", code=3).output
    assert blob in out and "[file-missing]" in out


def test_nan_weights_behind_a_consistent_manifest_fail_verification(compiled):
    offset, size = embedding_region(compiled)
    with open(compiled / "weights.bin", "r+b") as f:
        f.seek(offset)
        f.write(np.full(size // 4, np.nan, np.float32).tobytes())
    rehash(compiled)
    # The hashes agree: only the numbers can tell. No token is printed from NaN logits.
    for backend in ("numpy", "openvino"):
        out = kvc("run", compiled, "--check", "--prompt-ids", "1,2,3", "--backend", backend, code=8).output
        assert "computed NaN in the logits" in out and "Traceback" not in out and "generated" not in out
    for backend in ("numpy", "openvino"):
        result = kvc("verify", compiled, "--backends", backend, "--max-new-tokens", "4", code=4)
        assert "verification: MISMATCH" in result.output and "non-finite" in result.output


def test_copied_files_unlike_the_sources_fail_verification(compiled):
    """tokenizer.json with two tokens' ids swapped behind a consistent manifest: `kvc run
    --prompt` feeds other ids and every probe, which feeds ids, agrees; the copy is compared
    with the source's."""
    report = json.loads(kvc("verify", compiled, "--backends", "numpy", "--max-new-tokens", "2", "--json").stdout)
    assert report["copies"]["ok"] and report["copies"]["files"] >= 3
    _swap_two_tokens(compiled)
    rehash(compiled)
    result = kvc("verify", compiled, "--backends", "numpy", "--max-new-tokens", "2", code=4)
    assert "copied files: tokenizer.json differs from the source model's" in result.output
    assert "kvc: error: mismatch in the copied files: tokenizer.json differs" in result.output


def _swap_two_tokens(directory) -> None:
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (directory / "tokenizer.json").write_text(json.dumps(data))


def test_a_copied_file_the_source_lacked_is_refused_not_read(source, tmp_path):
    """Red team A (3a): a compile of a source without generation_config.json and
    tokenizer.json, both planted in OUT with no manifest edit: `kvc run --check` stopped at the
    planted EOS and tokenized with the planted tokenizer, exit 0, and `kvc verify` said OK."""
    bare = tmp_path / "bare"
    shutil.copytree(source, bare)
    (bare / "generation_config.json").unlink()
    (bare / "tokenizer.json").unlink()
    out = tmp_path / "out"
    kvc("compile", bare, "-o", out, *SMALL, "--device", "CPU", "--no-verify")
    assert "generation_config.json" not in read_manifest(out)["files"]
    (out / "generation_config.json").write_text('{"eos_token_id": 72}\n')
    for extra in ([], ["--check"]):
        result = run(out, *extra, code=3)
        assert f"{out / 'generation_config.json'}: a tokenizer, config or text embeddings file the manifest " \
               "does not list" in result.output and "[file-unlisted]" in result.output
    (out / "generation_config.json").unlink()
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    result = kvc("run", out, "--check", "--prompt", "Hello world", "--max-new-tokens", "2", code=3)
    assert f"{out / 'tokenizer.json'}" in result.output and "[file-unlisted]" in result.output
    result = kvc("verify", out, "--backends", "numpy", "--max-new-tokens", "2", code=3)
    assert "tokenizer.json" in result.output and "[file-unlisted]" in result.output


def test_verify_compares_copies_the_manifest_lists_with_the_source_s_on_both_sides(compiled, source, tmp_path):
    """Every tokenizer or config file beside the source or in OUT is compared, whatever the
    manifest lists: a copy of a file the source does not have (its hash in the manifest, a
    consistent lie), or a file of the source that OUT has no copy of, is a mismatch."""
    m = json.loads((compiled / MANIFEST).read_text())
    assert "special_tokens_map.json" not in m["files"] and not (source / "special_tokens_map.json").exists()
    (compiled / "special_tokens_map.json").write_text('{"eos_token": "</s>"}\n')
    m["files"]["special_tokens_map.json"] = file_entry(compiled / "special_tokens_map.json")
    m["tokenizer"].append("special_tokens_map.json")
    (compiled / MANIFEST).write_text(dumps(m))
    run(compiled, "--check")  # what the manifest says is what the directory holds
    result = kvc("verify", compiled, "--backends", "numpy", "--max-new-tokens", "2", code=4)
    assert (f"mismatch in the copied files: special_tokens_map.json is in {compiled} but the source model has "
            "none") in result.output
    (compiled / "special_tokens_map.json").unlink()
    (compiled / "tokenizer_config.json").unlink()
    del m["files"]["special_tokens_map.json"], m["files"]["tokenizer_config.json"]
    m["tokenizer"] = [n for n in m["tokenizer"] if n not in ("special_tokens_map.json", "tokenizer_config.json")]
    (compiled / MANIFEST).write_text(dumps(m))
    run(compiled, "--check")
    result = kvc("verify", compiled, "--backends", "numpy", "--max-new-tokens", "2", code=4)
    assert (f"mismatch in the copied files: tokenizer_config.json is beside the source model "
            f"({source / 'tokenizer_config.json'}) but was not copied into {compiled}") in result.output


@pytest.mark.parametrize("lists", ["files", "neither"])
def test_a_copy_taken_out_of_the_manifest_s_copied_files_is_refused(compiled, lists):
    """Red team A (3b): tokenizer.json with two tokens swapped, its hash refreshed, taken out
    of the manifest's copied files ("tokenizer"): `kvc verify` compared only what that list
    named and printed OK, and `kvc run --check` tokenized with it, exit 0. Taken out of `files`
    too, it is a file the manifest does not list."""
    _swap_two_tokens(compiled)
    rehash(compiled)
    m = json.loads((compiled / MANIFEST).read_text())
    m["tokenizer"].remove("tokenizer.json")
    if lists == "neither":
        del m["files"]["tokenizer.json"]
    (compiled / MANIFEST).write_text(dumps(m))
    expected = ("'tokenizer.json' is in the manifest's files but not in its tokenizer" if lists == "files" else
                "tokenizer.json: a tokenizer, config or text embeddings file the manifest does not list")
    for argv in (["run", compiled, "--check", "--prompt", "Hello world", "--max-new-tokens", "2"],
                 ["verify", compiled, "--backends", "numpy", "--max-new-tokens", "2"]):
        assert expected in kvc(*argv, code=3).output, argv


@pytest.mark.parametrize("value,message", [
    ("tokenizer.json", "malformed tokenizer (the files copied beside the models)"),
    (["tokenizer.json", "tokenizer.json"], "malformed tokenizer"),
    (["tokenizer.json", "weights.bin"], "the copied files (tokenizer) list 'weights.bin', which kvc never copies"),
    (["tokenizer.json", "special_tokens_map.json"],
     "'special_tokens_map.json' is in the manifest's tokenizer but not in its files"),
])
def test_a_malformed_list_of_copied_files_is_refused(compiled, value, message):
    m = json.loads((compiled / MANIFEST).read_text())
    m["tokenizer"] = value
    if isinstance(value, list) and "weights.bin" not in value:  # the rest of files agrees with it
        for name in list(m["files"]):
            if name.endswith(".json") and name not in value:
                del m["files"][name]
    (compiled / MANIFEST).write_text(dumps(m))
    out = run(compiled, code=3).output
    assert f"{compiled / MANIFEST}: {message}" in out and "[bad-manifest]" in out


def test_goldens_never_record_and_always_fail_non_finite_logits(compiled, tmp_path):
    goldens = tmp_path / "goldens.json"
    kvc("verify", compiled, "--record", goldens, "--backends", "numpy", "--max-new-tokens", "3")
    offset, size = embedding_region(compiled)
    with open(compiled / "weights.bin", "r+b") as f:
        f.seek(offset)
        f.write(np.full(size // 4, np.nan, np.float32).tobytes())
    rehash(compiled)
    out = kvc("verify", compiled, "--goldens", goldens, "--backends", "numpy", code=4).output
    assert "non-finite logit(s)" in out
    again = tmp_path / "again.json"
    out = kvc("verify", compiled, "--record", again, "--backends", "numpy", "--max-new-tokens", "3", code=4).output
    assert "refusing to record them as goldens" in out and not again.exists()


def test_manifest_naming_a_file_outside_the_directory_is_refused(compiled):
    m = json.loads((compiled / MANIFEST).read_text())
    m["files"]["../outside.bin"] = {"bytes": 1, "sha256": "0" * 64}
    (compiled / MANIFEST).write_text(dumps(m))
    assert "outside the compiled directory" in run(compiled, code=3).output


@pytest.mark.parametrize("command", ["run", "run-check", "verify"])
def test_a_compiled_file_that_is_a_symlink_out_of_the_directory_is_refused(compiled, tmp_path, command):
    """kvc verify refused such a file (path-escape) while kvc run, with or without --check, ran
    it when its size or hash matched: every command that opens the directory now refuses it."""
    outside = tmp_path / "elsewhere.bin"
    shutil.move(compiled / "weights.bin", outside)
    (compiled / "weights.bin").symlink_to(outside)
    if command == "verify":
        out = kvc("verify", compiled, "--backends", "numpy", "--max-new-tokens", "2", code=3).output
    else:
        out = run(compiled, *(["--check"] if command == "run-check" else []), code=3).output
    assert "weights.bin: a file of the compiled directory points outside the model directory" in out, out
    assert "[path-escape]" in out


@pytest.mark.parametrize("weights", ["../weights.bin", "/tmp/weights.bin"])
def test_manifest_weights_outside_the_directory_are_refused_as_such(compiled, weights):
    """Not blamed on the blobs (which import the directory's weights.bin, as they should)."""
    m = json.loads((compiled / MANIFEST).read_text())
    m["weights"] = weights
    (compiled / MANIFEST).write_text(dumps(m))
    out = run(compiled, code=3).output
    assert f"weights {weights!r} is outside the compiled directory" in out and "blob" not in out


def test_manifest_using_an_unlisted_file_is_refused(compiled):
    m = json.loads((compiled / MANIFEST).read_text())
    del m["files"]["weights.bin"]
    (compiled / MANIFEST).write_text(dumps(m))
    assert "'weights.bin' is used but not listed" in run(compiled, code=3).output


def test_old_manifest_format_asks_for_a_recompile(compiled):
    m = json.loads((compiled / MANIFEST).read_text())
    m["format"] = 1
    (compiled / MANIFEST).write_text(dumps(m))
    out = run(compiled, code=3).output
    assert "recompile" in out and "expected format 3, found format 1" in out


def _swap(a: dict, b: dict, key: str) -> None:
    a[key], b[key] = b[key], a[key]


@pytest.mark.parametrize("damage,message", [
    (lambda plan: plan.update(version=99), "malformed plan: ValueError: plan version 99, expected 1"),
    (lambda plan: plan["lengths"].pop("generate_sizes"), "malformed plan: KeyError: 'generate_sizes'"),
    (lambda plan: plan["options"].update(beam="keep"), "malformed plan: UsageError: beam=keep cannot be compiled"),
    # two entries' inputs swapped (key and value of layer 0): every shape agreed, and run --check generated
    # other tokens with exit 0
    (lambda plan: _swap(plan["kv"][0], plan["kv"][1], "input"),
     "the plan's KV entry for layer 0 key is wired to 'past_key_values.0.value'"),
    (lambda plan: _swap(plan["kv"][0], plan["kv"][2], "output"),
     "the plan's KV entry for layer 0 key is wired to 'present.1.key'"),
])
def test_a_malformed_plan_is_refused_naming_the_manifest(compiled, damage, message):
    m = json.loads((compiled / MANIFEST).read_text())
    damage(m["plan"])
    (compiled / MANIFEST).write_text(dumps(m))
    out = run(compiled, code=3).output
    assert f"{compiled / MANIFEST}: {message}" in out


@pytest.mark.parametrize("key,value,message", [
    ("source", "x", "malformed source"),
    ("source", {"path": 5, "sha256": {}}, "malformed source"),
    ("verification", "x", "malformed verification"),
    ("blob_check", "x", "malformed blob_check"),
])
def test_a_manifest_section_of_the_wrong_type_is_refused_by_every_command(compiled, key, value, message):
    """`inspect` and `verify` crashed on these (TypeError, exit 1); `report` refused them."""
    m = json.loads((compiled / MANIFEST).read_text())
    m[key] = value
    (compiled / MANIFEST).write_text(dumps(m))
    for argv in (["inspect", compiled], ["verify", compiled, "--backends", "numpy"], ["run", compiled, "--prompt-ids", "1"]):
        out = kvc(*argv, code=3).output
        assert f"{compiled / MANIFEST}: {message}" in out and "[bad-manifest]" in out


@pytest.mark.parametrize("dim,message", [
    (-1, "model 'prefill' has dynamic ports, which only a first chunk of dynamic rows has"),
    (-2, "model 'prefill' has malformed inputs"),
])
def test_a_dynamic_port_is_trusted_only_on_a_first_chunk_of_dynamic_rows(compiled, dim, message):
    """A manifest's -1 (a dynamic dimension) is a first chunk of dynamic rows' alone: on the
    prefill model's input_ids it is refused before anything is imported (exit 3), and any
    other negative dimension is malformed."""
    m = json.loads((compiled / MANIFEST).read_text())
    port = next(p for p in m["models"]["prefill"]["inputs"] if p["name"] == "input_ids")
    port["shape"][1] = dim
    (compiled / MANIFEST).write_text(dumps(m))
    out = run(compiled, code=3).output
    assert message in out


def test_the_plan_round_trips_through_the_manifest(compiled):
    from kvc.export.manifest import plan_of, read_manifest
    from kvc.plan import StaticPlan

    m = read_manifest(compiled)
    plan = plan_of(m)
    assert isinstance(plan, StaticPlan) and plan.to_dict() == m["plan"]
    assert plan.lengths.capacity == plan.lengths.sizes[-1] and plan.kv[0].input == "past_key_values.0.key"


def test_verify_finds_the_source_from_any_directory(compiled, tmp_path, monkeypatch):
    m = json.loads((compiled / MANIFEST).read_text())
    assert m["source"]["path"].startswith("/")
    monkeypatch.chdir(tmp_path)
    data = json.loads(kvc("verify", compiled, "--backends", "numpy", "--max-new-tokens", "2", "--json").stdout)
    assert data["ok"] and data["against_recorded_source"]


def test_a_moved_or_changed_source_is_reported(compiled, source, tmp_path):
    moved = tmp_path / "moved"
    source.rename(moved)
    try:
        out = kvc("verify", compiled, "--backends", "numpy", code=2).output
        assert "no longer exists" in out and "--against" in out
        data = json.loads(kvc("verify", compiled, "--against", moved, "--backends", "numpy", "--max-new-tokens", "2",
                              "--json").stdout)
        assert data["ok"] and data["against_recorded_source"]
    finally:
        moved.rename(source)
    changed = tmp_path / "changed"
    shutil.copytree(source, changed)
    with open(changed / "openvino_model.bin", "r+b") as f:
        f.write(b"\xff" * 4)
    m = json.loads((compiled / MANIFEST).read_text())
    m["source"]["path"] = str(changed)
    (compiled / MANIFEST).write_text(dumps(m))
    rehash(compiled)
    out = kvc("verify", compiled, "--backends", "numpy", code=3).output
    assert "openvino_model.bin" in out and "changed since" in out and "[source-changed]" in out


def test_npu_blobs_are_checked_and_run_in_f32_whatever_the_host(tmp_path, source):
    out = tmp_path / "npu"
    manifest = json.loads(kvc("compile", source, "-o", out, *SMALL, "--variants", "80,128", "--device", "CPU",
                              "--device", "NPU", "--json").stdout)
    rows = manifest["blob_check"]
    assert {r["device"] for r in rows} == {"CPU", "NPU"} and all(r["ok"] for r in rows)
    # The switch probe (P = 64 tokens, started on 80) runs from the 80 variant into the 128 one on every device.
    assert [r["variants"] for r in rows if r["prompt_tokens"] == 64] == [[80, 128], [80, 128]]
    blob = manifest["models"]["prefill"]["blobs"]["NPU"]
    assert blob["compile_config"]["INFERENCE_PRECISION_HINT"] == "f32"
    data = json.loads(kvc("verify", out, "--backends", "npu", "--max-new-tokens", "4", "--json").stdout)
    assert data["ok"] and data["backend_configs"]["npu"]["INFERENCE_PRECISION_HINT"] == "f32"


def test_a_blob_that_does_not_import_is_never_published(tmp_path, source, monkeypatch):
    """Compile imports every blob as `kvc run` does: a blob that fails there fails compile."""
    import kvc.export.compile as compile_mod

    monkeypatch.setenv("KVC_DEVICE_COMPILE", "in-process")  # the patch below applies to this process only
    real = compile_mod.import_config
    monkeypatch.setattr(compile_mod, "import_config",
                        lambda *args: {**real(*args), "WEIGHTS_PATH": "no-such-weights.bin"})
    out = tmp_path / "bad"
    result = kvc("compile", source, "-o", out, *SMALL, "--device", "CPU", code=5)
    assert re.search(r"cannot import ((first-\d+\+)?prefill(\+first-\d+)?|generate-128)\.CPU\.blob on CPU: ", result.output)
    assert not out.exists() and not list(tmp_path.glob(".bad*"))


def test_beam_keep_is_refused_up_front_by_the_library():
    from kvc.errors import UsageError
    from kvc.plan import StaticOptions

    with pytest.raises(UsageError, match="beam=keep cannot be compiled: the static contract runs batch 1"):
        StaticOptions(beam="keep")


@pytest.mark.parametrize("name", ["gptj", "cohere", "gpt_oss"])
def test_interleaved_rotary_blobs_import_and_match_the_ir(name, tmp_path):
    """GPT-J (rotary_dim 8 of 16) and Cohere rotate with x[..., ::2] slices, whose INT64_MAX
    stops OpenVINO 2026.4.1's CPU plugin restored wrongly from a weightless blob; GPT-OSS's
    split-halves rotary is fused by that plugin into a RoPE node that computes differently
    after export and import (kvc's rotate-half-rope rewrites it)."""
    from kvc.export.load import open_compiled
    from kvc.runtime.compare import judge, nrmse_limit, reduced_precision, step_limit

    out = tmp_path / name
    kvc("compile", fixtures.path(name), "-o", out, *SMALL, "--device", "CPU")
    blob, ir = open_compiled(out, "openvino"), open_compiled(out, "openvino", from_ir=True)
    config = read_manifest(out)["models"]["prefill"]["blobs"]["CPU"]["import_config"]
    kv, selects = blob.plan.kv_element_types, directory_selects(out, read_manifest(out))
    # judged as the compile's blob check judges: at bf16 a near-tie may flip a token (GPT-J's
    # fifth token here, at a margin of 0.003 with first-16 blobs), a restored constant gone wrong
    # moves every logit
    verdict = judge(ir.generate([5, 6, 7, 8], 6), blob.generate([5, 6, 7, 8], 6),
                    reduced=reduced_precision(kv, "openvino", config), limit=nrmse_limit(kv, selects, "openvino", config),
                    step_bound=step_limit(kv, selects, "openvino", config))
    assert verdict.ok, verdict.reason
    # gpt_oss's router (TopK) widens the bound of runs in reduced arithmetic: on a bf16 host its
    # blobs showed NRMSE 0.038 at an expert flip on compile's probe, and compile refused them
    assert directory_selects(out, read_manifest(out)) == (name == "gpt_oss")


def test_without_embedded_small_constants_the_blob_check_refuses_gptj(tmp_path, monkeypatch):
    """The blob check is what stands between that OpenVINO bug and a published directory."""
    import kvc.export.compile as compile_mod

    monkeypatch.setenv("KVC_DEVICE_COMPILE", "in-process")  # the patch below applies to this process only
    monkeypatch.setattr(compile_mod, "embed_small_constants", lambda model: None)
    out = tmp_path / "gptj"
    result = kvc("compile", fixtures.path("gptj"), "-o", out, *SMALL, "--device", "CPU", code=5)
    assert re.search(r"cannot import ((first-\d+\+)?prefill(\+first-\d+)?|generate-128)\.CPU\.blob on CPU: .*incompatible",
                     result.output)
    assert not out.exists()


def test_without_rotate_half_rope_the_blob_check_refuses_gpt_oss(tmp_path):
    """GPT-OSS compiled with the common passes but not rotate-half-rope: the CPU blobs do not
    reproduce the IR, and compile publishes nothing (exit 4)."""
    out = tmp_path / "gpt_oss"
    result = kvc("compile", fixtures.path("gpt_oss"), "-o", out, *SMALL, "--device", "CPU",
                 "--passes", "lift-state,dense-experts", code=4)
    assert "the CPU blobs do not reproduce the static IR" in result.output
    assert not out.exists()


@pytest.fixture(scope="module")
def bulky(tmp_path_factory, source):
    """A directory with a bulk prefill model and a first-chunk one: chunks of 16, bulk 32,
    first 32 (P 64), an f16 cache."""
    out = tmp_path_factory.mktemp("trust") / "bulk"
    kvc("compile", source, "-o", out, *SMALL, "--device", "CPU", "--prefill-chunk-size", "16,32", "--prefill-first", "32",
        "--prefill-first-rows", "static", "--kv-precision", "f16", "--no-verify")
    return out


def _rename_model(models, old, new):
    models[new] = models.pop(old)


@pytest.mark.parametrize("damage,message", [
    (lambda m: m["models"].pop("prefill-32"),
     "the bulk prefill models are not the plan's bulk chunks (expected [32], found [])"),
    (lambda m: _rename_model(m["models"], "prefill-32", "prefill-032"), "unknown model name 'prefill-032'"),
    (lambda m: m["plan"]["lengths"].update(prefill_bulk_chunks=[16]),
     "malformed plan: ValueError: bulk chunks [16] must lie between the chunk 16 and P 64"),
    (lambda m: m["plan"]["lengths"].update(prefill_bulk_chunks=[32, "64"]),
     "malformed plan: ValueError: prefill_bulk_chunks must be increasing integers"),
    (lambda m: next(p for p in m["models"]["prefill-32"]["inputs"] if p["name"] == "past_key_values.0.value")
     .update(shape=[1, 2, 48, 16]), "model 'prefill-32''s input 'past_key_values.0.value' does not match the plan's "
                                   "KV layout (expected f16 [1, 2, 32, 16]"),
    (lambda m: m["models"].pop("first-32"),
     "the first-chunk models are not the plan's first chunks (expected [32], found [])"),
    (lambda m: m["plan"]["lengths"].update(prefill_first_chunks=[64]),
     "malformed plan: ValueError: first chunks [64] must lie between 0 and P 64, with a chunk"),
    (lambda m: m["plan"]["lengths"].update(prefill_first_chunks=[24]),
     "the first-chunk models are not the plan's first chunks (expected [24], found [32])"),
    (lambda m: m["models"]["first-32"]["inputs"].append(
        dict(next(p for p in m["models"]["prefill"]["inputs"] if p["name"] == "past_key_values.0.key"))),
     "first-chunk model 'first-32' reads a past (expected no past input, found input 'past_key_values.0.key')"),
    (lambda m: next(p for p in m["models"]["first-32"]["inputs"] if p["name"] == "attention_mask").update(shape=[1, 64]),
     "model 'first-32''s attention_mask does not match the plan's lengths (expected [1, 32], found [1, 64])"),
])
def test_a_manifest_whose_bulk_prefill_disagrees_with_its_plan_is_refused(bulky, tmp_path, damage, message):
    out = tmp_path / "out"
    shutil.copytree(bulky, out)
    m = json.loads((out / MANIFEST).read_text())
    damage(m)
    (out / MANIFEST).write_text(dumps(m))
    assert message in run(out, code=3).output


def test_a_manifest_from_before_bulk_chunks_still_opens(source, tmp_path):
    """Manifests written before bulk (or first) chunks have no prefill_bulk_chunks (or
    prefill_first_chunks): none."""
    compiled = tmp_path / "out"
    kvc("compile", source, "-o", compiled, *SMALL, "--device", "CPU", "--prefill-first", "0", "--no-verify")
    m = json.loads((compiled / MANIFEST).read_text())
    assert m["plan"]["lengths"].pop("prefill_bulk_chunks") == []
    assert m["plan"]["lengths"].pop("prefill_first_chunks") == []
    (compiled / MANIFEST).write_text(dumps(m))
    assert "generated (4 tokens)" in run(compiled).output


def test_a_source_with_a_nan_weight_is_refused_before_anything_is_written(source, tmp_path):
    """One NaN in an embedding row no probe token selects verified OK and served tokens chosen
    from NaN; the compile now refuses the source, naming the constant."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    xml = (src / "openvino_model.xml").read_text()
    found = re.search(r'name="self\.model\.embed_tokens\.weight" type="Const".*?offset="(\d+)"', xml, re.S)
    with open(src / "openvino_model.bin", "r+b") as f:
        f.seek(int(found[1]) + 4 * (300 * 64 + 5))  # row 300, column 5 (rows of 64)
        f.write(np.float32(np.nan).tobytes())
    out = tmp_path / "out"
    result = kvc("compile", src, "-o", out, *SMALL, code=3)
    assert "[nan-weights]" in result.output and "self.model.embed_tokens.weight" in result.output
    assert "found 1 NaN of" in result.output and not out.exists()


def test_a_damaged_tokenizer_is_an_invalid_file(compiled):
    """A truncated tokenizer.json was a usage error (exit 2) with --prompt and an invalid file
    (exit 3) with --prompt-ids: it is an invalid file either way, refused by its size before
    it is read; behind a consistent manifest, by the tokenizer."""
    tokenizer = compiled / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:100])
    out = kvc("run", compiled, "--prompt", "hi", "--max-new-tokens", "2", code=3).output
    assert f"{tokenizer}: the file's size differs from the manifest's" in out and "[file-changed]" in out
    assert "[file-changed]" in run(compiled, code=3).output
    rehash(compiled)
    out = kvc("run", compiled, "--prompt", "hi", "--max-new-tokens", "2", code=3).output
    assert "tokenizer.json" in out and "[bad-tokenizer]" in out
