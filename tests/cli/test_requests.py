"""`kvc run OUT --requests FILE.jsonl`: a workload replayed with a prefix cache, chat sessions
and the KV event stream; bad workloads are refused by line, before anything runs."""

from __future__ import annotations

import json

import pytest

from kvc.cache.requests import parse_requests
from kvc.errors import UsageError
from tests.cli.runner import kvc

SYSTEM = list(range(1, 33))  # two blocks of the chunk (16)


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    out = tmp_path_factory.mktemp("requests") / "out"
    kvc("compile", "--max-prompt-len", "64", "--min-response-len", "64", "--prefill-chunk-size", "16",
        "-o", out)
    return out


def workload(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_replay_reports_requests_cache_and_events(chunked, tmp_path):
    lines = [
        "# a shared system prompt, a one-off turn, a chat",
        {"id": "a", "prompt_ids": SYSTEM + [40, 41], "max_new_tokens": 3,
         "retention": [{"start": 0, "end": 32, "priority": 100, "duration_ms": 60000}]},
        {"id": "b", "prompt_ids": SYSTEM + [50, 51, 52], "max_new_tokens": 3, "decode_priority": 0},
        {"id": "c1", "prompt_ids": [7, 7, 7, 7, 7], "max_new_tokens": 3, "session": "s"},
        {"id": "c2", "prompt_ids": [7, 7, 7, 7, 7, 1, 2, 3], "max_new_tokens": 3, "session": "s"},
        {"finish_session": "s"},
    ]
    events = tmp_path / "events.jsonl"
    result = kvc("run", chunked, "--requests", workload(tmp_path / "w.jsonl", lines), "--prefix-cache",
                 "--events", events, "--json")
    data = json.loads(result.output)
    requests = {r["id"]: r for r in data["requests"]}
    assert [requests[i]["cached_tokens"] for i in ("a", "b", "c1", "c2")] == [0, 32, 0, 5]
    assert requests["b"]["line"] == 3 and all(len(r["tokens"]) == 3 for r in requests.values())
    plain = json.loads(kvc("run", chunked, "--prompt-ids", ",".join(map(str, SYSTEM + [50, 51, 52])),
                           "--max-new-tokens", "3", "--json").output)
    assert requests["b"]["tokens"] == plain["tokens"]
    cache = data["cache"]
    assert cache["hit_tokens"] == 32 and cache["prompt_tokens"] == 34 + 35 + 5 + 8
    stored = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event_id"] for e in stored] == list(range(len(stored)))
    keys = {b["block_hash"] for e in stored if e["type"] == "stored" for b in e["blocks"]}
    keys -= {k for e in stored if e["type"] == "removed" for k in e["block_hashes"]}
    assert keys == set(cache["blocks"])
    assert stored[0]["blocks"][0]["priority"] == 100 and stored[0]["blocks"][0]["tokens"] == SYSTEM[:16]
    table = kvc("run", chunked, "--requests", tmp_path / "w.jsonl", "--prefix-cache").output
    assert "prefix cache: " in table and "hit rate 39.0% (32 of 82 prompt tokens)" in table
    assert table.splitlines()[0].split() == ["id", "session", "prompt", "cached", "new", "TTFT", "ms", "TPOT", "ms"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "w.jsonl:2: not JSON"),
    ('{"prompt_ids": [1, 2], "retention": [{"start": 0, "end": 5, "priority": 10}]}',
     r"w.jsonl:2: token range \[0, 5\) is outside the 2-token prompt"),
    ('{"prompt_ids": [1, 2], "decode_priority": 101}', "w.jsonl:2: 'decode_priority' must be an integer from 0 to 100"),
    ('{"prompt_ids": [1, 2], "retention": [{"priority": -3}]}', r"w.jsonl:2: retention\[0\].priority must be"),
    ('{"prompt_ids": [1], "colour": 1}', "w.jsonl:2: unknown field 'colour'"),
    ('{"prompt_ids": [1], "prompt": "x"}', "w.jsonl:2: give exactly one of 'prompt_ids' and 'prompt'"),
    ('{"id": "a", "prompt_ids": [1]}', "w.jsonl:2: request id 'a' is already the id of the request on line 1"),
    ('[1, 2]', "w.jsonl:2: expected a JSON object"),
    # the last of two silently won
    ('{"prompt_ids": [1], "prompt_ids": [1, 2, 3]}', "w.jsonl:2: not JSON: field 'prompt_ids' is given twice"),
    # a lone surrogate ran every request, then failed printing the table (exit 1)
    ('{"id": "\\ud800", "prompt_ids": [1]}', "w.jsonl:2: 'id' must be text UTF-8 can hold"),
    ('{"session": "\\udfff", "prompt_ids": [1]}', "w.jsonl:2: 'session' must be text UTF-8 can hold"),
    # a decode duration beside ranges was dropped unused (without ranges it was refused)
    ('{"prompt_ids": [1, 2], "retention": [{"start": 0, "priority": 50}], "decode_duration_ms": 1000}',
     "w.jsonl:2: 'decode_duration_ms' needs a 'decode_priority'"),
    ('{"prompt_ids": [1, 2], "decode_duration_ms": 1000}', "w.jsonl:2: 'decode_duration_ms' needs a 'decode_priority'"),
    # printed "token range [50, None)"
    ('{"prompt_ids": [1, 2], "retention": [{"start": 50, "priority": 10}]}',
     "w.jsonl:2: token range from 50 to the prompt's end is outside the 2-token prompt"),
])
def test_bad_workload_lines_are_named_and_nothing_runs(chunked, tmp_path, line, message):
    path = workload(tmp_path / "w.jsonl", [{"id": "a", "prompt_ids": [1, 2, 3]}, line])
    result = kvc("run", chunked, "--requests", path, "--json", code=2)
    assert "TTFT" not in result.output and '"requests"' not in result.output
    with pytest.raises(UsageError, match=message):
        parse_requests(path.read_text(), "w.jsonl")


def test_a_line_is_what_json_lines_says_and_an_id_is_never_taken_twice(chunked, tmp_path):
    """Only \\n ends a line: a string holding U+2028 or U+0085 (which json.dumps writes with
    ensure_ascii=False) was cut in two by str.splitlines. A request without an id takes its line
    number, which an earlier request's explicit id may hold: the error says so (it said the
    user had used the id twice). A byte that is not UTF-8 is named with its line."""
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"id": "a\u2028b\u0085c", "prompt_ids": [1, 2, 3]}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    data = json.loads(kvc("run", chunked, "--requests", path, "--json").output)
    assert [r["id"] for r in data["requests"]] == ["a\u2028b\u0085c"]
    with pytest.raises(UsageError, match="w.jsonl:2: the request has no id, and its default, its line number '2', "
                                         "is already the id of the request on line 1: give it one"):
        parse_requests('{"id": "2", "prompt_ids": [1]}\n{"prompt_ids": [1]}', "w.jsonl")
    path.write_bytes(b'{"prompt_ids": [1]}\n{"prompt": "ab\xffc"}\n')
    assert f"{path}:2: not UTF-8: byte 0xff at column 15" in kvc("run", chunked, "--requests", path, code=2).output


def test_an_events_path_that_cannot_be_written_is_refused_before_the_requests_run(chunked, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = workload(tmp_path / "w.jsonl", [{"prompt_ids": [1, 2, 3]}])
    out = kvc("run", chunked, "--requests", path, "--prefix-cache", "--events", blocker / "e.jsonl", code=7).output
    assert f"cannot write the KV events {blocker / 'e.jsonl'}" in out and "TTFT" not in out


def test_runtime_errors_name_the_request_and_line(chunked, tmp_path):
    unknown = workload(tmp_path / "u.jsonl", [{"prompt_ids": [1, 2]}, {"finish_session": "nope"}])
    assert "u.jsonl:2: finish_session: no chat session 'nope' is open" in kvc("run", chunked, "--requests", unknown,
                                                                             code=2).output
    long = workload(tmp_path / "l.jsonl", [{"id": "big", "prompt_ids": list(range(1, 80)), "session": "s"}])
    out = kvc("run", chunked, "--requests", long, code=2).output
    assert "l.jsonl:1: request 'big': chat session 's': the history of 79 tokens no longer fits" in out


@pytest.mark.parametrize("bad, message", [
    ({"id": "v", "prompt_ids": [1, 2, 100000]}, "w.jsonl:5: request 'v': token id 100000 at position 2"),
    ({"id": "p", "prompt_ids": list(range(1, 70))}, "w.jsonl:5: request 'p': prompt of 69 tokens does not fit"),
    ({"id": "t", "prompt_ids": [7, 7, 7, 7, 7, 1], "session": "s"}, "w.jsonl:5: request 't': .*exceed the KV capacity"),
    ({"finish_session": "s"}, "w.jsonl:5: finish_session: no chat session 's' is open"),
])
def test_errors_only_the_model_finds_are_found_before_any_request_runs(chunked, tmp_path, bad, message):
    """A workload that failed at its fifth request had run four: their tokens, the cache's
    blocks and the KV events were lost (no table, no events file), and a long replay's time
    with them. Every request is now checked as it will run before any runs; a session closed
    and opened again by a later turn is no error."""
    from kvc.cache.prefix import PrefixCache
    from kvc.cache.requests import read_requests
    from kvc.cache.serving import CachedPipeline, replay
    from kvc.export.load import open_compiled

    if "capacity" in message:
        bad = {**bad, "max_new_tokens": 200}
    path = workload(tmp_path / "w.jsonl", [
        {"id": "a", "prompt_ids": SYSTEM, "max_new_tokens": 2},
        {"id": "s1", "prompt_ids": [7, 7, 7, 7, 7], "max_new_tokens": 2, "session": "s"},
        {"finish_session": "s"},
        # opens "s" again, but for the case where finishing it is the fault
        {"id": "b", "prompt_ids": [7, 7], "max_new_tokens": 2, **({} if "finish" in message else {"session": "s"})},
        bad])
    served = CachedPipeline(open_compiled(chunked, "numpy"), PrefixCache(16, 8))
    ran = []
    with pytest.raises(UsageError, match=message):
        replay(served, read_requests(path), source="w.jsonl", on_result=ran.append)
    assert ran == [] and served.cache.stats.prompt_tokens == 0 and not served.sessions
    assert "TTFT" not in kvc("run", chunked, "--requests", path, "--prefix-cache", code=2).output
    good = workload(tmp_path / "g.jsonl", path.read_text().splitlines()[:-1])  # without the bad line it runs
    assert len(json.loads(kvc("run", chunked, "--requests", good, "--json").output)["requests"]) == 3


def test_prefix_cache_needs_a_chunked_prefill_and_the_options_need_requests(tmp_path):
    out = tmp_path / "whole"
    kvc("compile", "--max-prompt-len", "64", "--min-response-len", "64", "--prefill-chunk-size", "0", "-o", out)
    path = workload(tmp_path / "w.jsonl", [{"prompt_ids": [1, 2, 3]}])
    assert "needs a chunked prefill" in kvc("run", out, "--requests", path, "--prefix-cache", code=2).output
    assert "--prefix-cache, --chunk-reuse and --events go with --requests" in kvc("run", out, "--prompt-ids", "1", "--prefix-cache",
                                                                   code=2).output
    assert "leave out --prompt-ids" in kvc("run", out, "--requests", path, "--prompt-ids", "1", code=2).output
    # sessions work without the prefix cache (each turn prefills all of it on an unchunked prefill)
    chat = workload(tmp_path / "c.jsonl", [{"prompt_ids": [1, 2, 3], "session": "s"},
                                           {"prompt_ids": [1, 2, 3, 4], "session": "s"}])
    data = json.loads(kvc("run", out, "--requests", chat, "--json").output)
    assert [r["cached_tokens"] for r in data["requests"]] == [0, 0] and data["cache"] is None


def test_a_byte_order_mark_at_the_start_of_the_file_is_skipped(chunked, tmp_path):
    """Windows editors save UTF-8 with a byte order mark: the file was refused with Python's
    "not JSON: Unexpected UTF-8 BOM (decode using utf-8-sig)". At the start it is skipped; on a
    later line (files joined together) it is an error that says what it is."""
    lines = [{"id": "a", "prompt_ids": [1, 2, 3], "max_new_tokens": 2}, {"id": "b", "prompt_ids": [4, 5], "max_new_tokens": 2}]
    plain = workload(tmp_path / "plain.jsonl", lines)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    expected = json.loads(kvc("run", chunked, "--requests", plain, "--json").output)["requests"]
    got = json.loads(kvc("run", chunked, "--requests", bom, "--json").output)["requests"]
    assert [(r["id"], r["tokens"]) for r in got] == [(r["id"], r["tokens"]) for r in expected]
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(bom.read_bytes() * 2)
    out = kvc("run", chunked, "--requests", joined, code=2).output
    assert f"{joined}:3: the line starts with a byte order mark (U+FEFF)" in out and "utf-8-sig" not in out
