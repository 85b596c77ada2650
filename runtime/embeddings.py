"""Models that take `inputs_embeds`: the language model of a vision-language export.

optimum-intel exports a vision-language model (`--task image-text-to-text`: LLaVA, Gemma 3,
Qwen2-VL ...) as several IRs; its language model, `openvino_language_model.xml`, is a decoder
like any other but takes `inputs_embeds` [B, S, H] where a text model takes `input_ids`. Its
text embeddings model, `openvino_text_embeddings_model.xml` beside it (input `input`, ids;
output `inputs_embeds`), turns ids into those rows; a VLM pipeline puts the vision encoder's
rows in place of the image tokens'. kvc compiles the language model with `inputs_embeds` kept
(what the device's VLM pipeline feeds), and copies the text embeddings model into the compiled
directory unchanged.

The rules:

* kvc drives every model by token ids. A session over a model that takes `inputs_embeds`
  holds an `Embedder` (`session.embed`): the text embeddings model on OpenVINO CPU at f32;
  the feeds of a step give it the rows of their ids (`token_feed`). Both sides of every
  comparison get the same rows for the same ids, so the embedder is outside what kvc's checks
  prove; kvc does not change it.
* The text embeddings model is found beside the language model, by optimum's file name
  (`kvc.ir.text_embeddings`: `kvc.ir.load` records where on the model); a model that takes
  `inputs_embeds` with none beside it is refused when a session is opened over it
  (`no-text-embeddings`).
* Its output must be f32 rows as wide as the language model's `inputs_embeds`; anything else
  is refused naming both.
* A vision-language config.json states the language model's positions, window, rotary and
  special ids in its `text_config` (`language_config`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import openvino as ov

from kvc.errors import InvalidModelError
from kvc.ir.text_embeddings import RT_KEY, TEXT_EMBEDDINGS, TOKEN_EMBEDS, takes_embeds, token_input


def language_config(config: dict) -> dict:
    """A model's config.json as its language model's: a vision-language config's `text_config`
    over its top level (where some exports keep the special ids); any other config as it is."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def embedder_of(model: ov.Model, where: str | None = None) -> Embedder | None:
    """The embedder a session over `model` feeds it with; None for a model that takes ids.
    `where`: the model's file, for the error (else its name)."""
    if not takes_embeds(model):
        return None
    rt = model.get_rt_info()
    width = next(p for p in model.inputs if TOKEN_EMBEDS in p.get_names()).get_partial_shape()[-1]
    return _found(rt[RT_KEY].astype(str) if RT_KEY in rt else None, width.get_length() if width.is_static else -1,
                  where or model.get_friendly_name())


def embedder_beside(directory: Path, name: str, inputs: list[dict]) -> Embedder | None:
    """The embedder of compiled model `name` of `directory`, from its manifest `inputs`."""
    if token_input({p["name"] for p in inputs}) != TOKEN_EMBEDS:
        return None
    port = next(p for p in inputs if p["name"] == TOKEN_EMBEDS)
    path = Path(directory) / TEXT_EMBEDDINGS
    return _found(str(path.absolute()) if path.is_file() else None, port["shape"][-1], f"{directory}: model {name!r}")


def _found(path: str | None, width: int, where: str) -> Embedder:
    if path is None:
        raise InvalidModelError(
            "no-text-embeddings", where,
            f"takes {TOKEN_EMBEDS} (the language model of a vision-language export), and kvc drives models by "
            f"token ids through the text embeddings model beside it", expected=f"{TEXT_EMBEDDINGS} in its directory",
            found="none")
    files = (Path(path), Path(path).with_suffix(".bin"))
    stamp = tuple((s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for s in map(_stat, files))
    return _embedder(path, width, stamp)


def _stat(path: Path):
    try:
        return path.stat()
    except FileNotFoundError:
        raise InvalidModelError("no-text-embeddings", str(path), "is missing", expected="a file",
                                found="no such file") from None


@functools.lru_cache(maxsize=8)
def _embedder(path: str, width: int, stamp: tuple) -> Embedder:
    """One embedder per file, width and version of the files (`stamp`) in a process: each
    compiles its model once, and a file replaced is read again."""
    return Embedder(Path(path), width)


class Embedder:
    """Token ids [B, n] -> their rows [B, n, H] (f32), from a text embeddings model on OpenVINO
    CPU at f32."""

    def __init__(self, path: Path, width: int):
        from kvc.ir.reader import load
        from kvc.runtime.session import OpenVINOSession

        model = load(path)
        if len(model.inputs) != 1 or len(model.outputs) != 1:
            raise InvalidModelError("bad-text-embeddings", str(path), "is not a text embeddings model",
                                    expected="one input (token ids) and one output (their rows)",
                                    found=f"{len(model.inputs)} inputs, {len(model.outputs)} outputs")
        ids, out = model.input(0), model.output(0)
        if not ids.get_element_type().is_integral() or ids.get_partial_shape().rank != 2:
            raise InvalidModelError("bad-text-embeddings", str(path), "does not take token ids [B, S]",
                                    expected="an integer input of rank 2",
                                    found=f"{ids.get_element_type().get_type_name()}{ids.get_partial_shape()}")
        shape = out.get_partial_shape()
        if out.get_element_type() != ov.Type.f32 or shape.rank != 3 or (
                width > 0 and (not shape[2].is_static or shape[2].get_length() != width)):
            raise InvalidModelError("bad-text-embeddings", str(path),
                                    "gives rows the language model's inputs_embeds cannot take",
                                    expected=f"f32[?,?,{width}]", found=f"{out.get_element_type().get_type_name()}"
                                    f"{shape}")
        self._input, self._output = ids.get_any_name(), out.get_any_name()
        self._dtype = ids.get_element_type().to_dtype()
        self._session = OpenVINOSession(model, "CPU")

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        out = self._session.infer({self._input: np.asarray(ids, self._dtype)})
        return np.asarray(out[self._output], np.float32)


def token_feed(session, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The token inputs of one step of `session` (the caller keeps those it has): `input_ids`,
    or their rows as `inputs_embeds` when the session's model takes rows (`session.embed`, set
    where it is opened); and `token_type_ids`, 0 for every token: text (Gemma 3's language
    model marks an image's tokens 1, to attend each other both ways)."""
    embed = getattr(session, "embed", None)
    tokens = {"input_ids": ids} if embed is None else {TOKEN_EMBEDS: embed(ids)}
    return {**tokens, "token_type_ids": np.zeros(np.shape(ids), np.int64)}
