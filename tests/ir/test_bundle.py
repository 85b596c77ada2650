"""Bundles: several models, one weights file; read from the source file, written atomically."""

from __future__ import annotations

import re

import numpy as np
import openvino as ov
import pytest

import kvc.ir as ir
from kvc import fixtures
from kvc.export.build import build_static
from kvc.plan import StaticOptions
from kvc.ir import bundle as bundle_mod
from kvc.ir import weights_stream
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
def file_reads(monkeypatch):
    """Count the bytes read from the weights' own file and those copied from this process's memory."""
    counts = {"copied": 0, "written": 0}
    put_file, put_memory = bundle_mod._Stream._put_file, bundle_mod._Stream._put_memory

    def counting_file(stream, source, size):
        before = stream.base + stream.fill
        put_file(stream, source, size)
        counts["copied"] += stream.base + stream.fill - before

    def counting_memory(stream, data):
        counts["written"] += len(data)
        put_memory(stream, data)

    monkeypatch.setattr(bundle_mod._Stream, "_put_file", counting_file)
    monkeypatch.setattr(bundle_mod._Stream, "_put_memory", counting_memory)
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


def test_mapped_weights_are_read_from_their_file_during_the_passes(tmp_path, file_reads):
    """Opened before the model is loaded (as `kvc compile` does), the bundle still finds the
    mapped weights file, starts copying during the passes, and keeps that layout."""
    with Bundle(tmp_path) as bundle:
        _static(bundle)
        bundle.commit()
        assert bundle.weights.primed and bundle.weights.restarts == 0
    big = sum(s for o, s in _const_layers((tmp_path / "prefill.xml").read_text()) if s >= 1 << 16)
    assert file_reads["copied"] >= big > 0  # read from the file by the copy thread
    assert file_reads["written"] < file_reads["copied"] / 10


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


def test_a_replaced_source_file_is_not_copied_from(tmp_path, file_reads):
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
    assert file_reads["copied"] == 0
    assert ir.to_text(ir.load(tmp_path / "out" / "m.xml", weights=tmp_path / "out" / "weights.bin")) == want


def _if_model():
    """An If whose bodies hold constants, beside a 400 KB top-level weight."""
    import openvino.opset13 as ops

    x = ops.parameter([4], np.float32, name="x")
    x.output(0).set_names({"x"})
    then_x, else_x = ops.parameter([4], np.float32), ops.parameter([4], np.float32)
    then_body = ov.Model([ops.result(ops.add(then_x, ops.constant(np.arange(4, dtype=np.float32) + 100)))], [then_x])
    else_body = ov.Model([ops.result(ops.add(else_x, ops.constant(np.full(4, -1, np.float32))))], [else_x])
    branch = ov.opset8.if_op(ops.constant(np.array(True)))
    branch.set_then_body(then_body)
    branch.set_else_body(else_body)
    branch.set_input(x.output(0), then_x, else_x)
    out = branch.set_output(then_body.get_results()[0], else_body.get_results()[0])
    big = ops.constant(np.arange(100000, dtype=np.float32))
    total = ops.reduce_sum(big, ops.constant(np.array([0], np.int64)), keep_dims=True)
    return ov.Model([ops.result(out), ops.result(total)], [x])


def test_constants_inside_if_bodies_are_saved(tmp_path):
    """Subgraph bodies' constants get offsets in the shared weights file like any other."""
    model = _if_model()
    xml = save_bundle({"m": model}, tmp_path)["m"]
    feed = {"x": np.zeros(4, np.float32)}
    core = ov.Core()
    want = core.compile_model(model, "CPU")(feed)
    got = core.compile_model(core.read_model(str(xml), str(tmp_path / "weights.bin")), "CPU")(feed)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[0], np.arange(4, dtype=np.float32) + 100)
    np.testing.assert_array_equal(got[1], want[1])


def test_a_dynamic_model_keeps_its_shapes(tmp_path):
    """A Range whose length is read from a large constant: with the constant out of the graph
    its length would be unknown. Saving keeps the model's (and the file's) shapes."""
    import openvino.opset13 as ops

    x = ops.parameter([-1], np.float32, name="x")
    table = ops.constant(np.full(2048, 3, np.int64))
    stop = ops.squeeze(ops.gather(table, ops.constant(np.array([0])), ops.constant(np.int64(0))),
                       ops.constant(np.array([0])))
    rng = ops.range(ops.constant(np.int64(0)), stop, ops.constant(np.int64(1)), "f32")
    model = ov.Model([ops.result(rng), ops.result(ops.relu(x))], [x])
    before = [str(n.get_output_partial_shape(0)) for n in model.get_ordered_ops() if n.get_output_size()]
    xml = save_bundle({"m": model}, tmp_path)["m"]
    assert [str(n.get_output_partial_shape(0)) for n in model.get_ordered_ops() if n.get_output_size()] == before
    assert "[3]" in before
    assert "<dim>3</dim>" in xml.read_text()


def test_runtime_info_of_a_weight_is_kept(tmp_path):
    """A weight carrying runtime info (as compressed weights carry KeepConstPrecision) is
    written with it, as OpenVINO's own save_model writes it."""
    import openvino.opset13 as ops

    x = ops.parameter([4, 1024], np.float32, name="x")
    w = ops.constant(np.ones((1024, 8), np.float32))
    w.get_rt_info()["precise_0"] = ""  # DisablePrecisionConversion, as OpenVINO writes it
    model = ov.Model([ops.result(ops.matmul(x, w, False, False))], [x])
    ov.save_model(model, str(tmp_path / "ref.xml"), compress_to_fp16=False)
    want = re.findall(r"<attribute[^>]*>", (tmp_path / "ref.xml").read_text())
    xml = save_bundle({"m": model}, tmp_path / "b")["m"]
    assert want and re.findall(r"<attribute[^>]*>", xml.read_text()) == want


def test_a_failure_while_swapping_leaves_the_model_whole(monkeypatch):
    """If building the placeholders fails half-way, what was done is undone."""
    model = _static().models["generate-80"]
    before = _texts({"m": model})["m"]
    consts = [(node, True) for node in model.get_ordered_ops() if node.get_type_name() == "Constant"]
    made = []
    real = ov.op.Parameter

    def failing(*args):
        made.append(args)
        if len(made) == 3:
            raise RuntimeError("out of parameters")
        return real(*args)

    monkeypatch.setattr(bundle_mod.ov.op, "Parameter", failing)
    with pytest.raises(RuntimeError, match="out of parameters"):
        bundle_mod._Placeholders(model, consts, True)
    monkeypatch.undo()
    assert len(made) == 3
    assert ir.to_text(model) == before


def test_the_same_weights_file_loaded_twice_is_stored_once(tmp_path):
    """Two models read from the same files map the same bytes at different addresses: one copy."""
    a, b = ir.load(fixtures.path("llama")), ir.load(fixtures.path("llama"))
    save_bundle({"a": a, "b": b}, tmp_path)
    source = (fixtures.path("llama") / "openvino_model.bin").stat().st_size
    assert (tmp_path / "weights.bin").stat().st_size < 1.05 * source
    assert _const_layers((tmp_path / "a.xml").read_text()) == _const_layers((tmp_path / "b.xml").read_text())


def _primed_from_file(out, before=None):
    """Save the static models of the llama fixture as `kvc compile` does: the weights start
    copying from the file as soon as it is read, before OpenVINO reads it."""
    with Bundle(out) as bundle:
        if before is not None:
            before(bundle)
        model = ir.load(fixtures.path("llama"), consts_found=bundle.start_weights_file)
        build_static(model, SMALL, use_env=False, bundle=bundle)
        bundle.commit()
        return bundle.weights


def _same_files(a, b):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_weights_primed_from_the_validated_file_come_out_the_same(tmp_path, file_reads):
    weights = _primed_from_file(tmp_path / "primed")
    assert weights.primed and weights.restarts == 0
    assert file_reads["copied"] > 0 and file_reads["written"] < file_reads["copied"] / 10
    save_bundle(_static().models, tmp_path / "plain")
    _same_files(tmp_path / "plain", tmp_path / "primed")


def test_a_copy_that_missed_bytes_starts_over_from_memory(tmp_path, monkeypatch):
    """Primed from the file alone, a short read (the file cut or replaced meanwhile) has no
    bytes in memory to fall back on: the weights file starts over, from the loaded model."""
    monkeypatch.setattr(bundle_mod.os, "preadv", lambda *a: 0)  # every read finds the end of the file
    weights = _primed_from_file(tmp_path / "primed")
    monkeypatch.undo()
    assert weights.restarts == 1
    save_bundle(_static().models, tmp_path / "plain")
    _same_files(tmp_path / "plain", tmp_path / "primed")


def test_a_weights_file_replaced_between_validation_and_reading_is_not_mixed(tmp_path):
    """The file read by OpenVINO is not the one primed from (a new inode): start over."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixtures.path("llama"), src)
    with Bundle(tmp_path / "out") as bundle:
        calls = []

        def replace_then_prime(bin_path, consts):  # called with a guess, then once validated
            bundle.start_weights_file(bin_path, consts)
            calls.append(consts)
            if len(calls) == 2:
                shutil.copyfile(bin_path, src / "new.bin")
                (src / "new.bin").replace(bin_path)

        model = ir.load(src, consts_found=replace_then_prime)
        static = build_static(model, SMALL, use_env=False, bundle=bundle)
        want = _texts(static.models)
        bundle.commit()
        assert bundle.weights.restarts == 1 and len(calls) == 2
    for name in want:
        got = ir.load(tmp_path / "out" / f"{name}.xml", weights=tmp_path / "out" / "weights.bin")
        assert ir.to_text(got) == want[name], name


def test_a_stream_longer_than_its_buffers_writes_every_byte_in_place(tmp_path, monkeypatch):
    """Staging buffers are reused in turn while earlier ones are on their way to disk: a
    segment over three buffers, after a gap, comes out byte for byte."""
    import os

    monkeypatch.setattr(weights_stream, "_CHUNK", 1 << 20)
    fd = os.open(tmp_path / "w.bin", os.O_RDWR | os.O_CREAT, 0o644)
    stream = bundle_mod._Stream(fd)
    payload = np.arange(3 * weights_stream._CHUNK // 8 + 5, dtype=np.int64).view(np.uint8)
    stream.write(bundle_mod._Segment(64, payload.size, None, [(0, payload)]))
    stream.close(64 + payload.size)
    stream.release()
    os.close(fd)
    data = (tmp_path / "w.bin").read_bytes()
    assert data[:64] == bytes(64) and data[64:] == payload.tobytes()


def test_the_first_guess_of_the_weights_is_what_validation_finds():
    """`kvc.ir.load` starts the copy from the raw XML, before validating it: on every
    fixture that guess is the validated list, so the copy never starts over."""
    from kvc.ir.validate import guess_consts, validate_ir

    for name in ("llama", "gpt2", "gpt_bigcode", "bloom", "mistral", "phi", "qwen2"):
        xml = fixtures.path(name) / "openvino_model.xml"
        assert sorted(guess_consts(xml.read_bytes())) == sorted(validate_ir(xml)), name


def test_a_wrong_guess_is_replaced_by_the_validated_constants(tmp_path):
    bin_path = fixtures.path("llama") / "openvino_model.bin"
    weights = _primed_from_file(tmp_path / "primed", before=lambda bundle: bundle.start_weights_file(
        bin_path, [(0, 1 << 16), (1 << 16, 1 << 16)]))
    assert weights.restarts == 0
    save_bundle(_static().models, tmp_path / "plain")
    _same_files(tmp_path / "plain", tmp_path / "primed")
