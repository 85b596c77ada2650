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
stops it by closing its input, which also kills a compiling child); a child keeps the Ctrl-C
disposition kvc had. The server and its child die with kvc (PR_SET_PDEATHSIG): a killed
compile leaves no compile running. Replies go over a copy of the server's original stdout;
fd 1 itself is pointed at stderr, so the plugin's own prints cannot mix into them.
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


# Ctrl-C is ignored before anything else (the imports take a second); the disposition kvc
# had is restored in each compiling child. Only the entry `-c` puts first on sys.path (the
# working directory) is dropped: kvc's source tree would shadow the installed kvc.
_SERVER = ("import signal; inherited = signal.signal(signal.SIGINT, signal.SIG_IGN); import sys; "
           "sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; "
           "from kvc.export.device_compile import _serve; _serve(inherited)")


class DeviceCompiler:
    """The client: `compile(xml, weights, device, config, blob)` writes the blob and returns
    the import configuration; use as a context manager (the server stops at exit)."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None

    def __enter__(self) -> DeviceCompiler:
        if os.environ.get("KVC_DEVICE_COMPILE") == "in-process":
            return self
        self._server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(kill=exc_type is not None)

    def close(self, kill: bool = False) -> None:
        """Stop the server: by closing its input (it stops a compiling child then), or at once
        with `kill`, when the compile failed or was interrupted (its child dies with it:
        PDEATHSIG; a `compile` waiting on another thread then raises). Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        if kill:
            server.kill()
        with contextlib.suppress(OSError):  # a server that died has closed its end
            server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    def compile(self, name: str, xml: Path, weights: Path, device: str, config: dict, blob: Path,
                branches: dict[str, Path] | None = None) -> dict:
        """Compile `xml` (over `weights`) for `device` with `config` in a fresh fork; write the
        blob to `blob` (atomically) and return {"bytes", "import_config"}. With `branches`
        (CPU: the models by name, their xml, in the chain's order), the If chain over them
        (export/branches.py)."""
        request = {"name": name, "xml": str(xml), "weights": str(weights), "device": device, "config": config,
                   "blob": str(blob)}
        if branches:
            request["branches"] = {branch: str(path) for branch, path in branches.items()}
        server = self._server
        if server is None:
            return _compile_one(request)
        try:
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            line = server.stdout.readline()
        except (OSError, ValueError):  # a broken pipe; ValueError: closed by `close` meanwhile
            line = ""
        if not line:
            status = server.wait()
            raise RuntimeError(f"kvc's device compile server stopped (exit status {status})")
        try:
            reply = json.loads(line)
        except ValueError:
            raise RuntimeError(f"kvc's device compile server replied {line[:200]!r}, not JSON") from None
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
    from kvc.export.mapped import HeldPages
    from kvc.ir.reader import core, load, map_weights
    from kvc.ir.writer import write_bytes_atomic
    from kvc.ir.text_embeddings import detach

    name, device, config = request["name"], request["device"], request["config"]
    # The models' constants are read over one mapping kvc holds (under them while they compile),
    # whose pages are dropped as the compile reads them (export/mapped.py, HeldPages).
    mapped = map_weights(request["weights"])
    with HeldPages(mapped, request["weights"]) as pages:
        if "branches" in request:  # one If over the models
            from kvc.export.branches import branch_model

            bodies = {branch: load(xml, weights=request["weights"], mapped=mapped)
                      for branch, xml in request["branches"].items()}
            for body in bodies.values():
                detach(body)  # where this machine holds the text embeddings model: not for the blob
                embed_small_constants(body)
            model = branch_model(bodies)
        else:
            model = load(request["xml"], weights=request["weights"], mapped=mapped)
            detach(model)
            if device == "CPU":
                embed_small_constants(model)
        try:
            compiled = core().compile_model(model, device, config)
            pages.until_idle()
            blob = compiled.export_model().getvalue()
        except RuntimeError as exc:
            raise DeviceError(f"compiling {name} for {device} failed: {openvino_reason(exc)}") from None
    write_bytes_atomic(Path(request["blob"]), blob)
    return {"bytes": len(blob), "import_config": import_config(device, config, compiled)}


def _die_with_parent() -> None:
    """Be killed when the process that started this one dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(inherited_sigint=signal.SIG_DFL) -> None:
    """The server: one request per line on stdin, one reply per line on the file descriptor
    that was stdout, each request compiled in a child forked from this (unchanged) state.
    Everything else written to stdout, by Python or by the plugin's own code, goes to stderr
    (fd 1 is made a copy of fd 2), so nothing can mix into the replies. The server and each
    child die with their parent; input closing while a child compiles kills the child."""
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # kvc died before the line above
        return
    import openvino  # noqa: F401  (the state every child starts from)

    import kvc.export.compile  # noqa: F401
    import kvc.ir.reader  # noqa: F401

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    child_sigint = signal.SIG_IGN if inherited_sigint == signal.SIG_IGN else signal.SIG_DFL
    requests = _Requests()
    for request in requests:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into this loop
            status = 1
            try:
                signal.signal(signal.SIGINT, child_sigint)
                _die_with_parent()
                os.close(read)
                replies.close()
                status = _child(request, write)
            finally:
                os._exit(status)
        os.close(write)
        text = _await_child(read, pid, requests)
        replies.write(text + "\n")
        replies.flush()


def _child(request: dict, write: int) -> int:
    """Compile `request` and write the reply to `write`; the exit status."""
    try:
        reply = {"result": _compile_one(request)}
    except (KvcError, OSError) as exc:  # raised again in kvc's process, as it is, if it can be
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)
            reply = {"raise": base64.b64encode(data).decode()}
        except Exception:
            reply = {"error": "".join(traceback.format_exception(exc))}
    except BaseException:
        reply = {"error": traceback.format_exc()}
    with os.fdopen(write, "w") as f:
        f.write(json.dumps(reply))
    return 0


class _Requests:
    """The server's input, one JSON request per line, read from fd 0 past Python's buffering,
    so that what select() finds readable there is what this has not read yet: a request that
    arrives while a child compiles waits its turn, and only the end of the input means kvc
    stopped."""

    def __init__(self, fd: int = 0) -> None:
        self.fd, self.ended, self._buffer = fd, False, b""

    def read_some(self) -> None:
        data = os.read(self.fd, 1 << 16)
        self._buffer += data
        self.ended = not data

    def __iter__(self):
        while True:
            while b"\n" not in self._buffer and not self.ended:
                self.read_some()
            if b"\n" not in self._buffer:
                return  # the input ended (kvc ends every request with a newline)
            line, self._buffer = self._buffer.split(b"\n", 1)
            yield json.loads(line)


def _await_child(read: int, pid: int, requests: _Requests) -> str:
    """The child's reply, or why it gave none; a child still compiling when the server's input
    ends (kvc stopped) is killed. Requests arriving meanwhile are kept for later."""
    import select

    chunks = []
    while True:
        ready, _, _ = select.select([read, requests.fd], [], [])
        if requests.fd in ready:
            requests.read_some()
            if requests.ended:  # nothing more may come from kvc: it stopped
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(read)
                sys.exit(0)
        if read in ready:
            data = os.read(read, 1 << 16)
            if not data:
                break
            chunks.append(data)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode()
    if not text:
        text = json.dumps({"died": f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                           else f"exit status {os.WEXITSTATUS(status)}"})
    return text
