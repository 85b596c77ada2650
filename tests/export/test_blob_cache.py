"""kvc compile --cache-dir: a blob compiled once is reused by a later compile that needs the
same model for the same device and configuration, never when anything it depends on differs,
and the output is byte-identical to a compile from scratch."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import shutil

import pytest

from kvc import fixtures
from kvc.export.compile import CompileOptions, compile_to
from kvc.export.device_compile import DeviceCompiler
from kvc.plan import StaticOptions

SMALL = StaticOptions(max_prompt_len=64, min_response_len=32, variants=(80,))


@pytest.fixture
def compiles(monkeypatch):
    """The (model, device) pairs kvc compiled, in order."""
    done = []
    real = DeviceCompiler.compile

    def counting(self, name, xml, weights, device, config, blob, branches=None):
        done.append((name, device))
        return real(self, name, xml, weights, device, config, blob, branches)

    monkeypatch.setattr(DeviceCompiler, "compile", counting)
    return done


def same_tree(a, b) -> list[str]:
    """The files that differ between two directories, or are in one only (empty: the same)."""
    cmp = filecmp.dircmp(a, b)
    match, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return sorted(cmp.left_only + cmp.right_only + mismatch + errors)


def compile_(path, out, cache, static=SMALL, **kw):
    return compile_to(path, out, CompileOptions(static, cache_dir=cache, **kw))


def test_one_more_variant_compiles_one_model_and_matches_a_fresh_compile(tmp_path, compiles):
    cache = tmp_path / "cache"
    compile_(fixtures.path("llama"), tmp_path / "a", cache)
    assert compiles == [("prefill", "CPU"), ("generate-80", "CPU"), ("generate-128", "CPU")]
    compiles.clear()
    more = dataclasses.replace(SMALL, variants=(80, 96))
    compile_(fixtures.path("llama"), tmp_path / "b", cache, more)
    assert compiles == [("generate-96", "CPU")]
    compiles.clear()
    compile_(fixtures.path("llama"), tmp_path / "fresh", None, more)
    assert len(compiles) == 4
    assert not same_tree(tmp_path / "b", tmp_path / "fresh")


def test_an_if_blob_is_cached_as_one_and_matches_a_fresh_compile(tmp_path, compiles):
    """The chunk, the bulk chunk and a first chunk are one CPU blob (export/branches.py), kept
    and reused as one; compiled again afresh it is the same bytes."""
    cache = tmp_path / "cache"
    chunked = dataclasses.replace(SMALL, prefill_chunk_size=(16, 32), prefill_first=(32,), variants=(80,))
    compile_(fixtures.path("llama"), tmp_path / "a", cache, chunked)
    assert compiles == [("prefill+prefill-32+first-32", "CPU"), ("generate-80", "CPU"), ("generate-128", "CPU")]
    compiles.clear()
    compile_(fixtures.path("llama"), tmp_path / "b", cache, dataclasses.replace(chunked, variants=(80, 96)))
    assert compiles == [("generate-96", "CPU")]
    compiles.clear()
    compile_(fixtures.path("llama"), tmp_path / "fresh", None, chunked)
    assert len(compiles) == 3
    assert not same_tree(tmp_path / "a", tmp_path / "fresh")


def test_one_more_device_compiles_only_its_blobs(tmp_path, compiles):
    cache = tmp_path / "cache"
    compile_(fixtures.path("llama"), tmp_path / "a", cache)
    compiles.clear()
    manifest = compile_(fixtures.path("llama"), tmp_path / "b", cache, devices=("CPU", "NPU"))
    assert compiles == [("prefill", "NPU"), ("generate-80", "NPU"), ("generate-128", "NPU")]
    assert manifest["blob_check"] and all(r["ok"] for r in manifest["blob_check"])
    for name in ("prefill", "generate-80", "generate-128"):  # NPUW's blobs hold addresses: CPU ones are compared
        assert filecmp.cmp(tmp_path / "a" / f"{name}.CPU.blob", tmp_path / "b" / f"{name}.CPU.blob", shallow=False)


def test_a_damaged_or_foreign_entry_is_compiled_again(tmp_path, compiles):
    cache = tmp_path / "cache"
    compile_(fixtures.path("llama"), tmp_path / "a", cache)
    records = sorted(cache.glob("*.json"))
    blobs = [r.with_suffix(".blob") for r in records]
    # One entry per kind of damage: a flipped byte, a blob from another entry under this key,
    # a record naming another key, a record that is not JSON.
    data = bytearray(blobs[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    blobs[0].write_bytes(bytes(data))
    shutil.copyfile(blobs[2], blobs[1])
    meta = json.loads(records[2].read_text())
    records[2].write_text(json.dumps({**meta, "key": "0" * 64}))
    compiles.clear()
    warnings = []
    compile_to(fixtures.path("llama"), tmp_path / "b", CompileOptions(SMALL, cache_dir=cache),
               progress=warnings.append)
    assert len(compiles) == 3
    assert sum("stale or damaged" in w for w in warnings) == 3
    assert not same_tree(tmp_path / "a", tmp_path / "b")
    records[0].write_text("{not json")
    compiles.clear()
    compile_(fixtures.path("llama"), tmp_path / "c", cache)
    assert len(compiles) == 1 and not same_tree(tmp_path / "a", tmp_path / "c")
    compiles.clear()
    compile_(fixtures.path("llama"), tmp_path / "d", cache)  # every entry repaired
    assert compiles == []


def test_nothing_is_reused_across_weights_configuration_or_openvino_version(tmp_path, compiles, monkeypatch):
    cache = tmp_path / "cache"
    compile_(fixtures.path("llama"), tmp_path / "a", cache)
    compiles.clear()
    compile_(fixtures.path("llama"), tmp_path / "f32", cache, inference_precision="f32")
    assert len(compiles) == 3
    # The same graph over other weights: one float of the largest weight changed.
    source = tmp_path / "source"
    shutil.copytree(fixtures.path("llama"), source)
    weights = source / "openvino_model.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    compiles.clear()
    compile_(source, tmp_path / "other-weights", cache, verify=False)
    assert len(compiles) == 3
    import kvc.export.blob_cache as blob_cache

    monkeypatch.setattr(blob_cache, "openvino_version", lambda: "2099.1")
    compiles.clear()
    compile_(fixtures.path("llama"), tmp_path / "other-openvino", cache)
    assert len(compiles) == 3


def test_another_host_cpu_is_another_key(tmp_path, compiles, monkeypatch):
    """With the plugin's default precision a CPU blob follows the host's instruction set: a
    cache directory shared with another machine hands out none of its blobs."""
    import kvc.export.blob_cache as blob_cache

    cache = tmp_path / "cache"
    compile_(fixtures.path("llama"), tmp_path / "a", cache)
    real = blob_cache.host
    monkeypatch.setattr(blob_cache, "host", lambda: {**real(), "cpu": "another CPU"})
    compiles.clear()
    compile_(fixtures.path("llama"), tmp_path / "b", cache)
    assert len(compiles) == 3


def test_a_cache_that_cannot_be_written_is_said_and_skipped(tmp_path, monkeypatch):
    import errno

    import kvc.export.blob_cache as blob_cache

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(blob_cache, "write_bytes_atomic", full)
    said = []
    compile_to(fixtures.path("llama"), tmp_path / "out", CompileOptions(SMALL, cache_dir=tmp_path / "cache"),
               progress=said.append)
    assert (tmp_path / "out" / "manifest.json").exists()
    assert sum("blob cache: cannot store" in s and "No space left on device" in s for s in said) == 3


def test_a_const_the_key_cannot_read_keeps_its_model_out_of_the_cache():
    from kvc.export.blob_cache import keyable

    read = '<layer id="1" name="w" type="Const" version="opset1">\n<data element_type="f32" shape="2" offset="0" size="8" />'
    unread = '<layer id="1" name="w" type="Const" version="opset1">\n<data element_type="f32" shape="2" size="8" offset="0" />'
    assert keyable(read) and not keyable(unread)


@pytest.mark.parametrize("tamper", [
    lambda e: e["import_config"].update(INFERENCE_PRECISION_HINT="f16"),  # imported, and judged, as other arithmetic
    lambda e: e["import_config"].update(WEIGHTS_PATH="../../etc/passwd"),
    lambda e: e["import_config"].update(KEY_CACHE_PRECISION="u4"),
    lambda e: e.update(evil={"x": 1}),  # copied into the manifest as it was
    lambda e: e.update(branches=["prefill"]),
], ids=["precision", "weights-path", "extra-config", "extra-key", "branches"])
def test_a_record_unlike_what_the_compile_would_write_is_compiled_again(tmp_path, compiles, tamper):
    """A blob cache record's entry goes into the manifest and says how its blob is imported
    and judged; the record's key, size and sha256 were checked, the entry was not. At the
    default precision, whose arithmetic only the compiled model reports."""
    from tests.cli.runner import kvc

    cache = tmp_path / "cache"
    kvc("compile", fixtures.path("llama"), "-o", tmp_path / "a", "--max-prompt-len", "64", "--min-response-len", "64",
        "--cache-dir", cache)
    compiles.clear()
    kvc("compile", fixtures.path("llama"), "-o", tmp_path / "b", "--max-prompt-len", "64", "--min-response-len", "64",
        "--cache-dir", cache)
    assert compiles == []  # the default's records are what it would write
    for record in cache.glob("*.json"):
        meta = json.loads(record.read_text())
        tamper(meta["entry"])
        record.write_text(json.dumps(meta))
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "c", "--max-prompt-len", "64",
                 "--min-response-len", "64", "--cache-dir", cache)
    assert compiles and "says other than this compile would; compiling it again" in result.output
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["models"] == \
        json.loads((tmp_path / "a" / "manifest.json").read_text())["models"]
