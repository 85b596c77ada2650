"""Device compiles in forked processes: blobs that depend only on the model and its
configuration, and failures that reach the user as the errors kvc raises in-process."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvc import fixtures
from kvc.errors import DeviceError, InvalidModelError, VerificationError
from kvc.export import device_compile
from kvc.export.compile import CompileOptions, compile_to, device_config
from kvc.export.device_compile import DeviceCompiler
from kvc.plan import StaticOptions

SMALL = StaticOptions(max_prompt_len=64, min_response_len=32, variants=(80,))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("dc") / "llama"
    compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, verify=False))
    return out


def test_a_blob_does_not_depend_on_what_ran_before(compiled, tmp_path, monkeypatch):
    """The same model compiled after other compiles, in a new server, and in kvc's own process
    (KVC_DEVICE_COMPILE=in-process, after this test process compiled many models): the forked
    compiles agree byte for byte with the published blob, the in-process one does not."""
    config = device_config("CPU", for_export=True, precision="auto")
    with DeviceCompiler() as compiler:
        compiler.compile("generate-80", compiled / "generate-80.xml", compiled / "weights.bin", "CPU", config,
                         tmp_path / "first.blob")
        compiler.compile("prefill", compiled / "prefill.xml", compiled / "weights.bin", "CPU", config,
                         tmp_path / "after.blob")
    published = (compiled / "prefill.CPU.blob").read_bytes()
    assert (tmp_path / "after.blob").read_bytes() == published
    monkeypatch.setenv("KVC_DEVICE_COMPILE", "in-process")
    with DeviceCompiler() as compiler:
        compiler.compile("prefill", compiled / "prefill.xml", compiled / "weights.bin", "CPU", config,
                         tmp_path / "here.blob")
        compiler.compile("prefill", compiled / "prefill.xml", compiled / "weights.bin", "CPU", config,
                         tmp_path / "here2.blob")
    assert (tmp_path / "here2.blob").read_bytes() != published


def test_errors_in_the_compiling_process_are_raised_as_they_are(compiled, tmp_path):
    config = device_config("CPU", for_export=True, precision="auto")
    with DeviceCompiler() as compiler:
        with pytest.raises(InvalidModelError, match=r"no such file or directory \[missing-file\]"):
            compiler.compile("prefill", compiled / "missing.xml", compiled / "weights.bin", "CPU", config,
                             tmp_path / "a.blob")
        with pytest.raises(DeviceError, match="compiling prefill for CPU failed: Wrong value fp7"):
            compiler.compile("prefill", compiled / "prefill.xml", compiled / "weights.bin", "CPU",
                             {**config, "INFERENCE_PRECISION_HINT": "fp7"}, tmp_path / "a.blob")
        (tmp_path / "a-file").write_text("")
        with pytest.raises(OSError) as info:  # compile_to turns a full disk's OSError into exit 7
            compiler.compile("prefill", compiled / "prefill.xml", compiled / "weights.bin", "CPU", config,
                             tmp_path / "a-file" / "a.blob")
        assert info.value.errno == errno.EEXIST  # mkdir of the blob's directory: the errno came back
        # The server goes on after each failure.
        assert compiler.compile("prefill", compiled / "prefill.xml", compiled / "weights.bin", "CPU", config,
                                tmp_path / "ok.blob")["bytes"] == (tmp_path / "ok.blob").stat().st_size


@pytest.mark.parametrize("verify", [False, True], ids=["no-verify", "beside-verification"])
def test_a_compiling_process_that_dies_is_a_device_error_and_publishes_nothing(tmp_path, monkeypatch, verify):
    """A crash inside the plugin kills the forked child, not kvc: compile says which model and
    how it died (exit 5) and publishes nothing; also when the compile ran on a thread beside
    the IR's verification, which passed."""
    monkeypatch.setattr(device_compile, "_SERVER",
                        "import os, signal, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
                        "import kvc.export.device_compile as d; "
                        "d._compile_one = lambda request: os.kill(os.getpid(), signal.SIGSEGV); d._serve()")
    out = tmp_path / "out"
    with pytest.raises(DeviceError, match=r"compiling prefill for CPU failed: the compiling process died \(signal 11\)"):
        compile_to(fixtures.path("llama"), out, CompileOptions(SMALL, verify=verify))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_failed_verification_stops_the_compile_running_beside_it(tmp_path, monkeypatch):
    """The CPU's device compile runs while kvc's process verifies the IR: a verification that
    fails while a child compiles (one that would take a minute) kills the server and the child
    and raises the verification's error at once, publishing nothing."""
    import os
    import time

    import kvc.verify.compiled as checks

    marker = tmp_path / "child.pid"
    monkeypatch.setattr(device_compile, "_SERVER",
                        "import os, sys, time; sys.path[:1] = []; import kvc.export.device_compile as d; "
                        f"d._compile_one = lambda request: (open({str(marker)!r}, 'w').write(str(os.getpid())), "
                        "time.sleep(60)); d._serve()")
    seen = []

    def broken(*args, **kwargs):  # the verification fails once the compile is under way
        for _ in range(600):
            if marker.exists() and marker.read_text():
                break
            time.sleep(0.05)
        seen.append(marker.exists())
        return {"against": "test", "ok": False, "results": [{"ok": False, "prompt_tokens": 7, "reason": "forced"}]}

    monkeypatch.setattr(checks, "verify_static", broken)
    out = tmp_path / "out"
    with pytest.raises(VerificationError, match="prompt of 7 tokens: forced; nothing was written"):
        compile_to(fixtures.path("llama"), out, CompileOptions(SMALL))
    assert seen == [True], "the device compile was under way while the IR was verified"
    child = int(marker.read_text())
    for _ in range(100):
        alive = os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().split()[2] != "Z"
        if not alive:
            break
        time.sleep(0.05)
    assert not alive, "the compiling child was stopped"
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["child.pid"]


def test_a_failed_compile_does_not_wait_for_a_stuck_device_compile_thread(tmp_path, monkeypatch):
    """A thread awaiting the device compile that cannot end (as one blocked on the import
    lock a Ctrl-C left held) is waited for ABANDON_SECONDS once the verification has failed,
    then left behind: the verification's error is raised and nothing is published."""
    import threading
    import time

    import kvc.export.compile as compile_module
    import kvc.verify.compiled as checks

    never = threading.Event()
    monkeypatch.setattr(DeviceCompiler, "compile", lambda self, *args, **kwargs: never.wait(30))
    monkeypatch.setattr(compile_module, "ABANDON_SECONDS", 0.5)
    monkeypatch.setattr(checks, "verify_static", lambda *args, **kwargs: {
        "against": "test", "ok": False, "results": [{"ok": False, "prompt_tokens": 7, "reason": "forced"}]})
    out = tmp_path / "out"
    started = time.monotonic()
    try:
        with pytest.raises(VerificationError, match="prompt of 7 tokens: forced"):
            compile_to(fixtures.path("llama"), out, CompileOptions(SMALL))
        assert time.monotonic() - started < 20, "waited for the stuck thread"
        stuck = [t for t in threading.enumerate() if t.name == "kvc-device-compile"]
        assert stuck and all(t.daemon for t in stuck), "left behind, it must not hold the process at exit"
        assert not out.exists()
    finally:
        never.set()


def test_the_device_compile_thread_imports_nothing(tmp_path):
    """Every module the thread awaiting the CPU's compiles uses is imported before it starts
    (checked in a fresh interpreter): an import there could wait forever on an import lock a
    Ctrl-C left held in the main thread (`kvc compile` hung one time in ten when interrupted
    during the verification)."""
    import subprocess
    import sys

    script = f"""
import builtins, sys, threading
imported, real = [], builtins.__import__
def spy(name, *args, **kwargs):
    if threading.current_thread().name == "kvc-device-compile" and name not in sys.modules:
        imported.append(name)
    return real(name, *args, **kwargs)
builtins.__import__ = spy
from kvc.export.compile import CompileOptions, compile_to
from kvc.plan import StaticOptions
compile_to({str(fixtures.path("llama"))!r}, {str(tmp_path / "out")!r},
           CompileOptions(StaticOptions(max_prompt_len=64, min_response_len=32, variants=(80,))))
print(imported)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_what_the_plugin_prints_does_not_mix_into_the_replies(compiled, tmp_path, monkeypatch):
    """fd 1 of the compiling process is stderr: 12 KB written there by native code (here
    os.write, as a plugin's printf would) leave the reply intact."""
    monkeypatch.setattr(device_compile, "_SERVER",
                        "import os, sys; sys.path[:1] = []; import kvc.export.device_compile as d; real = d._compile_one; "
                        "d._compile_one = lambda request: (os.write(1, b'plugin says hello\\n' * 700), real(request))[1]; "
                        "d._serve()")
    config = device_config("CPU", for_export=True, precision="auto")
    with DeviceCompiler() as compiler:
        got = compiler.compile("prefill", compiled / "prefill.xml", compiled / "weights.bin", "CPU", config,
                               tmp_path / "a.blob")
    assert got["bytes"] == (tmp_path / "a.blob").stat().st_size


def test_a_killed_compile_leaves_no_compiling_process(tmp_path):
    """kill -9 of kvc while a child compiles: the server and the child die with it, and
    nothing is written afterwards."""
    import os
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "started"
    script = f"""
import sys
from pathlib import Path
import kvc.export.device_compile as d
d._SERVER = ("import sys, time; sys.path[:1] = []; import kvc.export.device_compile as d; "
             "d._compile_one = lambda request: (open({str(marker)!r}, 'w').close(), time.sleep(60)); d._serve()")
with d.DeviceCompiler() as c:
    c.compile("prefill", Path("x.xml"), Path("w.bin"), "CPU", {{}}, Path({str(tmp_path / 'late.blob')!r}))
"""
    kvc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    for _ in range(300):
        if marker.exists():
            break
        time.sleep(0.05)
    assert marker.exists(), "the child started compiling"
    children = subprocess.run(["pgrep", "-P", str(kvc.pid)], capture_output=True, text=True).stdout.split()
    server = int(children[0])
    child = int(subprocess.run(["pgrep", "-P", str(server)], capture_output=True, text=True).stdout.split()[0])
    os.kill(kvc.pid, signal.SIGKILL)
    kvc.wait()
    for _ in range(100):
        alive = [p for p in (server, child) if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split()[2] != "Z"]
        if not alive:
            break
        time.sleep(0.05)
    assert not alive, "the server and its compiling child died with kvc"


def test_a_request_arriving_while_a_child_compiles_waits_its_turn(tmp_path):
    """The server reads its input past Python's buffering: a second request written while the
    first compiles is answered after it (the server once took any input then for kvc having
    stopped, and killed the child); the input's end while a child compiles still stops both."""
    import json
    import subprocess
    import sys
    import time

    server_code = ("import sys, time; sys.path[:1] = []; import kvc.export.device_compile as d; "
                   "from pathlib import Path; "
                   "d._compile_one = lambda r: (Path(r['blob']).write_text('started'), time.sleep(float(r['xml'])), "
                   "{'bytes': 0, 'import_config': {'name': r['name']}})[2]; d._serve()")
    server = subprocess.Popen([sys.executable, "-c", server_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)

    def send(name: str, seconds: float) -> Path:
        marker = tmp_path / name
        server.stdin.write(json.dumps({"name": name, "xml": str(seconds), "blob": str(marker)}) + "\n")
        server.stdin.flush()
        for _ in range(600):
            if marker.exists():
                return marker
            time.sleep(0.05)
        raise AssertionError(f"{name} never started compiling")

    try:
        send("first", 1.0)
        server.stdin.write(json.dumps({"name": "second", "xml": "0", "blob": str(tmp_path / "second")}) + "\n")
        server.stdin.flush()  # while the first compiles
        replies = [json.loads(server.stdout.readline()) for _ in range(2)]
        assert [r["result"]["import_config"]["name"] for r in replies] == ["first", "second"]
        send("third", 60.0)
        server.stdin.close()
        assert server.wait(timeout=20) == 0, "the input's end stops the server and its compiling child"
    finally:
        server.kill()
