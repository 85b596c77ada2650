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
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from kvc.errors import InvalidModelError, UsageError
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
    sections = any("position_ids" in p.get_names() and p.get_partial_shape().rank == 3 for p in model.inputs)
    return _found(rt[RT_KEY].astype(str) if RT_KEY in rt else None, width.get_length() if width.is_static else -1,
                  where or model.get_friendly_name(), sections)


def embedder_beside(directory: Path, name: str, inputs: list[dict]) -> Embedder | None:
    """The embedder of compiled model `name` of `directory`, from its manifest `inputs`."""
    if token_input({p["name"] for p in inputs}) != TOKEN_EMBEDS:
        return None
    port = next(p for p in inputs if p["name"] == TOKEN_EMBEDS)
    path = Path(directory) / TEXT_EMBEDDINGS
    sections = any(p["name"] == "position_ids" and len(p["shape"]) == 3 for p in inputs)
    return _found(str(path.absolute()) if path.is_file() else None, port["shape"][-1], f"{directory}: model {name!r}",
                  sections)


def _found(path: str | None, width: int, where: str, sections: bool) -> Embedder:
    if path is None:
        raise InvalidModelError(
            "no-text-embeddings", where,
            f"takes {TOKEN_EMBEDS} (the language model of a vision-language export), and kvc drives models by "
            f"token ids through the text embeddings model beside it", expected=f"{TEXT_EMBEDDINGS} in its directory",
            found="none")
    files = (Path(path), Path(path).with_suffix(".bin"))
    stamp = tuple((s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for s in map(_stat, files))
    return _embedder(path, width, sections, stamp)


def _stat(path: Path):
    try:
        return path.stat()
    except FileNotFoundError:
        raise InvalidModelError("no-text-embeddings", str(path), "is missing", expected="a file",
                                found="no such file") from None


@functools.lru_cache(maxsize=8)
def _embedder(path: str, width: int, sections: bool, stamp: tuple) -> Embedder:
    """One embedder per file, width, language model kind and version of the files (`stamp`) in
    a process: each compiles its model once, and a file replaced is read again."""
    return Embedder(Path(path), width, sections)


class Embedder:
    """Token ids [B, n] -> their rows [B, n, H] (f32), from a text embeddings model on OpenVINO
    CPU at f32. `sections`: its language model reads mRoPE's [3, B, S] positions (Qwen2-VL),
    the only kind that takes a prompt's positions (`Media.positions`)."""

    def __init__(self, path: Path, width: int, sections: bool = False):
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
        self.width = shape[2].get_length() if shape[2].is_static else width  # a row's
        self.sections = sections
        self._dtype = ids.get_element_type().to_dtype()
        self._session = OpenVINOSession(model, "CPU")

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        out = self._session.infer({self._input: np.asarray(ids, self._dtype)})
        return np.asarray(out[self._output], np.float32)


POSITION_LIMIT = 1 << 31  # a media position's magnitude: far past any model's, and i64 arithmetic stays exact


@dataclass(frozen=True)
class Media:
    """What a vision-language pipeline feeds for a prompt besides its token ids: the rows of its
    media tokens (an image's, from the vision encoder), which take the place of their ids' rows,
    and the prompt's positions where they are not its slots.

    * `spans`: (start, rows [m, H] f32) pairs, sorted and disjoint: prompt positions
      `[start, start + m)` take those rows, and `token_type_ids` 1 (what Gemma 3's language
      model reads to let an image's tokens attend each other both ways; its other tokens are
      text, 0).
    * `positions`: None (position = slot), or the prompt's `[3, n]` positions: Qwen2-VL's
      mRoPE, a text token's three sections alike, an image's its t/h/w grid. A token generated
      into slot s then sits at s + `shift` (the prompt's last position + 1 - n), as
      transformers' `rope_deltas` place it.

    A model that reads `token_type_ids` computes an image's both-ways attention only in a
    call over no past (optimum's patch lays the step's types over the mask's first columns:
    over a past they fall on the past's slots), so a static pipeline runs the prompt up to the
    end of its last span in its first call (`StaticPipeline.prefill_prompt`), as the source
    model computes a whole prompt in one."""

    spans: tuple[tuple[int, np.ndarray], ...] = ()
    positions: np.ndarray | None = None

    def check(self, n: int, embed) -> None:
        """Refuse media that do not fit an `n`-token prompt of a session whose embedder is
        `embed` (None: the model takes ids, so no rows), or rows of another width."""
        end = 0
        for start, rows in self.spans:
            rows = np.asarray(rows)
            if embed is None:
                raise UsageError("media rows need a model that takes inputs_embeds (the language model of a "
                                 "vision-language export); this one takes input_ids")
            if rows.ndim != 2 or not rows.shape[0] or (embed.width > 0 and rows.shape[1] != embed.width):
                raise UsageError(f"media rows at position {start}: expected [m, {embed.width}], found "
                                 f"{list(rows.shape)}")
            if rows.dtype.kind not in "fiu":
                raise UsageError(f"media rows at position {start}: expected finite real numbers, found {rows.dtype}")
            with np.errstate(over="ignore", invalid="ignore"):
                if not np.isfinite(rows.astype(np.float32)).all():  # as the model is given them
                    raise UsageError(f"media rows at position {start}: expected finite real numbers, found "
                                     f"{rows.dtype} with NaN or infinity as f32")
            if start < end or start + rows.shape[0] > n:
                raise UsageError(f"media span [{start}, {start + rows.shape[0]}) must follow the one before it "
                                 f"(ending at {end}) and lie within the {n}-token prompt")
            end = start + rows.shape[0]
        if self.positions is None:
            return
        if embed is None or not embed.sections:
            raise UsageError("media positions are mRoPE's [3, n] (Qwen2-VL's language model); this model reads "
                             + ("input_ids" if embed is None else "one position a token") + ", not three sections")
        positions = np.asarray(self.positions)
        if positions.shape != (3, n) or positions.dtype.kind not in "iu":
            raise UsageError(f"media positions: expected integers [3, {n}] (mRoPE's sections of every prompt "
                             f"token), found {positions.dtype}{list(positions.shape)}")
        farthest = np.abs(positions.astype(np.float64)).max()
        if farthest >= POSITION_LIMIT:
            raise UsageError(f"media positions: expected positions within +-{POSITION_LIMIT - 1}, found "
                             f"{int(farthest)}")

    def key(self) -> tuple:
        """The media's content, hashable: a cache of runs keys on it."""
        return (tuple((start, np.asarray(rows, np.float32).tobytes()) for start, rows in self.spans),
                None if self.positions is None else np.asarray(self.positions, np.int64).tobytes())

    def tags(self, count: int) -> np.ndarray | None:
        """What a cache must key on besides the ids of the first `count` tokens of a sequence
        that begins with this prompt (its generated tokens after it), [count, 4] int64, or None
        when it is all 0 (the sequence is keyed by its ids alone, as text is):

        * column 0: a digest of the whole span a token lies in (start, extent, rows), 0 outside
          spans. Every token of an image carries its image's: its rows depend on all of the
          image (Gemma 3's tokens of an image attend each other both ways), so sequences that
          differ anywhere in an image differ from its first token on;
        * columns 1-3: each mRoPE section's position less the token's slot (a generated token's:
          `shift`), 0 without positions."""
        tags = np.zeros((count, 4), np.int64)
        for start, rows in self.spans:
            rows = np.ascontiguousarray(rows, np.float32)
            digest = hashlib.sha256(np.asarray([start, *rows.shape], "<i8").tobytes() + rows.tobytes()).digest()
            tags[start:start + len(rows), 0] = int.from_bytes(digest[:8], "little", signed=True) | 1
        if self.positions is not None:
            positions = np.asarray(self.positions, np.int64)
            n = positions.shape[1]
            tags[:n, 1:] = (positions - np.arange(n)).T[:count]
            tags[n:, 1:] = self.shift
        return tags if tags.any() else None

    def extents(self) -> list[list[int]]:
        """[start, rows] of each span: what a run's record says of its images."""
        return [[start, len(rows)] for start, rows in self.spans]

    @property
    def end(self) -> int:
        """The position after the last span (0 without spans)."""
        return max((start + len(rows) for start, rows in self.spans), default=0)

    @property
    def shift(self) -> int:
        """Where generated tokens sit past their slots: the prompt's last position + 1 - n."""
        if self.positions is None:
            return 0
        return int(np.max(self.positions)) + 1 - np.shape(self.positions)[1]


def read_npy(path: Path, what: str) -> np.ndarray:
    """The array of a .npy file a user names (`what` says where: `--image`, a requests line's
    field), read without pickles; a FIFO, a directory or an .npz archive is refused by name."""
    if not path.is_file():  # a FIFO would block the read, a directory fail it obscurely
        raise UsageError(f"{what} {path}: " + ("not a regular file" if path.exists() else "no such file"))
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise UsageError(f"{what} {path}: not a NumPy .npy array without pickles ({exc})") from None
    if not isinstance(array, np.ndarray):  # an .npz archive
        array.close()
        raise UsageError(f"{what} {path}: an .npz archive; give one array as a .npy")
    return array


def token_feed(session, ids: np.ndarray, media: Media | None = None, at: np.ndarray | None = None,
               ) -> dict[str, np.ndarray]:
    """The token inputs of one step of `session` (the caller keeps those it has): `input_ids`,
    or their rows as `inputs_embeds` when the session's model takes rows (`session.embed`, set
    where it is opened); and `token_type_ids`, 0 for every token: text (Gemma 3's language
    model marks an image's tokens 1, to attend each other both ways). With `media`, `at`
    [B, S] gives each token's prompt position (-1: a pad), and the tokens of its spans take
    their rows and type 1."""
    embed = getattr(session, "embed", None)
    tokens = {"input_ids": ids} if embed is None else {TOKEN_EMBEDS: embed(ids)}
    types = np.zeros(np.shape(ids), np.int64)
    if media is not None and media.spans:
        rows = tokens[TOKEN_EMBEDS] = np.array(tokens[TOKEN_EMBEDS], np.float32)  # the embedder's may be its own
        for start, span in media.spans:
            inside = (at >= start) & (at < start + len(span))
            rows[inside] = np.asarray(span, np.float32)[at[inside] - start]
            types[inside] = 1
    return {**tokens, "token_type_ids": types}
