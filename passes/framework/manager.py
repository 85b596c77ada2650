"""The PassManager: runs a pipeline and shows its work.

Instrumentation, all off by default, follows MLIR's ``--mlir-print-ir-before/after[-all|-change]``,
``--mlir-print-ir-tree-dir`` and LLVM's ``-print-changed=diff``:

* print the IR before and/or after passes whose names match a glob (``*`` for all);
* after-change mode: a pass that changed nothing prints one status line, not the same IR again;
* print diffs instead of whole texts;
* a dump directory: ``000-input.txt``, then per pass ``NNN-<pass>.txt`` (the IR after it, or
  a one-line status if unchanged) and ``NNN-<pass>.diff``, an ``index.json`` (pass, options,
  changed, op-count deltas; deterministic) and ``timings.json`` (wall time; not);
* on failure: the error names the pass, the node and the reason, lists the passes that ran
  before, and the IR before the failing pass is written to the dump directory when there is
  one (the error gives its path; without one it says how to get it, and writes nothing).

Library users get the same through environment variables (`Instrumentation.from_env`):
``KVC_PRINT_IR_BEFORE``, ``KVC_PRINT_IR_AFTER`` (globs, comma-separated),
``KVC_PRINT_IR_AFTER_CHANGE=1``, ``KVC_PRINT_IR_DIFF=1``, ``KVC_DUMP_DIR=path``.

Around every pass the manager checks the invariants the pass `requires` and `ensures`
(`kvc.passes.framework.invariants`) and records the hits of its rewrite rules
(`kvc.passes.framework.rules`; ``--debug-rules`` / ``KVC_DEBUG_RULES=1`` also prints each miss
with its node and reason). In check mode (``check=True`` or ``KVC_CHECK_PASSES=1``) it also
holds each pass to its word: no stale types left, and `modified` true exactly when the
model's text changed. A broken invariant is a PassFailure naming the pass.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import openvino as ov

from kvc.errors import OutputError
from kvc.ir.compare import count_delta, diff_text, op_counts
from kvc.ir.text import to_text
from kvc.ir.writer import write_output
from kvc.passes.framework import invariants, rules
from kvc.passes.framework.base import Pass, PassFailure


@dataclass
class Instrumentation:
    print_before: tuple[str, ...] = ()
    print_after: tuple[str, ...] = ()
    after_change: bool = False
    print_diff: bool = False
    dump_dir: Path | None = None
    stream: TextIO | None = None  # default: stderr
    debug_rules: bool = False  # print why each rewrite rule did not match, node by node

    @property
    def active(self) -> bool:
        return bool(self.print_before or self.print_after or self.dump_dir)

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Instrumentation":
        env = os.environ if env is None else env

        def globs(key: str) -> tuple[str, ...]:
            return tuple(g.strip() for g in env.get(key, "").split(",") if g.strip())

        flag = lambda key: env.get(key, "").lower() in ("1", "true", "yes")  # noqa: E731
        dump = env.get("KVC_DUMP_DIR")
        return cls(print_before=globs("KVC_PRINT_IR_BEFORE"), print_after=globs("KVC_PRINT_IR_AFTER"),
                   after_change=flag("KVC_PRINT_IR_AFTER_CHANGE"), print_diff=flag("KVC_PRINT_IR_DIFF"),
                   dump_dir=Path(dump) if dump else None, debug_rules=flag("KVC_DEBUG_RULES"))

    def merged(self, other: "Instrumentation") -> "Instrumentation":
        """Explicit settings (self) win; the environment fills in what they leave unset."""
        return Instrumentation(self.print_before or other.print_before, self.print_after or other.print_after,
                               self.after_change or other.after_change, self.print_diff or other.print_diff,
                               self.dump_dir or other.dump_dir, self.stream or other.stream,
                               self.debug_rules or other.debug_rules)


@dataclass
class PassRecord:
    index: int
    name: str
    spec: str
    modified: bool
    seconds: float
    op_delta: dict[str, int] = field(default_factory=dict)
    rule_hits: dict[str, int] = field(default_factory=dict)  # rewrite rule -> nodes it matched
    rule_misses: list[tuple[str, str, str]] = field(default_factory=list)  # (rule, node, why not)


@dataclass
class PipelineRun:
    model: ov.Model
    records: list[PassRecord]
    intermediates: list[ov.Model] = field(default_factory=list)  # after each pass, if kept


def _run_pass(p: Pass, model: ov.Model):
    """`p.run(model)`; for a pass from outside kvc (a plugin's), whatever it raises (an exit
    too) or returns other than a PassResult is a PassFailure naming the pass and its file: a
    plugin's RuntimeError was "internal error" (exit 1, a bug in kvc), its sys.exit(0) a
    compile that ended with status 0 and no output."""
    from kvc.passes.framework.base import PassResult

    if type(p).__module__.startswith("kvc."):
        return p.run(model)
    where = sys.modules.get(type(p).__module__)
    origin = getattr(where, "__file__", None) or type(p).__module__
    try:
        result = p.run(model)
    except PassFailure:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - foreign code
        raise PassFailure(p.name, f"the pass (from {origin}) raised {exc.__class__.__name__}: {str(exc)[:300]}") \
            from None
    if not isinstance(result, PassResult):
        raise PassFailure(p.name, f"the pass (from {origin}) returned {type(result).__name__}, not a PassResult")
    return result


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class PassManager:
    def __init__(self, passes: list[Pass], instrumentation: Instrumentation | None = None, *,
                 keep_intermediates: bool = False, use_env: bool = True, check: bool | None = None):
        self.passes = list(passes)
        instr = instrumentation or Instrumentation()
        self.instr = instr.merged(Instrumentation.from_env()) if use_env else instr
        self.keep_intermediates = keep_intermediates
        self.check = check if check is not None else \
            os.environ.get("KVC_CHECK_PASSES", "").lower() in ("1", "true", "yes")

    # -- output helpers ----------------------------------------------------------------
    def _emit(self, text: str) -> None:
        stream = self.instr.stream or sys.stderr
        stream.write(text if text.endswith("\n") else text + "\n")

    def _dump(self, filename: str, text: str) -> None:
        if self.instr.dump_dir is not None:
            write_output(Path(self.instr.dump_dir) / filename, text.encode(), "pass dump")

    # -- running -------------------------------------------------------------------------
    def run(self, model: ov.Model) -> PipelineRun:
        instr = self.instr
        need_text = instr.active or self.check
        text_before = to_text(model) if need_text else None
        if instr.dump_dir is not None:
            try:
                Path(instr.dump_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputError(f"cannot write the dumps to {instr.dump_dir}: {exc.strerror or exc}") from None
            self._dump("000-input.txt", text_before)
        records: list[PassRecord] = []
        intermediates: list[ov.Model] = []
        index_rows: list[dict] = []
        for i, p in enumerate(self.passes, start=1):
            tag = f"{i:03d}-{p.name}"
            if _matches(p.name, instr.print_before):
                self._emit(f"// -----// IR Dump Before {p.spec()} //----- //\n{text_before}")
            counts_before = op_counts(model) if need_text else None
            start = time.perf_counter()
            try:
                self._require(p, "requires", p.requires, model)
                with rules.recording() as rule_log:
                    result = _run_pass(p, model)
                self._require(p, "ensures", p.ensures, result.model)
            except PassFailure as exc:
                self._on_failure(exc, records, tag, text_before if text_before is not None else to_text(model))
                raise
            seconds = time.perf_counter() - start
            model = result.model
            record = PassRecord(i, p.name, p.spec(), result.modified, seconds, rule_hits=rule_log.hit_counts(),
                                rule_misses=rule_log.misses)
            self._report_rules(p, rule_log)
            if need_text:
                if self.check:
                    text_after = self._hold_to_word(p, result.modified, text_before, model, records, tag)
                else:
                    text_after = to_text(model) if result.modified else text_before
                record.op_delta = count_delta(counts_before, op_counts(model))
                self._instrument_after(p, tag, result.modified, text_before, text_after)
                index_rows.append({"index": i, "pass": p.name, "spec": p.spec(), "changed": result.modified,
                                   "op_delta": record.op_delta, "rules": record.rule_hits,
                                   "files": [f"{tag}.txt"] + ([f"{tag}.diff"] if result.modified else [])})
                text_before = text_after
            records.append(record)
            if self.keep_intermediates:
                intermediates.append(model.clone())
        if instr.dump_dir is not None:
            self._dump("index.json", json.dumps(index_rows, indent=1, sort_keys=True) + "\n")
            self._dump("timings.json", json.dumps([{"index": r.index, "pass": r.name, "seconds": round(r.seconds, 6)}
                                                   for r in records], indent=1) + "\n")
        return PipelineRun(model, records, intermediates)

    @staticmethod
    def _require(p: Pass, which: str, names: tuple[str, ...], model: ov.Model) -> None:
        broken = invariants.check(names, model)
        if broken is not None:
            stage = "its input" if which == "requires" else "its output"
            raise p.fail(f"{which} {broken[0]}, which {stage} breaks: {broken[1]}")

    def _hold_to_word(self, p: Pass, modified: bool, before: str, model: ov.Model, records: list[PassRecord],
                      tag: str) -> str:
        """Check mode: the pass left no stale type, and `modified` says what happened. Returns
        the model's text (after validation, which also settles the names of model outputs)."""
        reason = invariants.stale_types(model)
        after = to_text(model)
        if reason is None and modified != (before != after):
            reason = (f"it reported modified={modified}, but the model's text "
                      f"{'changed' if before != after else 'is unchanged'}")
        if reason is not None:
            exc = p.fail(f"check mode: {reason}")
            self._on_failure(exc, records, tag, before)
            raise exc
        return after

    def _report_rules(self, p: Pass, log: rules.RuleLog) -> None:
        if not self.instr.debug_rules:
            return
        for rule, hits in log.hit_counts().items():
            self._emit(f"// rule {rule}: {hits} match(es)")
        for rule, node, reason in log.misses:
            self._emit(f"// rule {rule} did not match at {node}: {reason}")

    def _instrument_after(self, p: Pass, tag: str, changed: bool, before: str, after: str) -> None:
        instr = self.instr
        status = f"// -----// IR Dump After {p.spec()}: unchanged //----- //"
        if changed:
            self._dump(f"{tag}.txt", after)
            self._dump(f"{tag}.diff", diff_text(before, after, "before", f"after {p.spec()}"))
        else:
            self._dump(f"{tag}.txt", status + "\n")
        if _matches(p.name, instr.print_after):
            if not changed and instr.after_change:
                self._emit(status)
            elif instr.print_diff:
                self._emit(f"// -----// IR Diff After {p.spec()} //----- //\n"
                           + (diff_text(before, after, "before", f"after {p.spec()}") or "(no change)\n"))
            else:
                self._emit(f"// -----// IR Dump After {p.spec()} //----- //\n{after}")

    def _on_failure(self, exc: PassFailure, records: list[PassRecord], tag: str, text_before: str) -> None:
        ran = ", ".join(r.spec for r in records) or "none"
        exc.add_context(f"passes run before it: {ran}")
        if self.instr.dump_dir is not None:
            path = Path(self.instr.dump_dir) / f"{tag}.failed-input.txt"
            self._dump(path.name, text_before)
            exc.add_context(f"IR before the failing pass: {path}")
        else:  # nothing is written where nobody asked for it
            exc.add_context("to keep the IR before the failing pass, run again with --dump-dir DIR "
                            "(or KVC_DUMP_DIR=DIR)")


__all__ = ["PassManager", "Instrumentation", "PassRecord", "PipelineRun"]
