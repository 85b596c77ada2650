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


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """CPU blobs at f32 (exact: the default bf16 is judged by the plugin's own drift, in the
    zoo-wide tests) and NPU blobs."""
    out = tmp_path_factory.mktemp("vlm") / "out"
    kvc("compile", fixtures.path(NAME), "-o", out, "--device", "CPU", "--device", "NPU",
        "--inference-precision", "f32")
    return out


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


@pytest.mark.parametrize("backend", ["numpy", "openvino", "npu"])
def test_the_compiled_pipeline_gives_the_torch_goldens(compiled, backend):
    pipe = open_compiled(compiled, backend)
    for prompt in fixtures.goldens(NAME)["prompts"]:
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


def test_a_text_embeddings_model_of_another_width_is_refused(tmp_path):
    import openvino as ov
    import openvino.opset13 as ops

    source = tmp_path / "model"
    shutil.copytree(fixtures.path(NAME), source)
    ids = ops.parameter([-1, -1], np.int64, name="input")
    ids.output(0).set_names({"input"})
    rows = ops.gather(ops.constant(np.ones((385, 32), np.float32)), ids, 0)
    rows.output(0).set_names({"inputs_embeds"})
    ov.save_model(ov.Model([rows], [ids], "embeddings"), source / TEXT_EMBEDDINGS)
    result = kvc("compile", source, "-o", tmp_path / "out", code=3)
    assert "expected f32[?,?,64], found f32[?,?,32]" in result.output and "[bad-text-embeddings]" in result.output


def test_verify_refuses_a_source_whose_text_embeddings_differ(compiled, tmp_path):
    """The copy is compared byte for byte: the same model with one changed row of its table."""
    source = tmp_path / "model"
    shutil.copytree(fixtures.path(NAME), source)
    kvc("verify", compiled, "--against", source, "--backends", "numpy")
    weights = source / TEXT_EMBEDDINGS.replace(".xml", ".bin")
    data = bytearray(weights.read_bytes())
    data[-4:] = np.float32(7.0).tobytes()
    weights.write_bytes(bytes(data))
    result = kvc("verify", compiled, "--against", source, "--backends", "numpy", code=4)
    assert f"{TEXT_EMBEDDINGS.replace('.xml', '.bin')} differs from the source model's" in result.output


def test_a_vision_language_config_is_read_as_its_language_models():
    config = {"model_type": "llava", "eos_token_id": 1, "image_token_index": 9,
              "text_config": {"max_position_embeddings": 256, "sliding_window": 32, "eos_token_id": 2}}
    assert language_config(config) == {**config, "max_position_embeddings": 256, "sliding_window": 32,
                                       "eos_token_id": 2}
    assert language_config({"max_position_embeddings": 64}) == {"max_position_embeddings": 64}
