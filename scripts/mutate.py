"""Put faults into kvc's static models and see whether `kvc compile` refuses them.

    python scripts/mutate.py [--mutants A,B] [--where ir|blob] [--device CPU] [FIXTURE ...] [-- KVC COMPILE ARGS]

Each mutant (tests/mutation/mutants.py) runs on each fixture named (default: llama) in a
process of its own, compiled as `kvc compile FIXTURE -o OUT --max-prompt-len 64
--min-response-len 64 --device DEVICE` (the CPU's defaults on this host) and whatever follows
`--` (`-- --max-prompt-len 1024` overrides the 64), and prints one line:
refused (the compile's exit code and the first line of its reason), PUBLISHED (the proof let
it through: a bug in kvc's checks), or "no edit" (the mutant does not apply to that model). A
new pass or check is audited by running every mutant over the zoo:

    python scripts/mutate.py $(python -c 'from kvc import fixtures; print(*fixtures.MODELS)')

Exit 1 when any mutant was published.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(mutant: str, fixture: str, where: str, device: str, extra: list[str]) -> int:
    """Compile `fixture` with `mutant` installed, in this process; print the verdict line."""
    sys.path.insert(0, str(ROOT))
    from click.testing import CliRunner

    from kvc import fixtures
    from kvc.cli.main import cli
    from tests.mutation.mutants import apply

    applied = apply(mutant, setattr, os.environ.__setitem__, where)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        result = CliRunner().invoke(cli, ["compile", str(fixtures.path(fixture)), "-o", str(out), "--max-prompt-len",
                                          "64", "--min-response-len", "64", "--device", device, *extra],
                                    catch_exceptions=False)
    edits = sum(applied.edits.values())
    if not edits and mutant != "none":
        verdict = "no edit"
    elif result.exit_code == 0:
        verdict = "PUBLISHED"
    else:
        reason = next((line for line in result.output.splitlines() if line.startswith("kvc: error")), "")
        verdict = f"refused (exit {result.exit_code}): {reason[:240]}"
    print(f"{mutant:32} {fixture:24} {where:4} edits {edits:3}  {verdict}", flush=True)
    return 1 if verdict == "PUBLISHED" and mutant != "none" else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", nargs="*", default=["llama"])
    parser.add_argument("--mutants", help="comma-separated (default: every one)")
    parser.add_argument("--where", choices=("ir", "blob"), default="ir")
    parser.add_argument("--device", choices=("CPU", "NPU"), default="CPU")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]  # after --: kvc compile's own options
    if args.one:
        return one(args.mutants, args.fixtures[0], args.where, args.device, extra)
    sys.path.insert(0, str(ROOT))
    from tests.mutation.mutants import MUTANTS

    names = args.mutants.split(",") if args.mutants else list(MUTANTS)
    published = 0
    for name in names:
        for fixture in args.fixtures:
            published |= subprocess.call([sys.executable, __file__, "--one", "--mutants", name, "--where", args.where,
                                          "--device", args.device, fixture, "--", *extra])
    return 1 if published else 0


if __name__ == "__main__":
    sys.exit(main())
