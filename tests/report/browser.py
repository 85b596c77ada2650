"""A real headless Chromium, driven over the DevTools protocol on a pipe (stdlib only).

`load(path)` opens a file in a fresh headless Chromium (its own temporary profile), waits for
the load event, evaluates a JavaScript expression in the page, takes a screenshot (the whole page, up to
`max_height` pixels) and
returns what the page reported: uncaught exceptions (`Runtime.exceptionThrown`),
console.error/assert calls (`Runtime.consoleAPICalled`) and browser log entries of level
error (`Log.entryAdded`: failed loads, Content Security Policy violations). The protocol
runs over ``--remote-debugging-pipe``: Chromium reads NUL-terminated JSON commands on fd 3
and writes replies and events on fd 4, so no port is opened.

`find()` is the browser to use: $KVC_CHROMIUM, else /usr/bin/chromium (Debian's package),
else chromium or chromium-browser on PATH; None when there is none.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def find() -> str | None:
    for candidate in (os.environ.get("KVC_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass
class PageRun:
    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions, error log entries
    console: list[str] = field(default_factory=list)  # every console call, as "type: text"
    value: object = None  # the evaluated expression's value
    screenshot: Path | None = None
    seconds: float = 0.0


class _Pipe:
    def __init__(self, proc, write_fd: int, read_fd: int):
        self.proc, self.w, self.r = proc, write_fd, read_fd
        self.buf, self.next_id, self.events = b"", 0, []

    def send(self, method: str, params=None, session: str | None = None) -> int:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.w, json.dumps(message).encode() + b"\0")
        return self.next_id

    def receive(self, until, timeout: float) -> dict:
        """Messages until one satisfies `until` (returned); the others are kept as events."""
        end = time.monotonic() + timeout
        while True:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                message = json.loads(raw)
                if until(message):
                    return message
                self.events.append(message)
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from Chromium within {timeout} s")
            ready, _, _ = select.select([self.r], [], [], left)
            if ready:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    raise EOFError(f"Chromium closed the pipe (exit {self.proc.poll()})")
                self.buf += chunk

    def call(self, method: str, params=None, session: str | None = None, timeout: float = 30) -> dict:
        i = self.send(method, params, session)
        reply = self.receive(lambda m: m.get("id") == i, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def drain(self, seconds: float) -> None:
        try:
            self.receive(lambda m: False, seconds)
        except TimeoutError:
            pass


def load(path: Path, *, expression: str = "null", screenshot: Path | None = None, width: int = 1280,
         height: int = 1000, max_height: int = 12000, timeout: float = 60, browser: str | None = None) -> PageRun:
    browser = browser or find()
    if browser is None:
        raise FileNotFoundError("no Chromium found (install Debian's chromium package, or set KVC_CHROMIUM)")
    start = time.monotonic()
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    profile = tempfile.mkdtemp(prefix="kvc-chromium-")

    def child_fds():  # fd 3: commands in, fd 4: replies out (dup2 to a new number clears close-on-exec)
        a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
        os.dup2(a, 3)
        os.dup2(b, 4)

    proc = subprocess.Popen([browser, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                             f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
                             "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
                             f"--window-size={width},{height}", "about:blank"],
                            preexec_fn=child_fds, close_fds=False, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    pipe = _Pipe(proc, to_chrome_w, from_chrome_r)
    run = PageRun()
    try:
        target = pipe.call("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
        session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
            pipe.call(domain, session=session)
        pipe.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=session)
        pipe.call("Page.navigate", {"url": Path(path).resolve().as_uri()}, session=session)
        pipe.receive(lambda m: m.get("method") == "Page.loadEventFired", timeout)
        result = pipe.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
        if "exceptionDetails" in result:
            run.errors.append(f"evaluating the check: {result['exceptionDetails'].get('text')}")
        run.value = result.get("result", {}).get("value")
        if screenshot is not None:
            size = pipe.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": width, "height": min(int(size["height"]), max_height), "scale": 1}
            shot = pipe.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip},
                             session=session)
            Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
            run.screenshot = Path(screenshot)
        pipe.drain(0.3)
        _classify(pipe.events, run)
        try:
            pipe.call("Browser.close", timeout=10)
        except (EOFError, TimeoutError, RuntimeError):
            pass
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(to_chrome_w)
        os.close(from_chrome_r)
        shutil.rmtree(profile, ignore_errors=True)
    run.seconds = time.monotonic() - start
    return run


def _classify(events: list[dict], run: PageRun) -> None:
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            run.errors.append(f"uncaught: {text} ({details.get('url', '')}:{details.get('lineNumber')})")
        elif method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            run.console.append(f"{params.get('type')}: {text}")
            if params.get("type") in ("error", "assert"):
                run.errors.append(f"console.{params['type']}: {text}")
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            if entry.get("level") == "error":
                run.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".rstrip())
