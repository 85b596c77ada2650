"""kvc.ir.reader refuses malformed and hostile model files with specific errors, writing nothing."""

from __future__ import annotations

import os
import re
import resource
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import kvc.ir as ir
from kvc.errors import InvalidModelError


@pytest.fixture
def model_dir(tmp_path, tiny) -> Path:
    d = tmp_path / "model"
    ir.save(tiny, d / "openvino_model.xml")
    return d


def _xml(d: Path) -> Path:
    return d / "openvino_model.xml"


def _edit_xml(d: Path, pattern: str, repl: str, count: int = 1) -> None:
    text = _xml(d).read_text()
    new, n = re.subn(pattern, repl, text, count=count)
    assert n, f"pattern {pattern!r} not found"
    _xml(d).write_text(new)


def _first_const_attr(d: Path, attr: str) -> str:
    m = re.search(r'name="weight" type="Const".*?' + attr + r'="(\d+)"', _xml(d).read_text(), re.S)
    return m.group(1)


def truncated_bin(d):
    b = d / "openvino_model.bin"
    b.write_bytes(b.read_bytes()[:20])


def offset_past_end(d):
    _edit_xml(d, r'(name="weight" type="Const" version="opset1">\s*<data [^>]*offset=")\d+', r"\g<1>99999")


def offset_overflow(d):
    # offset + size wraps to a small number in 64-bit arithmetic: a naive bounds check passes.
    size = int(_first_const_attr(d, "size"))
    _edit_xml(d, r'(name="weight" type="Const" version="opset1">\s*<data [^>]*offset=")\d+',
              rf"\g<1>{2**64 - size + 4}")


def duplicate_layer_id(d):
    _edit_xml(d, r'<layer id="1" ', '<layer id="0" ')


def doctype_entities(d):
    text = _xml(d).read_text()
    bomb = '<!DOCTYPE net [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;">]>\n'
    _xml(d).write_text(text.replace('<?xml version="1.0"?>\n', '<?xml version="1.0"?>\n' + bomb)
                       .replace('name="tiny"', 'name="&b;"'))


def doctype_in_utf16(d):
    """The same bomb where its bytes are not ASCII (kvc's fast path parses only plain UTF-8)."""
    doctype_entities(d)
    text = _xml(d).read_text().replace('<?xml version="1.0"?>', '<?xml version="1.0" encoding="UTF-16"?>')
    _xml(d).write_bytes(text.encode("utf-16"))


def missing_bin(d):
    (d / "openvino_model.bin").unlink()


def path_escape(d):
    outside = d.parent / "elsewhere"
    outside.mkdir()
    shutil.move(str(_xml(d)), outside / "openvino_model.xml")
    shutil.move(str(d / "openvino_model.bin"), outside / "openvino_model.bin")
    os.symlink(outside / "openvino_model.xml", _xml(d))
    os.symlink(outside / "openvino_model.bin", d / "openvino_model.bin")


def unknown_element_type(d):
    _edit_xml(d, r'(name="bias" type="Const" version="opset1">\s*<data element_type=")f32', r"\g<1>f33")


def negative_dimension(d):
    _edit_xml(d, r"<dim>4</dim>", "<dim>-5</dim>")


def empty_file(d):
    _xml(d).write_text("")


def not_xml(d):
    _xml(d).write_bytes(b"\x89PNG\r\n\x1a\n not a model at all")


def dangling_edge(d):
    _edit_xml(d, r'(<edge from-layer="\d+" from-port=")\d+', r"\g<1>7")


def const_size_mismatch(d):
    _edit_xml(d, r'(name="bias" type="Const" version="opset1">\s*<data [^>]*size=")\d+', r"\g<1>8")


CORPUS = {
    truncated_bin: "bin-truncated",
    offset_past_end: "const-out-of-range",
    offset_overflow: "offset-overflow",
    duplicate_layer_id: "duplicate-layer-id",
    doctype_entities: "xml-forbidden",
    doctype_in_utf16: "xml-forbidden",
    missing_bin: "bin-missing",
    path_escape: "path-escape",
    unknown_element_type: "unknown-element-type",
    negative_dimension: "negative-dimension",
    empty_file: "empty-file",
    not_xml: "not-xml",
    dangling_edge: "dangling-edge",
    const_size_mismatch: "const-size-mismatch",
}


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("corrupt", list(CORPUS), ids=lambda f: f.__name__)
def test_malformed_ir_is_refused(model_dir, corrupt):
    corrupt(model_dir)
    before = _snapshot(model_dir.parent)
    with pytest.raises(InvalidModelError) as info:
        ir.load(model_dir)
    err = info.value
    assert err.code == CORPUS[corrupt], str(err)
    assert err.exit_code == 3
    assert "openvino_model.xml" in err.file or "openvino_model" in str(err)
    assert _snapshot(model_dir.parent) == before, "a refused load must not write anything"


def test_errors_name_layer_and_expected_versus_found(model_dir):
    offset_past_end(model_dir)
    with pytest.raises(InvalidModelError) as info:
        ir.load(model_dir)
    text = str(info.value)
    assert "'weight' (Const)" in text and "layer " in text
    assert "expected offset + size ≤" in text and "found offset 99999" in text


def test_the_valid_model_loads(model_dir):
    model = ir.load(model_dir)
    assert [o.get_any_name() for o in model.outputs] == ["y"]


def test_ir_by_xml_path_and_by_directory_agree(model_dir):
    assert ir.to_text(ir.load(model_dir)) == ir.to_text(ir.load(_xml(model_dir)))


def test_directory_without_a_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidModelError) as info:
        ir.load(tmp_path)
    assert info.value.code == "no-model" and info.value.found == "no model files"
    # a fixture's folder, whose model is in openvino/: the error points there
    (tmp_path / "openvino").mkdir()
    (tmp_path / "openvino" / "openvino_model.xml").write_text("<net/>")
    with pytest.raises(InvalidModelError) as info:
        ir.load(tmp_path)
    assert info.value.found == ("no model files (in a subdirectory: openvino/openvino_model.xml; give that "
                                "directory)")


def _onnx_with_external(tmp_path: Path, location: str) -> Path:
    d = tmp_path / "onnx"
    d.mkdir()
    w = helper.make_tensor("w", TensorProto.FLOAT, [4], np.ones(4, np.float32).tobytes(), raw=True)
    w.data_location = TensorProto.EXTERNAL
    del w.external_data[:]
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        entry = w.external_data.add()
        entry.key, entry.value = k, v
    w.ClearField("raw_data")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = d / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_onnx_external_data_outside_its_folder_is_refused(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    path = _onnx_with_external(tmp_path, "../secret.bin")
    with pytest.raises(InvalidModelError) as info:
        ir.load(path)
    assert info.value.code == "path-escape"
    assert "w" in str(info.value)


def test_onnx_external_data_inside_its_folder_loads(tmp_path):
    path = _onnx_with_external(tmp_path, "weights.bin")
    (path.parent / "weights.bin").write_bytes(np.ones(4, dtype=np.float32).tobytes())
    model = ir.load(path)
    assert model.outputs[0].get_any_name() == "y"


def test_onnx_garbage_is_refused(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\xff\xfe definitely not protobuf" * 3)
    with pytest.raises(InvalidModelError) as info:
        ir.load(path)
    assert info.value.code == "not-onnx"


def test_weights_are_memory_mapped_not_read(tmp_path):
    """A 400 MB Const (a sparse file) loads without 400 MB of resident memory."""
    import openvino as ov
    import openvino.opset13 as ops

    n = 100 * 1024 * 1024  # float32 elements
    x = ops.parameter([n], np.float32, name="x")
    m = ov.Model([ops.add(x, ops.constant(np.zeros(n, np.float32)[:1], name="w"))], [x], "big")
    ir.save(m, tmp_path / "big.xml")
    text = (tmp_path / "big.xml").read_text()
    text, k = re.subn(r'(<data element_type="f32" shape=")1(" offset="0" size=")4"', rf'\g<1>{n}\g<2>{4 * n}"', text)
    assert k == 1
    text, k = re.subn(r'(name="w" type="Const".*?<dim>)1(</dim>)', rf"\g<1>{n}\g<2>", text, flags=re.S)
    assert k == 1
    (tmp_path / "big.xml").write_text(text)
    with open(tmp_path / "big.bin", "r+b") as f:
        f.truncate(4 * n)  # sparse: no disk, no page cache
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = ir.load(tmp_path / "big.xml")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    const = next(op for op in model.get_ops() if op.get_friendly_name() == "w")
    assert const.get_output_shape(0) == [n]
    assert grown_mb < 100, f"loading grew peak RSS by {grown_mb:.0f} MB for 400 MB of weights"
