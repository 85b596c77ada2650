"""Compile each static model for a device in the same fresh process state.

A blob records names OpenVINO generates from process-wide counters while the plugin
transforms the model, so the same model compiled after other work in one process gives
other bytes (the prefill blob of a compile differed from the same prefill compiled alone at
byte 153, and again when a variant was added before it). Blobs that depend only on the
model, the device, the configuration and the OpenVINO version are what lets a blob compiled
once be reused by a later compile with an identical result (`kvc.export.blob_cache`).

So every device compile runs in a process forked from one server that imported OpenVINO
and kvc and did nothing else: the server (`_serve`, in a `python -c` process started
when the compile begins so its imports overlap the passes) reads one request per line,
forks, and the child loads the model's IR, compiles it, writes the blob, replies and exits.
Forking costs milliseconds; the child's memory is returned to the system when it exits,
which also keeps the compiler's own process small.

``KVC_DEVICE_COMPILE=in-process`` compiles in kvc's own process instead (blobs then depend
on what ran before: for debugging a plugin crash, or a test that patches the compile).

A request that fails in the child raises in kvc's process what the child raised (a kvc error
or an OSError such as a full disk, pickled back over the server's own pipe; anything else is
an internal error with the child's traceback); a child that dies (a crash in the plugin) is
a DeviceError naming the model and the signal. The server ignores Ctrl-C (kvc's process
stops it by closing its input); a compiling child does not.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from kvc.errors import DeviceError, KvcError


_SERVER = ("import sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
           "from kvc.export.device_compile import _serve; _serve()")


class DeviceCompiler:
    """The client: `compile(xml, weights, device, config, blob)` writes the blob and returns
    the import configuration; use as a context manager (the server stops at exit)."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None

    def __enter__(self) -> DeviceCompiler:
        if os.environ.get("KVC_DEVICE_COMPILE") == "in-process":
            return self
        # Not `-m`: the working directory would come first on sys.path, and kvc's source tree
        # (whose kvc/ holds only part of the package) would shadow the installed kvc.
        self._server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):  # a server that died has closed its end
                server.stdin.close()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    def compile(self, name: str, xml: Path, weights: Path, device: str, config: dict, blob: Path) -> dict:
        """Compile `xml` (over `weights`) for `device` with `config` in a fresh fork; write the
        blob to `blob` (atomically) and return {"bytes", "import_config"}."""
        request = {"name": name, "xml": str(xml), "weights": str(weights), "device": device, "config": config,
                   "blob": str(blob)}
        if self._server is None:
            return _compile_one(request)
        try:
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            line = self._server.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise RuntimeError(f"kvc's device compile server stopped (exit status {self._server.poll()})")
        reply = json.loads(line)
        if "died" in reply:
            raise DeviceError(f"compiling {name} for {device} failed: the compiling process died ({reply['died']})")
        if "raise" in reply:
            raise pickle.loads(base64.b64decode(reply["raise"]))
        if "error" in reply:
            raise RuntimeError(f"compiling {name} for {device}: internal error in the compiling process:\n"
                               f"{reply['error']}")
        return reply["result"]


def _compile_one(request: dict) -> dict:
    from kvc.errors import openvino_reason
    from kvc.export.compile import embed_small_constants, import_config
    from kvc.ir.reader import core, load
    from kvc.ir.writer import write_bytes_atomic

    name, device, config = request["name"], request["device"], request["config"]
    model = load(request["xml"], weights=request["weights"])
    if device == "CPU":
        embed_small_constants(model)
    try:
        compiled = core().compile_model(model, device, config)
        blob = compiled.export_model().getvalue()
    except RuntimeError as exc:
        raise DeviceError(f"compiling {name} for {device} failed: {openvino_reason(exc)}") from None
    write_bytes_atomic(Path(request["blob"]), blob)
    return {"bytes": len(blob), "import_config": import_config(device, config, compiled)}


def _serve() -> None:
    """The server: one request per line on stdin, one reply per line on stdout, each
    request compiled in a child forked from this (unchanged) state."""
    import openvino  # noqa: F401  (the state every child starts from)

    import kvc.export.compile  # noqa: F401
    import kvc.ir.reader  # noqa: F401

    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the reply channel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.close(read)
            try:
                reply = {"result": _compile_one(request)}
            except (KvcError, OSError) as exc:  # raised again in kvc's process, as it is
                reply = {"raise": base64.b64encode(pickle.dumps(exc)).decode()}
            except BaseException:
                reply = {"error": traceback.format_exc()}
            with os.fdopen(write, "w") as f:
                f.write(json.dumps(reply))
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        _, status = os.waitpid(pid, 0)
        if not text:
            text = json.dumps({"died": f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                               else f"exit status {os.WEXITSTATUS(status)}"})
        out.write(text + "\n")
        out.flush()

