"""The hostile-input corpus (tests/hostile/corpus.py) through the installed `kvc`, as subprocesses.

Each test runs one case's command, so the runs spread over the xdist workers (run together in
one module fixture, all of them ran again in every worker that took one of these tests: 125 s
of each worker's time on 2 cores). It asserts the run's outcome: the documented exit code, a
message naming the file and the problem, no traceback, nothing left behind (no OUT, no
`.OUT.partial-*`, no temp files), and within corpus.TIMEOUT. Runs where kvc does the wrong
thing today are xfail(strict=True) with the bug as the reason, so the suite stays green and
each bug stays visible: fixing one turns its xfail into an XPASS failure, to be removed here.
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
RUNS = {(c.name, r.command): (c, r) for c in CASES for r in c.runs}


@pytest.fixture(scope="session")
def good() -> Path:
    """The good compiled directory the compiled-directory cases start from, once per worker
    (session-scoped: a module fixture is set up again whenever this worker's tests of the
    module resume after another module's)."""
    return corpus.compile_good(_GEN)


def test_corpus_is_large_enough():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)
    assert {r.command.split("-")[0] for c in CASES for r in c.runs} >= {"inspect", "compile", "run", "verify", "diff",
                                                                        "bisect"}


@pytest.mark.parametrize("case,command", PARAMS)
def test_hostile(good, case, command):
    c, r = RUNS[case, command]
    corpus.prepare_compiled(c, good)
    o = corpus.run_one(c, r, good, _GEN)
    assert o.verdict == "clean", (f"{o.verdict}: kvc {' '.join(o.argv)}\nexpected exit {o.expected}, got {o.code}: "
                                  f"{o.detail}\n--- stderr ---\n{o.stderr}")
