"""docs/how-to/ray-cluster.md as written: two nodes start on one machine, its way of stopping one node stops that
node's Ray and no other Ray on the host (`ray stop` stops them all), and `ray start --address` and `ray status`
reach a token-auth cluster only with `RAY_AUTH_MODE=token`.
Also: every section link (`[...](#anchor)`, `[...](page.md#anchor)`) in README.md and docs/ names a heading."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT, free_port, git_env, kill_session
from tests.e2e.test_readme import command_blocks, commands

DOC = REPO_ROOT / "docs/how-to/ray-cluster.md"
STOP_BLOCK = "ray-node.sid"  # the block that starts a node in a session of its own, and stops that session


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a block is no heading
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_section_link_names_a_heading_of_its_page():
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            if target.startswith("http"):
                continue
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file() or anchor not in anchors(linked):
                broken.append(f"{page.relative_to(REPO_ROOT)}: ({target}#{anchor})")
    assert not broken, "section links that name no heading:\n" + "\n".join(broken)
    # The how-to's pointers to its own sections are links (checked above), not a quoted name: its `(see "When
    # things go wrong")` named a section the page did not have.
    assert not re.findall(r'\(see "[^"]+"\)', DOC.read_text())


def ray_processes(session: int) -> list[int]:
    """The live processes of session `session` (a node started as the how-to says)."""
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
        except (OSError, psutil.Error):
            pass
    return alive


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_hows_two_nodes_start_as_written_and_its_stop_leaves_another_ray_running(tmp_path: Path):
    """The block as written, two nodes on this machine: the head, then another node joining it (which needs
    `RAY_AUTH_MODE=token`: without it, exit code 1 and InvalidAuthToken), each in a session of its own; then each
    stopped by its session, the node first. The test session's own Ray head, another Ray on the host, runs on."""
    other = os.environ.get("RAY_ADDRESS")  # the test session's own Ray head (tests/conftest.py), the other Ray
    assert other, "the test session starts a Ray head of its own"
    block = next(b for path, b in command_blocks() if path == DOC and STOP_BLOCK in b)
    start_head, start_node, stop_node, stop_head = commands(block)
    # The substitutions: free ports for the documented 6379 and for Ray's dashboard and its agents, whose default
    # ports another head on this host (another test's) may hold; the head's address for <head>.
    port = free_port()
    ports = f"--port={port} --dashboard-port={free_port()} --dashboard-agent-listen-port={free_port()}"
    joined = f"--address=127.0.0.1:{port} --dashboard-agent-listen-port={free_port()}"
    env = {k: v for k, v in git_env().items() if not k.startswith("RAY_AUTH")} | {"RAY_ADDRESS": ""}
    sessions: list[int] = []
    try:
        for command, sid in ((start_head.replace("--port=6379", ports), "ray-head.sid"),
                             (start_node.replace("--address=<head>:6379", joined), "ray-node.sid")):  # fmt: skip
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=180)  # fmt: skip
            sessions.append(int((tmp_path / sid).read_text()))
            assert done.returncode == 0, command + "\n" + done.stdout[-3000:] + done.stderr[-3000:]
            assert ray_processes(sessions[-1]), "the node's processes are in the session the how-to names"
        status = ["ray", "status", "--address", f"127.0.0.1:{port}"]
        refused = subprocess.run(status, env=env, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "InvalidAuthToken" in refused.stdout + refused.stderr
        for _ in range(30):  # a node just started is listed once its raylet reports (a loaded host: seconds)
            shown = subprocess.run(status, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                                   timeout=120)  # fmt: skip
            active = re.search(r"Active:\n((?: \d+ node_\w+\n)+)", shown.stdout)
            if shown.returncode != 0 or (active and active.group(1).count("node_") == 2):
                break
            time.sleep(2)
        assert shown.returncode == 0 and active and active.group(1).count("node_") == 2, shown.stdout + shown.stderr
        for command, session in ((stop_node, sessions[1]), (stop_head, sessions[0])):
            subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, check=True, timeout=60)
            for _ in range(100):  # SIGKILLed processes leave once the kernel has reaped them
                if not ray_processes(session):
                    break
                time.sleep(0.1)
            assert not ray_processes(session), f"the how-to's {command!r} left that node's processes running"
            if session == sessions[1]:
                assert ray_processes(sessions[0]), "stopping the other node stopped the head too"
        other_port = other.rsplit(":", 1)[1]
        still = [p for p in psutil.process_iter(["cmdline"]) if f"--gcs_server_port={other_port}" in
                 " ".join(p.info["cmdline"] or [])]  # fmt: skip
        assert still, "the other Ray head's GCS was stopped too"
    finally:
        for session in sessions:
            kill_session(session)
