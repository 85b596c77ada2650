"""Source models whose inputs are not what an optimum-intel export declares."""

from __future__ import annotations

import shutil

from kvc import fixtures
from tests.cli.runner import SMALL, kvc


def test_token_ids_declared_as_floats_are_refused_naming_the_port(tmp_path):
    """input_ids declared f32 compiled (a mismatch at the check, or with --no-verify published
    blobs whose bf16 arithmetic rounded every id above 256)."""
    source = tmp_path / "src"
    shutil.copytree(fixtures.path("llama"), source)
    xml = source / "openvino_model.xml"
    text = xml.read_text()
    head = text.index('name="input_ids" type="Parameter"')
    end = text.index("</layer>", head)
    layer = text[head:end].replace('element_type="i64"', 'element_type="f32"').replace('precision="I64"',
                                                                                        'precision="FP32"')
    xml.write_text(text[:head] + layer + text[end:])
    result = kvc("compile", source, "-o", tmp_path / "out", *SMALL, "--no-verify", code=3)
    assert "input input_ids must be an integer tensor (expected i64 or i32, found f32) [bad-input]" in result.output
    assert not (tmp_path / "out").exists()


def test_an_openvino_message_is_quoted_at_bounded_length():
    from kvc.errors import REASON_CHARS, openvino_reason

    echoed = RuntimeError("Exception from src/core/shape.cpp:1:\nCheck failed: dim " + "9" * 5000 + " is too large")
    reason = openvino_reason(echoed)
    assert reason.startswith("Check failed: dim 999") and reason.endswith("... (5031 characters)")
    assert len(reason) < REASON_CHARS + 40
    assert openvino_reason(RuntimeError("Exception from x\nshort")) == "short"
