"""docs/tour.md is generated: every ```console block's `$ command` is run and its output
written under it, so the tour cannot drift from what kvc prints.

The commands run in a fresh temporary directory, in order, with this Python's `kvc` first on
PATH (the tour's first block copies the bundled model there, so following the tour by hand
leaves nothing in the checkout). Prose outside the blocks is kept as written.

    python scripts/tour.py            # rewrite docs/tour.md from a fresh run
    python scripts/tour.py --check    # exit 1 if docs/tour.md differs from a fresh run,
                                      # numbers that vary by machine masked, progress lines
                                      # in any order (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOUR = ROOT / "docs" / "tour.md"
BLOCK = re.compile(r"```console\n(\$ [^\n]*)\n(.*?)```", re.S)
# What a fresh run may print differently on another machine or run: timings, sizes of
# compiled blobs (they carry the host's ISA), and the digits of logit errors; then the padding
# of a table's columns and the length of its rule, which follow those digits' widths.
VARIES = [
    (re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?"), "<n>"),
    (re.compile(r" {2,}"), "  "),
    (re.compile(r"-{3,}"), "---"),
]


def run_tour(text: str) -> str:
    """`text` with every console block's output replaced by a fresh run's."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONUNBUFFERED="1", COLUMNS="120", NO_COLOR="1")
    with tempfile.TemporaryDirectory(prefix="kvc-tour-") as work:
        def fill(m: re.Match) -> str:
            command = m.group(1)[2:]
            proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            if proc.returncode not in (0, 4):
                raise SystemExit(f"tour command failed ({proc.returncode}): {command}\n{proc.stdout[-2000:]}")
            return f"```console\n$ {command}\n{proc.stdout}```"
        return BLOCK.sub(fill, text)


def masked(text: str) -> str:
    """`text` with what varies masked, and each run of progress lines in sorted order: a
    compile's device compiles report from a thread beside its verification, so their lines
    interleave with the verification's as each finishes first."""
    for pattern, repl in VARIES:
        text = pattern.sub(repl, text)
    return "".join("".join(sorted(run)) if progress else "".join(run)
                   for progress, run in itertools.groupby(text.splitlines(True), lambda line: line.startswith("[kvc] ")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with a fresh run instead of rewriting")
    args = ap.parse_args(argv)
    committed = TOUR.read_text()
    fresh = run_tour(committed)
    if not args.check:
        TOUR.write_text(fresh)
        return 0
    if masked(fresh) == masked(committed):
        return 0
    sys.stdout.writelines(difflib.unified_diff(masked(committed).splitlines(True), masked(fresh).splitlines(True),
                                               "docs/tour.md", "a fresh run"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
