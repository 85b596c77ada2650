"""Paths a user hands kvc. What it writes where the user says (`write_output`: events, plans,
costs, goldens, reports, pass dumps) keeps what the path names, and never overwrites kvc's own
files; what it reads as JSON is a regular file (`jsontext.read_text`: a FIFO hung it)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import pytest
from kvc import jsontext
from kvc.errors import OutputError
from kvc.ir.writer import check_writable, write_output
from kvc import fixtures
from tests.cli.runner import SMALL, kvc


def test_a_symlink_keeps_pointing_at_the_file_it_names(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_output(link, b"new", "plan")
    assert link.is_symlink() and real.read_text() == "new"


def test_a_fifo_is_written_to_not_replaced_by_a_file(tmp_path):
    """As root, `--events /dev/null` replaced the system's /dev/null with a regular file (an
    atomic rename over whatever the path names); a FIFO stands in for the device here."""
    fifo = tmp_path / "events"
    os.mkfifo(fifo)
    got = []
    def read():
        time.sleep(0.3)  # a reader started beside kvc may open it a moment late
        got.append(open(fifo, "rb").read())

    reader = threading.Thread(target=read)
    reader.start()
    check_writable(fifo, "KV events")
    write_output(fifo, b'{"event": 1}\n', "KV events")
    reader.join(timeout=10)
    assert got == [b'{"event": 1}\n'] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_compiled_directorys_files_and_a_directory_are_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"prefill.xml": {}, "weights.bin": {}}}))
    (tmp_path / "prefill.xml").write_text("<net/>")
    for name in ("manifest.json", "prefill.xml", "weights.bin"):
        with pytest.raises(OutputError, match=f"it is a file of the compiled directory {tmp_path}, which it would "
                                              f"break; nothing was written"):
            write_output(tmp_path / name, b"x", "goldens")
    assert (tmp_path / "prefill.xml").read_text() == "<net/>"
    write_output(tmp_path / "goldens.json", b"{}", "goldens")  # a file of its own beside them is fine
    with pytest.raises(OutputError, match="it is a directory"):
        write_output(tmp_path, b"x", "report")


def test_events_are_never_written_over_the_requests_they_replay(tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text('{"prompt_ids": [1, 2, 3], "max_new_tokens": 2}\n')
    result = kvc("run", tmp_path, "--requests", requests, "--prefix-cache", "--events", requests, code=2)
    assert "is the --requests file: writing the events would replace it" in result.output
    assert requests.read_text().startswith('{"prompt_ids"')


def test_an_integer_past_pythons_digit_limit_is_a_json_error():
    with pytest.raises(json.JSONDecodeError, match="a value Python cannot hold"):
        jsontext.loads('{"format": 1' + "0" * 5000 + "}")


def test_a_fifo_is_never_read_as_json(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        jsontext.read_text(fifo)


def test_a_source_config_that_is_not_a_regular_file_is_refused(tmp_path):
    """A FIFO config.json hung `kvc compile` at loading; skipped as absent, it would drop the
    window probe and the EOS."""
    import shutil

    source = tmp_path / "src"
    shutil.copytree(fixtures.path("llama"), source)
    config = next(source.rglob("config.json"))
    config.unlink()
    os.mkfifo(config)
    result = kvc("compile", config.parent, "-o", tmp_path / "out", *SMALL, "--no-verify", code=3)
    assert f"{config}: is not a regular file" in result.output and "[bad-config]" in result.output


def test_a_blob_cache_record_that_is_a_fifo_is_stale_not_a_hang(tmp_path):
    cache = tmp_path / "cache"
    kvc("compile", fixtures.path("llama"), "-o", tmp_path / "a", *SMALL, "--cache-dir", cache)
    record = sorted(cache.glob("*.json"))[0]
    record.unlink()
    os.mkfifo(record)
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "b", *SMALL, "--cache-dir", cache)
    assert "is stale or damaged" in result.output


def test_a_blob_cache_that_cannot_be_made_is_said_and_the_compile_goes_on(tmp_path):
    """docs/blob-cache.md: a cache that cannot be written is said, and the compile goes on; one
    whose directory could not be made (read-only, or under a file) ended it with exit 7 blaming
    OUT."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "out", *SMALL, "--cache-dir", blocker / "cache")
    assert f"blob cache: cannot use {blocker / 'cache'}" in result.output and "goes on without it" in result.output
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_a_cached_blob_that_is_not_a_regular_file_of_its_size_is_stale(tmp_path):
    """A cached blob linked to /dev/zero was copied until the disk filled (3.35 GB in 8 s)."""
    cache = tmp_path / "cache"
    kvc("compile", fixtures.path("llama"), "-o", tmp_path / "a", *SMALL, "--cache-dir", cache)
    blob = sorted(cache.glob("*.blob"))[0]
    blob.unlink()
    blob.symlink_to("/dev/zero")
    result = kvc("compile", fixtures.path("llama"), "-o", tmp_path / "b", *SMALL, "--cache-dir", cache)
    assert "is stale or damaged" in result.output


def test_a_fifo_nobody_reads_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """kvc waited forever to open a FIFO for writing that no process read (as a shell
    redirect does); it is an OutputError naming the path once FIFO_WAIT_SECONDS pass."""
    from kvc.ir import writer

    monkeypatch.setattr(writer, "FIFO_WAIT_SECONDS", 0.2)
    fifo = tmp_path / "events"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match=f"cannot write the KV events {fifo}: no process opened it for reading "
                                          f"within 0.2 s"):
        write_output(fifo, b"{}\n", "KV events")


def test_checking_a_report_path_makes_no_directory(tmp_path):
    """`kvc compile -o NEW --report NEW/report.html` made NEW when it checked the page's path,
    then refused NEW as an existing OUT: the check makes nothing, the compile makes NEW, and the
    page is written into it."""
    new = tmp_path / "new"
    check_writable(new / "deeper" / "report.html", "report")
    assert not new.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OutputError, match="is not a directory"):
        check_writable(blocker / "deeper" / "report.html", "report")
    kvc("compile", fixtures.path("llama"), "-o", new, *SMALL, "--no-verify", "--report", new / "report.html")
    assert (new / "manifest.json").is_file() and "<html" in (new / "report.html").read_text()[:200].lower()
