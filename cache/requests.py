"""The workload file `kvc run OUT --requests FILE.jsonl` replays: one JSON object a line.

    {"id": "r1", "prompt_ids": [1, 2, 3], "max_new_tokens": 16}
    {"id": "r2", "prompt": "text", "max_new_tokens": 8, "session": "chat-1",
     "retention": [{"start": 0, "end": 64, "priority": 100, "duration_ms": 30000}],
     "decode_priority": 0, "decode_duration_ms": 1000}
    {"id": "r3", "prompt_ids": [...], "images": [{"start": 2, "rows": "cat.npy"}],
     "image_positions": "positions.npy"}
    {"finish_session": "chat-1"}

* `id` (string or integer; default: the line number), exactly one of `prompt_ids` (token ids)
  and `prompt` (text, tokenized with the compiled directory's tokenizer.json), and
  `max_new_tokens` (>= 1; default 16).
* `session`: the request is a turn of that chat session, which its first turn opens;
  `{"finish_session": NAME}` closes it (an unknown name is an error).
* `retention`: token ranges of the prompt with a priority 0-100 and an optional duration in
  milliseconds (`end` may be left out: to the end of the prompt); `decode_priority` and
  `decode_duration_ms` for the blocks the decode phase produces.
* `images` (a vision-language model's): each image's first prompt position and its rows, an
  f32 .npy [m, H] from the vision encoder; `image_positions`: mRoPE's [3, n] positions of the
  prompt (Qwen2-VL), an integer .npy. Paths are relative to the requests file; the arrays
  are read without pickles (`kvc run --image`, `--image-positions`), and checked against
  the prompt and the model before any request runs. A chat turn gives its whole history's
  images, as it gives its whole history.
* Blank lines and lines starting with `#` are skipped, and so is a UTF-8 byte order mark at the
  start of the file. Any other field is an error.

Every problem is a UsageError naming the file and line. Ranges are checked against the
prompt here when the prompt is token ids, and before the request runs when it is text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvc.cache.prefix import Retention, TokenRange
from kvc.errors import UsageError
from kvc.runtime.embeddings import Media, read_npy

REQUEST_FIELDS = {"id", "prompt_ids", "prompt", "max_new_tokens", "session", "retention", "decode_priority",
                  "decode_duration_ms", "images", "image_positions"}
RANGE_FIELDS = {"start", "end", "priority", "duration_ms"}
IMAGE_FIELDS = {"start", "rows"}
DEFAULT_NEW_TOKENS = 16
BOM = "\ufeff"  # a UTF-8 byte order mark, decoded
MAX_LINE = 1 << 24  # 16 MiB: a line longer than any prompt the static pipeline takes


@dataclass(frozen=True)
class Request:
    line: int
    id: str
    prompt_ids: tuple[int, ...] | None
    prompt: str | None
    max_new_tokens: int
    session: str | None = None
    retention: Retention | None = None
    media: Media | None = None


@dataclass(frozen=True)
class FinishSession:
    line: int
    session: str


def _int(value, what: str, low: int, high: int = (1 << 63) - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{what} must be an integer from {low} to {high}, found {json.dumps(value)[:60]}")
    return value


def _name(value, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise UsageError(f"{what} must be a non-empty string or an integer, found {json.dumps(value)[:60]}")
    try:
        str(value).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): printing the results failed after the run
        raise UsageError(f"{what} must be text UTF-8 can hold, found {json.dumps(value)[:60]} (a lone "
                         f"surrogate)") from None
    return str(value)


def _seconds(ms, what: str) -> float | None:
    if ms is None:
        return None
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms < 1e15:
        raise UsageError(f"{what} must be a number of milliseconds >= 0, found {json.dumps(ms)[:60]}")
    return ms / 1000


def _retention(obj: dict) -> Retention | None:
    ranges = obj.get("retention", [])
    if not isinstance(ranges, list):
        raise UsageError("'retention' must be a list of {start, end, priority, duration_ms} objects")
    parsed = []
    for i, r in enumerate(ranges):
        if not isinstance(r, dict):
            raise UsageError(f"retention[{i}] must be an object with start, end, priority and duration_ms")
        unknown = sorted(set(r) - RANGE_FIELDS)
        if unknown:
            raise UsageError(f"retention[{i}]: unknown field {unknown[0]!r} (fields: {', '.join(sorted(RANGE_FIELDS))})")
        if "priority" not in r:
            raise UsageError(f"retention[{i}]: 'priority' is required")
        start = _int(r.get("start", 0), f"retention[{i}].start", 0)
        end = None if r.get("end") is None else _int(r["end"], f"retention[{i}].end", start + 1)
        priority = _int(r["priority"], f"retention[{i}].priority", 0, 100)
        parsed.append(TokenRange(start, end, priority, _seconds(r.get("duration_ms"), f"retention[{i}].duration_ms")))
    decode = obj.get("decode_priority")
    if decode is not None:
        decode = _int(decode, "'decode_priority'", 0, 100)
    duration = _seconds(obj.get("decode_duration_ms"), "'decode_duration_ms'")
    if duration is not None and decode is None:  # with ranges too: it was dropped unused
        raise UsageError("'decode_duration_ms' needs a 'decode_priority' (the duration is how long that priority "
                         "lasts)")
    if not parsed and decode is None:
        return None
    return Retention(tuple(parsed), decode, duration)


def _media(obj: dict, base: Path) -> Media | None:
    images = obj.get("images", [])
    if not isinstance(images, list):
        raise UsageError("'images' must be a list of {start, rows} objects")
    spans = []
    for i, image in enumerate(images):
        if not isinstance(image, dict) or set(image) != IMAGE_FIELDS:
            raise UsageError(f"images[{i}] must be an object with exactly 'start' (a prompt position) and 'rows' "
                             f"(a .npy path), found {json.dumps(image)[:60]}")
        start = _int(image["start"], f"images[{i}].start", 0)
        spans.append((start, read_npy(_path(image["rows"], f"images[{i}].rows", base), f"images[{i}].rows")))
    positions = obj.get("image_positions")
    if positions is not None:
        positions = read_npy(_path(positions, "'image_positions'", base), "'image_positions'")
    if not spans and positions is None:
        return None
    return Media(tuple(sorted(spans, key=lambda span: span[0])), positions)


def _path(value, what: str, base: Path) -> Path:
    if not isinstance(value, str) or not value or "\0" in value:
        raise UsageError(f"{what} must be the path of a .npy file, found {json.dumps(value)[:60]}")
    return base / value


def parse_line(obj, line: int, base: Path = Path(".")) -> Request | FinishSession:
    if not isinstance(obj, dict):
        raise UsageError(f"expected a JSON object, found {type(obj).__name__}")
    if "finish_session" in obj:
        if len(obj) != 1:
            raise UsageError("a finish_session line has no other fields")
        return FinishSession(line, _name(obj["finish_session"], "'finish_session'"))
    unknown = sorted(set(obj) - REQUEST_FIELDS)
    if unknown:
        raise UsageError(f"unknown field {unknown[0]!r} (fields: {', '.join(sorted(REQUEST_FIELDS))}, "
                         f"or finish_session alone)")
    if ("prompt_ids" in obj) == ("prompt" in obj):
        raise UsageError("give exactly one of 'prompt_ids' and 'prompt'")
    ids = text = None
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids:
            raise UsageError("'prompt_ids' must be a non-empty list of token ids")
        ids = tuple(_int(t, f"prompt_ids[{i}]", 0) for i, t in enumerate(ids))
    else:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise UsageError("'prompt' must be a non-empty string")
    new_tokens = _int(obj.get("max_new_tokens", DEFAULT_NEW_TOKENS), "'max_new_tokens'", 1, 1 << 20)
    session = None if obj.get("session") is None else _name(obj["session"], "'session'")
    retention = _retention(obj)
    if retention is not None and ids is not None:
        retention.check(len(ids))
    rid = _name(obj["id"], "'id'") if "id" in obj else str(line)
    return Request(line, rid, ids, text, new_tokens, session, retention, _media(obj, base))


def parse_requests(text: str, source: str = "<requests>", base: Path = Path(".")) -> list[Request | FinishSession]:
    """Every line of a workload, validated; the first problem is an error naming its line.
    `base`: the directory image paths are relative to."""
    entries, ids = [], {}
    text = text.removeprefix(BOM)  # Windows editors begin UTF-8 files with one; JSON Lines has none
    for number, raw in enumerate(text.split("\n"), 1):  # JSON Lines: only \n ends a line (U+2028 may be in a string)
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            if stripped.startswith(BOM):  # json's own message says "decode using utf-8-sig"
                raise UsageError("the line starts with a byte order mark (U+FEFF), which only the file's start may "
                                 "hold (files joined together?): remove it")
            if len(stripped) > MAX_LINE:
                raise UsageError(f"the line is {len(stripped)} characters long (at most {MAX_LINE})")
            try:
                obj = json.loads(stripped, parse_constant=_no_constant, object_pairs_hook=_unique_fields)
            except (ValueError, RecursionError) as exc:
                raise UsageError(f"not JSON: {str(exc)[:200]}") from None
            entry = parse_line(obj, number, base)
            if isinstance(entry, Request):
                if entry.id in ids:
                    given, line = ids[entry.id]
                    first = f"the request on line {line}" + ("" if given else " (its line number: it has no id)")
                    if "id" in obj:
                        raise UsageError(f"request id {entry.id!r} is already the id of {first}")
                    raise UsageError(f"the request has no id, and its default, its line number {entry.id!r}, is "
                                     f"already the id of {first}: give it one")
                ids[entry.id] = ("id" in obj, number)
            entries.append(entry)
        except UsageError as exc:
            raise UsageError(f"{source}:{number}: {exc}") from None
    if not any(isinstance(e, Request) for e in entries):
        raise UsageError(f"{source}: no requests (one JSON object a line, with prompt_ids or prompt)")
    return entries


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _unique_fields(pairs) -> dict:
    """A JSON object whose fields are each given once (the last of two silently won)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"field {key!r} is given twice")
        out[key] = value
    return out


def read_requests(path: str | Path) -> list[Request | FinishSession]:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the requests: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = data.count(b"\n", 0, exc.start) + 1, exc.start - data.rfind(b"\n", 0, exc.start)
        raise UsageError(f"{path}:{line}: not UTF-8: byte 0x{data[exc.start]:02x} at column {column}") from None
    return parse_requests(text, str(path), Path(path).parent)
