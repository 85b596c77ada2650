"""Every row of every compiled model's token embedding table is the source's (kvc.verify.embedding):
the rows no probe reads. A pass that zeroed one row, or weights.bin rewritten there behind a
consistent manifest, verified OK before this check."""

from __future__ import annotations

import json
import re

import numpy as np
import openvino.opset13 as ops
import pytest

from kvc import fixtures
from kvc.export.build import build_static
from kvc.export.compile import compile_static
from kvc.export.manifest import MANIFEST, dumps, file_entry
from kvc.ir.reader import load
from kvc.verify.embedding import check_embeddings, embedding_tables
from tests.cli.runner import SMALL, kvc

PLUGIN = '''
from dataclasses import dataclass
from typing import ClassVar

import openvino.opset13 as ops

from kvc.passes.framework.base import Pass, PassResult
from kvc.passes.framework.registry import register_pass


@register_pass
@dataclass(frozen=True)
class ZeroRowOne(Pass):
    """Test: zeroes embedding row 1 (an off-by-one for the pad id 0)."""

    name: ClassVar[str] = "test-zero-row-one"

    def run(self, model):
        for op in model.get_ordered_ops():
            if op.get_type_name() == "Constant" and op.get_friendly_name() == "self.model.embed_tokens.weight":
                table = op.get_data().copy()
                table[1] = 0.0
                for target in list(op.output(0).get_target_inputs()):
                    target.replace_source_output(ops.constant(table).output(0))
                return PassResult(model, True)
        return PassResult(model, False)
'''


def built(name: str):
    return build_static(load(fixtures.path(name)), compile_static(("CPU",), max_prompt_len=64, min_response_len=64))


@pytest.mark.parametrize("name", ["llama", "gpt2", "llama_int4_sym_g16", "granitemoe_int4_asym_cw"])
def test_a_clean_compile_has_every_row_of_the_source(name):
    result = check_embeddings(load(fixtures.path(name)), built(name).models)
    assert result["ok"] and result["compared"], result


def test_one_changed_row_is_found_and_named():
    static = built("llama")
    model = static.models["generate-128"]
    [table] = embedding_tables(model)
    [const] = [n for n in table if n.get_type_name() == "Constant"]
    data = const.get_data().copy()
    data[300, 5] += 1e-3
    for target in list(const.output(0).get_target_inputs()):
        target.replace_source_output(ops.constant(data).output(0))
    result = check_embeddings(load(fixtures.path("llama")), static.models)
    assert not result["ok"] and result["model"] == "generate-128"
    assert "rows for 1 token id(s) differ from the source's (300; max abs 0.001)" in result["reason"]


def test_a_compressed_table_that_differs_is_found():
    static = built("llama_int4_sym_g16")
    model = static.models["prefill"]
    [table] = embedding_tables(model)
    scale = next(n for n in table if n.get_type_name() == "Constant" and n.get_output_element_type(0).get_type_name()
                 == "f16" and n.get_output_partial_shape(0).rank.get_length() > 1)
    data = scale.get_data().copy()
    data.reshape(-1)[7] *= 2
    for target in list(scale.output(0).get_target_inputs()):
        target.replace_source_output(ops.constant(data).output(0))
    result = check_embeddings(load(fixtures.path("llama_int4_sym_g16")), static.models)
    assert not result["ok"] and "embedding constant" in result["reason"] and "differs" in result["reason"]


def test_a_pass_that_zeroes_a_row_no_probe_reads_is_refused(tmp_path):
    plugin = tmp_path / "zero_row.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "out"
    result = kvc("compile", fixtures.path("llama"), "-o", out, *SMALL, "--pass-plugin", plugin,
                 "--passes", "lift-state,dense-experts,rotate-half-rope,test-zero-row-one", code=4)
    assert "embedding rows for 1 token id(s) differ from the source's (1;" in result.output
    assert not out.exists()
    # kvc bisect names the pass: its probe's 8 tokens do not select row 1, so their outputs agree
    result = kvc("bisect", fixtures.path("llama"), *SMALL, "--pass-plugin", plugin,
                 "--passes", "lift-state,dense-experts,rotate-half-rope,test-zero-row-one", code=4)
    assert "first bad pass: test-zero-row-one (common, pass 4): its embedding rows for 1 token id(s)" in result.output


def test_kvc_verify_reads_every_row_of_a_rewritten_weights_file(tmp_path):
    """weights.bin changed in one embedding row behind a consistent manifest: only the numbers
    can tell, and no probe reads that row."""
    out = tmp_path / "out"
    kvc("compile", fixtures.path("llama"), "-o", out, *SMALL)
    xml = (out / "prefill.xml").read_text()
    offset = int(re.search(r'name="self\.model\.embed_tokens\.weight" type="Const".*?offset="(\d+)"', xml, re.S)[1])
    with open(out / "weights.bin", "r+b") as f:
        f.seek(offset + 4 * 64 * 40)  # row 40 of 64 floats
        row = np.frombuffer(f.read(256), np.float32) * -3
        f.seek(offset + 4 * 64 * 40)
        f.write(row.tobytes())
    m = json.loads((out / MANIFEST).read_text())
    m["files"] = {name: file_entry(out / name) for name in m["files"]}
    (out / MANIFEST).write_text(dumps(m))
    result = kvc("verify", out, "--backends", "numpy", "--max-new-tokens", "2", code=4)
    assert "embedding rows for 1 token id(s) differ from the source's (40;" in result.output
    report = json.loads(kvc("verify", out, "--backends", "numpy", "--max-new-tokens", "2", "--json", code=4).stdout)
    assert report["embedding"]["compared"] and not report["embedding"]["ok"]
