"""Compiled directories for the report tests: the bundled model, compiled once per module."""

from __future__ import annotations

import shutil

import openvino as ov
import pytest

from kvc import fixtures
from tests.cli.runner import kvc

HOSTILE = "<script>alert(1)</script>"
HOSTILE_DIR = "<img src=x onerror=alert(2)>"  # a directory name: no slash


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """`kvc compile -o OUT --dumps --report OUT.html` of the bundled model: (OUT, the page)."""
    root = tmp_path_factory.mktemp("report")
    out, page = root / "out", root / "compile-report.html"
    kvc("compile", "-o", out, "--dumps", "--report", page)
    return out, page


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The bundled model with a hostile friendly name on layer 0's attention, in a directory
    whose name is markup, compiled with --report: (OUT, the page)."""
    root = tmp_path_factory.mktemp("hostile")
    source = root / HOSTILE_DIR
    shutil.copytree(fixtures.bundled_model(), source)
    core = ov.Core()
    model = core.read_model(source / "openvino_model.xml")
    attention = next(op for op in model.get_ordered_ops() if op.get_type_name() == "ScaledDotProductAttention")
    attention.set_friendly_name(HOSTILE)
    (source / "openvino_model.xml").unlink()
    (source / "openvino_model.bin").unlink()
    ov.save_model(model, source / "openvino_model.xml", compress_to_fp16=False)
    out, page = root / "out", root / "hostile.html"
    kvc("compile", source, "-o", out, "--no-verify", "--report", page)
    return out, page
