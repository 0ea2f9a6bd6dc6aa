"""Opens a page in a real headless Chromium and reports what its console and network saw.

Driven over the DevTools protocol on a pipe (--remote-debugging-pipe: commands on the browser's fd 3,
answers and events on its fd 4, NUL-terminated JSON), so no port and no websocket library. Errors are
everything a developer console would show in red: uncaught exceptions, console.error / console.assert
calls, and the browser's own error entries (a load refused by the Content-Security-Policy, a resource
that failed to load).
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def find_chromium() -> str | None:
    """Debian's chromium (`apt-get install chromium`; `make setup` installs it), or another Chrome."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageReport:
    errors: list[str] = field(default_factory=list)      # what the console shows as errors
    requests: list[str] = field(default_factory=list)    # every URL the page asked for (data: URIs cut short)
    images: list[dict] = field(default_factory=list)     # each <img>: {"src": first 40 chars, "width": natural width}
    text: str = ""                                       # the page's visible text


class _Pipe:
    """The DevTools pipe: send a command, wait for its answer; events pile up in ``events``."""

    def __init__(self, write_fd: int, read_fd: int, timeout: float) -> None:
        self._write_fd, self._read_fd, self._timeout = write_fd, read_fd, timeout
        self._answers: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._read_fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self._answers.put(None)
                return
            buffer += chunk
            while b"\0" in buffer:
                message, buffer = buffer.split(b"\0", 1)
                decoded = json.loads(message)
                if "id" in decoded:
                    self._answers.put(decoded)
                else:
                    self.events.append(decoded)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        command = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            command["sessionId"] = session
        os.write(self._write_fd, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                answer = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"chromium did not answer {method} within {self._timeout} s") from None
            if answer is None:
                raise RuntimeError(f"chromium closed the DevTools pipe during {method}")
            if answer["id"] == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def wait_for(self, method: str, session: str) -> None:
        deadline = time.monotonic() + self._timeout
        while not any(e.get("method") == method and e.get("sessionId") == session for e in list(self.events)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {self._timeout} s")
            time.sleep(0.02)


def _short(url: str) -> str:
    return url[:40] + "..." if url.startswith("data:") else url


def _errors(events: list[dict], session: str) -> list[str]:
    found = []
    for event in events:
        if event.get("sessionId") != session:
            continue
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            found.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            found.append("console.error: " + " ".join(str(a.get("value", a.get("description", "")))
                                                      for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            found.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            found.append(f"network: {params.get('errorText')} ({params.get('blockedReason', '')})")
    return found


def open_page(path: Path, *, timeout: float = 60.0, settle_s: float = 0.3) -> PageReport:
    """Loads ``path`` (a local file) in headless Chromium, waits for its load event and ``settle_s`` more,
    and returns its console errors, requests, images and text."""
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("chromium is not installed (make setup installs Debian's chromium)")
    command_read, command_write = os.pipe()
    answer_read, answer_write = os.pipe()

    def on_fds_3_and_4() -> None:  # in the child, before exec: the pipe ends where chromium looks for them
        read_end, write_end = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (command_read, answer_write))
        os.dup2(read_end, 3)
        os.dup2(write_end, 4)

    with tempfile.TemporaryDirectory(prefix="kvtool-chromium-") as profile:
        log = Path(profile) / "stderr.log"
        with log.open("wb") as stderr:
            process = subprocess.Popen(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--no-default-browser-check", "--remote-debugging-pipe",
                 f"--user-data-dir={Path(profile) / 'profile'}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, pass_fds=(3, 4),
                preexec_fn=on_fds_3_and_4, start_new_session=True)  # its own group: its helpers end with it
        os.close(command_read)
        os.close(answer_write)
        closing = False  # the browser was asked to close: give it time to
        try:
            pipe = _Pipe(command_write, answer_read, timeout)
            target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Network", "Page"):
                pipe.send(f"{domain}.enable", session=session)
            pipe.send("Page.navigate", {"url": Path(path).resolve().as_uri()}, session=session)
            pipe.wait_for("Page.loadEventFired", session)
            time.sleep(settle_s)
            probe = ("JSON.stringify({images: Array.from(document.images).map(i => ({src: i.src.slice(0, 40), "
                     "width: i.naturalWidth})), text: document.body ? document.body.innerText : ''})")
            value = json.loads(pipe.send("Runtime.evaluate", {"expression": probe, "returnByValue": True},
                                         session=session)["result"]["value"])
            requests = [_short(e["params"]["request"]["url"]) for e in pipe.events
                        if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session]
            report = PageReport(_errors(pipe.events, session), requests, value["images"], value["text"])
            closing = True
            try:
                pipe.send("Browser.close")
            except RuntimeError:
                pass  # the pipe closes as the browser goes
        except Exception as error:
            raise RuntimeError(f"{error}; chromium's stderr: {log.read_text(errors='replace')[-2000:]}") from error
        finally:
            try:
                process.wait(timeout=10 if closing else 0.1)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            os.close(command_write)
            os.close(answer_read)
    return report
