"""A generated corpus of hostile inputs for kvc (issue 19, parts 1 and 4).

Nothing here is committed data: `build(tmp)` writes every hostile file into `tmp` (copies of
the small llama fixture, mutated, and tiny models made with openvino.opset13 and onnx.helper)
and returns one `Case` per input. Each case lists the `kvc` commands that read it, and for
each command the documented exit code (kvc/errors.py, README "Exit codes") and the
substrings its message must contain (the file, and the problem).

`run_case` runs a case's commands as subprocesses of the installed kvc, with a time bound,
and classifies each outcome:

    clean           the expected exit code, the message, no traceback, nothing left behind
    crash           a traceback, an internal error (exit 1) or death by a signal
    accepted-wrong  exit 0 where an error was expected
    wrong-code      another documented code than the expected one
    no-message      the right code, but the message does not name the file or the problem
    partial         a failed compile left OUT, a `.OUT.partial-*`/`.OUT.old-*` sibling, or temp files
    hang            still running after the time bound (killed)

Script mode runs the whole corpus (and, with --kill, the kill -9 fault injection on
`kvc compile`) and writes the figure:

    python tests/hostile/corpus.py --report docs/reliability.md [--kill 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "fixtures" / "llama" / "openvino"
SMALL = ["--max-prompt-len", "64", "--min-response-len", "64"]
TIMEOUT = 60.0

# Exit codes, as kvc/errors.py and README "Exit codes" define them.
OK, INTERNAL, USAGE, INVALID, VERIFY, DEVICE, UNSUPPORTED = 0, 1, 2, 3, 4, 5, 6


def kvc_command() -> list[str]:
    """The installed kvc: the console script beside this interpreter, else `-m kvc.cli.main`."""
    script = Path(sys.executable).with_name("kvc")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvc.cli.main"]


@dataclass
class Run:
    """One command over a case. argv may hold {case}, {out}, {good}, {fixture}, {dir}."""

    command: str  # inspect, compile, run, verify, diff, bisect
    argv: list[str]
    code: int
    message: tuple[str, ...] = ()  # every one must appear in stderr+stdout
    bug: str | None = None  # kvc does the wrong thing here: the test is xfail(strict) with this reason
    timeout: float | None = None  # default TIMEOUT


@dataclass
class Case:
    name: str
    what: str
    runs: list[Run]
    path: Path | None = None  # the hostile input

    @property
    def commands(self) -> tuple[str, ...]:
        return tuple(r.command for r in self.runs)


@dataclass
class Outcome:
    case: str
    command: str
    argv: list[str]
    expected: int
    code: int | None
    seconds: float
    verdict: str
    detail: str = ""
    bug: str | None = None
    stderr: str = ""


# A run whose `bug` is set is xfail(strict=True) in test_corpus.py: a kvc bug the corpus
# found and nobody has fixed yet (none today; the last two are in the git history).


# --------------------------------------------------------------------------------------------
# Building blocks


def fixture_xml() -> str:
    return (FIXTURE / "openvino_model.xml").read_text()


def fixture_bin() -> bytes:
    return (FIXTURE / "openvino_model.bin").read_bytes()


def write_ir(d: Path, xml: str | bytes, bin_bytes: bytes | None = None, *, with_bin: bool = True) -> Path:
    """An IR pair in `d` (openvino_model.xml/.bin); returns the .xml."""
    d.mkdir(parents=True, exist_ok=True)
    x = d / "openvino_model.xml"
    x.write_bytes(xml.encode() if isinstance(xml, str) else xml)
    if with_bin:
        (d / "openvino_model.bin").write_bytes(fixture_bin() if bin_bytes is None else bin_bytes)
    return x


def copy_fixture_dir(d: Path) -> Path:
    shutil.copytree(FIXTURE, d)
    return d


def layer_span(xml: str, lid: int | str) -> tuple[int, int]:
    m = re.search(rf'<layer id="{lid}" .*?</layer>', xml, re.S)
    assert m, f"layer {lid} not in the fixture"
    return m.start(), m.end()


def sub_in_layer(xml: str, lid, pattern: str, repl: str, count: int = 1) -> str:
    a, b = layer_span(xml, lid)
    block, n = re.subn(pattern, repl, xml[a:b], count=count)
    assert n, f"{pattern!r} not in layer {lid}"
    return xml[:a] + block + xml[b:]


def layers_of(xml: str) -> dict[str, dict]:
    out = {}
    for m in re.finditer(r'<layer id="(\d+)" name="([^"]*)" type="([^"]*)" version="([^"]*)">(.*?)</layer>', xml, re.S):
        body = m.group(5)
        data = re.search(r"<data ([^>]*)/>", body)
        attrs = dict(re.findall(r'(\w+)="([^"]*)"', data.group(1))) if data else {}
        out[m.group(1)] = {"name": m.group(2), "type": m.group(3), "version": m.group(4), "data": attrs,
                           "span": (m.start(), m.end())}
    return out


EDGE = re.compile(r'<edge from-layer="(\d+)" from-port="(\d+)" to-layer="(\d+)" to-port="(\d+)" ?/>')


def edges_of(xml: str) -> list[tuple[str, str, str, str]]:
    return EDGE.findall(xml)


def set_edge(xml: str, old: tuple, new: tuple) -> str:
    o = '<edge from-layer="{}" from-port="{}" to-layer="{}" to-port="{}"'.format(*old)
    n = '<edge from-layer="{}" from-port="{}" to-layer="{}" to-port="{}"'.format(*new)
    assert o in xml, o
    return xml.replace(o, n, 1)


def drop_layers(xml: str, ids: set[str]) -> str:
    """Remove layers and every edge touching them."""
    for lid in sorted(ids, key=int, reverse=True):
        a, b = layer_span(xml, lid)
        xml = xml[:a] + xml[b:]
    return EDGE.sub(lambda m: "" if m.group(1) in ids or m.group(3) in ids else m.group(0), xml)


def poison_weights(value: float) -> bytes:
    """The fixture's .bin with every f32 Const of 1 KB or more filled with `value`."""
    import numpy as np

    data = bytearray(fixture_bin())
    for layer in layers_of(fixture_xml()).values():
        d = layer["data"]
        if layer["type"] == "Const" and d.get("element_type") == "f32" and int(d.get("size", 0)) >= 1024:
            off, size = int(d["offset"]), int(d["size"])
            data[off:off + size] = np.full(size // 4, value, np.float32).tobytes()
    return bytes(data)


def save_ov(model, d: Path, name: str = "openvino_model") -> Path:
    import openvino as ov

    d.mkdir(parents=True, exist_ok=True)
    x = d / f"{name}.xml"
    ov.save_model(model, str(x), compress_to_fp16=False)
    return x


def tiny_non_llm():
    """y = relu(x @ W^T + b), as tests/conftest.py builds it: a valid model that is no LLM."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([1, -1, 4], np.float32, name="x")
    x.output(0).set_names({"x"})
    w = ops.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
    b = ops.constant(np.array([0.5, -0.5, 1.0], dtype=np.float32))
    y = ops.relu(ops.add(ops.matmul(x, w, False, True), b))
    y.output(0).set_names({"y"})
    return ov.Model([y], [x], "tiny")


def tiny_no_kv():
    """input_ids/attention_mask -> embedding -> lm head -> logits: an LLM's interface, no KV state."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    ids = ops.parameter([-1, -1], np.int64, name="input_ids")
    ids.output(0).set_names({"input_ids"})
    mask = ops.parameter([-1, -1], np.int64, name="attention_mask")
    mask.output(0).set_names({"attention_mask"})
    emb = ops.gather(ops.constant(np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)), ids, 0)
    m = ops.unsqueeze(ops.convert(mask, np.float32), ops.constant(np.int64(-1)))
    h = ops.multiply(emb, m)
    logits = ops.matmul(h, ops.constant(np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32)),
                        False, True)
    logits.output(0).set_names({"logits"})
    return ov.Model([logits], [ids, mask], "no_kv")


def tiny_onnx(d: Path, external: str | None = None, *, write_data: bool = True, offset: int = 0) -> Path:
    """A small ONNX model (MatMul by an initializer); with `external`, the initializer's data is
    declared as external data at that location."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    d.mkdir(parents=True, exist_ok=True)
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    if external is not None:
        w.ClearField("raw_data")
        w.data_location = TensorProto.EXTERNAL
        for k, v in (("location", external), ("offset", str(offset)), ("length", "64")):
            e = w.external_data.add()
            e.key, e.value = k, v
        if write_data and not os.path.isabs(external):
            target = d / external
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(np.ones((4, 4), np.float32).tobytes())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    p = d / "model.onnx"
    p.write_bytes(model.SerializeToString())
    return p


# --------------------------------------------------------------------------------------------
# The corpus


def _ir_runs(name: str, code: int, msg: tuple[str, ...], *, commands=("inspect", "compile"),
             bug: dict[str, str] | None = None) -> list[Run]:
    """The usual runs over a hostile model at {case}."""
    bug = bug or {}
    argv = {
        "inspect": ["inspect", "{case}"],
        "compile": ["compile", "{case}", "-o", "{out}", *SMALL],
        "bisect": ["bisect", "{case}", *SMALL],
        "diff": ["diff", "{fixture}/openvino_model.xml", "{case}", "--summary-only"],
    }
    return [Run(c, argv[c], code, msg, bug.get(c)) for c in commands]


def build(tmp: Path) -> list[Case]:
    """Write every hostile input under `tmp`; return the cases."""
    tmp = Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    xml = fixture_xml()
    L = layers_of(xml)
    E = edges_of(xml)
    cases: list[Case] = []

    def ir_case(name, what, text, code, msg, *, bin_bytes=None, with_bin=True, commands=("inspect", "compile"),
                bug=None):
        p = write_ir(tmp / name, text, bin_bytes, with_bin=with_bin)
        msg = tuple(m.replace("{file}", p.name) for m in msg)
        cases.append(Case(name, what, _ir_runs(name, code, msg, commands=commands, bug=bug), p))

    # ---- XML level -------------------------------------------------------------------------
    bomb = ('<?xml version="1.0"?>\n<!DOCTYPE lolz [\n <!ENTITY lol "lol">\n'
            + "".join(f' <!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">\n'
                      for i in range(1, 10))
            + ']>\n<net name="bomb" version="11"><layers><layer id="0" name="&lol9;" type="Parameter" '
              'version="opset1"/></layers><edges/></net>\n')
    ir_case("xml-billion-laughs", "entity expansion bomb (10^9 'lol's) in a layer name", bomb, INVALID,
            ("{file}", "xml-forbidden"), commands=("inspect", "compile", "diff"))
    nest = "<layers></layers><edges></edges>"
    for i in range(3000):  # exhausted the validator's recursion (exit 1)
        nest = (f'<layers><layer id="{i}" name="n{i}" type="TensorIterator" version="opset1"><body>{nest}</body>'
                f'</layer></layers><edges></edges>')
    deep = f'<layer id="99999" name="deep" type="TensorIterator" version="opset1"><body>{nest}</body></layer>'
    ir_case("xml-bodies-nested-3000-deep", "a TensorIterator whose body nests 3000 bodies", xml.replace(
        "\t</layers>\n\t<edges>", deep + "\n\t</layers>\n\t<edges>", 1), INVALID, ("{file}", "nesting-too-deep"))
    xxe = ('<?xml version="1.0"?>\n<!DOCTYPE net [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>\n'
           '<net name="&xxe;" version="11"><layers/><edges/></net>\n')
    ir_case("xml-external-entity", "external entity reading /etc/passwd", xxe, INVALID, ("{file}", "xml-forbidden"))
    xxe16 = xxe.replace('<?xml version="1.0"?>', '<?xml version="1.0" encoding="UTF-16"?>').encode("utf-16")
    ir_case("xml-external-entity-utf16", "the external entity, encoded as UTF-16 (hides the DOCTYPE bytes)",
            xxe16, INVALID, ("{file}", "xml-forbidden"))
    # Unknown elements are ignored by OpenVINO's reader: the model is valid; what matters is that
    # neither parser recurses into a stack overflow or takes long.
    ir_case("xml-deep-nesting", "200 000 nested unknown elements inside <layers>",
            xml.replace("<layers>", "<layers>" + "<a>" * 200_000 + "</a>" * 200_000, 1), OK, ("kv cache: 2 layers",),
            commands=("inspect",))
    ir_case("xml-truncated", "the .xml cut in the middle of a layer", xml[: len(xml) // 2], INVALID,
            ("{file}", "not well-formed"), commands=("inspect", "compile", "diff", "bisect"))
    ir_case("xml-not-utf8", "Latin-1 bytes in a layer name, no encoding declared",
            xml.encode().replace(b'name="input_ids" type', b'name="input_\xe9\xff" type', 1), INVALID,
            ("{file}", "not well-formed"))
    ir_case("xml-empty", "an empty .xml", "", INVALID, ("{file}", "empty"))
    ir_case("xml-not-ir", "well-formed XML whose root is not <net>", "<html><body/></html>", INVALID,
            ("{file}", "not-ir"))
    ir_case("xml-binary-garbage", "4 KB of random bytes named .xml", random.Random(1).randbytes(4096), INVALID,
            ("{file}", "not well-formed"))

    # ---- graph level -----------------------------------------------------------------------
    e0 = next(e for e in E if L[e[2]]["type"] == "MatMul")
    ir_case("edge-missing-layer", "an edge from layer 99999, which does not exist",
            set_edge(xml, e0, ("99999",) + e0[1:]), INVALID, ("{file}", "dangling-edge", "99999"),
            commands=("inspect", "compile", "diff"))
    ir_case("edge-missing-port", "an edge into input port 7 of a MatMul that has ports 0 and 1",
            set_edge(xml, e0, e0[:3] + ("7",)), INVALID, ("{file}", "dangling-edge"))
    mm_in = next(e for e in E if L[e[2]]["type"] == "MatMul" and L[e[0]]["type"] != "Const")
    ir_case("edge-type-mismatch", "a MatMul fed the i64 input_ids instead of its f32 activations",
            set_edge(xml, mm_in, ("0", "0") + mm_in[2:]), INVALID, ("{file}", "openvino-rejected"))
    # A -> B -> A: take an Add A, a consumer B of A's output, and feed B back into A's input 0.
    a_id = next(i for i, l in L.items() if l["type"] == "Add"
                and any(e[0] == i and L[e[2]]["type"] == "Multiply" for e in E))
    b_edge = next(e for e in E if e[0] == a_id and L[e[2]]["type"] == "Multiply")
    b_out = re.search(r'<output>\s*<port id="(\d+)"', xml[slice(*L[b_edge[2]]["span"])]).group(1)
    into_a = next(e for e in E if e[2] == a_id and e[3] == "0")
    ir_case("graph-cycle", "a cycle: an Add fed by the Multiply it feeds",
            set_edge(xml, into_a, (b_edge[2], b_out, a_id, "0")), INVALID, ("{file}", "cycle"),
            commands=("inspect", "compile"))
    dup = next(i for i, l in L.items() if l["type"] == "Swish")
    ir_case("duplicate-layer-id", "two layers with id 4 (a Const and a renumbered Swish)",
            sub_in_layer(xml, dup, rf'<layer id="{dup}"', '<layer id="4"'), INVALID, ("{file}", "duplicate-layer-id"),
            commands=("inspect", "compile"))
    ir_case("bad-layer-id", "a layer id that is not an integer",
            sub_in_layer(xml, dup, rf'<layer id="{dup}"', '<layer id="x-1"'), INVALID, ("{file}", "bad-layer"))
    ir_case("unknown-op", "a layer of type FrobnicateV9 (no such op)",
            sub_in_layer(xml, dup, 'type="Swish" version="opset4"', 'type="FrobnicateV9" version="opset4"'), INVALID,
            ("{file}", "FrobnicateV9"))
    ir_case("unknown-opset", "a Swish in opset99",
            sub_in_layer(xml, dup, 'version="opset4"', 'version="opset99"'), INVALID, ("{file}", "opset99"))
    ir_case("negative-dimension", "a port dimension of -7",
            sub_in_layer(xml, dup, r"<dim>(\d+|-1)</dim>", "<dim>-7</dim>"), INVALID, ("{file}", "negative-dimension"))
    ir_case("unknown-element-type", "a Const of element type f13",
            sub_in_layer(xml, 4, 'element_type="f32"', 'element_type="f13"'), INVALID,
            ("{file}", "unknown-element-type"))

    # ---- weights ---------------------------------------------------------------------------
    big = max((i for i, l in L.items() if l["type"] == "Const"), key=lambda i: int(L[i]["data"]["size"]))
    off, size = L[big]["data"]["offset"], L[big]["data"]["size"]
    ir_case("const-offset-past-end", "a Const at offset 2^40, far past the end of the .bin",
            sub_in_layer(xml, big, f'offset="{off}"', f'offset="{2**40}"'), INVALID,
            ("{file}", "const-out-of-range"), commands=("inspect", "compile", "diff", "bisect"))
    ir_case("const-offset-2^63", "a Const at offset 2^63 (negative as a signed 64-bit offset)",
            sub_in_layer(xml, big, f'offset="{off}"', f'offset="{2**63}"'), INVALID, ("{file}", "const-out-of-range"))
    ir_case("const-offset-overflow", "offset + size wraps 64 bits (offset 2^64 - 16)",
            sub_in_layer(xml, big, f'offset="{off}"', f'offset="{2**64 - 16}"'), INVALID,
            ("{file}", "offset-overflow"))
    ir_case("const-offset-negative", "a Const at offset -4",
            sub_in_layer(xml, big, f'offset="{off}"', 'offset="-4"'), INVALID, ("{file}", "bad-const"))
    ir_case("const-size-mismatch", "a Const whose size disagrees with its shape",
            sub_in_layer(xml, big, f'size="{size}"', f'size="{int(size) - 4}"'), INVALID,
            ("{file}", "const-size-mismatch"))
    ir_case("bin-missing", "the .xml without its .bin", xml, INVALID, ("{file}", "bin-missing"), with_bin=False,
            commands=("inspect", "compile", "bisect"))
    ir_case("bin-truncated", "the .bin cut to half its size", xml, INVALID, ("{file}", "bin-truncated"),
            bin_bytes=fixture_bin()[: len(fixture_bin()) // 2])
    ir_case("bin-empty", "a zero-byte .bin", xml, INVALID, ("{file}", "bin-truncated"), bin_bytes=b"")
    ir_case("weights-nan", "every f32 weight of 1 KB or more is NaN", xml, INVALID, ("nan-weights", "NaN of"),
            bin_bytes=poison_weights(float("nan")), commands=("compile", "bisect"), bug=None)
    p = write_ir(tmp / "weights-inf-no-verify", xml, poison_weights(float("inf")))
    cases.append(Case("weights-inf-no-verify", "every large f32 weight is +Inf, compiled with --no-verify", [
        Run("compile", ["compile", "{case}", "-o", "{out}", *SMALL, "--no-verify"], VERIFY, ("finite",))], p))

    # ---- state -----------------------------------------------------------------------------
    assigns = {i for i, l in L.items() if l["type"] == "Assign"}
    p = write_ir(tmp / "readvalue-no-assign", drop_layers(xml, assigns))
    cases.append(Case("readvalue-no-assign", "ReadValue layers whose Assigns were removed", [
        Run("inspect", ["inspect", "{case}"], OK, ("stateful",)),  # a valid OpenVINO model: describing it is right
        Run("compile", ["compile", "{case}", "-o", "{out}", *SMALL], UNSUPPORTED,
            ("openvino_model.xml", "never assigned"))], p))
    one_assign = sorted(assigns, key=int)[0]
    ir_case("variable-id-mismatch", "an Assign writing a variable no ReadValue reads",
            sub_in_layer(xml, one_assign, r'variable_id="[^"]*"', 'variable_id="past_key_values.9.key_nobody"'),
            INVALID, ("{file}", "past_key_values.9.key_nobody"))
    x = save_ov(tiny_no_kv(), tmp / "no-kv-state")
    cases.append(Case("no-kv-state", "input_ids -> embedding -> logits: an LLM interface without KV state", [
        Run("compile", ["compile", "{case}", "-o", "{out}", *SMALL], UNSUPPORTED, ("openvino_model.xml", "no KV cache"))],
        x))
    x = save_ov(tiny_non_llm(), tmp / "non-llm")
    cases.append(Case("non-llm", "y = relu(x W + b): a valid model that is not an LLM", [
        Run("inspect", ["inspect", "{case}"], OK, ("kv cache: none found",)),
        Run("compile", ["compile", "{case}", "-o", "{out}", *SMALL], UNSUPPORTED, ("openvino_model.xml", "no KV cache")),
        Run("bisect", ["bisect", "{case}", *SMALL], UNSUPPORTED, ("openvino_model.xml", "logits"))],
        x))

    # ---- directories -----------------------------------------------------------------------
    d = tmp / "dir-two-models"
    write_ir(d, xml)
    shutil.copy(d / "openvino_model.xml", d / "other.xml")
    (d / "openvino_model.xml").rename(d / "a.xml")
    cases.append(Case("dir-two-models", "a directory with two candidate .xml files", [
        Run("inspect", ["inspect", "{case}"], INVALID, ("no-model",))], d))
    d = tmp / "dir-symlink-out"
    d.mkdir()
    (tmp / "outside").mkdir()
    write_ir(tmp / "outside", xml)
    os.symlink(tmp / "outside" / "openvino_model.xml", d / "openvino_model.xml")
    os.symlink(tmp / "outside" / "openvino_model.bin", d / "openvino_model.bin")
    cases.append(Case("dir-symlink-out", "a model directory whose files are symlinks out of it", [
        Run("inspect", ["inspect", "{case}"], INVALID, ("path-escape",)),
        Run("compile", ["compile", "{case}", "-o", "{out}", *SMALL], INVALID, ("path-escape",))], d))
    d = tmp / "bin-symlink-out"
    write_ir(d, xml, with_bin=False)
    os.symlink(tmp / "outside" / "openvino_model.bin", d / "openvino_model.bin")
    cases.append(Case("bin-symlink-out", "an .xml whose .bin is a symlink out of its directory", [
        Run("inspect", ["inspect", "{case}/openvino_model.xml"], INVALID, ("path-escape",))], d))
    p = tmp / "not-a-model.txt"
    p.write_text("hello")
    cases.append(Case("unknown-suffix", "a .txt given as the model", [
        Run("inspect", ["inspect", "{case}"], INVALID, ("not-a-model.txt", "unknown-format"))], p))

    # ---- ONNX ------------------------------------------------------------------------------
    d = tmp / "onnx-garbage"
    d.mkdir()
    (d / "model.onnx").write_bytes(random.Random(2).randbytes(2048))
    cases.append(Case("onnx-garbage", "2 KB of random bytes named model.onnx", [
        Run("inspect", ["inspect", "{case}/model.onnx"], INVALID, ("model.onnx", "not-onnx")),
        Run("compile", ["compile", "{case}/model.onnx", "-o", "{out}", *SMALL], INVALID, ("model.onnx", "not-onnx"))],
        d))
    for name, loc, what in (("onnx-external-dotdot", "../secret.bin", "external data at ../secret.bin"),
                            ("onnx-external-absolute", "/etc/passwd", "external data at /etc/passwd")):
        (tmp / "secret.bin").write_bytes(bytes(64))
        p = tiny_onnx(tmp / name, loc, write_data=False)
        cases.append(Case(name, what, [
            Run("inspect", ["inspect", "{case}"], INVALID, ("model.onnx", "path-escape")),
            Run("compile", ["compile", "{case}", "-o", "{out}", *SMALL], INVALID, ("model.onnx", "path-escape"))], p))
    p = tiny_onnx(tmp / "onnx-external-symlink", "w.bin", write_data=False)
    os.symlink(tmp / "secret.bin", p.parent / "w.bin")
    cases.append(Case("onnx-external-symlink", "external data through a symlink out of the directory", [
        Run("inspect", ["inspect", "{case}"], INVALID, ("model.onnx", "path-escape"))], p))
    p = tiny_onnx(tmp / "onnx-external-missing", "w.bin", write_data=False)
    cases.append(Case("onnx-external-missing", "external data file that does not exist", [
        Run("inspect", ["inspect", "{case}"], INVALID, ("model.onnx", "bin-missing"))], p))
    p = tiny_onnx(tmp / "onnx-external-past-end", "w.bin", offset=1 << 40)
    cases.append(Case("onnx-external-past-end", "external data at offset 2^40 of a 64-byte file", [
        Run("inspect", ["inspect", "{case}"], INVALID, ("model.onnx", "const-out-of-range"))], p))
    d = tmp / "onnx-empty"
    d.mkdir()
    (d / "model.onnx").write_bytes(b"")
    cases.append(Case("onnx-empty", "a zero-byte model.onnx", [
        Run("inspect", ["inspect", "{case}/model.onnx"], INVALID, ("model.onnx", "empty"))], d))

    # ---- CLI values at the edges -----------------------------------------------------------
    def cli_case(name, what, runs):
        cases.append(Case(name, what, runs, None))

    comp = ["compile", "{fixture}", "-o", "{out}"]
    cli_case("bisect-steps-huge", "kvc bisect --steps 99999999999 (ran for hours)", [
        Run("bisect", ["bisect", "{fixture}", *SMALL, "--steps", "99999999999"], USAGE, ("--steps", "256"))])
    cli_case("cli-prompt-len-0", "--max-prompt-len 0", [
        Run("compile", comp + ["--max-prompt-len", "0", "--min-response-len", "64"], USAGE, ("--max-prompt-len",))])
    cli_case("cli-prompt-len-negative", "--max-prompt-len -64", [
        Run("compile", comp + ["--max-prompt-len", "-64", "--min-response-len", "64"], USAGE, ("--max-prompt-len",))])
    cli_case("cli-prompt-len-1e9", "--max-prompt-len 10^9 (a 10^9-token KV cache)", [
        Run("compile", comp + ["--max-prompt-len", str(10**9), "--min-response-len", "64"], USAGE,
            ("max-prompt-len",), timeout=20)])
    cli_case("cli-response-len-1e9", "--min-response-len 10^9", [
        Run("compile", comp + ["--max-prompt-len", "64", "--min-response-len", str(10**9)], USAGE,
            ("min-response-len",))])
    cli_case("cli-chunk-not-pow2", "--prefill-chunk-size 48 (not a power of two)", [
        Run("compile", comp + SMALL + ["--prefill-chunk-size", "48"], USAGE, ("chunk",))])
    cli_case("cli-variants-garbage", "--variants 0,-5,abc", [
        Run("compile", comp + SMALL + ["--variants", "0,-5,abc"], USAGE, ("variants",))])
    cli_case("cli-unknown-pass", "--passes no-such-pass", [
        Run("compile", comp + SMALL + ["--passes", "no-such-pass"], USAGE, ("no-such-pass",))])
    cli_case("cli-model-missing", "a model path that does not exist", [
        Run("inspect", ["inspect", "{dir}/nothing-here"], USAGE, ("nothing-here", "does not exist")),
        Run("compile", ["compile", "{dir}/nothing-here", "-o", "{out}", *SMALL], USAGE, ("nothing-here",))])
    runv = ["run", "{good}", "--backend", "numpy"]
    cli_case("cli-max-new-tokens-0", "kvc run --max-new-tokens 0", [
        Run("run", runv + ["--prompt-ids", "1,2,3", "--max-new-tokens", "0"], USAGE, ("--max-new-tokens",))])
    cli_case("cli-max-new-tokens-huge", "kvc run --max-new-tokens 10^9 (past the compiled capacity)", [
        Run("run", runv + ["--prompt-ids", "1,2,3", "--max-new-tokens", str(10**9)], USAGE, ("capacity",))])
    cli_case("cli-token-id-too-big", "a prompt token id past the vocabulary", [
        Run("run", runv + ["--prompt-ids", "1,2,99999999"], USAGE, ("99999999",)),
        Run("run-openvino", ["run", "{good}", "--prompt-ids", "1,2,99999999", "--max-new-tokens", "2"], USAGE,
            ("99999999",))])
    cli_case("cli-token-id-negative", "a negative prompt token id", [
        Run("run", runv + ["--prompt-ids", "1,-2,3", "--max-new-tokens", "2"], USAGE, ("-2",))])
    cli_case("cli-token-id-2^63", "a prompt token id of 2^63 (does not fit in i64)", [
        Run("run", runv + ["--prompt-ids", f"1,{2**63}", "--max-new-tokens", "2"], USAGE, (str(2**63),))])
    cli_case("cli-prompt-ids-garbage", "--prompt-ids 1,two,3", [
        Run("run", runv + ["--prompt-ids", "1,two,3"], USAGE, ("prompt-ids",))])
    cli_case("cli-prompt-ids-empty", "--prompt-ids ,,", [
        Run("run", runv + ["--prompt-ids", ",,"], USAGE, ("prompt-ids",))])
    cli_case("cli-prompt-too-long", "a 65-token prompt for a 64-token prefill", [
        Run("run", runv + ["--prompt-ids", ",".join(["1"] * 65), "--max-new-tokens", "2"], USAGE, ("64",))])
    prompts = tmp / "prompts-bad.json"
    prompts.write_text(json.dumps([[1, 2, -3], {"ids": "x"}]))
    cli_case("verify-prompts-bad", "a verify prompts file with a negative id and a non-list", [
        Run("verify", ["verify", "{good}", "--prompts", str(prompts), "--backends", "numpy",
                       "--max-new-tokens", "2"], USAGE, ("prompts-bad.json",))])
    (tmp / "prompts-long.json").write_text(json.dumps([[1] * 300]))
    cli_case("verify-prompt-too-long", "a verify prompt of 300 tokens, past the capacity (blamed a negative "
             "token count)", [Run("verify", ["verify", "{good}", "--prompts", str(tmp / "prompts-long.json"),
                                             "--backends", "numpy"], USAGE, ("prompt of 300 tokens does not fit",))])
    # JSON nested past the parser's recursion limit (it raised RecursionError: exit 1, "internal error").
    deep = "[" * 100000 + "]" * 100000
    for name in ("prompts-deep.json", "goldens-deep.json", "plan-deep.json"):
        (tmp / name).write_text(deep)
    cli_case("json-nested-too-deeply", "prompts, goldens and plan files of 100000 nested arrays", [
        Run("verify", ["verify", "{good}", "--prompts", str(tmp / "prompts-deep.json"), "--backends", "numpy"],
            USAGE, ("prompts-deep.json", "nested too deeply")),
        Run("verify-goldens", ["verify", "{good}", "--goldens", str(tmp / "goldens-deep.json")], INVALID,
            ("goldens-deep.json", "bad-goldens", "nested too deeply")),
        Run("compile", ["compile", "{fixture}", "-o", "{out}", "--plan", str(tmp / "plan-deep.json")], USAGE,
            ("plan-deep.json", "nested too deeply"))])
    # Goldens that claim what they cannot be: what recorded them malformed, numpy at bf16.
    base = {"format": "kvc-goldens/1", "backend": "numpy", "kv_element_type": "f32", "openvino_version": "x",
            "prompts": [{"ids": [1, 2], "tokens": [3], "top_logits": [[[3, 1.0]]]}]}
    (tmp / "goldens-recorded-from.json").write_text(json.dumps({**base, "recorded_from": "a directory"}))
    (tmp / "goldens-numpy-bf16.json").write_text(json.dumps({**base, "inference_precision": "bf16"}))
    cli_case("goldens-claims", "goldens whose recorded_from is a string, goldens naming numpy at bf16", [
        Run("recorded-from", ["verify", "{good}", "--goldens", str(tmp / "goldens-recorded-from.json")], INVALID,
            ("goldens-recorded-from.json", "bad-goldens", "do not say what recorded them")),
        Run("numpy-bf16", ["verify", "{good}", "--goldens", str(tmp / "goldens-numpy-bf16.json")], INVALID,
            ("goldens-numpy-bf16.json", "bad-goldens", "numpy runs exact"))])
    # Text that is not UTF-8: bytes from the shell, a lone surrogate in JSON (the tokenizer raised TypeError).
    (tmp / "requests-surrogate.jsonl").write_text('{"prompt": "hi \\ud800", "max_new_tokens": 2}\n')
    cli_case("prompt-not-utf8", "a --prompt of bytes that are not UTF-8, a requests line with a lone surrogate", [
        Run("run", ["run", "{good}", "--prompt", os.fsdecode(b"hi \xff\xfe"), "--max-new-tokens", "2"], USAGE,
            ("--prompt", "not valid UTF-8")),
        Run("run-requests", ["run", "{good}", "--requests", str(tmp / "requests-surrogate.jsonl")], USAGE,
            ("requests-surrogate.jsonl", "not valid UTF-8"))])
    # A vision-language prompt's image (`kvc run --image START:ROWS.npy`): read without pickles,
    # never from a FIFO (np.load would block on it), and only for a model that takes rows.
    import numpy as np

    np.save(tmp / "image-pickled.npy", np.array([{"rows": 1}], dtype=object), allow_pickle=True)
    np.save(tmp / "image-rows.npy", np.zeros((2, 8), np.float32))
    os.mkfifo(tmp / "image-fifo.npy")
    cli_case("run-image-hostile", "kvc run --image: a pickled .npy, a FIFO, rows for a model that takes ids", [
        Run("run-pickled", runv + ["--prompt-ids", "1,2,3", "--image", f"0:{tmp / 'image-pickled.npy'}"], USAGE,
            ("image-pickled.npy", "without pickles")),
        Run("run-fifo", runv + ["--prompt-ids", "1,2,3", "--image", f"0:{tmp / 'image-fifo.npy'}"], USAGE,
            ("image-fifo.npy", "not a regular file")),
        Run("run-text-model", runv + ["--prompt-ids", "1,2,3", "--image", f"0:{tmp / 'image-rows.npy'}"], USAGE,
            ("media rows need a model that takes inputs_embeds",))])
    for name, image in (("fifo", "image-fifo.npy"), ("pickled", "image-pickled.npy"), ("rows", "image-rows.npy")):
        (tmp / f"requests-image-{name}.jsonl").write_text(
            '{"prompt_ids": [1, 2, 3], "max_new_tokens": 2, "images": [{"start": 0, "rows": "%s"}]}\n' % image)
    cli_case("requests-image-hostile", "kvc run --requests with an image: a FIFO, a pickled .npy, rows for a model "
             "that takes ids", [
        Run("requests-fifo", runv + ["--requests", str(tmp / "requests-image-fifo.jsonl")], USAGE,
            ("requests-image-fifo.jsonl:1", "image-fifo.npy", "not a regular file")),
        Run("requests-pickled", runv + ["--requests", str(tmp / "requests-image-pickled.jsonl")], USAGE,
            ("requests-image-pickled.jsonl:1", "without pickles")),
        Run("requests-text-model", runv + ["--requests", str(tmp / "requests-image-rows.jsonl")], USAGE,
            ("requests-image-rows.jsonl:1", "media rows need a model that takes inputs_embeds"))])
    cli_case("bisect-prompt-out-of-vocab", "kvc bisect with a token id past the vocabulary", [
        Run("bisect", ["bisect", "{fixture}", *SMALL, "--prompt-ids", "1,99999999"], USAGE, ("99999999",))])

    # ---- compiled directories (made from {good} at run time, see `prepare_compiled`) --------
    cd = ["run", "{case}", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
    cv = ["verify", "{case}", "--backends", "numpy", "--max-new-tokens", "2"]
    for name, what, runs in (
        ("compiled-manifest-edited", "manifest.json with weights.bin's recorded size changed", [
            Run("run", cd, INVALID, ("weights.bin", "file-changed")),
            Run("verify", cv, INVALID, ("weights.bin", "file-changed")),
            Run("inspect", ["inspect", "{case}"], OK, ())]),
        ("compiled-manifest-hash-edited", "manifest.json with weights.bin's recorded sha256 changed", [
            Run("run", cd + ["--check"], INVALID, ("weights.bin", "sha256")),
            Run("verify", cv, INVALID, ("weights.bin", "sha256"))]),
        ("compiled-blob-swapped", "prefill and generate blobs swapped (sizes differ)", [
            Run("run", cd, INVALID, ("CPU.blob", "file-changed")),
            Run("verify", cv, INVALID, ("file-changed",))]),
        ("compiled-blob-corrupt-same-size", "prefill blob overwritten by random bytes of the same size", [
            Run("run", cd, DEVICE, ("prefill",)),
            Run("run-check", cd + ["--check"], INVALID, ("prefill", "CPU.blob", "sha256"))]),
        ("compiled-manifest-dotdot", "manifest naming ../outside.bin as its weights", [
            Run("run", cd, INVALID, ("manifest.json", "outside")),
            Run("verify", cv, INVALID, ("manifest.json", "outside")),
            Run("inspect", ["inspect", "{case}"], INVALID, ("manifest.json", "outside"))]),
        ("compiled-manifest-absolute", "manifest naming /etc/passwd as a file", [
            Run("run", cd, INVALID, ("manifest.json", "outside"))]),
        ("compiled-manifest-deep", "manifest.json of 100000 nested arrays", [
            Run("run", cd, INVALID, ("manifest.json", "bad-manifest", "nested too deeply")),
            Run("inspect", ["inspect", "{case}"], INVALID, ("manifest.json", "nested too deeply"))]),
        ("compiled-manifest-not-json", "manifest.json cut in half", [
            Run("run", cd, INVALID, ("manifest.json", "bad-manifest")),
            Run("inspect", ["inspect", "{case}"], INVALID, ("manifest.json", "bad-manifest"))]),
        ("compiled-manifest-format-99", "manifest.json of format 99", [
            Run("run", cd, INVALID, ("manifest.json", "format"))]),
        ("compiled-manifest-plan-garbage", "manifest.json whose plan lengths are strings", [
            Run("run", cd, INVALID, ("manifest.json", "plan"))]),
        ("compiled-weights-missing", "a compiled directory without weights.bin", [
            Run("run", cd, INVALID, ("weights.bin", "file-missing")),
            Run("verify", cv, INVALID, ("weights.bin", "file-missing"))]),
        ("compiled-no-manifest", "a compiled directory without manifest.json", [
            Run("run", cd, INVALID, ("no-manifest",)),
            Run("verify", cv, INVALID, ("no-manifest",))]),
        ("compiled-xml-edited-same-size", "prefill.xml with one Const offset changed, same size, run --from-ir --check", [
            Run("run", cd + ["--from-ir", "--check"], INVALID, ("prefill.xml", "sha256"))]),
        # Found by tests/hostile/fuzz.py (each crashed kvc with an internal error):
        ("compiled-manifest-not-utf8", "manifest.json with a byte flipped into invalid UTF-8 (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "UTF-8"))]),
        ("compiled-manifest-kv-huge", "the plan's KV shape with 2^63 rows (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "largest variant"))]),
        ("compiled-manifest-kv-renamed", "the plan's KV output renamed to a port no model has (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "present.0.kez"))]),
        ("compiled-manifest-kv-shape", "the plan's KV head size off by one (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "KV layout"))]),
        ("compiled-manifest-no-blobs", "a model entry without its blobs (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "blobs"))]),
        ("compiled-manifest-import-config", "a blob's import_config replaced by a string (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "blobs"))]),
        ("compiled-manifest-port-garbage", "a model's logits port replaced by a number (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "outputs"))]),
        ("compiled-manifest-weights-path", "a blob's WEIGHTS_PATH pointing out of the directory (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "WEIGHTS_PATH"))]),
        ("compiled-manifest-lengths-lie", "the plan's max_prompt_len 64 -> 65, the models unchanged (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "lengths"))]),
        ("compiled-manifest-ports-lie", "the manifest lists a prefill input shape the model does not have", [
            Run("run", cd, INVALID, ("manifest.json", "input_ids"))]),
        ("compiled-manifest-present-rows", "a model's present rows one short: an If blob's outputs are cut to "
         "them, and a first chunk generated other tokens with exit 0 (fuzz)", [
            Run("run", cd, INVALID, ("manifest.json", "present.0.key", "KV layout"))]),
        # Red team A, finding 3: kvc read tokenizer and config files the manifest does not list.
        ("compiled-copy-unlisted", "generation_config.json stopping at another id, taken out of the manifest's "
         "files and copied files: kvc run --check stopped there with exit 0", [
            Run("run", cd + ["--check"], INVALID, ("generation_config.json", "file-unlisted")),
            Run("verify", cv, INVALID, ("generation_config.json", "file-unlisted"))]),
        ("compiled-copy-delisted", "tokenizer.json taken out of the manifest's copied files (its hash kept): "
         "kvc verify never compared it with the source's", [
            Run("run", cd + ["--check"], INVALID, ("manifest.json", "'tokenizer.json'", "bad-manifest")),
            Run("verify", cv, INVALID, ("manifest.json", "'tokenizer.json'", "bad-manifest"))]),
    ):
        cases.append(Case(name, what, runs, tmp / name))
    return cases


def prepare_compiled(case: Case, good: Path) -> None:
    """Make a compiled-directory case's input from a copy of the good compiled directory."""
    d = case.path
    if d is None or not case.name.startswith("compiled-") or d.exists():
        return
    shutil.copytree(good, d)
    mpath = d / "manifest.json"
    m = json.loads(mpath.read_text())
    n = case.name
    if n == "compiled-manifest-edited":
        m["files"]["weights.bin"]["bytes"] += 1
    elif n == "compiled-manifest-hash-edited":
        m["files"]["weights.bin"]["sha256"] = "0" * 64
    elif n == "compiled-blob-swapped":
        a, b = d / m["models"]["prefill"]["blobs"]["CPU"]["file"], next(d.glob("generate-*.CPU.blob"))
        ta = a.read_bytes()
        a.write_bytes(b.read_bytes())
        b.write_bytes(ta)
    elif n == "compiled-blob-corrupt-same-size":
        a = d / m["models"]["prefill"]["blobs"]["CPU"]["file"]  # with first-16's on a bf16 host
        a.write_bytes(random.Random(3).randbytes(a.stat().st_size))
    elif n == "compiled-manifest-dotdot":
        (d.parent / "outside.bin").write_bytes((d / "weights.bin").read_bytes())
        m["weights"] = "../outside.bin"
        m["files"]["../outside.bin"] = m["files"]["weights.bin"]
    elif n == "compiled-manifest-absolute":
        m["files"]["/etc/passwd"] = {"bytes": 1, "sha256": "0" * 64}
    elif n == "compiled-manifest-format-99":
        m["format"] = 99
    elif n == "compiled-manifest-plan-garbage":
        m["plan"]["lengths"] = {k: "lots" for k in m["plan"]["lengths"]}
    elif n == "compiled-weights-missing":
        (d / "weights.bin").unlink()
    elif n == "compiled-no-manifest":
        mpath.unlink()
    elif n == "compiled-xml-edited-same-size":
        x = d / "prefill.xml"
        t = x.read_text()
        t2 = re.sub(r'offset="(\d)(\d*)"', lambda mm: f'offset="{(int(mm.group(1)) + 4) % 10}{mm.group(2)}"', t, 1)
        assert len(t2) == len(t) and t2 != t
        x.write_text(t2)
    elif n == "compiled-manifest-kv-huge":
        m["plan"]["kv"][-1]["shape"][2] = 2 ** 63
    elif n == "compiled-manifest-kv-renamed":
        m["plan"]["kv"][0]["output"] = "present.0.kez"
    elif n == "compiled-manifest-kv-shape":
        m["plan"]["kv"][-1]["shape"][3] -= 1
    elif n == "compiled-manifest-no-blobs":
        del m["models"]["prefill"]["blobs"]
    elif n == "compiled-manifest-import-config":
        m["models"]["prefill"]["blobs"]["CPU"]["import_config"] = "x" * 40
    elif n == "compiled-manifest-port-garbage":
        m["models"]["prefill"]["outputs"][0] = 1
    elif n == "compiled-manifest-weights-path":
        m["models"]["prefill"]["blobs"]["CPU"]["import_config"]["WEIGHTS_PATH"] = "../../outside.bin"
    elif n == "compiled-manifest-lengths-lie":
        m["plan"]["lengths"]["max_prompt_len"] += 1
    elif n == "compiled-manifest-ports-lie":
        port = next(p for p in m["models"]["prefill"]["inputs"] if p["name"] == "input_ids")
        port["shape"][-1] += 1
    elif n == "compiled-manifest-present-rows":
        port = next(p for p in m["models"]["prefill"]["outputs"] if p["name"] == "present.0.key")
        port["shape"][2] -= 1
    elif n == "compiled-copy-unlisted":
        (d / "generation_config.json").write_text('{"eos_token_id": 72}\n')
        del m["files"]["generation_config.json"]
        m["tokenizer"].remove("generation_config.json")
    elif n == "compiled-copy-delisted":
        m["tokenizer"].remove("tokenizer.json")
    if n == "compiled-manifest-not-utf8":
        mpath.write_bytes(mpath.read_bytes().replace(b'"format"', b'"\xbbormat"', 1))
    elif n == "compiled-manifest-not-json":
        text = mpath.read_text()
        mpath.write_text(text[: len(text) // 2])
    elif n == "compiled-manifest-deep":
        mpath.write_text("[" * 100000 + "]" * 100000)
    elif n not in ("compiled-no-manifest", "compiled-manifest-not-utf8"):
        mpath.write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")


def compile_good(tmp: Path) -> Path:
    """One good compiled directory of the llama fixture, shared by the cases that need one."""
    good = Path(tmp) / "good"
    if not (good / "manifest.json").is_file():
        subprocess.run(kvc_command() + ["compile", str(FIXTURE), "-o", str(good), *SMALL], check=True,
                       capture_output=True, timeout=300)
    return good


# --------------------------------------------------------------------------------------------
# Running and classifying


def _leftovers(out: Path, tmpdir: Path) -> list[str]:
    found = []
    if out.exists():
        found.append(f"{out.name} exists")
    found += [p.name for p in out.parent.glob(f".{out.name}.*")]
    found += [p.name for p in out.parent.glob(f"{out.name}.failed-dumps")]
    found += [f"$TMPDIR/{p.name}" for p in tmpdir.iterdir()] if tmpdir.exists() else []
    return found


def run_one(case: Case, run: Run, good: Path, work: Path, timeout: float = TIMEOUT) -> Outcome:
    cdir = work / "runs" / f"{case.name}--{run.command}"
    shutil.rmtree(cdir, ignore_errors=True)
    cdir.mkdir(parents=True)
    out = cdir / "out"
    tmpdir = cdir / "tmp"
    tmpdir.mkdir()
    subst = {"case": str(case.path), "out": str(out), "good": str(good), "fixture": str(FIXTURE), "dir": str(cdir)}
    argv = [a.format(**subst) for a in run.argv]
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONWARNINGS": "ignore"}
    timeout = run.timeout or timeout
    t0 = time.monotonic()
    proc = subprocess.Popen(kvc_command() + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = None
    seconds = time.monotonic() - t0
    stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    text = stdout + stderr
    # The message is the error itself, not the progress lines before it (they name the file too).
    err = re.search(r"^(kvc: error:|Error:|kvc: internal error:).*", stderr, re.M | re.S)
    message = err.group(0) if err else text
    o = Outcome(case.name, run.command, argv, run.code, code, seconds, "clean", bug=run.bug, stderr=stderr[-2000:])
    left = _leftovers(out, tmpdir) if run.command.startswith("compile") and run.code != OK else \
        [f"$TMPDIR/{p.name}" for p in tmpdir.iterdir()]
    missing = [m for m in run.message if m not in message]
    if code is None:
        o.verdict, o.detail = "hang", f"killed after {timeout:.0f} s"
    elif "Traceback" in text or code == INTERNAL or code < 0:
        crash_line = re.search(r"^(kvc: internal error:.*|\w*Error:.*)$", stderr, re.M)
        o.verdict, o.detail = "crash", (crash_line.group(0) if crash_line else _last_line(stderr)) or f"exit {code}"
    elif code == OK and run.code != OK:
        o.verdict, o.detail = "accepted-wrong", f"exit 0; {_last_line(stdout)}"
    elif code != run.code:
        o.verdict, o.detail = "wrong-code", f"exit {code}: {_last_line(stderr)}"
    elif missing:
        o.verdict, o.detail = "no-message", f"message lacks {missing}: {_last_line(stderr)}"
    elif left:
        o.verdict, o.detail = "partial", "left behind: " + ", ".join(left)
    else:
        o.detail = _last_line(stderr) or _last_line(stdout)
    return o


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_case(case: Case, good: Path, work: Path, timeout: float = TIMEOUT) -> list[Outcome]:
    prepare_compiled(case, good)
    return [run_one(case, r, good, work, timeout) for r in case.runs]


def run_all(cases: list[Case], good: Path, work: Path, jobs: int = 0, timeout: float = TIMEOUT,
            echo=None) -> dict[tuple[str, str], Outcome]:
    """Every run of every case, `jobs` at a time (default: one per CPU); keyed (case, command)."""
    from concurrent.futures import ThreadPoolExecutor

    for c in cases:
        prepare_compiled(c, good)
    pairs = [(c, r) for c in cases for r in c.runs]
    # The slowest first (compiles that may run to the bound), so they overlap with the rest.
    order = sorted(pairs, key=lambda cr: (not cr[0].name.startswith("cli-") or cr[1].command != "compile"))
    results: dict[tuple[str, str], Outcome] = {}
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        futures = {pool.submit(run_one, c, r, good, work, timeout): (c.name, r.command) for c, r in order}
        for f in futures:
            o = f.result()
            results[futures[f]] = o
            if echo:
                echo(o)
    return {(c.name, r.command): results[(c.name, r.command)] for c, r in pairs}


# --------------------------------------------------------------------------------------------
# Fault injection: kill -9 during `kvc compile`


def kill_moments(work: Path, good: Path, samples: int = 10, seed: int = 19) -> list[dict]:
    """SIGKILL `kvc compile` at `samples` moments spread over a full run; after each, OUT is
    absent or complete (and passes `kvc verify`), and any leftover sibling is reported; then a
    second compile to the same OUT must clean the leftover and succeed."""
    t0 = time.monotonic()
    subprocess.run(kvc_command() + ["compile", str(FIXTURE), "-o", str(work / "kill-probe"), *SMALL], check=True,
                   capture_output=True)
    full = time.monotonic() - t0
    rng = random.Random(seed)
    rows = []
    for i in range(samples):
        delay = 1.15 * full * (i + rng.random()) / samples  # the last ones land after OUT is published
        d = work / f"kill-{i}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        out = d / "out"
        proc = subprocess.Popen(kvc_command() + ["compile", str(FIXTURE), "-o", str(out), *SMALL],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        killed = proc.poll() is None
        if killed:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        row = {"moment_s": round(delay, 2), "killed": killed, "out": "absent", "verify": "-",
               "leftovers": sorted(p.name for p in d.iterdir() if p.name != "out"), "recompile": "-"}
        if out.exists():
            complete = (out / "manifest.json").is_file()
            row["out"] = "complete" if complete else "INCOMPLETE"
            if complete:
                v = subprocess.run(kvc_command() + ["verify", str(out), "--backends", "numpy",
                                                    "--max-new-tokens", "2"], capture_output=True, timeout=120)
                row["verify"] = "ok" if v.returncode == 0 else f"exit {v.returncode}"
        if row["leftovers"] and row["out"] != "INCOMPLETE":
            r = subprocess.run(kvc_command() + ["compile", str(FIXTURE), "-o", str(out), *SMALL, "--force"],
                               capture_output=True, text=True, timeout=300)
            left = sorted(p.name for p in d.iterdir() if p.name != "out")
            said = "removed" in r.stderr + r.stdout or "restored" in r.stderr + r.stdout
            row["recompile"] = f"exit {r.returncode}, {'said so' if said else 'silent'}, left {left or 'nothing'}"
        row["survived"] = (row["out"] in ("absent", "complete") and row["verify"] in ("-", "ok")
                           and (not row["leftovers"] or row["recompile"].startswith("exit 0, said so, left nothing")))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Report

BAD = ("crash", "accepted-wrong", "wrong-code", "no-message", "partial", "hang")


def write_report(path: Path, outcomes: list[Outcome], n_cases: int, kills: list[dict] | None, seconds: float,
                 fuzz_lines: list[str] | None = None, fuzz_budget: int = 0) -> str:
    totals = {v: sum(o.verdict == v for o in outcomes) for v in ("clean",) + BAD}
    lines = [
        "# Reliability: kvc against hostile inputs",
        "",
        "Generated by `python tests/hostile/corpus.py --report docs/reliability.md"
        + (f" --kill {len(kills)}" if kills else "") + (f" --fuzz {fuzz_budget}" if fuzz_lines else "")
        + "` (issue 19); do not edit by hand.",
        "The corpus (tests/hostile/corpus.py) is generated into a temporary directory from the llama fixture "
        "and tiny opset13/ONNX models; nothing hostile is committed. Each case runs through the kvc commands "
        "that read it, as subprocesses of the installed `kvc`, with a "
        f"{TIMEOUT:.0f} s bound. tests/hostile/test_corpus.py runs the same corpus under pytest; the cases "
        "below that are not clean are `xfail(strict=True)` there, each naming the kvc bug.",
        "",
        "Verdicts: **clean** (documented exit code, message naming the file and the problem, no traceback, "
        "nothing left behind), **crash** (traceback, internal error exit 1, or a signal), **accepted-wrong** "
        "(exit 0 on garbage), **wrong-code**, **no-message** (right code, message lacks the file or the problem), "
        "**partial** (a failed compile left OUT, `.OUT.partial-*`/`.OUT.old-*`, or temp files), **hang**.",
        "",
        "## Totals",
        "",
        f"- cases: {n_cases}; command runs: {len(outcomes)}; wall time {seconds:.0f} s",
        "",
        "| " + " | ".join(totals) + " |",
        "|" + "---|" * len(totals),
        "| " + " | ".join(str(v) for v in totals.values()) + " |",
        "",
    ]
    if kills is not None:
        survived = sum(r["survived"] for r in kills)
        lines += [
            "## kill -9 during `kvc compile`",
            "",
            f"{survived} of {len(kills)} moments survived (OUT absent or complete and passing `kvc verify`; "
            "a leftover sibling is only acceptable when the next compile removes it and says so).",
            "",
            "| moment (s) | killed | OUT | verify | leftovers beside OUT | next compile --force | survived |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [f"| {r['moment_s']} | {r['killed']} | {r['out']} | {r['verify']} | "
                  f"{', '.join(r['leftovers']) or '-'} | {r['recompile']} | {'yes' if r['survived'] else '**no**'} |"
                  for r in kills]
        lines.append("")
    lines += fuzz_lines or []
    bugs: dict[str, list[str]] = {}
    for o in outcomes:
        if o.verdict != "clean":
            bugs.setdefault(o.bug or "(not yet marked in the corpus)", []).append(f"{o.case} ({o.command}: {o.verdict})")
    if bugs:
        lines += ["## kvc bugs behind the bad columns", ""]
        lines += [f"- {reason.removeprefix('kvc bug: ')}  \n  cases: {', '.join(where)}" for reason, where in bugs.items()]
        lines.append("")
    lines += ["## Per case", "", "| case | command | expected | exit | verdict | s | detail |",
              "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        verdict = o.verdict if o.verdict == "clean" else f"**{o.verdict}**"
        detail = o.detail.replace("|", "\\|").replace("\n", " ")[:220]
        lines.append(f"| {o.case} | {o.command} | {o.expected} | {o.code} | {verdict} | {o.seconds:.1f} | {detail} |")
    lines += ["", "## Commands that produced each outcome", "", "```"]
    lines += [f"{o.case}: kvc {shlex.join(o.argv)}" for o in outcomes]
    lines += ["```", ""]
    text = "\n".join(lines)
    # argv may hold bytes that are not UTF-8 (a --prompt case): written as \xNN escapes
    Path(path).write_text(text, encoding="utf-8", errors="backslashreplace")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", type=Path, help="write the figure here (e.g. docs/reliability.md)")
    ap.add_argument("--dir", type=Path, help="generate into this directory (default: a temporary one)")
    ap.add_argument("--kill", type=int, default=0, metavar="N", help="also SIGKILL kvc compile at N moments")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N", help="also run N fuzz executions (fuzz.py, seed 1)")
    ap.add_argument("-k", default=None, help="only cases whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("-j", "--jobs", type=int, default=0, help="runs at a time (default: one per CPU)")
    args = ap.parse_args(argv)
    keep = args.dir is not None
    work = args.dir or Path(tempfile.mkdtemp(prefix="kvc-hostile-"))
    try:
        t0 = time.monotonic()
        cases = build(work / "corpus")
        if args.list:
            for c in cases:
                print(f"{c.name:36} {','.join(c.commands):28} {c.what}")
            return 0
        if args.k:
            cases = [c for c in cases if args.k in c.name]
        good = compile_good(work)
        def echo(o):
            print(f"{o.verdict:14} {o.case:36} {o.command:12} exit {o.code} ({o.seconds:.1f} s) {o.detail[:120]}",
                  flush=True)

        outcomes = list(run_all(cases, good, work, args.jobs, echo=echo).values())
        kills = kill_moments(work / "kill", good, args.kill) if args.kill else None
        if kills:
            for r in kills:
                print("kill", r, flush=True)
        fuzz_lines = None
        if args.fuzz:
            sys.path.insert(0, str(ROOT))
            from tests.hostile import fuzz
            fuzz_lines = fuzz.report_lines(fuzz.fuzz(args.fuzz, 1, work / "fuzz"))
            print("\n".join(fuzz_lines))
        if args.report:
            write_report(args.report, outcomes, len(cases), kills, time.monotonic() - t0, fuzz_lines, args.fuzz)
        bad = sum(o.verdict != "clean" for o in outcomes)
        print(f"{len(cases)} cases, {len(outcomes)} runs, {bad} not clean")
        return 0
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
