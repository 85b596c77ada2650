"""`fixtures/build.py --check` and `fixtures/compress.py --check` (kvc.fixtures.files): a rebuild
is what is in place when its files are byte-identical, but for the goldens' logits, whose last
bits follow the host's kernels, and the package versions the goldens record."""

from __future__ import annotations

import json
import shutil

import numpy as np

from kvc import fixtures
from kvc.fixtures.files import LOGIT_TOLERANCE, differences, write_npz


def rebuilt(tmp_path, name="llama"):
    """A copy of a fixture's goldens (the files a rebuild on another host changes)."""
    out = tmp_path / name
    out.mkdir()
    for f in ("goldens.json", "goldens.npz"):
        shutil.copyfile(fixtures.ROOT / name / f, out / f)
    present = tmp_path / "present"
    present.mkdir()
    for f in ("goldens.json", "goldens.npz"):
        shutil.copyfile(fixtures.ROOT / name / f, present / f)
    return out, present


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def edit_npz(path, delta):
    with np.load(path) as arrays:
        data = {k: arrays[k] for k in arrays.files}
    key = sorted(data)[0]
    data[key] = data[key] + np.float32(delta)
    write_npz(path, data)


def test_another_hosts_logits_and_package_versions_are_the_fixture_as_in_place(tmp_path):
    built, present = rebuilt(tmp_path)
    assert differences(built, present) == []
    edit_npz(built / "goldens.npz", LOGIT_TOLERANCE / 4)
    edit_json(built / "goldens.json", lambda d: (d["versions"].update(onnxruntime="9.9.9"),
                                                 d["first_logits_max_abs_diff"].update(
                                                     {k: v + LOGIT_TOLERANCE / 4 for k, v in
                                                      d["first_logits_max_abs_diff"].items()})))
    assert differences(built, present) == []


def test_a_token_a_logit_or_a_file_that_differs_is_a_difference(tmp_path):
    built, present = rebuilt(tmp_path)
    edit_json(built / "goldens.json", lambda d: d["prompts"][0]["tokens"]["torch"].__setitem__(3, 0))
    edit_npz(built / "goldens.npz", 10 * LOGIT_TOLERANCE)
    (built / "extra.txt").write_text("x")
    (present / "gone.txt").write_text("y")
    assert differences(built, present) == ["extra.txt: missing from fixtures/", "goldens.json: differs",
                                           "goldens.npz: differs", "gone.txt: not produced by the build"]


def test_the_npz_writer_is_reproducible(tmp_path):
    arrays = {"b": np.arange(3, dtype=np.float32), "a": np.ones((2, 2), np.float32)}
    write_npz(tmp_path / "one.npz", arrays)
    write_npz(tmp_path / "two.npz", dict(reversed(arrays.items())))
    assert (tmp_path / "one.npz").read_bytes() == (tmp_path / "two.npz").read_bytes()
