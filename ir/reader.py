"""Find, validate and read a model: an optimum-intel directory, an IR `.xml`, or an `.onnx`.

OpenVINO reads the weights memory-mapped (the Core's default), so loading a model costs
its graph, not its weights. kvc's own ops are registered on the shared Core before any read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import openvino as ov

from kvc.errors import InvalidModelError, openvino_reason
from kvc.ir.text_embeddings import attach
from kvc.ir.validate import check_inside, validate_ir, validate_onnx

# File names optimum-intel and openvino.genai use for the language model of a directory.
DIR_CANDIDATES = ("openvino_model.xml", "openvino_language_model.xml", "model.onnx")
# IR files in a model directory that are not the language model.
NOT_THE_MODEL = ("tokenizer", "detokenizer")


@dataclass(frozen=True)
class ModelFiles:
    """The files that make up one model on disk."""

    kind: str  # "ir" or "onnx"
    model: Path
    weights: Path | None  # the IR .bin; None for ONNX
    root: Path  # the directory every referenced path must stay in


@functools.cache
def core() -> ov.Core:
    """The process-wide Core, with kvc's custom ops registered (read and compile need them)."""
    c = ov.Core()
    from kvc.ir.custom_ops import register_extensions

    register_extensions(c)
    return c


def resolve(path: str | Path) -> ModelFiles:
    """Map a user's path to the model files it names, refusing anything ambiguous."""
    p = Path(path)
    if not p.exists():
        raise InvalidModelError("missing-file", str(p), "no such file or directory")
    if p.is_dir():
        return _resolve_dir(p)
    if p.suffix == ".xml":
        bin_path = check_inside(p.with_suffix(".bin"), p.parent, str(p), "weights file")
        check_inside(p, p.parent, str(p), "model file")
        return ModelFiles("ir", p, bin_path, p.parent)
    if p.suffix == ".onnx":
        return ModelFiles("onnx", p, None, p.parent)
    raise InvalidModelError("unknown-format", str(p), "not a model kvc can read",
                            expected="a directory, an .xml (OpenVINO IR) or an .onnx", found=p.suffix or "no suffix")


def _resolve_dir(d: Path) -> ModelFiles:
    for name in DIR_CANDIDATES:
        candidate = d / name
        if candidate.exists():
            target = check_inside(candidate, d, str(candidate), "model file")
            if name.endswith(".onnx"):
                return ModelFiles("onnx", target, None, d)
            bin_path = check_inside(candidate.with_suffix(".bin"), d, str(candidate), "weights file")
            return ModelFiles("ir", target, bin_path, d)
    xmls = sorted(x.name for x in d.glob("*.xml") if not any(t in x.name for t in NOT_THE_MODEL))
    onnxs = sorted(x.name for x in d.glob("*.onnx"))
    found = xmls + onnxs
    if len(found) == 1:
        return resolve(d / found[0])
    holders = sorted(f"{sub.name}/{name}" for sub in d.iterdir() if sub.is_dir() and not sub.is_symlink()
                     for name in DIR_CANDIDATES if (sub / name).is_file())
    hint = (f" (in {'a subdirectory' if len(holders) == 1 else 'subdirectories'}: {', '.join(holders)}; give "
            f"{'that directory' if len(holders) == 1 else 'one of them'})") if holders and not found else ""
    raise InvalidModelError("no-model", str(d), "cannot tell which file is the model",
                            expected=" or ".join(DIR_CANDIDATES) + " (or exactly one .xml/.onnx)",
                            found=(", ".join(found) or "no model files") + hint)


def map_weights(path: str | Path) -> ov.Tensor | None:
    """A weights file mapped once, for `load(..., mapped=)` to read several IRs over (None for
    an empty file). Each read_model of a path maps the file anew, and the pages one model
    touches count in RSS again for every mapping that touches them: the three static models of
    the 250M Llama on kvc's numpy runtime held 2.6 GB resident, 0.97 GB over one mapping.
    Copy-on-write because OpenVINO shares only a writable buffer; nothing writes it. The
    models read over it do not keep it alive: whoever holds them must hold it too (unmapped
    under a model's constants, reading them crashes the process)."""
    if Path(path).stat().st_size == 0:
        return None
    import numpy as np

    return ov.Tensor(np.memmap(path, dtype=np.uint8, mode="c"), shared_memory=True)


def load(path: str | Path, *, weights: str | Path | None = None, validate: bool = True,
         consts_found: Callable[[Path, list[tuple[int, int]]], None] | None = None,
         mapped: ov.Tensor | None = None) -> ov.Model:
    """Read a model after validating its files; the model's friendly name is kept as exported.

    `weights` names the IR's weights file when it is not `<stem>.bin` beside the `.xml` (the
    shared `weights.bin` of a compiled directory); it must stay inside the model's directory.
    `mapped`: that file as `map_weights` mapped it, read in place of the file (validation
    still reads the file). `consts_found(bin, consts)` is told where an IR's Consts are in
    its weights file (a `Bundle` starts copying them then): first with a guess from the raw
    XML, then with what validation found (the one to trust), before OpenVINO reads the model.
    """
    files = resolve(path)
    if weights is not None:
        if files.kind != "ir":
            raise InvalidModelError("unknown-format", str(files.model), "a weights file applies to an IR (.xml) only")
        files = ModelFiles("ir", files.model, check_inside(Path(weights), files.root, str(files.model),
                                                           "weights file"), files.root)
    return _load(files, validate, consts_found, mapped)


def _load(files: ModelFiles, validate: bool, consts_found, mapped: ov.Tensor | None = None) -> ov.Model:
    if validate:
        if files.kind == "ir":
            tell = None
            if consts_found is not None and files.weights is not None and files.weights.exists():
                tell = functools.partial(consts_found, files.weights)
            consts = validate_ir(files.model, files.weights, early=tell)
            if tell is not None and consts:
                tell(consts)
        else:
            validate_onnx(files.model)
    try:
        if files.kind == "ir" and mapped is not None:
            model = core().read_model(files.model.read_text(encoding="utf-8"), mapped)
        elif files.kind == "ir" and files.weights is not None and files.weights.exists():
            model = core().read_model(str(files.model), str(files.weights))
        else:
            model = core().read_model(str(files.model))
    except RuntimeError as exc:
        # Validation passed, so this is a semantic problem (unknown op, bad attribute).
        raise InvalidModelError("openvino-rejected", str(files.model),
                                f"OpenVINO cannot read this model: {openvino_reason(exc)}") from None
    attach(model, files.model)  # a language model taking inputs_embeds: its text embeddings model
    return model


def bodies(node: ov.Node) -> list[ov.Model]:
    """The bodies of an If (then, else), a Loop or a TensorIterator; [] for any other node.
    (A Loop's `get_function` takes no index, an If's takes one.)"""
    kind = node.get_type_name()
    if kind == "If":
        return [node.get_then_body(), node.get_else_body()]
    if kind in ("Loop", "TensorIterator"):
        return [node.get_function()]
    return []
