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
  before, and the IR before the failing pass is written out (to the dump directory, or to
  a temporary directory whose path the error gives).

Library users get the same through environment variables (`Instrumentation.from_env`):
``KVC_PRINT_IR_BEFORE``, ``KVC_PRINT_IR_AFTER`` (globs, comma-separated),
``KVC_PRINT_IR_AFTER_CHANGE=1``, ``KVC_PRINT_IR_DIFF=1``, ``KVC_DUMP_DIR=path``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import openvino as ov

from kvc.ir.compare import count_delta, diff_text, op_counts
from kvc.ir.text import to_text
from kvc.ir.writer import write_bytes_atomic
from kvc.passes.base import Pass, PassFailure


@dataclass
class Instrumentation:
    print_before: tuple[str, ...] = ()
    print_after: tuple[str, ...] = ()
    after_change: bool = False
    print_diff: bool = False
    dump_dir: Path | None = None
    stream: TextIO | None = None  # default: stderr

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
                   dump_dir=Path(dump) if dump else None)

    def merged(self, other: "Instrumentation") -> "Instrumentation":
        """Explicit settings (self) win; the environment fills in what they leave unset."""
        return Instrumentation(self.print_before or other.print_before, self.print_after or other.print_after,
                               self.after_change or other.after_change, self.print_diff or other.print_diff,
                               self.dump_dir or other.dump_dir, self.stream or other.stream)


@dataclass
class PassRecord:
    index: int
    name: str
    spec: str
    changed: bool
    seconds: float
    op_delta: dict[str, int] = field(default_factory=dict)


@dataclass
class PipelineRun:
    model: ov.Model
    records: list[PassRecord]
    intermediates: list[ov.Model] = field(default_factory=list)  # after each pass, if kept


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class PassManager:
    def __init__(self, passes: list[Pass], instrumentation: Instrumentation | None = None, *,
                 keep_intermediates: bool = False, use_env: bool = True):
        self.passes = list(passes)
        instr = instrumentation or Instrumentation()
        self.instr = instr.merged(Instrumentation.from_env()) if use_env else instr
        self.keep_intermediates = keep_intermediates

    # -- output helpers ----------------------------------------------------------------
    def _emit(self, text: str) -> None:
        stream = self.instr.stream or sys.stderr
        stream.write(text if text.endswith("\n") else text + "\n")

    def _dump(self, filename: str, text: str) -> None:
        if self.instr.dump_dir is not None:
            write_bytes_atomic(Path(self.instr.dump_dir) / filename, text.encode())

    # -- running -------------------------------------------------------------------------
    def run(self, model: ov.Model) -> PipelineRun:
        instr = self.instr
        need_text = instr.active
        text_before = to_text(model) if need_text else None
        if instr.dump_dir is not None:
            Path(instr.dump_dir).mkdir(parents=True, exist_ok=True)
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
                result = p.run(model)
            except PassFailure as exc:
                self._on_failure(exc, records, tag, text_before if text_before is not None else to_text(model))
                raise
            seconds = time.perf_counter() - start
            model = result.model
            record = PassRecord(i, p.name, p.spec(), result.changed, seconds)
            if need_text:
                record.op_delta = count_delta(counts_before, op_counts(model))
                text_after = to_text(model) if result.changed else text_before
                self._instrument_after(p, tag, result.changed, text_before, text_after)
                index_rows.append({"index": i, "pass": p.name, "spec": p.spec(), "changed": result.changed,
                                   "op_delta": record.op_delta,
                                   "files": [f"{tag}.txt"] + ([f"{tag}.diff"] if result.changed else [])})
                text_before = text_after
            records.append(record)
            if self.keep_intermediates:
                intermediates.append(model.clone())
        if instr.dump_dir is not None:
            self._dump("index.json", json.dumps(index_rows, indent=1, sort_keys=True) + "\n")
            self._dump("timings.json", json.dumps([{"index": r.index, "pass": r.name, "seconds": round(r.seconds, 6)}
                                                   for r in records], indent=1) + "\n")
        return PipelineRun(model, records, intermediates)

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
        else:
            fd, name = tempfile.mkstemp(prefix=f"kvc-{tag}-", suffix=".failed-input.txt")
            os.close(fd)
            path = Path(name)
            path.write_text(text_before)
        exc.add_context(f"IR before the failing pass: {path}")


__all__ = ["PassManager", "Instrumentation", "PassRecord", "PipelineRun"]
