"""Load a page in real headless Chromium and report what happened, over the DevTools
protocol on ``--remote-debugging-pipe`` (fd 3: commands in, fd 4: answers out, each a JSON
message ended by a NUL byte): no websocket library, no browser driver.

``load(path)`` returns the requests the page made (other than the page itself), its
console errors and uncaught exceptions, and the evaluated value of ``expression``. Name
resolution is switched off (``--host-resolver-rules``), so a page that does try to load
something from the network sends nothing out: the request is still seen here.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def chromium() -> str | None:
    return shutil.which("chromium")


class Browser:
    def __init__(self, timeout: float = 20.0):
        exe = chromium()
        if exe is None:
            raise FileNotFoundError("chromium is not on PATH")
        self.deadline = time.monotonic() + timeout
        self.profile = tempfile.TemporaryDirectory()
        to_chrome, self._write = os.pipe()
        self._read, from_chrome = os.pipe()
        # fds 3 and 4 in the browser: keep ours above them so the shell's redirections cannot clash
        low = (to_chrome, from_chrome)
        to_chrome, from_chrome = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in low)
        for fd in low:
            os.close(fd)
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
                f"--user-data-dir={self.profile.name}", "--host-resolver-rules=MAP * ~NOTFOUND",
                "--window-size=1280,900", "about:blank"]
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_chrome} 4>&{from_chrome} {to_chrome}<&- {from_chrome}>&-', exe, *args],
            pass_fds=(to_chrome, from_chrome), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer = b""
        self._next = 0
        self.events: list[dict] = []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=True)

    def send(self, method: str, session: bool = False, **params) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def _receive(self) -> dict:
        while b"\0" not in self._buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def load(self, path: Path, expression: str = "null") -> dict:
        """Navigate to ``path``, wait for its load event, then evaluate ``expression``."""
        self.events.clear()
        url = Path(path).resolve().as_uri()
        self.send("Page.navigate", session=True, url=url)
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._receive())
        value = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        requests = [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]
        errors = [e["params"]["entry"]["text"] for e in self.events
                  if e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error"]
        errors += [" ".join(str(a.get("value", a.get("description", ""))) for a in e["params"]["args"])
                   for e in self.events if e.get("method") == "Runtime.consoleAPICalled"
                   and e["params"]["type"] in ("error", "assert")]
        errors += [e["params"]["exceptionDetails"]["text"] for e in self.events
                   if e.get("method") == "Runtime.exceptionThrown"]
        return {"requests": [u for u in requests if u != url], "errors": errors,
                "value": value["result"].get("value")}

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._write)
        os.close(self._read)
        self.profile.cleanup()
