"""The blob check's bounds widened by the plugin's own drift (kvc.verify.peer_drift): bloom at
its own P (1024: ALiBi states no position limit) compiles at bf16, where OpenVINO's own bf16
run of the source drifts past the fixed bounds on the 521-token probe that a bulk chunk of 512
brings (LONG: the default chunks' longest probe has 265 tokens, within the bounds); a fault
past twice that drift, or in exact blobs, is still refused."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from kvc import fixtures
from kvc.export.manifest import MANIFEST
from kvc.verify import cache_rows
from kvc.verify.cache_rows import BLOB_ROW_ERROR
from kvc.verify.peer_drift import NRMSE_CEILING, PEER_FACTOR, ROW_CEILING, Drift
from tests.cli.runner import kvc

LONG = ("--prefill-chunk-size", "16,128,512", "--prefill-first", "0")  # probes of 7, 25, 137 and 521 tokens


def test_bloom_at_its_own_prompt_length_compiles_at_bf16_within_the_plugins_own_drift(tmp_path):
    out = tmp_path / "bloom"
    result = kvc("compile", fixtures.path("bloom"), "-o", out, "--inference-precision", "bf16", *LONG)
    rows = json.loads((out / MANIFEST).read_text())["blob_check"]
    long = next(r for r in rows if r["prompt_tokens"] == 521)
    # The plugin's own bf16 run of the source is past the fixed bound itself: drift, not a fault.
    assert long["peer_precision"] == "bf16"
    assert long["peer_cache_error"] > BLOB_ROW_ERROR["bf16"]
    assert long["ok"] and long["cache_error"] <= PEER_FACTOR * long["peer_cache_error"]
    assert "the run is within 2x of that" in result.output
    # Probes inside the fixed bounds never compiled the peer.
    assert all("peer_precision" not in r for r in rows if r["prompt_tokens"] < 521)
    # kvc verify judges the blobs against the source at f32 the same way (its 1024-token prompt
    # drifted NRMSE 0.021 past the fixed 0.01, the plugin's own run 0.015).
    report = json.loads(kvc("verify", out, "--json").stdout)
    assert report["ok"]
    assert all(r["ok"] for r in report["results"])


def _flip_rows_past(position: int):
    """`stored_rows` with every KV row from `position` on negated in pipelines of blobs (not the
    IR's on kvc's interpreter): rows wrong by twice their RMS, as a blob that wrote them with
    the wrong sign would hold them."""
    real = cache_rows.stored_rows

    def flipped(pipe, rows, origin=0):
        held = real(pipe, rows, origin)
        if next(iter(pipe.generate_sessions.values())).backend == "numpy":
            return held
        for spec in pipe.kv:
            index = [slice(None)] * held[spec.input].ndim
            index[spec.seq_axis] = slice(max(position - origin, 0), None)
            held[spec.input][tuple(index)] *= -1
        return held
    return flipped


@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_a_fault_past_the_plugins_own_drift_is_refused(precision, tmp_path, monkeypatch):
    """Rows of the 521-token probe only (from 515 on) made wrong: at bf16 the peer is measured
    and does not excuse them; exact blobs are never judged against a peer."""
    monkeypatch.setattr(cache_rows, "stored_rows", _flip_rows_past(515))
    out = tmp_path / precision
    result = kvc("compile", fixtures.path("bloom"), "-o", out, "--inference-precision", precision, *LONG, code=4)
    assert re.search(r"prompt of 521 tokens: KV cache row 5(1[5-9]|2\d) of past_key_values\.\d+\.(key|value) is not "
                     r"the IR's: its error is 2 of the row's RMS", result.output)
    assert not out.exists()
    if precision == "bf16":
        assert "OpenVINO CPU's own bf16 run of the source model drifts" in result.output
        assert "the run is not within 2x of that" in result.output
        assert "--inference-precision f32" in result.output  # the way to tell drift from a fault
    else:
        assert "own" not in result.output and "these blobs compute at bf16" not in result.output


def test_widened_bounds_never_narrow_and_never_pass_the_ceilings():
    fixed = dict(BLOB_ROW_ERROR)
    small = Drift(nrmse=0.001, row_error=0.01, precision="bf16")
    assert small.limit(0.01) == 0.01 and small.row_bounds(fixed) == fixed
    drifting = Drift(nrmse=0.009, row_error=0.195, precision="bf16")
    assert drifting.limit(0.01) == pytest.approx(0.018)
    assert drifting.row_bounds(fixed)["bf16"] == pytest.approx(0.39)
    wild = Drift(nrmse=0.5, row_error=3.0, precision="bf16")
    assert wild.limit(0.01) == NRMSE_CEILING and set(wild.row_bounds(fixed).values()) == {ROW_CEILING}
    assert Drift(nrmse=np.float64(0.0), row_error=None, precision="bf16").row_bounds(fixed) == fixed


def test_a_peer_that_cannot_run_leaves_the_refusal_as_it_was(tmp_path, monkeypatch):
    """The widening is only ever a second judgement: when the plugin's own run of the source
    fails, the fixed bounds' verdict stands (exit 4, not the peer's device error)."""
    from kvc.errors import DeviceError
    from kvc.verify import peer_drift

    def broken(*args, **kwargs):
        raise DeviceError("cannot compile for CPU: out of memory")

    monkeypatch.setattr(cache_rows, "stored_rows", _flip_rows_past(515))
    monkeypatch.setattr(peer_drift.Peer, "drift", broken)
    result = kvc("compile", fixtures.path("bloom"), "-o", tmp_path / "out", "--inference-precision", "bf16", *LONG,
                 code=4)
    assert "is not the IR's: its error is 2 of the row's RMS" in result.output
    assert "run of the source model, which could widen the bounds, failed: cannot compile for CPU" in result.output
    assert not (tmp_path / "out").exists()
