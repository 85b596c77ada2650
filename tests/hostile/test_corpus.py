"""The hostile-input corpus (tests/hostile/corpus.py) through the installed `kvc`, as subprocesses.

Every case's commands run once, in parallel (one per CPU), in a module-scoped fixture; each
test then asserts its outcome: the documented exit code, a message naming the file and the
problem, no traceback, nothing left behind (no OUT, no `.OUT.partial-*`, no temp files), and
within corpus.TIMEOUT. Runs where kvc does the wrong thing today are xfail(strict=True) with
the bug as the reason, so the suite stays green and each bug stays visible: fixing one turns
its xfail into an XPASS failure, to be removed here.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.hostile import corpus

_GEN = Path(tempfile.mkdtemp(prefix="kvc-hostile-"))
# Built at collection, in every process that collects this module (each xdist worker), and
# removed when that process exits: a worker that never ran the fixture left 21 MB in /tmp.
atexit.register(shutil.rmtree, _GEN, ignore_errors=True)
CASES = corpus.build(_GEN / "corpus")
PARAMS = [pytest.param(c.name, r.command, id=f"{c.name}-{r.command}",
                       marks=[pytest.mark.xfail(strict=True, reason=r.bug)] if r.bug else [])
          for c in CASES for r in c.runs]


@pytest.fixture(scope="module")
def outcomes():
    try:
        good = corpus.compile_good(_GEN)
        yield corpus.run_all(CASES, good, _GEN)
    finally:
        shutil.rmtree(_GEN, ignore_errors=True)


def test_corpus_is_large_enough():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)
    assert {r.command.split("-")[0] for c in CASES for r in c.runs} >= {"inspect", "compile", "run", "verify", "diff",
                                                                        "bisect"}


@pytest.mark.parametrize("case,command", PARAMS)
def test_hostile(outcomes, case, command):
    o = outcomes[(case, command)]
    assert o.verdict == "clean", (f"{o.verdict}: kvc {' '.join(o.argv)}\nexpected exit {o.expected}, got {o.code}: "
                                  f"{o.detail}\n--- stderr ---\n{o.stderr}")
