"""Every expert's wiring, run: the probes again with each router forced to experts fixed by position.

A probe proves only what it reads, and a mixture of experts reads an expert only where its
router picks it. kvc.verify.weights proves every expert's weights are the source's, byte for
byte, but not that the compiled graph wires them where the source does: a pass that fed expert
3 expert 2's weights, or scattered expert 3's routing weight into expert 2's column, keeps every
weight and passes every probe whose router never picks 2 or 3.

So the compile runs its probes a second time with every router *forced*, on both sides: the
source on OpenVINO CPU at f32 and the static IR on kvc's numpy runtime, each edited the same
way (`force_routers`). A router is a TopK over [rows, E] (E static, k a constant below E, mode
max, on the last axis: Mixtral, Qwen-MoE, GPT-OSS, GraniteMoE, PhiMoE as optimum-intel exports
them; routers that pick a token's experts in turns are one, `router_groups`); its indices are
replaced by the experts fixed by each row's position p,

    experts(p) = {pi_r((p * k + j) mod E) : j < k},  r = floor(p / m) mod R,  m = ceil(E / k)

(`rounds`: pi_r the r-th of R relabelings of the experts), and its values by the router's own
scores of those experts (GatherElements of its input), so what follows the TopK (softmax over
the picked scores, normalization, the scatter into [rows, E], the experts' products) runs as it
would had the router picked them. The m positions of a round pick every expert, so a model
run at 2m - 1 consecutive positions (which hold a whole round) runs every expert's wiring. The
rounds relabel the experts so that different rounds put different experts together: with k 2
of an even E, every pair of experts in either slot order is a token's in some round (a
round-robin tournament). Without them the pairs were always the same ({0,1} and {2,3} of 4):
a graph that moved expert 5's routing weight to expert 6's column only when a token picked 0
and 5 together passed the compile and `kvc verify` on qwen2_moe (8 experts), whose routers
never picked that pair on any probe. The forced probes are the compile's probes
(`probe_cases`), with each generate variant's far probe decoded over its last max(2, 2m - 1)
positions instead of its last 2 (`forced_cases`), and every prefill model runs over a whole
round when its smallest call holds 2m - 1 rows, or m rows on the chunk grid where m divides
the chunk (a chunk of 16 for E / k = 16, Qwen3-MoE's 128 experts, 8 a token).

The row's position is the model's ``position_ids``, flattened: the router's rows are the
tokens of the call in order, batch 1, in the source and in every static model. A TopK of
another form (GraniteMoE's 1-D sort of rows by expert) is left alone; a model with routers but
without ``position_ids`` cannot be forced, which is a VerificationError (`force_routers`).
"""

from __future__ import annotations

import math

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kvc.passes.framework.base import constant_ints


def routers(model: ov.Model) -> list[ov.Node]:
    """The model's router TopKs (the module's rule), in graph order."""
    found = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "TopK":
            continue
        shape = op.get_input_partial_shape(0)
        k = constant_ints(op.input_value(1))
        attrs = op.get_attributes()
        if (shape.rank.is_dynamic or shape.rank.get_length() != 2 or shape[1].is_dynamic or k is None
                or len(k) != 1 or attrs["mode"] != "max" or attrs["axis"] % 2 != 1):
            continue
        if 0 < k[0] < shape[1].get_length():
            found.append(op)
    return found


# Ops an index passes through unchanged in value on its way to a scatter (`router_groups`).
_INDEX_PLUMBING = {"Convert", "Reshape", "Unsqueeze", "Squeeze", "Broadcast"}


def router_groups(model: ov.Model) -> list[list[ov.Node]]:
    """The routers grouped by the token's picks they make together, each group in graph order: a
    TopK whose scores are computed, through values of the scores' own shape [rows, E] alone,
    from another router's picked indices (a scatter of -inf at them) picks after it for the same
    token. PhiMoE's sparsemixer picks its two experts so, each with a top-1 over the scores, the
    second with the first's pick scattered to -inf; forced apart, both took the same expert and
    the second's score was that -inf. (The next layer's router reads this one's picks through
    the hidden state: another group.)"""
    found = routers(model)
    index = {op.get_instance_id(): i for i, op in enumerate(found)}
    parent = list(range(len(found)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    def picks_of(value: ov.Output) -> int | None:
        """The router whose indices `value` is, through index plumbing; else None."""
        while value.get_node().get_type_name() in _INDEX_PLUMBING:
            value = value.get_node().input_value(0)
        return index.get(value.get_node().get_instance_id()) if value.get_index() == 1 else None

    for i, op in enumerate(found):
        experts = op.get_input_partial_shape(0)[1]
        seen, todo = set(), [op.input_value(0)]
        while todo:
            value = todo.pop()
            node = value.get_node()
            shape = value.get_partial_shape()
            if (node.get_instance_id() in seen or shape.rank.is_dynamic or shape.rank.get_length() != 2
                    or shape[1] != experts):
                continue
            seen.add(node.get_instance_id())
            for above in node.input_values():
                j = picks_of(above)
                if j is not None and j != i:
                    parent[root(i)] = root(j)
                else:
                    todo.append(above)
    groups: dict[int, list[ov.Node]] = {}
    for i, op in enumerate(found):
        groups.setdefault(root(i), []).append(op)
    return list(groups.values())


def _k(op: ov.Node) -> int:
    return constant_ints(op.input_value(1))[0]


def experts_of(model: ov.Model) -> tuple[int, int] | None:
    """(E, k) of the model's routers, k the experts a token's picks take together (of the
    group that needs the most positions, ceil(E / k), to pick every expert, where they differ),
    or None for a model without one."""
    sizes = [(g[0].get_input_partial_shape(0)[1].get_length(), sum(_k(op) for op in g)) for g in router_groups(model)]
    return max(sizes, key=lambda s: (math.ceil(s[0] / s[1]), s), default=None)


def _positions(model: ov.Model) -> ov.Output | None:
    for p in model.inputs:
        if "position_ids" in p.get_names():
            return p.get_node().output(0)
    return None


def rounds(experts: int, per_token: int) -> np.ndarray:
    """The relabelings of the experts, one per round of ceil(E / k) positions (the module's
    rule): [R, E], row r the permutation round r applies. With k 2 of an even E, the rounds of
    a round-robin tournament (the circle method: E - 1 rounds whose pairs, (2q, 2q + 1) relabeled,
    are every pair once), then the same with each pair's slots swapped: every pair of experts, in
    either slot, is a token's in some round. Otherwise the identity, then seeded permutations."""
    E, k = experts, per_token
    if k == 2 and E % 2 == 0 and E > 2:
        table = []
        for swap in (False, True):
            for r in range(E - 1):
                pairs = [(E - 1, r)] + [((r + i) % (E - 1), (r - i) % (E - 1)) for i in range(1, E // 2)]
                table.append([x for a, b in pairs for x in ((b, a) if swap else (a, b))])
        return np.array(table, np.int64)
    rng = np.random.default_rng(E * 1009 + k)
    return np.array([np.arange(E)] + [rng.permutation(E) for _ in range(max(1, 2 * (E - 1)) - 1)], np.int64)


# The scalar i64 input `force_routers(shift_input=True)` adds: the shift, fed at each call.
ROUTER_SHIFT = "kvc.router_shift"


def force_routers(model: ov.Model, shift: int = 0, *, shift_input: bool = False) -> ov.Model:
    """`model`, edited in place: every router picks the experts its row's position fixes (the
    module's rule), or with `shift` those of position + shift (kvc bisect's one-row steps run
    each shift below 2 ceil(E / k) - 1 to pick every expert); with `shift_input`, the shift is
    the input ROUTER_SHIFT instead, so that one prepared model runs every shift. The routers of a group
    (`router_groups`) take the k experts in turn: the t-th, of k_t, those from the sum of the k's
    before it. A model with routers but no ``position_ids`` is a VerificationError: its experts
    cannot all be run, and an unproven model is not passed."""
    groups = router_groups(model)
    if not groups:
        return model
    positions = _positions(model)
    if positions is None:
        from kvc.errors import VerificationError

        raise VerificationError(f"cannot run every expert of model '{model.get_friendly_name()}': it routes "
                                f"experts but has no position_ids input to force its routers by (use --no-verify "
                                f"to publish it unproven)")
    rows = ops.reshape(ops.convert(positions, "i64"), ops.constant(np.array([-1], np.int64)), False)
    if shift_input:
        param = ops.parameter([], np.int64, name=ROUTER_SHIFT)
        param.output(0).set_names({ROUTER_SHIFT})
        model.add_parameters([param])
        rows = ops.add(rows, param)
    elif shift:
        rows = ops.add(rows, ops.constant(np.int64(shift)))
    for group in groups:
        total, first = sum(_k(op) for op in group), 0
        start = ops.unsqueeze(ops.multiply(rows, ops.constant(np.int64(total))), ops.constant(np.int64(1)))
        for tk in group:
            scores = tk.input_value(0)
            experts, k = scores.get_partial_shape()[1].get_length(), _k(tk)
            base = ops.floor_mod(ops.add(start, ops.constant(np.arange(first, first + k, dtype=np.int64)[None, :])),
                                 ops.constant(np.int64(experts)))
            table = rounds(experts, total)
            m = math.ceil(experts / total)
            round_ = ops.floor_mod(ops.divide(rows, ops.constant(np.int64(m))),
                                   ops.constant(np.int64(len(table))))
            at = ops.add(ops.unsqueeze(ops.multiply(round_, ops.constant(np.int64(experts))),
                                       ops.constant(np.int64(1))), base)
            picked = ops.gather(ops.constant(table.reshape(-1)), at, ops.constant(np.int64(0)))
            first += k
            values = ops.gather_elements(scores, picked, 1)
            indices = ops.convert(picked, tk.get_output_element_type(1))
            for out, new in ((tk.output(0), values.output(0)), (tk.output(1), indices.output(0))):
                for target in list(out.get_target_inputs()):
                    target.replace_source_output(new)
    model.validate_nodes_and_infer_types()
    return model


# The most steps the forced run's first probe decodes to reach every round (`forced_cases`).
ROUND_STEPS = 64


def forced_cases(cases, experts: int, per_token: int, lengths=None) -> list:
    """The compile's probe `cases` for the forced run: each generate variant's far probe (a
    decode over its last 2 positions) decoded over its last max(2, 2 ceil(E / k) - 1) instead,
    which hold a whole round, so that it runs every expert (the module's rule); with the plan's
    `lengths`, the first probe (the generate models' probe) decoding on over every round, up to
    ROUND_STEPS steps and the capacity, so that the generate models put every pair of experts
    together (8 experts, 2 a token: 56 steps; on NPU blobs at P 64 the generate models' 10
    forced steps reached 4 of 14 rounds, and a pair no router picked passed); the other probes
    as they are."""
    from kvc.runtime.static_pipeline import max_new_tokens
    from kvc.verify.compiled import Probe

    m = math.ceil(experts / per_token)
    steps = max(2, 2 * m - 1)
    forced = []
    for i, probe in enumerate(cases):
        if i == 0 and lengths is not None and not probe.decode:
            every = min(len(rounds(experts, per_token)) * m + 1, ROUND_STEPS)  # n tokens: n - 1 generate steps
            forced.append(probe._replace(new_tokens=max(probe.new_tokens, min(
                every, max_new_tokens(lengths, len(probe.prompt))))))
        elif probe.decode and probe.start is not None and probe.origin == probe.start - 2 and probe.start >= steps:
            # a token a step from position start - steps, then the last step's own token
            prompt = (probe.prompt * steps)[: steps - 1]
            forced.append(Probe(prompt, 2, probe.start, probe.start - steps, True, probe.filled))
        else:
            forced.append(probe)
    return forced


def forced_routing(experts: tuple[int, int]) -> str:
    """How a verdict names the forced routing of (E, k) experts."""
    return f"every router forced to the experts each position fixes ({experts[0]} experts, {experts[1]} a token)"


def verify_experts(directory, manifest: dict, cases, experts: tuple[int, int], reference, on_case=None) -> dict:
    """The forced check (the module's rule): the static IR written to `directory`, its routers
    forced, on kvc's numpy runtime against `reference()` (a session of the source, its routers
    forced alike, made once the IR's runs are done: one engine in memory at a time) on
    `forced_cases(cases)`, judged as the compile's check judges its probes (`verify_static`,
    exact: a forced router flips nothing); `experts` is (E, k) of the source's routers
    (`experts_of`)."""
    from kvc.export.manifest import plan_of
    from kvc.verify.compiled import ir_generations, verify_static

    plan = plan_of(manifest)
    forced = forced_cases(cases, *experts, plan.lengths)
    ir_gens = ir_generations(directory, manifest, forced, on_case, edit=force_routers)
    result = verify_static(reference(), plan, forced, ir_gens)
    if result["ok"]:
        reason = f"{forced_routing(experts)}: {len(forced)} probes agree with the source forced alike"
    else:
        from kvc.verify.compiled import probe_label

        bad = next(r for r in result["results"] if not r["ok"])
        reason = f"with {forced_routing(experts)}, {probe_label(bad)}: {bad['reason']}"
    return {"experts": experts[0], "per_token": experts[1], **result, "reason": reason}
