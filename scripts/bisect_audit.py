"""Put faults into kvc's passes and see whether `kvc bisect` names the pass and tensor that hold them.

    python scripts/bisect_audit.py [--mutants A,B] [--install pass|bundle] [FIXTURE ...] [-- KVC BISECT ARGS]

`kvc compile` refuses a faulty pipeline and points to `kvc bisect` to locate the fault; this
checks that it does. Each IR mutant (tests/mutation/mutants.py) runs on each fixture named
(default: llama) in a process of its own, and `kvc bisect FIXTURE --max-prompt-len 64
--min-response-len 64 --json` runs with it installed, with the options its test compiles it with
(tests/mutation/test_mutants.py CHUNKS: the models it edits; not with `--plain`) and whatever
follows `--`:

* `--install pass` (default, `tests.mutation.mutants.apply_in_passes`): the mutant's edit made
  by the *last pass of each static branch*, after that pass's own work (a static model named
  as the branch, as `Bundle.add` names it in a compile): the fault is in a pass that bisect
  walks, so the truth is that pass, in the branches the mutant edits. A mutant that patches a
  pass itself (`hooks`, e.g. mask_positions_past_from_one) is in that pass.
* `--install bundle`: as scripts/mutate.py installs it for a compile (`Bundle.add`, after
  every pass): bisect builds no bundle, so it sees only the hooks.

One line per mutant and fixture: bisect's exit code, the pass it names (branch, index,
spec), the tensor it names, where the mutant put the fault (the branches it edited and their
last pass; the values its new nodes feed), and a verdict: "correct" (pass and tensor),
"correct pass, tensor X" (named a tensor that is not one the new nodes feed: judge it by
hand), "WRONG pass", "CLEAN" (exit 0 on a fault: bisect says nothing is wrong), "crash"
(exit 1), "no edit" (the mutant does not apply to the models bisect builds).

Exit 1 when any verdict is WRONG pass, CLEAN or crash.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = ["--max-prompt-len", "64", "--min-response-len", "64"]
BAD = ("WRONG pass", "CLEAN", "crash")


def one(mutant: str, fixture: str, install: str, plain: bool, extra: list[str]) -> int:
    """Bisect `fixture` with `mutant` installed, in this process; print the verdict line."""
    sys.path.insert(0, str(ROOT))
    from click.testing import CliRunner

    from kvc import fixtures
    from kvc.cli.main import cli
    from tests.mutation.mutants import apply, apply_in_passes
    from tests.mutation.test_mutants import CHUNKS

    if install == "pass":
        applied = apply_in_passes(mutant, setattr)
        edits, last, downstream = applied.edits, applied.last, applied.fed
    else:
        edits, last, downstream = apply(mutant, setattr, os.environ.__setitem__, "ir").edits, {}, {}
    forms = [] if plain else list(CHUNKS.get(mutant, ()))  # the models the mutant edits, as its test builds them
    argv = ["bisect", str(fixtures.path(fixture)), *SIZE, *forms, *extra, "--json"]
    try:
        result = CliRunner().invoke(cli, argv, catch_exceptions=False)
        code, output = result.exit_code, result.stdout
    except Exception as exc:  # a crash of bisect itself
        code, output = 1, f"{type(exc).__name__}: {exc}"
    hooked = sorted(k for k in edits if k not in last)  # a pass patched (hooks): its name
    fault = {b: last[b] for b in edits if b in last}
    named, tensor = "", ""
    try:
        data = json.loads(output)
        bad = data.get("first_bad_pass")
        if bad:
            named = f"{bad['branch']} #{bad['index']} {bad['spec']}"
            if bad.get("reason"):
                named += f" [{bad['reason'][:80]}]"
        t = data.get("first_diverging_tensor")
        tensor = f"{t['tensor']} {t['shape']}" if t else "-"
        bad_branch, bad_spec = (bad["branch"], bad["spec"]) if bad else ("", "")
    except (json.JSONDecodeError, TypeError):
        bad_branch = bad_spec = ""
        named = output.strip().splitlines()[-1][:160] if output.strip() else ""
    if code == 1:
        verdict = "crash"
    elif code not in (0, 4):  # bisect refused the options or the model (before the mutant's models, maybe)
        verdict = f"exit {code}"
    elif not edits and mutant != "none":
        verdict = "no edit"
    elif code == 0:
        verdict = "ok (control)" if mutant == "none" else "CLEAN"
    elif fault.get(bad_branch) == bad_spec or any(bad_spec.split("{")[0] == h for h in hooked):
        fed = downstream.get(bad_branch)
        verdict = ("correct" if fed is None or tensor.split(" ")[0] in fed
                   else f"correct pass, tensor? (fed: {', '.join(fed[:4]) or 'none named'})")
    else:
        verdict = "WRONG pass"
    truth = ", ".join([f"{b}: {s}" for b, s in fault.items()] + hooked) or "-"
    print(f"{mutant:32} {fixture:10} {' '.join(forms) or '-':24} exit {code}  named: {named or '-'}  tensor: {tensor or '-'}  "
          f"truth: {truth}  => {verdict}", flush=True)
    return 1 if verdict in BAD else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", nargs="*", default=["llama"])
    parser.add_argument("--mutants", help="comma-separated (default: every one)")
    parser.add_argument("--install", choices=("pass", "bundle"), default="pass")
    parser.add_argument("--plain", action="store_true",
                        help="no per-mutant options (else those its test compiles with: tests/mutation/test_mutants.py CHUNKS)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]  # after --: kvc bisect's own options
    if args.one:
        return one(args.mutants, args.fixtures[0], args.install, args.plain, extra)
    sys.path.insert(0, str(ROOT))
    from tests.mutation.mutants import MUTANTS

    names = args.mutants.split(",") if args.mutants else list(MUTANTS)
    failed = 0
    for name in names:
        for fixture in args.fixtures:
            failed |= subprocess.call([sys.executable, __file__, "--one", "--mutants", name, "--install",
                                       args.install, *(["--plain"] if args.plain else []), fixture, "--", *extra])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
