"""A vision-language prompt: an image's rows in place of its tokens' (kvc.runtime.embeddings.Media),
Gemma 3's both-ways attention within an image (token_type_ids), Qwen2-VL's mRoPE sections, run
by the compiled pipeline as the source model computes them on OpenVINO CPU at f32, and checked
by the compile's image probe (kvc.verify.compiled.media_probe)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvc import fixtures
from kvc.errors import UsageError
from kvc.export.load import open_compiled
from kvc.export.manifest import read_manifest
from kvc.ir import load
from kvc.runtime.embeddings import Media
from kvc.runtime.generate import greedy
from kvc.runtime.session import OpenVINOSession
from kvc.runtime import static_pipeline
from kvc.runtime.static_pipeline import prefill_calls
from tests.cli.runner import kvc

VISION = ("llava", "gemma3", "qwen2_5_vl")
WIDTH = 64  # the fixtures' hidden size


def _source(name: str):
    model = load(fixtures.path(name) / "openvino_language_model.xml")
    return OpenVINOSession(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def _image(n: int, start: int, rows: int, cols: int, sections: bool, seed: int = 1):
    """An n-token prompt with a rows x cols image at `start`: random rows, and with `sections`
    mRoPE's positions as transformers' Qwen2-VL `get_rope_index` lays them out (t, then h and w
    over the grid from the image's first position; the text after it from the grid's largest
    position + 1)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 300, n)
    m = rows * cols
    positions = None
    if sections:
        positions = np.repeat(np.arange(n)[None], 3, axis=0)
        grid = np.arange(m)
        positions[:, start:start + m] = start + np.stack([0 * grid, grid // cols, grid % cols])
        positions[:, start + m:] = positions[:, :start + m].max() + 1 + np.arange(n - start - m)
    return prompt, Media(((start, rng.standard_normal((m, WIDTH)).astype(np.float32)),), positions)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Each vision-language fixture compiled for the CPU, at its default chunking (a first chunk
    of dynamic rows, then chunks over a past) with f32 blobs, and for the NPU (an unchunked
    prefill, an f16 cache): by (name, device)."""
    outs = {}
    for name in VISION:
        for device, extra in (("CPU", ("--inference-precision", "f32")), ("NPU", ())):
            out = outs[name, device] = tmp_path_factory.mktemp(name) / device
            kvc("compile", fixtures.path(name), "-o", out, "--device", device, *extra)
    return outs


# (directory, backend, bound on the logits' difference from the source's at f32)
RUNS = (("CPU", "numpy", 2e-5), ("CPU", "openvino", 2e-5), ("NPU", "numpy", 0.02), ("NPU", "npu", 0.02))


@pytest.mark.parametrize("name", VISION)
@pytest.mark.parametrize("n, start, grid", [(12, 2, (2, 3)), (120, 40, (4, 8))])
def test_an_image_runs_as_the_source_computes_it(compiled, name, n, start, grid):
    """On every backend, the tokens and logits of the source run with the same rows, types and
    positions; and the image matters: the text alone gives other logits. 120 tokens run a first
    call and then chunks over its rows on the CPU."""
    prompt, media = _image(n, start, *grid, sections=name == "qwen2_5_vl")
    source = _source(name)
    ref = greedy(source, prompt, 6, media=media)
    text = greedy(source, prompt, 6)
    assert max(np.abs(a - b).max() for a, b in zip(ref.logits, text.logits)) > 0.1
    for device, backend, bound in RUNS:
        got = open_compiled(compiled[name, device], backend).generate(prompt, 6, media=media)
        assert got.tokens == ref.tokens, (device, backend)
        assert max(np.abs(a - b).max() for a, b in zip(got.logits, ref.logits)) < bound, (device, backend)


def test_the_generated_tokens_take_their_positions_after_the_images_grid(compiled):
    """Qwen2-VL's text after an image, and every generated token, sit at the grid's largest
    position + 1 on (transformers' rope_deltas): a 2 x 3 grid at 2 ends at position 4, so the
    12-token prompt's last token sits at 8 and the first generated one at 9, slot 12: shift -3.
    A pipeline that put generated tokens at their slots gives other logits."""
    prompt, media = _image(12, 2, 2, 3, sections=True)
    assert media.positions[:, -1].tolist() == [8, 8, 8] and media.shift == -3
    ref = greedy(_source("qwen2_5_vl"), prompt, 6, media=media)
    pipe = open_compiled(compiled["qwen2_5_vl", "CPU"], "openvino")
    run = pipe.prefill_prompt(prompt, 6, media=media)
    assert run.shift == -3
    run.shift = 0
    wrong = pipe.decode_from(run)
    assert max(np.abs(a - b).max() for a, b in zip(wrong.logits[1:], ref.logits[1:])) > 1e-3


def test_an_image_of_a_model_that_reads_token_types_runs_in_the_first_call(compiled, monkeypatch):
    """Gemma 3's image attends itself both ways only in a call over no past (optimum lays the
    step's types over the mask's first columns). The runtime puts the whole image in the first
    call; an image past the largest first chunk is refused, naming the way out."""
    pipe = open_compiled(compiled["gemma3", "CPU"], "openvino")
    first = max(pipe.lengths.first)
    prompt, media = _image(120, first - 8, 2, 8, sections=False)  # ends 8 past the first chunk
    with pytest.raises(UsageError, match=rf"the media end at position {first + 8}: no first prefill chunk \({first}\) "
                                         rf"holds them .*compile with a first chunk that holds them"):
        pipe.generate(prompt, 2, media=media)


def test_no_call_after_the_first_computes_an_image_again(tmp_path):
    """A static first chunk of 112 at P 128 and chunks of 32: the calls after it start at 96
    (P - C) and compute rows 96-111 again over a past. An image there was computed causally
    and overwrote the first call's rows (logits 4.5 off, other tokens, every check OK); it is
    refused now, and an image the later calls do not reach runs as the source computes it."""
    out = tmp_path / "out"
    kvc("compile", fixtures.path("gemma3"), "-o", out, "--inference-precision", "f32", "--prefill-chunk-size", "32",
        "--prefill-first", "112", "--prefill-first-rows", "static")
    pipe = open_compiled(out, "openvino")
    late, media = _image(128, 100, 2, 6, sections=False)
    with pytest.raises(UsageError, match=r"the media end at position 112: no first prefill chunk \(112\) holds "
                                         r"them with the calls after it starting at or past them"):
        pipe.generate(late, 4, media=media)
    early, media = _image(128, 2, 2, 6, sections=False)
    ref = greedy(_source("gemma3"), early, 4, media=media)
    got = pipe.generate(early, 4, media=media)
    assert got.tokens == ref.tokens
    assert max(np.abs(a - b).max() for a, b in zip(got.logits, ref.logits)) < 2e-5


def test_without_the_first_call_an_image_of_gemma3_is_computed_wrong(tmp_path, monkeypatch):
    """Chunks of 16 and no first chunk: every call has a past, so an image is refused, and the
    compile's image probe, which no call could run, is left out. Run anyway by the chunk split
    a text takes, its logits are not the source's: the reason for the rule."""
    out = tmp_path / "out"
    result = kvc("compile", fixtures.path("gemma3"), "-o", out, "--prefill-chunk-size", "16", "--prefill-first", "0",
                 "--inference-precision", "f32")
    assert "images: none: no first prefill call over no past holds one" in result.output  # said up front
    assert not any(r.get("media") for r in read_manifest(out)["verification"]["results"])
    prompt, media = _image(12, 2, 2, 3, sections=False)
    pipe = open_compiled(out, "openvino")
    with pytest.raises(UsageError, match="only in a prefill call over no past"):
        pipe.generate(prompt, 2, media=media)
    L = pipe.lengths
    monkeypatch.setattr(static_pipeline, "media_calls", lambda lengths, n, end: list(
        prefill_calls(0, n, (), L.prompt, (L.chunk, *L.bulk), L.first, L.first_dynamic)))
    got = pipe.generate(prompt, 2, media=media)
    ref = greedy(_source("gemma3"), prompt, 2, media=media)
    assert np.abs(got.logits[0] - ref.logits[0]).max() > 0.01


def test_the_compile_and_verify_probe_an_image(compiled):
    """Every check of a model that takes rows runs a prompt with an image (numpy, each device's
    blobs); a text model's runs none."""
    for device in ("CPU", "NPU"):
        manifest = read_manifest(compiled["gemma3", device])
        assert [r["media"] for r in manifest["verification"]["results"] if "media" in r] == [[[2, 6]]]
        assert [r["device"] for r in manifest["blob_check"] if "media" in r] == [device]
    # a model that reads no types gets an image in a chunk call over a past too (CPU: chunked)
    spans = [r["media"] for r in read_manifest(compiled["qwen2_5_vl", "CPU"])["verification"]["results"] if "media" in r]
    assert len(spans) == 2 and spans[0] == [[2, 6]] and spans[1][0][0] > 2
    assert sum("media" in r for r in read_manifest(compiled["qwen2_5_vl", "NPU"])["verification"]["results"]) == 1
    inspect = {name: kvc("inspect", compiled[name, "CPU"]).output for name in VISION}
    assert "images: anywhere in a prompt" in inspect["llava"] and "images: anywhere" in inspect["qwen2_5_vl"]
    assert "images: in the first prefill call, ending by position 96 in a prompt of 128 tokens" in inspect["gemma3"]
    result = kvc("verify", compiled["gemma3", "CPU"])
    assert len(re.findall(r"^(numpy|openvino) +\d+ +12 \(image 2-7\) ", result.output, re.M)) == 2


@pytest.mark.parametrize("media, message", [
    (Media(((2, np.zeros((3, 32), np.float32)),)), r"media rows at position 2: expected \[m, 64\], found \[3, 32\]"),
    (Media(((2, np.zeros((4, 64), np.float32)), (5, np.zeros((2, 64), np.float32)))),
     r"media span \[5, 7\) must follow the one before it \(ending at 6\)"),
    (Media(((10, np.zeros((4, 64), np.float32)),)), r"media span \[10, 14\) must .* lie within the 12-token prompt"),
    (Media((), np.zeros((3, 11), np.int64)), r"media positions: expected integers \[3, 12\] .*found int64\[3, 11\]"),
    (Media((), np.zeros((3, 12), np.float32)), r"media positions: expected integers \[3, 12\] .*found float32"),
    (Media(((2, np.full((3, 64), np.nan, np.float32)),)), r"position 2: expected finite real numbers, found float32 "
                                                           r"with NaN"),
    (Media(((2, np.full((3, 64), "x")),)), r"position 2: expected finite real numbers, found <U1"),
    (Media(((2, np.full((3, 64), 1e300)),)), r"position 2: expected finite real numbers, found float64 with NaN or "
                                             r"infinity as f32"),
    (Media((), np.full((3, 12), 2**63 + 5, np.uint64)), r"media positions: expected positions within \+-2147483647"),
    (Media((), np.full((3, 12), 2**40, np.int64)), r"media positions: expected positions within \+-2147483647"),
])
def test_media_that_do_not_fit_the_prompt_are_refused(compiled, media, message):
    pipe = open_compiled(compiled["llava" if media.positions is None else "qwen2_5_vl", "CPU"], "numpy")
    with pytest.raises(UsageError, match=message):
        pipe.generate(list(range(1, 13)), 2, media=media)


def test_positions_for_a_model_without_mrope_are_refused(compiled, tmp_path):
    """Positions are mRoPE's; a model that reads one position a token (LLaVA) or ids refuses
    them by name, on the compiled pipeline, the source and `kvc run`, before any model runs."""
    prompt, media = _image(12, 2, 2, 3, sections=True)
    message = r"media positions are mRoPE's \[3, n\] \(Qwen2-VL's language model\); this model reads one position"
    with pytest.raises(UsageError, match=message):
        open_compiled(compiled["llava", "CPU"], "numpy").generate(prompt, 2, media=media)
    with pytest.raises(UsageError, match=message):
        greedy(_source("llava"), prompt, 2, media=media)
    (start, rows), = media.spans
    np.save(tmp_path / "rows.npy", rows)
    np.save(tmp_path / "positions.npy", media.positions)
    result = kvc("run", compiled["llava", "CPU"], "--prompt-ids", ",".join(map(str, prompt)), "--image",
                 f"{start}:{tmp_path / 'rows.npy'}", "--image-positions", tmp_path / "positions.npy", code=2)
    assert re.search(message, result.output), result.output


def test_media_for_a_text_model_are_refused(compiled, tmp_path):
    prompt, media = _image(12, 2, 2, 3, sections=False)
    kvc("compile", fixtures.path("llama"), "-o", tmp_path / "llama", "--max-prompt-len", "64",
        "--min-response-len", "64", "--no-verify")
    with pytest.raises(UsageError, match="media rows need a model that takes inputs_embeds"):
        open_compiled(tmp_path / "llama", "numpy").generate(prompt, 2, media=media)


def test_kvc_run_takes_an_image_and_its_positions(compiled, tmp_path):
    """`kvc run --image START:ROWS.npy --image-positions POS.npy` gives the source's tokens."""
    import json

    prompt, media = _image(12, 2, 2, 3, sections=True)
    (start, rows), = media.spans
    np.save(tmp_path / "rows.npy", rows)
    np.save(tmp_path / "positions.npy", media.positions)
    ids = ",".join(map(str, prompt))
    result = kvc("run", compiled["qwen2_5_vl", "CPU"], "--prompt-ids", ids, "--image", f"{start}:{tmp_path / 'rows.npy'}",
                 "--image-positions", tmp_path / "positions.npy", "--max-new-tokens", 6, "--ignore-eos", "--json")
    run = json.loads(result.output)
    assert run["tokens"] == greedy(_source("qwen2_5_vl"), prompt, 6, media=media).tokens
    assert run["images"] == [[2, 6]]
    text = json.loads(kvc("run", compiled["qwen2_5_vl", "CPU"], "--prompt-ids", ids, "--max-new-tokens", 6,
                          "--ignore-eos", "--json").output)
    assert text["tokens"] != run["tokens"] and "images" not in text


@pytest.mark.parametrize("image, message", [
    ("x:{rows}", "expected START:ROWS.npy"),
    ("2:{tmp}/missing.npy", "missing.npy: no such file"),
    ("2:{tmp}", "not a regular file"),
    ("2:{pickled}", "not a NumPy .npy array without pickles"),
    ("10:{rows}", r"media span \[10, 16\) must follow the one before it \(ending at 0\) and lie within the 12-token"),
    ("\u00b2:{rows}", "expected START:ROWS.npy"),  # a digit to str.isdigit, not to int()
    ("2:{npz}", "an .npz archive; give one array as a .npy"),
])
def test_kvc_run_refuses_an_image_it_cannot_use(compiled, tmp_path, image, message):
    np.save(tmp_path / "rows.npy", np.zeros((6, WIDTH), np.float32))
    np.save(tmp_path / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "rows.npz", rows=np.zeros((6, WIDTH), np.float32))
    image = image.format(rows=tmp_path / "rows.npy", tmp=tmp_path, pickled=tmp_path / "pickled.npy",
                         npz=tmp_path / "rows.npz")
    result = kvc("run", compiled["llava", "CPU"], "--prompt-ids", ",".join(map(str, range(1, 13))), "--image", image,
                 code=2)
    assert re.search(message, result.output), result.output


def _gemma3_with_real_images(tmp_path):
    """The gemma3 fixture stating Gemma 3's 256 rows an image and 1024 positions (its rotary
    has no table, so the tiny model runs there as it does at 256)."""
    import json
    import shutil

    source = tmp_path / "gemma3"
    shutil.copytree(fixtures.path("gemma3"), source)
    config = json.loads((source / "config.json").read_text())
    config["mm_tokens_per_image"] = 256
    config["text_config"]["max_position_embeddings"] = 1024
    (source / "config.json").write_text(json.dumps(config))
    return source


def test_gemma3s_default_compile_holds_an_image_in_a_first_chunk(tmp_path):
    """With the CPU's first chunks alone (16, 128) no Gemma 3 image of 256 rows fit any call
    over no past, so the default compile could take none; a first chunk of 512 is added
    (`resolve_first`), a 256-row image after 5 text tokens runs as the source computes it,
    and the compile probes an image in every first chunk."""
    from kvc.export.compile import resolve_first, source_image_rows

    source = _gemma3_with_real_images(tmp_path)
    assert source_image_rows(source) == 256
    assert [source_image_rows(fixtures.path(name)) for name in ("llava", "qwen2_5_vl", "llama")] == [0, 0, 0]
    assert resolve_first("auto", ("CPU",), (16, 128), "static", 256) == (16, 128, 512)
    assert resolve_first("auto", ("CPU",), (32, 256), "dynamic", 256) == (512,)
    assert resolve_first("auto", ("NPU",), 0, "static", 256) == ()
    assert resolve_first((64,), ("CPU",), (16, 128), "static", 256) == (64,)  # as given
    out = tmp_path / "out"
    result = kvc("compile", source, "-o", out, "--inference-precision", "f32")
    assert "images: in the first prefill call, ending by position 512" in result.output
    # at bf16 (the CPU's default on a bf16 host) static first chunks, each probed with an image
    bf16 = kvc("compile", source, "-o", tmp_path / "bf16", "--inference-precision", "bf16").output
    assert "first 16 + first 128 + first 512" in bf16
    assert "verification: prompt of 134 tokens with an image of 6 rows at position 124" in bf16
    prompt, media = _image(300, 5, 16, 16, sections=False)
    ref = greedy(_source("gemma3"), prompt, 4, media=media)
    got = open_compiled(out, "openvino").generate(prompt, 4, media=media)
    assert got.tokens == ref.tokens
    assert max(np.abs(a - b).max() for a, b in zip(got.logits, ref.logits)) < 2e-5


def test_an_image_fault_in_the_large_first_chunk_alone_is_refused(tmp_path, monkeypatch):
    """At bf16 the first chunks are static (16, 128, 512): a fault in the larger ones' image
    handling passed the 12-token image probe, which runs first-16; each first chunk now runs
    an image."""
    from tests.mutation.mutants import apply

    applied = apply("large_first_token_types_ignored", monkeypatch.setattr, monkeypatch.setenv, "ir")
    result = kvc("compile", _gemma3_with_real_images(tmp_path), "-o", tmp_path / "out", "--inference-precision",
                 "bf16", code=4)
    assert applied.edits
    assert "prompt of 22 tokens with an image of 6 rows at position 12" in result.output


def _layout(n: int, start: int, rows: np.ndarray, cols: int, sections: bool) -> Media:
    """An image of `rows` (a grid of `cols` columns) at `start` in an n-token prompt, with
    mRoPE's positions when `sections` (as `_image` lays them out)."""
    positions = None
    if sections:
        m = len(rows)
        positions = np.repeat(np.arange(n)[None], 3, axis=0)
        grid = np.arange(m)
        positions[:, start:start + m] = start + np.stack([0 * grid, grid // cols, grid % cols])
        positions[:, start + m:] = positions[:, :start + m].max() + 1 + np.arange(n - start - m)
    return Media(((start, rows),), positions)


def _served(compiled, name, **cache):
    from kvc.cache.prefix import PrefixCache
    from kvc.cache.serving import CachedPipeline

    return CachedPipeline(open_compiled(compiled[name, "CPU"], "numpy"), PrefixCache(block_size=32, **cache))


def _same_as_plain(compiled, name, got, prompt, media, what):
    plain = open_compiled(compiled[name, "CPU"], "numpy").generate(prompt, len(got.tokens), media=media)
    assert got.tokens == plain.tokens, what
    assert max(np.abs(a - b).max() for a, b in zip(got.logits, plain.logits)) < 2e-5, what


@pytest.mark.parametrize("name", VISION)
def test_the_prefix_cache_restores_an_image_only_where_ids_rows_and_positions_agree(compiled, name):
    """A block's key holds the images and mRoPE positions of its tokens (`Media.tags`): the same
    ids with another image, no image or other positions restore nothing from a block an image
    touched, the same image restores it, and text blocks before an image are shared with text
    prompts. Gemma 3 (token_type_ids) restores no rows a prefill call after them would compute
    an image again over: its image must lie in its first call. Every run gives the tokens of
    the same prompt without the cache."""
    sections = name == "qwen2_5_vl"
    rng = np.random.default_rng(5)
    rows, other = (rng.standard_normal((6, WIDTH)).astype(np.float32) for _ in range(2))
    a = rng.integers(1, 300, 70)
    b = np.concatenate([a[:64], rng.integers(1, 300, 20)])
    text = rng.integers(1, 300, 70)
    typed = name == "gemma3"
    cases = [
        ("an image's prompt", a, _layout(70, 2, rows, 3, sections), 0),
        ("the same image, other text after two blocks", b, _layout(84, 2, rows, 3, sections), 64),
        ("the same ids, another image", b, _layout(84, 2, other, 3, sections), 0),
        ("the same ids as text", b, None, 0),
        ("a text prompt", text, None, 0),
        ("its first block, then an image in the second", np.concatenate([text[:40], a[40:]]),
         _layout(70, 40, rows, 3, sections), 0 if typed else 32),
    ]
    if sections:
        cases.insert(3, ("the same ids and rows, a 3 x 2 grid", b, _layout(84, 2, rows, 2, True), 0))
    served = _served(compiled, name, event_buffer_size=64)
    for what, prompt, media, hit in cases:
        got = served.generate(prompt, 3, media=media)
        assert got.cached_tokens == hit, (what, got.cached_tokens)
        _same_as_plain(compiled, name, got, prompt, media, what)
    stored = [block for event in served.cache.get_latest_events() if event.type == "stored" for block in event.blocks]
    keyed = [block.to_dict().get("media_key") is not None for block in stored]
    assert keyed[:2] == [True, bool(sections)] and not any(
        served.cache.blocks[block.block_hash].media for block in stored if not block.to_dict().get("media_key"))
    assert all(served.cache.blocks[k].media is None for keys in served.cache.by_content.values() for k in keys)


@pytest.mark.parametrize("name", VISION)
def test_a_chat_session_keeps_an_images_rows_across_turns(compiled, name):
    """A turn whose history holds the image of an earlier turn restores the rows the session
    kept (generated tokens at their slots + shift for mRoPE); an edit inside the image rolls
    the session back to where it begins (Gemma 3: to nothing, its image needs the first call).
    Every turn gives the tokens of its history without the session."""
    sections = name == "qwen2_5_vl"
    rng = np.random.default_rng(6)
    rows = rng.standard_normal((6, WIDTH)).astype(np.float32)
    prompt = rng.integers(1, 300, 40)
    media = _layout(40, 2, rows, 3, sections)
    served = _served(compiled, name)
    served.start_chat("s")
    first = served.generate(prompt, 4, session="s", media=media)
    history = np.concatenate([prompt, first.tokens, rng.integers(1, 300, 20)])
    positions = None
    if sections:  # generated and new tokens at their slots + shift, as transformers' get_rope_index lays them
        tail = np.arange(40, len(history)) + media.shift
        positions = np.concatenate([media.positions, np.repeat(tail[None], 3, axis=0)], axis=1)
    turns = [("the image and its answer", Media(media.spans, positions), 43),
             ("an edit inside the image", Media(((2, rows + 1),), positions), 0 if name == "gemma3" else 2)]
    for what, turn, cached in turns:
        got = served.generate(history, 3, session="s", media=turn)
        assert got.cached_tokens == cached, (what, got.cached_tokens)
        _same_as_plain(compiled, name, got, history, turn, what)


def test_restored_rows_an_image_of_gemma3_would_be_computed_over_are_refused(compiled):
    """The pipeline itself refuses what a cache must not ask: rows restored before the end of
    a Gemma 3 image, and placed rows with any image."""
    prompt, media = _image(12, 2, 2, 3, sections=False)
    with pytest.raises(UsageError, match=r"the rows of the first 4 tokens cannot be restored: a prefill call after "
                                         r"them computes the image ending at 8 again over a past"):
        open_compiled(compiled["gemma3", "CPU"], "numpy").generate(prompt, 2, media=media, reuse=4)
    pipe = open_compiled(compiled["llava", "CPU"], "numpy")
    rows = pipe.copy_rows(0, 2)
    with pytest.raises(UsageError, match="a prompt with media starts at position 0 and places no rows"):
        pipe.generate(prompt, 2, media=media, placed=((8, rows),))


def test_a_requests_workload_carries_images(compiled, tmp_path):
    """`kvc run --requests` takes `images` and `image_positions` (.npy paths relative to the
    file): a second request with the same image restores its blocks, a chat turn its session's
    rows, each with the tokens of its prompt run alone; the stored events name the image's
    blocks (`media_key`)."""
    import json

    rng = np.random.default_rng(7)
    np.save(tmp_path / "cat.npy", rng.standard_normal((6, WIDTH)).astype(np.float32))
    a = [int(t) for t in rng.integers(1, 300, 70)]
    b = a[:64] + [int(t) for t in rng.integers(1, 300, 10)]
    image = [{"start": 2, "rows": "cat.npy"}]
    lines = [{"id": "a", "prompt_ids": a, "images": image, "max_new_tokens": 3},
             {"id": "b", "prompt_ids": b, "images": image, "max_new_tokens": 3},
             {"id": "t", "prompt_ids": b, "max_new_tokens": 3}]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = kvc("run", compiled["llava", "CPU"], "--requests", tmp_path / "w.jsonl", "--prefix-cache", "--backend",
                 "numpy", "--events", tmp_path / "ev.jsonl", "--json")
    runs = json.loads(result.output)["requests"]
    assert [r["cached_tokens"] for r in runs] == [0, 64, 0]
    assert [r.get("images") for r in runs] == [[[2, 6]], [[2, 6]], None]
    pipe = open_compiled(compiled["llava", "CPU"], "numpy")
    rows = np.load(tmp_path / "cat.npy")
    for run, prompt, media in zip(runs, (a, b, b), (Media(((2, rows),)), Media(((2, rows),)), None)):
        assert run["tokens"] == pipe.generate(prompt, 3, media=media).tokens, run["id"]
    events = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    blocks = [block for e in events if e["type"] == "stored" for block in e["blocks"]]
    assert ["media_key" in block for block in blocks] == [True, False, False, False]  # a's two blocks, then t's


@pytest.mark.parametrize("line, message", [
    ({"images": {"start": 2}}, "'images' must be a list of {start, rows} objects"),
    ({"images": [{"start": 2}]}, r"images\[0\] must be an object with exactly 'start' .* and 'rows'"),
    ({"images": [{"start": -1, "rows": "cat.npy"}]}, r"images\[0\].start must be an integer from 0"),
    ({"images": [{"start": 2, "rows": "nope.npy"}]}, r"images\[0\].rows .*nope.npy: no such file"),
    ({"images": [{"start": 2, "rows": "pickled.npy"}]}, "not a NumPy .npy array without pickles"),
    ({"images": [{"start": 2, "rows": 7}]}, r"images\[0\].rows must be the path of a .npy file, found 7"),
    ({"images": [{"start": 10, "rows": "cat.npy"}]}, r"media span \[10, 16\) must .* lie within the 12-token prompt"),
    ({"image_positions": "cat.npy"}, r"media positions are mRoPE's \[3, n\]"),
])
def test_a_requests_workload_refuses_an_image_it_cannot_use(compiled, tmp_path, line, message):
    """Every image of a workload is read and checked before any request runs: the error names
    the line, exit 2, and nothing is written."""
    import json

    np.save(tmp_path / "cat.npy", np.zeros((6, WIDTH), np.float32))
    np.save(tmp_path / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    lines = [{"prompt_ids": list(range(1, 13))}, {"prompt_ids": list(range(1, 13)), **line}]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = kvc("run", compiled["llava", "CPU"], "--requests", tmp_path / "w.jsonl", "--prefix-cache", "--events",
                 tmp_path / "ev.jsonl", code=2)
    assert re.search(r"w.jsonl:2: .*" + message, result.output), result.output
    assert not (tmp_path / "ev.jsonl").exists()


def test_a_gemma3_image_no_first_call_holds_is_refused_before_the_workload_runs(compiled, tmp_path):
    import json

    np.save(tmp_path / "cat.npy", np.zeros((6, WIDTH), np.float32))
    lines = [{"prompt_ids": list(range(1, 13))},
             {"prompt_ids": list(range(1, 121)), "images": [{"start": 100, "rows": "cat.npy"}]}]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = kvc("run", compiled["gemma3", "CPU"], "--requests", tmp_path / "w.jsonl", "--prefix-cache", "--events",
                 tmp_path / "ev.jsonl", code=2)
    assert re.search(r"w.jsonl:2: request '2': .*the media end at position 106: no first prefill chunk", result.output)
    assert not (tmp_path / "ev.jsonl").exists()
