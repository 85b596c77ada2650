"""A bounded, seeded mutation fuzzer over what kvc reads from strangers (issue 19, part 3).

Targets, each mutated from a known-good input and run through the kvc command that reads it:

    ir-xml      the llama fixture's openvino_model.xml: attribute values at the edges (ids,
                ports, offsets, sizes, dims), element types, op types and versions, rewired
                edges, deleted/duplicated/swapped lines, flipped bytes, truncation.
                `kvc inspect`, and `kvc compile --no-verify` on one execution in four.
    manifest    a compiled directory's manifest.json: JSON-aware (a value at a random path
                deleted, retyped, set to an edge value or a path out of the directory) or raw
                byte flips. `kvc run OUT --prompt-ids ...` (blobs on CPU).
    files       a byte of one of a compiled directory's files flipped, truncated or extended.
                `kvc run OUT --check`: sha256 against the manifest must refuse every change.
    requests    a workload for `kvc run OUT --requests FILE --prefix-cache --events EV` (a
                directory compiled with a chunked prefill): a JSON value of one line deleted,
                retyped or set to an edge value, lines deleted/duplicated/swapped, or raw byte
                flips. A refused workload must leave no events file behind.

Every execution is classified as the corpus does (corpus.py): **clean** (exit 0, or a
documented code 2-7 with a `kvc: error:` message and no traceback), **crash** (exit 1, a
traceback, a signal), **hang** (over the time bound), **partial** (a failed compile left
output beside OUT), **accepted-wrong** (a mutated manifest gave different tokens with exit 0;
a changed file passed `--check`). A finding is kept in FINDINGS/<target>-<n>/ with the mutated
input and the command, to become a corpus case.

Each execution is a fork of a server process that imported kvc and never ran OpenVINO (a
process that did has worker threads, and a fork of it can deadlock on their locks), which
makes an `inspect` cost ~0.05-0.4 s instead of a fresh interpreter's ~1.5 s.

    python tests/hostile/fuzz.py --budget 400 --seed 1        # bench-length run
    tests/hostile/test_fuzz.py                                 # CI: a fixed seed and budget
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "fixtures" / "llama" / "openvino"
SMALL = ["--max-prompt-len", "64", "--min-response-len", "64"]
PROMPT = ["--prompt-ids", "5,17,101,9", "--max-new-tokens", "3", "--json"]
TIMEOUT = 60.0
DOCUMENTED = {0, 2, 3, 4, 5, 6, 7}
TARGETS = ("ir-xml", "manifest", "files", "requests")
CHUNKED = [*SMALL, "--prefill-chunk-size", "16"]
REQUESTS = "\n".join(json.dumps(r) for r in [
    {"id": "sys", "prompt_ids": list(range(1, 35)), "max_new_tokens": 3,
     "retention": [{"start": 0, "end": 32, "priority": 100, "duration_ms": 1000}], "decode_priority": 10},
    {"id": "user", "prompt_ids": list(range(1, 33)) + [50, 51], "max_new_tokens": 2},
    {"id": "t1", "prompt_ids": [7, 8, 9], "max_new_tokens": 2, "session": "chat"},
    {"id": "t2", "prompt_ids": [7, 8, 9, 4, 5], "max_new_tokens": 2, "session": "chat"},
    {"finish_session": "chat"},
]) + "\n"
BAD = ("crash", "hang", "partial", "accepted-wrong")

EDGE_INTS = ["0", "-1", "1", "2147483647", "2147483648", "4294967296", "9223372036854775807",
             "9223372036854775808", "-9223372036854775808", "18446744073709551616", "1e308", "nan", "",
             "abc", "1,2", " 3", "0x10"]
ELEMENT_TYPES = ["f32", "f16", "bf16", "i8", "u8", "u4", "i4", "u1", "i64", "i32", "boolean", "string",
                 "dynamic", "undefined", "f8e4m3", "nf4", "zz"]
OP_TYPES = ["Parameter", "Const", "Result", "ReadValue", "Assign", "Concat", "Gather", "MatMul", "Add",
            "ScaledDotProductAttention", "Loop", "NoSuchOp", ""]
JSON_EDGES = [None, "", -1, 0, 1, 2 ** 31, 2 ** 63, -2 ** 63, 1e308, float("nan"), True, [], {}, [1, 2],
              "../../../etc/passwd", "/etc/passwd", "x" * 300, {"a": 1}]


@dataclass
class Execution:
    target: str
    index: int
    mutations: list[str]
    argv: list[str]
    code: int | None = None
    seconds: float = 0.0
    verdict: str = "clean"
    detail: str = ""


@dataclass
class FuzzReport:
    seed: int
    budget: int
    executions: list[Execution] = field(default_factory=list)
    seconds: float = 0.0

    def counts(self) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for e in self.executions:
            out.setdefault(e.target, Counter())[e.verdict] += 1
        return out

    def findings(self) -> list[Execution]:
        return [e for e in self.executions if e.verdict in BAD]


# --------------------------------------------------------------------------------------------
# Mutators: each takes (rng, data) and returns (new data, a description).


def _replacer(pattern: str, choices, label: str):
    """A mutator that replaces the last group of one random match of `pattern` by a choice
    (`choices` may be a function of the text, for values taken from it)."""
    regex = re.compile(pattern)

    def mutate(rng, text):
        m = rng.choice(list(regex.finditer(text)))
        new = rng.choice(choices(text) if callable(choices) else choices)
        g = m.lastindex
        return text[:m.start(g)] + new + text[m.end(g):], f"{label} {m.group(0)[:40]!r}: {m.group(g)!r}->{new!r}"
    return mutate


IR_TEXT_MUTATORS = (
    _replacer(r'\b([\w-]+)="(-?\d+(?:,\s*-?\d+)*)"', EDGE_INTS, "number"),  # ids, ports, offsets, sizes
    _replacer(r'\b([\w-]+)="(-?\d+(?:,\s*-?\d+)*)"', EDGE_INTS, "number"),  # (twice as likely)
    _replacer(r"<dim>([^<]*)</dim>", EDGE_INTS + ["?", "-1", "1..", "..3", "5..2"], "dim"),
    _replacer(r'(element_type|precision)="(\w*)"', ELEMENT_TYPES, "element type"),
    _replacer(r'<layer [^>]*type="(\w*)"', OP_TYPES, "op type"),
    _replacer(r'version="(\w*)"', ["opset1", "opset13", "opset99", "internal", "", "ie"], "version"),
    _replacer(r'(from-layer|to-layer)="(\d+)"', lambda text: re.findall(r'<layer id="(\d+)"', text), "edge"),
)


def _lines(rng, text):
    lines = text.split("\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    op = rng.choice(["delete", "duplicate", "swap"])
    if op == "delete":
        del lines[i]
    elif op == "duplicate":
        lines.insert(j, lines[i])
    else:
        lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines), f"{op} line {i}" + ("" if op == "delete" else f" / {j}")


def _bytes(rng, data: bytes):
    data = bytearray(data)
    op = rng.choice(["flip", "flip", "truncate", "extend", "zero-run"])
    if op == "flip":
        spots = [rng.randrange(len(data)) for _ in range(rng.randint(1, 4))]
        for s in spots:
            data[s] ^= 1 << rng.randrange(8)
        return bytes(data), f"flip bytes {spots}"
    if op == "truncate":
        n = rng.randrange(len(data))
        return bytes(data[:n]), f"truncate to {n} of {len(data)}"
    if op == "extend":
        extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return bytes(data) + extra, f"append {len(extra)} bytes"
    s, n = rng.randrange(len(data)), rng.randint(1, 256)
    data[s:s + n] = bytes(len(data[s:s + n]))
    return bytes(data), f"zero {n} bytes at {s}"


IR_TEXT_MUTATORS += (_lines,)


def mutate_ir(rng: random.Random, text: str) -> tuple[bytes, list[str]]:
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if rng.random() < 0.12:
            data, what = _bytes(rng, text.encode())
            return data, done + [what]
        text, what = rng.choice(IR_TEXT_MUTATORS)(rng, text)
        done.append(what)
    return text.encode(), done


def _json_paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _json_paths(v, path + (i,))


def mutate_manifest(rng: random.Random, text: str) -> tuple[bytes, list[str]]:
    if rng.random() < 0.15:
        data, what = _bytes(rng, text.encode())
        return data, [what]
    doc = json.loads(text)
    done = _mutate_json(rng, doc)
    return json.dumps(doc, indent=1).encode(), done


def mutate_requests(rng: random.Random, text: str) -> tuple[bytes, list[str]]:
    """One line's JSON mutated (most often), lines moved, or raw bytes."""
    roll = rng.random()
    if roll < 0.15:
        data, what = _bytes(rng, text.encode())
        return data, [what]
    if roll < 0.3:
        text, what = _lines(rng, text)
        return text.encode(), [what]
    lines = text.rstrip("\n").split("\n")
    i = rng.randrange(len(lines))
    doc = json.loads(lines[i])
    done = [f"line {i + 1}: {d}" for d in _mutate_json(rng, doc)]
    lines[i] = json.dumps(doc)
    return ("\n".join(lines) + "\n").encode(), done


def _mutate_json(rng: random.Random, doc) -> list[str]:
    """One or two values of `doc` (in place) deleted, set to an edge value or tweaked."""
    done = []
    for _ in range(rng.choice([1, 1, 2])):
        paths = [p for p in _json_paths(doc) if p]
        if not paths:
            break
        path = rng.choice(paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        old = parent[key]
        op = rng.choice(["delete", "edge", "edge", "tweak"])
        if op == "delete" and isinstance(parent, dict):
            del parent[key]
            done.append(f"delete {'/'.join(map(str, path))}")
            continue
        if op == "tweak" and isinstance(old, (int, float)) and not isinstance(old, bool):
            new = old + rng.choice([-1, 1, 2 ** 20])
        elif op == "tweak" and isinstance(old, str):
            new = old[:-1] + chr((ord(old[-1]) + 1) % 128) if old else "x"
        else:
            new = rng.choice(JSON_EDGES)
        parent[key] = new
        done.append(f"{'/'.join(map(str, path))}: {str(old)[:40]!r} -> {str(new)[:40]!r}")
    return done


# --------------------------------------------------------------------------------------------
# Running one execution in a fork


def _prepare_cli():
    """Import what the commands import, once, before forking (no OpenVINO Core is created)."""
    from kvc.cli.main import cli  # noqa: F401  (registers every command)
    import kvc.export.compile  # noqa: F401
    import kvc.export.load  # noqa: F401
    import kvc.verify.compiled  # noqa: F401
    import kvc.cli.render  # noqa: F401
    return cli


def run_forked(argv: list[str], cwd: Path, timeout: float = TIMEOUT) -> tuple[int | None, str, float]:
    """Run `kvc ARGV` in a child of this process; (exit code or None on timeout, output, s).
    A child killed by a signal returns the negative signal number."""
    cli = _prepare_cli()
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(r)
            os.chdir(cwd)
            os.setsid()
            os.environ["TMPDIR"] = str(cwd / "tmp")
            tempfile.tempdir = None
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(w, 1)
            os.dup2(w, 2)
            # Under pytest sys.stdout/err are capture objects, not fds 1 and 2: write to the pipe.
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            cli.main(argv, prog_name="kvc", standalone_mode=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001  (click's own last line of defence failed)
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(w)
    out, deadline, code = bytearray(), t0 + timeout, None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None, out.decode(errors="replace"), time.monotonic() - t0
            ready, _, _ = select.select([r], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                out += chunk
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
    finally:
        os.close(r)
    return code, out.decode(errors="replace"), time.monotonic() - t0


class ForkServer:
    """`python fuzz.py --serve` in a fresh process: one JSON request per line (argv, cwd,
    timeout), answered by `run_forked` in that process. `plant` makes the server break kvc
    first ("crash": opening a compiled directory raises; "no-check": file hashes are not
    checked), so the tests can show the verdicts catch what they must."""

    def __init__(self, plant: str | None = None):
        import subprocess
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--serve"] + (["--plant", plant] if plant else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, argv: list[str], cwd: Path, timeout: float = TIMEOUT) -> tuple[int | None, str, float]:
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fuzz server died (exit {self.proc.wait()})")
        answer = json.loads(line)
        return answer["code"], answer["output"], answer["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def serve(plant: str | None = None) -> None:
    """The server loop (see ForkServer)."""
    _prepare_cli()
    if plant == "crash":
        import kvc.export.load as load
        import kvc.export.manifest as manifest

        def boom(*args, **kwargs):
            raise ZeroDivisionError("planted")
        load.read_manifest = manifest.read_manifest = boom  # `kvc run` reads it first for its default backend
    elif plant == "no-check":
        import kvc.export.load as load
        import kvc.export.manifest as manifest
        load.check_files = manifest.check_files = lambda *args, **kwargs: None  # (`kvc run` checks before it opens)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the answer stream
    for line in sys.stdin:
        request = json.loads(line)
        code, output, seconds = run_forked(request["argv"], Path(request["cwd"]), request["timeout"])
        out.write(json.dumps({"code": code, "output": output, "seconds": seconds}) + "\n")
        out.flush()


def classify(e: Execution, code: int | None, output: str, leftovers: list[str]) -> None:
    e.code = code
    err = re.search(r"^(kvc: internal error:.*|kvc: error:.*|\w*Error:.*)$", output, re.M)
    last = (err.group(0) if err else next((ln for ln in reversed(output.strip().splitlines()) if ln.strip()), ""))[:300]
    if code is None:
        e.verdict, e.detail = "hang", f"killed after {TIMEOUT:.0f} s"
    elif code < 0 or code == 1 or "Traceback" in output or code not in DOCUMENTED:
        e.verdict, e.detail = "crash", last or f"exit {code}"
    elif code != 0 and "kvc: error:" not in output and "Error:" not in output:
        e.verdict, e.detail = "crash", f"exit {code} without a message: {last}"
    elif code != 0 and leftovers:
        e.verdict, e.detail = "partial", "left behind: " + ", ".join(leftovers)
    else:
        e.detail = last


# --------------------------------------------------------------------------------------------
# The fuzz loop


def good_directory(work: Path, server: ForkServer | None = None) -> tuple[Path, list[int]]:
    """A compiled llama directory and the tokens `kvc run` gives on it (the unmutated answer)."""
    work.mkdir(parents=True, exist_ok=True)
    own = server is None
    server = server or ForkServer()
    try:
        good = work / "good"
        if not (good / "manifest.json").is_file():
            code, out, _ = server.run(["compile", str(FIXTURE), "-o", str(good), *SMALL], work, timeout=300)
            if code != 0:
                raise RuntimeError(f"compiling the good directory failed: {out[-2000:]}")
        code, out, _ = server.run(["run", str(good), *PROMPT], work)
    finally:
        if own:
            server.close()
    if code != 0:
        raise RuntimeError(f"kvc run on the good directory failed: {out[-2000:]}")
    return good, _tokens(out)


def chunked_directory(work: Path, server: ForkServer) -> Path:
    """A compiled llama directory with a chunked prefill (the prefix cache needs one)."""
    out = work / "good-chunked"
    if not (out / "manifest.json").is_file():
        code, log, _ = server.run(["compile", str(FIXTURE), "-o", str(out), *CHUNKED], work, timeout=300)
        if code != 0:
            raise RuntimeError(f"compiling the chunked directory failed: {log[-2000:]}")
    return out


def _tokens(output: str) -> list[int] | None:
    m = re.search(r"^\{.*\}\s*$", output, re.M | re.S)
    try:
        return json.loads(m.group(0))["tokens"] if m else None
    except (ValueError, KeyError, TypeError):
        return None


def _leftovers(out: Path) -> list[str]:
    found = [f"{out.name} exists"] if out.exists() else []
    found += [p.name for p in out.parent.glob(f".{out.name}.*")]
    tmp = out.parent / "tmp"
    found += [f"$TMPDIR/{p.name}" for p in tmp.iterdir()] if tmp.exists() else []
    return found


def _fresh(work: Path, name: str) -> Path:
    d = work / "exec" / name
    shutil.rmtree(d, ignore_errors=True)
    (d / "tmp").mkdir(parents=True)
    return d


def fuzz(budget: int, seed: int, work: Path, targets=TARGETS, findings: Path | None = None,
         echo=None, good: tuple[Path, list[int]] | None = None, plant: str | None = None) -> FuzzReport:
    """`budget` executions spread over `targets`, from `seed`; the same seed runs the same
    inputs. `good`: the compiled directory and its tokens (`good_directory`), if made already.
    `plant`: break kvc on purpose in the server (ForkServer), to test the verdicts."""
    server = ForkServer(plant)
    try:
        return _fuzz(budget, seed, work, targets, findings, echo, good or good_directory(work), server)
    finally:
        server.close()


def _fuzz(budget, seed, work, targets, findings, echo, good, server) -> FuzzReport:
    t0 = time.monotonic()
    rng = random.Random(seed)
    good, good_tokens = good
    xml = (FIXTURE / "openvino_model.xml").read_text()
    manifest = (good / "manifest.json").read_text()
    files = sorted(p.name for p in good.iterdir() if p.is_file() and p.name != "manifest.json")
    chunked = chunked_directory(work, server) if "requests" in targets else None
    report = FuzzReport(seed, budget)
    for i in range(budget):
        target = targets[i % len(targets)]
        d = _fresh(work, f"{i:05d}")
        if target == "ir-xml":
            data, what = mutate_ir(rng, xml)
            model = d / "model"
            model.mkdir()
            (model / "openvino_model.xml").write_bytes(data)
            os.link(FIXTURE / "openvino_model.bin", model / "openvino_model.bin")
            out = d / "out"
            argv = (["compile", str(model), "-o", str(out), *SMALL, "--no-verify"] if i % 4 == 3
                    else ["inspect", str(model)])
        elif target == "manifest":
            data, what = mutate_manifest(rng, manifest)
            out = d / "compiled"
            shutil.copytree(good, out)
            (out / "manifest.json").write_bytes(data)
            argv = ["run", str(out), *PROMPT]
        elif target == "requests":
            data, what = mutate_requests(rng, REQUESTS)
            (d / "requests.jsonl").write_bytes(data)
            out = d / "events.jsonl"
            argv = ["run", str(chunked), "--requests", str(d / "requests.jsonl"), "--prefix-cache", "--events",
                    str(out), "--json"]
        else:
            out = d / "compiled"
            shutil.copytree(good, out)
            name = rng.choice(files)
            data, what = _bytes(rng, (out / name).read_bytes())
            what = [f"{name}: {what}"]
            changed = data != (out / name).read_bytes()
            (out / name).write_bytes(data)
            argv = ["run", str(out), "--check", *PROMPT]
        e = Execution(target, i, what, argv)
        code, output, e.seconds = server.run(argv, d)
        leaves = argv[0] == "compile" or target == "requests"
        classify(e, code, output, _leftovers(out) if leaves and code not in (0, None) else [])
        if e.verdict == "clean" and code == 0:
            if target == "manifest" and _tokens(output) != good_tokens:
                e.verdict, e.detail = "accepted-wrong", f"tokens {_tokens(output)} != {good_tokens}"
            elif target == "files" and changed:
                e.verdict, e.detail = "accepted-wrong", "a changed file passed --check"
        report.executions.append(e)
        if findings is not None and e.verdict in BAD:
            keep = findings / f"{target}-{i:05d}"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(d, keep, ignore=shutil.ignore_patterns("*.bin", "*.blob"))
            (keep / "finding.json").write_text(json.dumps(e.__dict__, indent=1))
        if echo:
            echo(e)
        shutil.rmtree(d, ignore_errors=True)
    report.seconds = time.monotonic() - t0
    return report


def report_lines(r: FuzzReport) -> list[str]:
    """The fuzz section of docs/reliability.md."""
    counts = r.counts()
    lines = ["## Fuzzing", "",
             f"`tests/hostile/fuzz.py`: {r.budget} executions from seed {r.seed} ({r.seconds:.0f} s); "
             "mutations of the llama IR's XML (`inspect`, `compile --no-verify`), of a compiled "
             "directory's manifest (`run`), of its files (`run --check`) and of a workload "
             "(`run --requests --prefix-cache --events`).", "",
             "| target | executions | clean | " + " | ".join(BAD) + " |",
             "|---|---:|---:|" + "---:|" * len(BAD)]
    for t, c in counts.items():
        lines.append(f"| {t} | {sum(c.values())} | {c['clean']} | " + " | ".join(str(c[b]) for b in BAD) + " |")
    codes = Counter(e.code for e in r.executions)
    lines += ["", "Exit codes: " + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items(), key=lambda kv: str(kv[0]))),
              ""]
    found = r.findings()
    lines += [f"Findings: {len(found)}" + ("" if found else " (each would be kept, and made a corpus case).")]
    lines += [f"- {e.target} #{e.index} {e.verdict}: {'; '.join(e.mutations)} -> {e.detail}" for e in found]
    lines.append("")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=300, help="executions (default 300)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--target", action="append", choices=TARGETS, help="only these targets (repeatable)")
    ap.add_argument("--findings", type=Path, default=Path("fuzz-findings"), help="where findings are kept")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every execution")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # ForkServer
    ap.add_argument("--plant", choices=["crash", "no-check"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.plant)
        return 0
    work = Path(tempfile.mkdtemp(prefix="kvc-fuzz-"))
    try:
        def echo(e):
            if args.verbose or e.verdict in BAD:
                print(f"{e.verdict:14} {e.target:8} #{e.index:<5} exit {e.code} {e.seconds:5.2f}s "
                      f"{'; '.join(e.mutations)[:100]} -> {e.detail[:140]}", flush=True)

        r = fuzz(args.budget, args.seed, work, tuple(args.target or TARGETS), args.findings, echo)
        print("\n".join(report_lines(r)))
        return 1 if r.findings() else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
