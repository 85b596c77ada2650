"""Reference greedy generation over any session: the yardstick pipelines are measured by.

A stateful session keeps its cache in variables; a stateless one (lifted IR, ONNX) gets
the previous step's `present.*` outputs back as `past_key_values.*` inputs. Either way each
step feeds what optimum-intel's exports expect (input_ids, attention_mask, position_ids,
beam_idx), restricted to the inputs the model actually has: ALiBi models without
position_ids work unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from kvc.errors import UsageError
from kvc.runtime.embeddings import Media, token_feed
from kvc.runtime.session import Session

# Inputs a stateless model gets back from its own outputs: the KV cache and kvc's beam table.
PAST_INPUT = re.compile(r"^(past_key_values\.(\d+)\.(key_value|key|value)|past_beam_table)$")


def present_name(past: str) -> str:
    """The output that feeds an input next step: past_key_values.N.key <- present.N.key,
    past_beam_table <- present_beam_table."""
    return past.replace("past_key_values", "present", 1) if past.startswith("past_key_values") \
        else past.replace("past_", "present_", 1)


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated, prompt excluded
    logits: list[np.ndarray] = field(default_factory=list)  # [V] per step: what chose each token
    first_logits: np.ndarray | None = None  # [S, V] of the prefill step
    # The cache after the run, when kept: `greedy(keep_cache=True)` gives a stateful session's
    # variables by variable id, a stateless one's last past by input name; the checks hold every
    # cache by the static models' input names (kvc.verify.cache_rows).
    cache: dict[str, np.ndarray] | None = None
    origin: int = 0  # the prompt's first position (compile's far probes)
    # The rows before `origin` hold `far_past` rows, attended; else they are empty and masked.
    filled: bool = False
    media: Media | None = None  # the prompt's media rows and positions (kvc.runtime.embeddings.Media)


# A far past's values: q / FAR_PAST_SCALE for integers q drawn uniformly from
# [-FAR_PAST_RANGE, FAR_PAST_RANGE] for every element: multiples of 2^-5 within 1.5, exact in
# f32, f16 and bf16, so a static cache of any float type holds the very values the source
# model's cache is given. Independent rows: with a part every row shared (each element a common
# value +-0.25), attention over them nearly averaged a blob that read the values of a stretch of
# slots one off to what it should have read, and at bf16 it was published.
FAR_PAST_SCALE = 32
FAR_PAST_RANGE = 48


def far_past(name: str, shape, seq_axis: int) -> np.ndarray:
    """The synthetic KV rows compile's far probes start over (`kvc.verify.compiled.probe_cases`),
    f32 of `shape`, for the cache tensor named `name` (a static model's input name,
    past_key_values.N.key): distinct in every row and head, a function of the name, the row
    and the row's other indices in order only, so a layout that moves the sequence axis (values
    stored [B, H, D, S]) holds the same values at the same rows, and a longer past begins with a
    shorter one."""
    import zlib

    shape = [int(d) for d in shape]
    rows = shape.pop(seq_axis)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q = rng.integers(-FAR_PAST_RANGE, FAR_PAST_RANGE + 1, (rows, int(np.prod(shape))), dtype=np.int8)
    q = q.astype(np.float32) * np.float32(1 / FAR_PAST_SCALE)  # a power of two: exact
    return np.moveaxis(q.reshape([rows, *shape]), 0, seq_axis)


def far_past_fits(kv_element_types) -> bool:
    """Whether a cache of these element types holds a far past exactly: a float one (an int8
    cache's keys are read back through calibrated channel magnitudes the source cannot be
    given)."""
    return all(t in ("f32", "f16", "bf16") for t in kv_element_types)


def _far_past_cache(session: Session, rows: int, zeros: bool = False) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Seed a session's empty cache with `rows` far-past rows (`far_past`; with `zeros`, rows
    of zeros, which a caller masks): a stateless
    session's past inputs (returned), a stateful one's variables (set); and, for each cache
    tensor by the name its cache is kept under (`Generation.cache`), its sequence axis. A zero-length cache names its sequence axis by its last empty dimension
    (the first is the batch's, as OpenVINO's variables start)."""
    from kvc.passes.lift_state import lifted_name

    def seeded(name, array, static):
        dims = [i for i, d in enumerate(array.shape) if d == 0]
        if not dims:
            raise UsageError(f"cannot seed {name} {list(array.shape)} with a far past: no empty sequence axis")
        shape = list(array.shape)
        if len(dims) > 1:
            shape[dims[0]] = 1
        shape[dims[-1]] = rows
        axes[name] = dims[-1]
        if zeros:
            return np.zeros(shape, array.dtype)
        return far_past(static, shape, dims[-1]).astype(array.dtype)

    axes: dict[str, int] = {}
    if is_stateless(session):
        past = empty_past(session, 1)
        past = {name: seeded(name, v, name) if name != "past_beam_table" else v for name, v in past.items()}
        if not axes:
            raise UsageError(f"cannot seed a far past: the {type(session).__name__} takes no past")
        return past, axes
    for variable, value in _empty_state(session).items():
        session.set_state(variable, seeded(variable, value, lifted_name(variable).input_name))
    if not axes:
        raise UsageError(f"cannot seed a far past: the {type(session).__name__} shows no cache to seed")
    return {}, axes


def _empty_state(session: Session) -> dict[str, np.ndarray]:
    """A reset stateful session's variables, empty: OpenVINO's as it holds them ([0, H, 0, D]),
    kvc's interpreter's (which holds none until a step assigns them) zero-length from their
    declared shapes (`_zero_len`)."""
    from kvc.runtime.ops.registry import to_dtype
    from kvc.runtime.session import NumpySession

    if not isinstance(session, NumpySession):
        return session.state()
    empty = {}
    for variable, info in session.interpreter._variables.items():
        dims = [d.get_length() if d.is_static else None for d in info.data_shape]
        empty[variable] = _zero_len(variable, dims, 1, to_dtype(info.data_type))
    return empty


def step_inputs(session: Session, ids: np.ndarray, past_len: int, origin: int = 0,
                media: Media | None = None) -> dict[str, np.ndarray]:
    """The inputs optimum's exports take for `ids` after `past_len` cached tokens, restricted
    to those the session has; `origin`: the first token's position (where position_ids says
    it: a model without them counts from 0). `media` (`kvc.runtime.embeddings.Media`): the
    prompt's, which is `ids` when `past_len` is 0; the tokens after it sit `media.shift` past
    their slots."""
    batch, n = ids.shape
    first = origin + past_len
    positions = np.broadcast_to(np.arange(first, first + n, dtype=np.int64), (batch, n)).copy()
    prompt = media is not None and not past_len
    if media is not None and past_len:
        positions += media.shift
    elif prompt and media.positions is not None:
        positions = np.broadcast_to(np.asarray(media.positions, np.int64)[:, None, :], (3, batch, n)).copy()
    full = {
        **token_feed(session, ids, media if prompt else None, np.broadcast_to(np.arange(n), (batch, n))),
        "attention_mask": np.ones((batch, past_len + n), np.int64),
        "position_ids": positions,
        "beam_idx": np.arange(batch, dtype=np.int32),
    }
    return {k: v for k, v in full.items() if session.has_input(k)}


def empty_past(session: Session, batch: int) -> dict[str, np.ndarray]:
    """Zero-length past tensors for a stateless session, shaped from its input ports."""
    from kvc.runtime.session import NumpySession, OnnxRuntimeSession, OpenVINOSession

    past = {}
    if isinstance(session, OnnxRuntimeSession):
        ports = [(i.name, i.shape, i.type) for i in session.session.get_inputs()]
        for name, shape, _ in ports:
            if PAST_INPUT.match(name):
                dims = [d if isinstance(d, int) else None for d in shape]
                past[name] = _zero_len(name, dims, batch, np.float32)
        return past
    if isinstance(session, NumpySession):
        ports = [(names[0], p) for names, _, p in session.interpreter._inputs]
    elif isinstance(session, OpenVINOSession):
        ports = [(names[0], p) for names, p in session._inputs]
    else:
        raise UsageError(f"cannot drive a stateless {type(session).__name__}")
    from kvc.runtime.ops.registry import to_dtype

    for name, port in ports:
        if PAST_INPUT.match(name):
            dims = [d.get_length() if d.is_static else None for d in port.get_partial_shape()]
            past[name] = _zero_len(name, dims, batch, to_dtype(port.get_element_type()))
    return past


def _zero_len(name: str, dims: list, batch: int, dtype) -> np.ndarray:
    """Dynamic dims: the first is batch, the last dynamic one is the (empty) sequence."""
    if name == "past_beam_table":
        return np.zeros((batch, 0), np.int32)
    dyn = [i for i, d in enumerate(dims) if d is None]
    if len(dyn) < 2:
        raise UsageError(f"cannot tell batch and sequence axes of {name} {dims}")
    shape = [d if d is not None else 0 for d in dims]
    shape[dyn[0]] = batch
    return np.zeros(shape, dtype)


def is_stateless(session: Session) -> bool:
    """True when the session takes its cache as inputs (past_key_values.*) rather than state."""
    return any(PAST_INPUT.match(n) for n in session.input_names)


def first_step_feed(session: Session, prompt) -> dict[str, np.ndarray]:
    """Everything a session needs to run a prompt from an empty cache (batch 1)."""
    feed = step_inputs(session, np.asarray(prompt, np.int64).reshape(1, -1), 0)
    if is_stateless(session):
        feed.update(empty_past(session, 1))
    return feed


def greedy(session: Session, prompt: list[int] | np.ndarray, max_new_tokens: int, *,
           reset: bool = True, keep_cache: bool = False, origin: int = 0, filled: bool = False,
           media: Media | None = None) -> Generation:
    """Greedy decoding of one prompt (batch 1): argmax each step, no early stop; with
    `keep_cache`, the cache it leaves in `Generation.cache`; `origin`: the prompt's first
    position (`step_inputs`), and with `filled` the cache starts with `origin` rows of
    `far_past`, attended (the kept cache then leaves them out: its rows are the prompt's on);
    without, a model with position_ids starts over `origin` masked rows of zeros (below).
    `media`: the prompt's rows and positions besides its ids (`kvc.runtime.embeddings.Media`),
    from position 0."""
    ids = np.asarray(prompt, dtype=np.int64).reshape(1, -1)
    if ids.shape[1] == 0:
        raise UsageError("the prompt is empty")
    if media is not None:
        if origin:
            raise UsageError("a prompt with media starts at position 0")
        media.check(ids.shape[1], getattr(session, "embed", None))
    if reset:
        session.reset()
    stateless = is_stateless(session)
    past = empty_past(session, 1) if stateless else {}
    gen = Generation(prompt=[int(t) for t in ids[0]], origin=origin, filled=bool(filled and origin), media=media)
    past_len, axes, masked = 0, {}, 0
    # Without a far past, a model with positions of its own gets `origin` masked rows before the
    # prompt, as a static model has them (`StaticPipeline`): a source that sizes what it reads
    # by its cache (transformers 4's PhiMoE computes its cos/sin table for the cache's rows and
    # indexes it by position) then reads a position as it does in a run from position 0. A
    # model without position_ids counts positions from its first attended row, as before.
    if origin and not gen.filled and reset and session.has_input("position_ids") \
            and session.has_input("attention_mask"):
        masked = origin
    if gen.filled or masked:  # the far past is the cache's first `origin` rows: positions count on from them
        if not reset:
            raise UsageError("a far past seeds an empty cache: greedy(filled=True) needs reset")
        past, axes = _far_past_cache(session, origin, zeros=bool(masked))
        past_len, origin = origin, 0
    step_ids = ids
    for step in range(max_new_tokens):
        feed = step_inputs(session, step_ids, past_len, origin, media)
        if masked:
            feed["attention_mask"][:, :masked] = 0
        feed.update(past)
        out = session.infer(feed)
        logits = out["logits"][0]
        if step == 0:
            gen.first_logits = np.array(logits, copy=True)
        last = logits[-1]
        token = int(np.argmax(last))
        gen.tokens.append(token)
        gen.logits.append(np.array(last, copy=True))
        if stateless:
            past = {name: out[present_name(name)] for name in past}
        past_len += step_ids.shape[1]
        step_ids = np.array([[token]], dtype=np.int64)
    if keep_cache:
        gen.cache = dict(past) if stateless else session.state()
        for name, axis in axes.items():
            gen.cache[name] = np.take(gen.cache[name], range(gen.origin, gen.cache[name].shape[axis]), axis)
    return gen
