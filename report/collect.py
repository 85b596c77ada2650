"""What a report shows, gathered from a compiled directory, its dumps and a compile's record.

Sources, each optional but the manifest:

* ``OUT/manifest.json``: read with `kvc.export.manifest.read_manifest` (its structure and
  plan checked) and every listed file's size checked (`check_files`): a damaged directory is
  an InvalidModelError (exit 3), never a half-drawn page.
* a dump directory (``OUT/dumps`` from ``kvc compile --dumps``, or another given): per branch
  (``common``, ``prefill``, ``generate-<T>``) its ``index.json`` (pass, spec, changed, op-count
  deltas, rule hits), ``timings.json`` and the ``NNN-<pass>.diff`` files. A malformed index is
  an InvalidModelError (code ``bad-dumps``); file names are only ever taken from the pattern
  ``NNN-<name>.diff`` inside the branch, never from the index as paths.
* the compile's record (`CompileRecorder`): per phase the wall time and the bytes written, and
  per verification probe the per-step logit error and margins. ``kvc compile`` keeps it in
  memory for ``--report`` and, with ``--dumps``, writes it beside the dumps
  (``dumps/timings.json``: phases, which vary run to run like the branches' timings.json;
  ``dumps/verification.json``: the probes, which do not), so that ``kvc report OUT`` shows the
  same page later.
* the models: the source (before lifting) and the final prefill and generate IR, for the
  KV subgraph pictures (`kvc.report.graph`).

What is absent is said in the page, with how to get it; nothing here fails for a missing
optional source.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvc import jsontext
from kvc.errors import InvalidModelError, KvcError, UsageError
from kvc.export.manifest import KINDS, model_kind, model_order

TIMINGS = "timings.json"  # at the dump directory's root: the compile's phases
VERIFICATION = "verification.json"  # at the dump directory's root: the probes' per-step numbers
RECORD_VERSION = 1
_BRANCH = re.compile(r"^(common|prefill(-\d+)?|first-\d+|generate-\d+)$")
_PASS_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,80}$")
DIFF_LINES = 4000  # per pass in the page; longer diffs are cut, with the file to read named


def _sig(x) -> float | None:
    """A float rounded to 7 significant digits (stable JSON, no spurious digits); None when
    not finite."""
    x = float(x)
    return float(f"{x:.7g}") if math.isfinite(x) else None


def _tree_bytes(work: Path) -> int:
    """Bytes of the output files under `work` (the dumps are diagnostics, not output)."""
    return sum(p.stat().st_size for p in work.rglob("*") if p.is_file() and "dumps" not in p.relative_to(work).parts)


def per_step(ref, got) -> dict:
    """Per generated step of two `Generation`s: the largest absolute logit error, the
    reference's margin (its top logit minus the runner-up) and whether the tokens agree. After
    the first differing token the runs condition on different tokens; those steps are marked
    (`compared` stops there)."""
    steps = min(len(ref.logits), len(got.logits))
    error, margin, same = [], [], []
    for i in range(steps):
        r = np.asarray(ref.logits[i], dtype=np.float64)
        a = np.asarray(got.logits[i], dtype=np.float64)
        both = np.isfinite(r) & np.isfinite(a)
        error.append(_sig(np.max(np.abs(r[both] - a[both]), initial=0.0)) if both.any() else None)
        top = np.sort(r[np.isfinite(r)])[-2:] if np.isfinite(r).sum() >= 2 else None
        margin.append(_sig(top[1] - top[0]) if top is not None else None)
        same.append(i < len(ref.tokens) and i < len(got.tokens) and ref.tokens[i] == got.tokens[i])
    compared = next((i + 1 for i, s in enumerate(same) if not s), steps)
    return {"error": error, "margin": margin, "same_token": same, "compared": compared}


class CompileRecorder:
    """What `kvc compile` tells a report while it runs: `kvc.export.compile` calls `phase`
    as each phase begins, `probes` once the IR's probe generations exist, and `finish` when
    the output is complete. Times are wall-clock seconds (rounded to microseconds); bytes are
    what the phase added to the output directory."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._open: tuple[str, float, int] | None = None
        self.phases: list[dict] = []
        self.probe_steps: list[dict] = []
        self.against = ""

    def phase(self, name: str | None, work: Path) -> None:
        """Close the running phase (if any) and start `name` (None: only close)."""
        now, size = self._clock(), _tree_bytes(Path(work))
        if self._open is not None:
            title, start, before = self._open
            self.phases.append({"phase": title, "seconds": round(now - start, 6), "bytes": size - before})
        self._open = (name, now, size) if name is not None else None

    def probes(self, source: Path, cases, ir_gens, work: Path) -> None:
        """Per-step numbers of the compile's verification probes: the IR on kvc's numpy
        runtime (`ir_gens`, as compile ran it) against the source on OpenVINO CPU f32, run once
        more here (verify_static keeps only its summary): a phase of its own."""
        from kvc.ir.reader import load
        from kvc.runtime.generate import greedy
        from kvc.runtime.session import OpenVINOSession
        from kvc.verify.compiled import probe_row

        self.phase("report: reference per step", work)
        reference = OpenVINOSession(load(source), "CPU")
        self.against = "the static IR on kvc's numpy runtime against the source model on OpenVINO CPU f32"
        for probe, got in zip(cases, ir_gens):
            self.probe_steps.append({**probe_row(probe),
                                     **per_step(greedy(reference, probe.prompt, probe.new_tokens, origin=probe.origin,
                                                             filled=probe.filled),
                                                got)})

    def finish(self, work: Path, dumps: Path | None) -> None:
        """Close the last phase; with a dump directory, write the record beside the dumps."""
        from kvc.ir.writer import write_bytes_atomic

        self.phase(None, work)
        if dumps is not None and Path(dumps).is_dir():
            data = self.to_dict()
            write_bytes_atomic(Path(dumps) / TIMINGS, _json({"version": RECORD_VERSION, "phases": data["phases"]}))
            write_bytes_atomic(Path(dumps) / VERIFICATION,
                               _json({"version": RECORD_VERSION, "against": data["against"], "probes": data["probes"]}))

    def to_dict(self) -> dict:
        """The record as the page reads it (a JSON round trip, so that a page from memory and
        one from the written files are the same bytes)."""
        return json.loads(_json({"phases": self.phases, "probes": self.probe_steps, "against": self.against}))


def _json(data) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


# --- reading back ---------------------------------------------------------------------------------

@dataclass
class PassRow:
    index: int
    name: str
    spec: str
    changed: bool
    op_delta: dict[str, int]
    rules: dict[str, int]
    seconds: float | None
    diff: str | None  # None: unchanged, or no diff file
    diff_file: str | None
    diff_cut: int = 0  # lines left out of the page


@dataclass
class Branch:
    name: str
    passes: list[PassRow]


@dataclass
class Picture:
    title: str
    subgraph: object | None  # kvc.report.graph.Subgraph
    absent: str | None = None  # why there is no picture


@dataclass
class ReportData:
    directory: Path
    manifest: dict
    layer: int
    branches: list[Branch] | None
    dumps: Path | None
    absent: dict[str, str] = field(default_factory=dict)  # section -> what is missing and how to get it
    phases: list[dict] | None = None
    probes: list[dict] | None = None
    probes_against: str = ""
    pictures: list[Picture] = field(default_factory=list)
    dumps_label: str | None = None


def _bad_dumps(path: Path, reason: str, found=None) -> InvalidModelError:
    return InvalidModelError("bad-dumps", str(path), reason, expected="a dump directory written by kvc",
                             found=None if found is None else repr(found)[:80])


def _read_json(path: Path):
    try:
        return jsontext.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad_dumps(path, f"not readable JSON: {exc}") from None


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_branch(path: Path) -> Branch:
    """One branch of a dump directory: its index.json checked, its timings and diffs read."""
    index = _read_json(path / "index.json")
    if not isinstance(index, list):
        raise _bad_dumps(path / "index.json", "index.json is not a list of passes", index)
    seconds = {}
    if (path / "timings.json").is_file():
        timings = _read_json(path / "timings.json")
        if not isinstance(timings, list) or not all(
                isinstance(t, dict) and _int(t.get("index")) and isinstance(t.get("seconds"), (int, float))
                and not isinstance(t.get("seconds"), bool) for t in timings):
            raise _bad_dumps(path / "timings.json", "timings.json is not a list of {index, seconds}", timings)
        seconds = {t["index"]: float(t["seconds"]) for t in timings}
    rows = []
    for row in index:
        ok = (isinstance(row, dict) and _int(row.get("index")) and 0 < row["index"] < 1000
              and isinstance(row.get("pass"), str) and _PASS_NAME.match(row["pass"])
              and isinstance(row.get("spec"), str) and isinstance(row.get("changed"), bool)
              and isinstance(row.get("op_delta"), dict)
              and all(isinstance(k, str) and _int(v) for k, v in row["op_delta"].items())
              and isinstance(row.get("rules", {}), dict)
              and all(isinstance(k, str) and _int(v) for k, v in row.get("rules", {}).items()))
        if not ok:
            raise _bad_dumps(path / "index.json", "a pass entry is malformed "
                             "(index, pass, spec, changed, op_delta {op: int}, rules {rule: int})", row)
        name = f"{row['index']:03d}-{row['pass']}.diff"  # built, never read from the file
        diff, cut = None, 0
        if row["changed"] and (path / name).is_file():
            try:
                lines = (path / name).read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)
            except OSError as exc:
                raise _bad_dumps(path / name, f"cannot read: {exc}") from None
            cut = max(0, len(lines) - DIFF_LINES)
            diff = "".join(lines[:DIFF_LINES])
        rows.append(PassRow(row["index"], row["pass"], row["spec"], row["changed"],
                            dict(sorted(row["op_delta"].items())), dict(sorted(row.get("rules", {}).items())),
                            seconds.get(row["index"]), diff, name if diff is not None else None, cut))
    rows.sort(key=lambda r: r.index)
    return Branch(path.name, rows)


def branch_order(name: str):
    """common, then the models in `model_order`."""
    if name == "common":
        return (0, False, 0)
    kind, size = model_kind(name)
    return (1, KINDS.index(kind), size or 0)


def read_dumps(dumps: Path) -> list[Branch]:
    branches = [read_branch(p) for p in sorted(dumps.iterdir())
                if p.is_dir() and _BRANCH.match(p.name) and (p / "index.json").is_file()]
    if not branches and (dumps / "index.json").is_file():  # a single pipeline's dump (kvc bisect, KVC_DUMP_DIR)
        branches = [read_branch(dumps)]
    branches.sort(key=lambda b: branch_order(b.name) if _BRANCH.match(b.name) else (3, 0))
    return branches


def _finite_or_none(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def read_record(dumps: Path) -> tuple[list[dict] | None, list[dict] | None, str]:
    """The compile's record written beside the dumps: (phases, probes, against); None for a
    part that is not there (dumps from an older kvc, or from `--dump-dir`)."""
    phases = probes = None
    against = ""
    data = _read_json(dumps / TIMINGS) if (dumps / TIMINGS).is_file() else None
    if data is not None and not (isinstance(data, list) and (dumps / "index.json").is_file()):
        # (a list beside an index.json: a single pipeline's pass timings, not a compile's phases)
        rows = data.get("phases") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not all(
                isinstance(r, dict) and isinstance(r.get("phase"), str) and _int(r.get("bytes"))
                and isinstance(r.get("seconds"), (int, float)) and _finite_or_none(r["seconds"]) for r in rows):
            raise _bad_dumps(dumps / TIMINGS, "the compile's phases are malformed (phase, seconds, bytes)", data)
        phases = rows
    if (dumps / VERIFICATION).is_file():
        data = _read_json(dumps / VERIFICATION)
        rows = data.get("probes") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not all(_probe_ok(r) for r in rows):
            raise _bad_dumps(dumps / VERIFICATION, "the per-step verification numbers are malformed", data)
        probes, against = rows, str(data.get("against", ""))
    return phases, probes, against


def _probe_ok(r) -> bool:
    if not (isinstance(r, dict) and _int(r.get("prompt_tokens")) and _int(r.get("new_tokens"))
            and _int(r.get("compared"))):
        return False
    series = [r.get("error"), r.get("margin"), r.get("same_token")]
    if not all(isinstance(s, list) and len(s) == len(series[0]) <= 100_000 for s in series):
        return False
    return (all(_finite_or_none(v) for v in r["error"] + r["margin"])
            and all(isinstance(v, bool) for v in r["same_token"]))


def collect(directory: str | Path, *, dumps: str | Path | None = None, record: dict | None = None,
            source: str | Path | None = None, layer: int = 0, pictures: bool = True,
            dumps_label: str | None = None) -> ReportData:
    """Everything the page shows. `dumps`: a dump directory (default OUT/dumps when it
    exists); `record`: a `CompileRecorder.to_dict()` (default: read from the dumps); `source`:
    the model before lifting (default: the manifest's source, when it is still there and
    unchanged); `layer`: whose KV subgraph to draw; `dumps_label`: how the page names the dump
    directory (a temporary one is gone when the page is read)."""
    from kvc.export.manifest import check_files, plan_of, read_manifest

    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory; give a directory written by kvc compile")
    manifest = read_manifest(directory)
    check_files(directory, manifest)
    plan = plan_of(manifest)
    layers = sorted({spec.layer for spec in plan.kv})
    if layer not in layers:
        raise UsageError(f"--layer {layer}: the plan's KV cache has layers {layers[0]} to {layers[-1]}")
    if dumps is None and (directory / "dumps").is_dir():
        dumps = directory / "dumps"
    data = ReportData(directory, manifest, layer, None, Path(dumps) if dumps is not None else None,
                      dumps_label=dumps_label)
    if dumps is not None:
        dumps = Path(dumps)
        if not dumps.is_dir():
            raise UsageError(f"--dumps {dumps}: no such directory")
        data.branches = read_dumps(dumps)
        if not data.branches:
            data.absent["passes"] = f"{dumps} holds no pass dumps (no index.json)"
        data.phases, data.probes, data.probes_against = read_record(dumps)
    else:
        data.absent["passes"] = ("the passes, their op-count deltas and diffs are recorded only when compiled with "
                                 "--dumps (kvc compile --dumps, then kvc report OUT) or kvc compile --report")
    if record is not None:
        data.phases, data.probes, data.probes_against = record["phases"], record["probes"], record["against"]
    if data.phases is None:
        data.absent["timings"] = ("the time and bytes of each compile phase are recorded by kvc compile --dumps "
                                  "(written to OUT/dumps/timings.json) or kvc compile --report")
    if data.probes is None:
        data.absent["steps"] = ("per-step logit errors and margins are recorded by kvc compile --dumps "
                                "(OUT/dumps/verification.json) or kvc compile --report, with verification on")
    elif not data.probes:
        data.absent["steps"] = "the compile ran with --no-verify: no probes were compared with the source"
    if pictures:
        data.pictures = _pictures(directory, manifest, plan, source, layer)
    return data


def _pictures(directory: Path, manifest: dict, plan, source, layer: int) -> list[Picture]:
    """The KV subgraph of `layer` before lifting (the source) and in the final prefill and
    first generate model."""
    from kvc.export.manifest import recorded_source
    from kvc.ir.reader import load
    from kvc.report.graph import kv_subgraph_final, kv_subgraph_source

    pictures = []
    title = f"before lifting: the source model (layer {layer})"
    recorded = manifest["source"]
    try:
        if source is None and not (isinstance(recorded, dict) and isinstance(recorded.get("path"), str)
                                   and isinstance(recorded.get("sha256"), dict)):
            raise InvalidModelError("bad-manifest", str(directory / "manifest.json"), "its source is malformed",
                                    expected='{"path": str, "sha256": {file: hash}}')
        path = Path(source) if source is not None else recorded_source(manifest, directory)
        pictures.append(Picture(title, kv_subgraph_source(load(path), layer, str(path))))
    except KvcError as exc:
        pictures.append(Picture(title, None, f"the source model cannot be drawn: {exc} "
                                             f"(kvc report OUT --source MODEL)"))
    specs = [s for s in plan.kv if s.layer == layer]
    names = model_order(manifest["models"])
    smallest = next(n for n in names if model_kind(n)[0] == "generate")  # after the bulk and first chunks
    for name in ("prefill", smallest):
        entry = manifest["models"][name]
        title = f"final {name} model (layer {layer})"
        try:
            model = load(directory / entry["xml"], weights=directory / manifest["weights"])
            pictures.append(Picture(title, kv_subgraph_final(model, specs, entry["xml"])))
        except KvcError as exc:
            pictures.append(Picture(title, None, f"cannot be drawn: {exc}"))
    return pictures
