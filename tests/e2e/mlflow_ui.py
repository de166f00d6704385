"""The MLflow UI as a user sees it: a real `mlflow server` and headless Chromium driven over DevTools."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import kill_session

# Clicks every row's expand toggle (unlabelled buttons inside grid rows), so nested trial runs show.
EXPAND_ROWS = """(() => {
  const toggles = [...document.querySelectorAll(".ag-row button")]
    .filter(b => !(b.getAttribute("aria-label") || "") && !b.innerText.trim());
  toggles.forEach(b => b.click());
  return toggles.length;
})()"""
# Each grid row's text, joined across the grid's pinned and scrolling parts (they share a row-index).
ROW_TEXTS = """(() => {
  const rows = {};
  document.querySelectorAll(".ag-row[row-index]").forEach(r => {
    const i = r.getAttribute("row-index");
    rows[i] = (rows[i] || "") + " | " + r.innerText.replace(/\\s+/g, " ");
  });
  return Object.values(rows);
})()"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return urllib.request.urlopen(url, timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@contextmanager
def mlflow_ui(store: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 over a sqlite store file; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{store}", "--workers", "1"],
        cwd=store.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(f"http://127.0.0.1:{port}/health", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_session(proc.pid)  # uvicorn, the job runner and its consumers too, not only the parent
        proc.wait()


def runs_table_rows(url: str, seconds: float = 90, ready: Callable[[list[str]], bool] = bool) -> list[str]:
    """Open `url` (an experiment's runs page) in headless Chromium, expand nested runs; each row's text.

    The rows' cells (datasets, models) load after the rows, later on a loaded machine: the rows are read
    again until `ready(rows)` holds or `seconds` have passed (then the last read is returned, for the assert).
    """
    import websocket

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium not installed (.ci/run installs Debian's chromium)")
    port = free_port()
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}",
             f"--user-data-dir={profile}", "--window-size=2400,1600", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            targets = json.load(wait_for(f"http://127.0.0.1:{port}/json", 30))
            page = next(t for t in targets if t["type"] == "page")
            ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
            calls = iter(range(1, 10**6))

            def call(method: str, **params: Any) -> dict[str, Any]:
                number = next(calls)
                ws.send(json.dumps({"id": number, "method": method, "params": params}))
                while True:
                    message = json.loads(ws.recv())
                    if message.get("id") == number:
                        return message.get("result", {})

            def js(expression: str) -> Any:
                result = call("Runtime.evaluate", expression=expression, returnByValue=True)
                return result.get("result", {}).get("value")

            call("Page.enable")
            call("Page.navigate", url=url)
            deadline = time.monotonic() + seconds
            while not js("document.querySelectorAll('.ag-row[row-index]').length"):
                if time.monotonic() > deadline:
                    raise AssertionError(f"the runs table did not render within {seconds:.0f} s")
                time.sleep(1)
            time.sleep(2)  # let the rows' cells (datasets, models) load
            js(EXPAND_ROWS)
            time.sleep(4)
            rows = js(ROW_TEXTS)
            cells_deadline = time.monotonic() + seconds
            while not ready(rows) and time.monotonic() < cells_deadline:
                time.sleep(2)
                rows = js(ROW_TEXTS)
            ws.close()
            return rows
        finally:
            proc.kill()
            proc.wait()
