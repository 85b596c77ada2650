"""A vision-language export's language model (optimum's image-text-to-text: it takes
inputs_embeds): compiled with the rows kept, run and checked by token ids through its text
embeddings model (kvc.runtime.embeddings), against PyTorch's goldens."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvc import fixtures
from kvc.export.load import open_compiled
from kvc.export.manifest import read_manifest
from kvc.ir.text_embeddings import RT_KEY, TEXT_EMBEDDINGS
from kvc.runtime.embeddings import language_config
from tests.cli.runner import kvc

NAME = "llava"
# The vision-language fixtures: LLaVA (Llama), Gemma 3 (token_type_ids, a window over a
# difference of slots), Qwen2.5-VL (mRoPE's 3-D position_ids).
VISION = ("llava", "gemma3", "qwen2_5_vl")


def _compile(name: str, out):
    """CPU blobs at f32 (exact: the default bf16 is judged by the plugin's own drift, in the
    zoo-wide tests) and NPU blobs."""
    kvc("compile", fixtures.path(name), "-o", out, "--device", "CPU", "--device", "NPU", "--inference-precision", "f32")
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _compile(NAME, tmp_path_factory.mktemp("vlm") / "out")


def test_the_models_take_rows_and_the_directory_carries_their_text_embeddings_model(compiled):
    manifest = read_manifest(compiled)
    hidden = fixtures.goldens(NAME)["config"]["hidden_size"]
    for name, entry in manifest["models"].items():
        ports = {p["name"]: p for p in entry["inputs"]}
        assert "input_ids" not in ports, name
        assert ports["inputs_embeds"]["element_type"] == "f32" and ports["inputs_embeds"]["shape"][2] == hidden, name
    # text_config's 256 positions lower the default P so that P + R fits them
    assert manifest["plan"]["lengths"]["max_prompt_len"] == 128
    for suffix in (".xml", ".bin"):
        copy = TEXT_EMBEDDINGS.replace(".xml", suffix)
        assert copy in manifest["files"] and copy in manifest["tokenizer"]
        assert (compiled / copy).read_bytes() == (fixtures.path(NAME) / copy).read_bytes()
    assert TEXT_EMBEDDINGS in manifest["source"]["sha256"]
    for entry in manifest["models"].values():  # where the source lay is not written into the IR
        assert RT_KEY not in (compiled / entry["xml"]).read_text()


@pytest.mark.parametrize("name", VISION)
def test_the_compiled_pipeline_gives_the_torch_goldens(name, tmp_path):
    out = _compile(name, tmp_path / "out")
    for backend in ("numpy", "openvino", "npu"):
        pipe = open_compiled(out, backend)
        for prompt in fixtures.goldens(name)["prompts"]:
            assert pipe.generate(prompt["ids"], len(prompt["tokens"]["torch"])).tokens == prompt["tokens"]["torch"], \
                (backend, prompt["name"])


def test_the_same_model_elsewhere_compiles_to_the_same_bytes(tmp_path):
    """The text embeddings model's path is found on this machine, never written."""
    outs = []
    for where in ("a", "b"):
        source = tmp_path / where / "model"
        shutil.copytree(fixtures.path(NAME), source)
        kvc("compile", source, "-o", tmp_path / where / "out", "--no-verify")
        outs.append(tmp_path / where / "out")
    files = read_manifest(outs[0])["files"]
    assert files == read_manifest(outs[1])["files"]
    assert any(name.endswith(".xml") and name != TEXT_EMBEDDINGS for name in files)


def test_a_model_that_takes_rows_without_its_text_embeddings_model_is_refused(tmp_path):
    source = tmp_path / "model"
    shutil.copytree(fixtures.path(NAME), source)
    (source / TEXT_EMBEDDINGS).unlink()
    result = kvc("compile", source, "-o", tmp_path / "out", code=3)
    assert "openvino_language_model.xml: takes inputs_embeds" in result.output
    assert f"expected {TEXT_EMBEDDINGS} in its directory" in result.output and "[no-text-embeddings]" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("form, found", [
    ("width", "found f32[?,?,32]"),  # rows of another width
    ("rank", "found f32[?,64]"),  # a row per token, the batch flattened away
    ("float-ids", "found f32[?,?]"),  # ids as floats
])
def test_a_text_embeddings_model_the_language_model_cannot_use_is_refused_up_front(form, found, tmp_path):
    import openvino as ov
    import openvino.opset13 as ops

    source = tmp_path / "model"
    shutil.copytree(fixtures.path(NAME), source)
    ids = ops.parameter([-1, -1], np.float32 if form == "float-ids" else np.int64, name="input")
    ids.output(0).set_names({"input"})
    index = ops.convert(ids, "i64") if form == "float-ids" else ids
    rows = ops.gather(ops.constant(np.ones((385, 32 if form == "width" else 64), np.float32)), index, 0)
    if form == "rank":
        rows = ops.reshape(rows, ops.constant(np.array([-1, 64], np.int64)), False)
    rows.output(0).set_names({"inputs_embeds"})
    ov.save_model(ov.Model([rows], [ids], "embeddings"), source / TEXT_EMBEDDINGS)
    result = kvc("compile", source, "-o", tmp_path / "out", code=3)
    assert found in result.output and "[bad-text-embeddings]" in result.output
    assert "verifying" not in result.output  # refused before the static models run


def test_a_text_embeddings_model_linked_from_outside_the_directory_is_refused(tmp_path):
    source, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    shutil.copytree(fixtures.path(NAME), source)
    elsewhere.mkdir()
    shutil.move(source / TEXT_EMBEDDINGS, elsewhere / TEXT_EMBEDDINGS)
    (source / TEXT_EMBEDDINGS).symlink_to(elsewhere / TEXT_EMBEDDINGS)
    result = kvc("compile", source, "-o", tmp_path / "out", code=3)
    assert "[path-escape]" in result.output and not (tmp_path / "out").exists()


def test_a_directory_whose_manifest_leaves_out_its_text_embeddings_model_is_refused(compiled, tmp_path):
    """The text embeddings model gives every row the compiled models read: a manifest that
    does not list it (and so no hash of it) is refused, else a replaced one ran unchecked
    (the review's: `kvc verify` OK, `kvc run` other tokens for an id no probe feeds)."""
    import json

    copy = tmp_path / "out"
    shutil.copytree(compiled, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for name in (TEXT_EMBEDDINGS, TEXT_EMBEDDINGS.replace(".xml", ".bin")):
        del manifest["files"][name]
        manifest["tokenizer"].remove(name)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    for command in (("verify", copy), ("run", copy, "--prompt-ids", "1,2,3")):
        result = kvc(*command, code=3)
        assert f"'{TEXT_EMBEDDINGS}' is used but not listed with its hash" in result.output, command


@pytest.mark.parametrize("delisted", [True, False])
def test_a_changed_text_embeddings_copy_behind_a_rehashed_manifest_is_refused(compiled, tmp_path, delisted):
    """Red team A (3b): one row of the copy negated, its hash in files refreshed and the file
    taken out of the copied files ("tokenizer"): `kvc verify` compared only that list's files,
    printed OK, and `kvc run --check` generated other tokens with exit 0. Now such a manifest
    is refused (exit 3); left in the list, the copy is compared with the source's (exit 4)."""
    import json

    from kvc.export.manifest import file_entry

    copy = tmp_path / "out"
    shutil.copytree(compiled, copy)
    weights = TEXT_EMBEDDINGS.replace(".xml", ".bin")
    data = bytearray((copy / weights).read_bytes())
    hidden = fixtures.goldens(NAME)["config"]["hidden_size"]
    row = slice(200 * 4 * hidden, 201 * 4 * hidden)  # the table is at offset 0
    data[row] = (-np.frombuffer(bytes(data[row]), np.float32)).tobytes()
    (copy / weights).write_bytes(bytes(data))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][weights] = file_entry(copy / weights)
    if delisted:
        manifest["tokenizer"].remove(weights)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    verify = kvc("verify", copy, "--backends", "numpy", "--max-new-tokens", "2", code=3 if delisted else 4)
    if delisted:
        assert f"'{weights}' is in the manifest's files but not in its tokenizer" in verify.output
        run = kvc("run", copy, "--check", "--prompt-ids", "5,200,7,200,9", "--max-new-tokens", "4", code=3)
        assert f"'{weights}' is in the manifest's files but not in its tokenizer" in run.output
    else:
        assert f"mismatch in the copied files: {weights} differs from the source model's" in verify.output


def test_verify_refuses_a_source_whose_text_embeddings_differ(compiled, tmp_path):
    """The copy is compared byte for byte: the same model with one changed row of its table."""
    source = tmp_path / "model"
    shutil.copytree(fixtures.path(NAME), source)
    kvc("verify", compiled, "--against", source, "--backends", "numpy")
    weights = source / TEXT_EMBEDDINGS.replace(".xml", ".bin")
    data = bytearray(weights.read_bytes())
    data[256:260] = np.float32(7.0).tobytes()  # the table is at offset 0: a value of token 1's row
    weights.write_bytes(bytes(data))
    result = kvc("verify", compiled, "--against", source, "--backends", "numpy", code=4)
    assert f"{TEXT_EMBEDDINGS.replace('.xml', '.bin')} differs from the source model's" in result.output


def test_a_vision_language_config_is_read_as_its_language_models():
    config = {"model_type": "llava", "eos_token_id": 1, "image_token_index": 9,
              "text_config": {"max_position_embeddings": 256, "sliding_window": 32, "eos_token_id": 2}}
    assert language_config(config) == {**config, "max_position_embeddings": 256, "sliding_window": 32,
                                       "eos_token_id": 2}
    assert language_config({"max_position_embeddings": 64}) == {"max_position_embeddings": 64}


def _with_mrope_positions(name: str, out):
    """Fixture `name` with its position_ids [B, S] replaced by mRoPE's [3, B, S] (Qwen2-VL's
    language model: a temporal, height and width position per token), of which the model reads
    the first row: a text's sections are all the same position, so its tokens are unchanged."""
    import openvino as ov
    import openvino.opset13 as ops

    shutil.copytree(fixtures.path(name), out)
    model = ov.Core().read_model(fixtures.path(name) / "openvino_model.xml")  # not the copy, which is rewritten
    old = next(p for p in model.get_parameters() if "position_ids" in p.output(0).get_names())
    new = ops.parameter([3, -1, -1], np.int64, name="position_ids")
    first = ops.gather(new, ops.constant(np.int64(0)), ops.constant(np.int64(0)))
    old.output(0).set_names(set())
    new.output(0).set_names({"position_ids"})
    for target in list(old.output(0).get_target_inputs()):
        target.replace_source_output(first.output(0))
    model.remove_parameter(old)
    model.add_parameters([new])
    ov.save_model(model, out / "openvino_model.xml", compress_to_fp16=False)
    return out


def test_three_dimensional_position_ids_must_state_their_sections(tmp_path):
    source = _with_mrope_positions("mistral", tmp_path / "model")
    xml = source / "openvino_model.xml"
    text = xml.read_text()
    assert text.count('shape="3,?,?"') == 1
    xml.write_text(text.replace('shape="3,?,?"', 'shape="?,?,?"'))
    result = kvc("compile", source, "-o", tmp_path / "out", code=3)
    assert "3-D position_ids must state their sections (expected [3, ?, ?] (mRoPE), found [?,?,?]) [bad-input]" \
        in result.output


@pytest.mark.parametrize("device", ["CPU", "NPU"])
def test_three_dimensional_position_ids_are_static_and_fed_a_texts_positions(device, tmp_path):
    """mRoPE's position_ids [3, B, S] become [3, 1, rows] (not [1, rows, S]: an internal error
    before); kvc gives every section a text's positions, mask-positions reads the first row
    (mistral's window), and the pipeline reproduces the model's PyTorch goldens."""
    source = _with_mrope_positions("mistral", tmp_path / "model")
    out = tmp_path / "out"
    kvc("compile", source, "-o", out, "--device", device, *(("--inference-precision", "f32") if device == "CPU" else ()))
    manifest = read_manifest(out)
    for name, entry in manifest["models"].items():
        rows = next(p["shape"][1] for p in entry["inputs"] if p["name"] == "input_ids")
        assert next(p for p in entry["inputs"] if p["name"] == "position_ids")["shape"] == [3, 1, rows], name
    pipe = open_compiled(out, {"CPU": "openvino", "NPU": "npu"}[device])
    for prompt in fixtures.goldens("mistral")["prompts"]:
        assert pipe.generate(prompt["ids"], 24).tokens == prompt["tokens"]["torch"], prompt["name"]


def test_an_input_kvc_cannot_feed_is_refused_before_anything_runs(tmp_path):
    """Qwen3-VL's language model also takes visual_pos_masks and deepstack_visual_embeds: kvc
    feeds neither, and said so only at a pass (exit 6) or at the first probe (exit 2)."""
    import openvino as ov
    import openvino.opset13 as ops

    source = tmp_path / "model"
    shutil.copytree(fixtures.path("llama"), source)
    model = ov.Core().read_model(fixtures.path("llama") / "openvino_model.xml")
    extra = ops.parameter([-1, -1], ov.Type.boolean, name="visual_pos_masks")
    extra.output(0).set_names({"visual_pos_masks"})
    model.add_parameters([extra])
    ov.save_model(model, source / "openvino_model.xml", compress_to_fp16=False)
    result = kvc("compile", source, "-o", tmp_path / "out", code=3)
    assert "openvino_model.xml: input visual_pos_masks is not one kvc can feed" in result.output
    assert "found visual_pos_masks boolean[?,?]) [unknown-input]" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("finite", [True, False])
def test_gemma3s_whole_prompt_prefill_compiles_at_the_cpus_default_precision(finite, tmp_path, monkeypatch):
    """Its mask's float32-lowest fill rounded to -inf at bf16 (0 * -inf at every attended
    slot) once its shapes were static, and the compile's blob check refused the unchunked
    prefill (0.85 of the logits' spread off the IR, the plugin's own drift 0.01);
    unmask-pad-rows/finite-fill keeps it finite (tests/passes/test_unmask_pad_rows.py)."""
    from kvc.export.compile import cpu_precision
    import kvc.passes.unmask_pad_rows as unmask

    if not finite:
        if cpu_precision("auto") != "bf16":
            pytest.skip("the CPU plugin computes at f32 on this host: no bf16 to round the fill")
        rules = unmask._rules
        monkeypatch.setattr(unmask, "_rules", lambda *args: rules(*args)[:-1])
    out = tmp_path / "out"
    result = kvc("compile", fixtures.path("gemma3"), "-o", out, "--prefill-chunk-size", "0", "--prefill-first", "0",
                 code=0 if finite else 4)
    if finite:
        assert all(row["ok"] for row in read_manifest(out)["blob_check"])
    else:
        assert "the CPU blobs do not reproduce the static IR: prompt of 127 tokens" in result.output
