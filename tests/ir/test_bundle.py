"""Bundles: several models, one weights file; copied by the kernel, written atomically."""

from __future__ import annotations

import re

import numpy as np
import openvino as ov
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.export.build import StaticOptions, build_static
from kvc.ir import bundle as bundle_mod
from kvc.ir.bundle import Bundle, save_bundle

SMALL = StaticOptions(max_prompt_len=64, min_response_len=32, variants=(80,))


def _static(bundle=None):
    return build_static(ir.load(fixtures.path("llama")), SMALL, use_env=False, bundle=bundle)


def _texts(models):
    """What saving must keep: the models as text, with the stable friendly names saving gives."""
    from kvc.ir.naming import canonicalize_friendly_names

    for model in models.values():
        canonicalize_friendly_names(model)
    return {name: ir.to_text(m) for name, m in models.items()}


def _const_layers(xml_text):
    return [(int(o), int(s)) for o, s in re.findall(r'type="Const" version="opset1">\s*<data [^>]*offset="(\d+)" '
                                                    r'size="(\d+)"', xml_text)]


@pytest.fixture
def kernel_copies(monkeypatch):
    """Count the bytes copied file-to-file and those written from this process's memory."""
    counts = {"copied": 0, "written": 0}
    copy, pwrite = bundle_mod._copy_range, bundle_mod._pwrite_all

    def counting_copy(source, size, fd, offset):
        ok = copy(source, size, fd, offset)
        counts["copied"] += size if ok else 0
        return ok

    def counting_pwrite(fd, data, offset):
        counts["written"] += memoryview(data).nbytes
        pwrite(fd, data, offset)

    monkeypatch.setattr(bundle_mod, "_copy_range", counting_copy)
    monkeypatch.setattr(bundle_mod, "_pwrite_all", counting_pwrite)
    return counts


def test_models_read_back_identical_and_share_one_weights_file(tmp_path):
    static = _static()
    before = _texts(static.models)
    xmls = save_bundle(static.models, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(f"{n}.xml" for n in static.models), "weights.bin"])
    weights = tmp_path / "weights.bin"
    for name, xml in xmls.items():
        assert ir.to_text(static.models[name]) == before[name], "saving leaves the models as they were"
        assert ir.to_text(ir.load(xml, weights=weights)) == before[name], name
        layers = _const_layers(xml.read_text())
        assert layers and all(o % 64 == 0 and o + s <= weights.stat().st_size for o, s in layers), name
    source = (fixtures.path("llama") / "openvino_model.bin").stat().st_size
    assert weights.stat().st_size < 1.05 * source, "each weight once, whatever the number of models"


def test_saved_models_run_like_the_originals(tmp_path):
    from kvc.runtime.session import OpenVINOSession

    static = _static()
    xml = save_bundle(static.models, tmp_path)["generate-80"]
    model = static.models["generate-80"]
    feed = {p.get_any_name(): np.random.default_rng(0).integers(1, 100, size=list(p.get_shape())).astype(
        p.get_element_type().to_dtype()) for p in model.inputs}
    want = OpenVINOSession(model, "CPU").infer(feed)
    got = OpenVINOSession(ir.load(xml, weights=tmp_path / "weights.bin"), "CPU").infer(feed)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_same_models_same_bytes(tmp_path):
    save_bundle(_static().models, tmp_path / "a")
    save_bundle(_static().models, tmp_path / "b")
    for f in sorted((tmp_path / "a").iterdir()):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


def test_mapped_weights_are_copied_by_the_kernel_during_the_passes(tmp_path, kernel_copies):
    """Opened before the model is loaded (as `kvc compile` does), the bundle still finds the
    mapped weights file, starts copying during the passes, and keeps that layout."""
    with Bundle(tmp_path) as bundle:
        _static(bundle)
        bundle.commit()
        assert bundle.weights.primed and bundle.weights.restarts == 0
    big = sum(s for o, s in _const_layers((tmp_path / "prefill.xml").read_text()) if s >= 1 << 16)
    assert kernel_copies["copied"] >= big > 0
    assert kernel_copies["written"] < kernel_copies["copied"] / 10


def test_a_layout_the_passes_broke_is_rewritten_whole(tmp_path):
    """If the final models do not use what the primed copy placed (here: another model's
    weights), the file starts over, and comes out as if it had never been primed."""
    static = _static()
    with Bundle(tmp_path / "primed") as bundle:
        bundle.start_weights(ir.load(fixtures.path("qwen2")))
        for name, model in static.models.items():
            bundle.add(name, model)
        bundle.commit()
        restarts = bundle.weights.restarts
    save_bundle(static.models, tmp_path / "plain")
    assert restarts == 1
    for f in sorted((tmp_path / "plain").iterdir()):
        assert f.read_bytes() == (tmp_path / "primed" / f.name).read_bytes(), f.name


def test_failure_leaves_nothing_and_the_models_intact(tmp_path, monkeypatch):
    static = _static()
    before = _texts(static.models)
    calls = []

    def failing(model, xml, bin_path):
        calls.append(xml)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return ov.serialize(model, xml, bin_path)

    monkeypatch.setattr(bundle_mod.ov, "serialize", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        save_bundle(static.models, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
    for name, model in static.models.items():
        assert ir.to_text(model) == before[name], name


def test_a_replaced_source_file_is_not_copied_from(tmp_path, kernel_copies):
    """The weights are copied from the mapped file only while it is still that file: when a
    new file has replaced it since loading, the mapped (old) bytes are written instead."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixtures.path("llama"), src)
    model = ir.load(src)
    (src / "new.bin").write_bytes(b"\0" * (src / "openvino_model.bin").stat().st_size)
    (src / "new.bin").replace(src / "openvino_model.bin")
    want = _texts({"m": model})["m"]
    save_bundle({"m": model}, tmp_path / "out")
    assert kernel_copies["copied"] == 0
    assert ir.to_text(ir.load(tmp_path / "out" / "m.xml", weights=tmp_path / "out" / "weights.bin")) == want
