"""The fuzzer (fuzz.py) at a fixed seed and budget: no crash, hang, partial output or
accepted-wrong outcome. A longer run: `python tests/hostile/fuzz.py --budget 1500 --seed 3`.

The last two tests show the fuzzer's verdicts have teeth: with kvc broken on purpose in the
fork server (`plant`), it reports what it must.
"""

from __future__ import annotations

import pytest

from tests.hostile import fuzz

SEED, BUDGET = 19, 150


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def good(work):
    return fuzz.good_directory(work)


def test_fuzzing_finds_nothing_bad(work, good):
    report = fuzz.fuzz(BUDGET, SEED, work, good=good)
    counts = report.counts()
    assert set(counts) == set(fuzz.TARGETS) and sum(sum(c.values()) for c in counts.values()) == BUDGET
    assert not report.findings(), "\n".join(fuzz.report_lines(report))
    refused = sum(e.code not in (0, None) for e in report.executions)
    assert refused > BUDGET // 2, "most mutations must be refused; the fuzzer is not reaching kvc's checks"


def test_a_crash_is_reported_as_one(work, good):
    report = fuzz.fuzz(3, SEED, work, targets=("manifest",), good=good, plant="crash")
    assert [e.verdict for e in report.executions] == ["crash"] * 3
    assert "ZeroDivisionError: planted" in report.executions[0].detail


def test_a_changed_file_that_passes_check_is_accepted_wrong(work, good):
    report = fuzz.fuzz(12, SEED, work, targets=("files",), good=good, plant="no-check")
    assert any(e.verdict == "accepted-wrong" for e in report.executions), [e.detail for e in report.executions]
