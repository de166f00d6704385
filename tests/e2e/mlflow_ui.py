"""The MLflow UI as a user sees it: a real `mlflow server` and headless Chromium driven over DevTools."""

from __future__ import annotations

import json
import os
import shutil
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

from tests.conftest import free_port, kill_session

# MLflow 3's server also starts a job runner for its GenAI jobs: 8 more processes (huey consumers) that poll their
# queue, 0.78 of a core while the server idled (2-core AMD EPYC), and about half its start-up CPU. Runs of this
# project use no server jobs, so every server a test starts has it off, as docs/how-to/mlflow.md advises.
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

# A laptop's browser window (issue 71: at 1400x1000 the headline figures were off the screen, right of the table's
# edge): what the tests read is what fits in it.
WINDOW = "1400,1000"
# The runs table's column headers that lie whole within the window, left to right (the grid renders some beyond it).
VISIBLE_HEADERS = """(() => [...document.querySelectorAll('.ag-header-cell')]
  .filter(c => { const r = c.getBoundingClientRect(); return r.width > 0 && r.left >= 0 && r.right <= innerWidth; })
  .sort((a, b) => a.getBoundingClientRect().left - b.getBoundingClientRect().left)
  .map(c => c.innerText.trim()).join(' | '))()"""
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
        cwd=store.parent, env={**os.environ, **SERVER_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(f"http://127.0.0.1:{port}/health", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_session(proc.pid)  # uvicorn's workers too, not only the parent
        proc.wait()


class Page:
    """A headless Chromium tab driven over DevTools: `navigate(url)`, then `js(expression)` for a value."""

    def __init__(self, ws: Any) -> None:
        self.ws, self.calls = ws, iter(range(1, 10**6))

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self.calls)
        self.ws.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == number:
                return message.get("result", {})

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, expression: str, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not self.js(expression):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not render within {seconds:.0f} s")
            time.sleep(1)


@contextmanager
def headless_page() -> Iterator[Page]:
    """A tab of headless Chromium (skips the test when Chromium is not installed)."""
    import websocket

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium not installed (.ci/run installs Debian's chromium)")
    port = free_port()
    # Chromium's renderer and utility processes outlive a killed browser process and keep writing to the
    # profile: the whole session is killed (kill_session) before the profile is removed.
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}",
             f"--user-data-dir={profile}", f"--window-size={WINDOW}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            targets = json.load(wait_for(f"http://127.0.0.1:{port}/json", 30))
            page = next(t for t in targets if t["type"] == "page")
            ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
            tab = Page(ws)
            tab.call("Page.enable")
            yield tab
            ws.close()
        finally:
            kill_session(proc.pid)
            proc.wait()


def runs_table_rows(
    url: str, seconds: float = 90, ready: Callable[[list[str]], bool] = bool, sidebar: list[str] | None = None
) -> list[str]:
    """Open `url` (an experiment's runs page) in headless Chromium, expand nested runs; each row's text (and, into
    `sidebar`, the text of the page's navigation, which of MLflow's views it opened on, then the table's column
    headers that fit in the window, `VISIBLE_HEADERS`).

    The rows' cells (datasets, models) load after the rows, later on a loaded machine: the rows are read
    again until `ready(rows)` holds or `seconds` have passed (then the last read is returned, for the assert).
    """
    with headless_page() as page:
        page.navigate(url)
        page.wait_for("document.querySelectorAll('.ag-row[row-index]').length", seconds, "the runs table")
        if sidebar is not None:
            sidebar.append(page.js("[...document.querySelectorAll('nav, aside')].map(e => e.innerText).join(' | ')"))
            page.wait_for("document.querySelectorAll('.ag-header-cell').length", seconds, "the table's headers")
            sidebar.append(page.js(VISIBLE_HEADERS))
        time.sleep(2)  # let the rows' cells (datasets, models) load
        page.js(EXPAND_ROWS)
        time.sleep(4)
        rows = page.js(ROW_TEXTS)
        cells_deadline = time.monotonic() + seconds
        while not ready(rows) and time.monotonic() < cells_deadline:
            time.sleep(2)
            rows = page.js(ROW_TEXTS)
        return rows


def compare_view_metrics(url: str, experiment_id: str, run_ids: list[str], seconds: float = 90) -> list[str]:
    """The metrics MLflow's compare view (`Compare` on selected runs) plots when it opens: its parallel-coordinates
    plot's selection, read from the page's text between "Metrics:" and "Clear All"."""
    compare = f"{url}/#/compare-runs?runs={json.dumps(run_ids)}&experiments={json.dumps([experiment_id])}"
    with headless_page() as page:
        page.navigate(compare)
        page.wait_for("document.body.innerText.includes('Clear All')", seconds, "the compare view's plot controls")
        text = page.js("document.body.innerText")
    return text.split("Metrics:", 1)[1].split("Clear All", 1)[0].split()
