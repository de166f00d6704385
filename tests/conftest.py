"""Shared fixtures: the repository's own params, and a throw-away copy of the project as a git+DVC repo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipelines.params import Params, apply_overrides, load_params

# The suite runs on several pytest-xdist workers, so two trials can train at once on cores each expects to
# have to itself. OpenMP's default waiting spins on a core: with two 2-thread torch processes on 2 cores, a
# training step measured 6.5x slower than alone; with passive waiting, 2x (its fair share). Set before torch
# loads (libgomp reads it once) and inherited by every process a test starts: DVC, the stages, Ray's trials.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO_ROOT = Path(__file__).resolve().parents[1]
AG_NEWS = REPO_ROOT.parent / "shared" / "data" / "ag_news"


@pytest.fixture(scope="session")
def default_params() -> Params:
    """The validated params.yaml of this repository (the only place defaults live)."""
    return load_params(REPO_ROOT / "params.yaml")


def tiny_params(base: Params, **overrides: Any) -> Params:
    """`base` with dotted-key overrides, re-validated."""
    return apply_overrides(base, overrides)


def _project_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [f for f in out.stdout.split("\0") if f and (REPO_ROOT / f).is_file()]


def git_env() -> dict[str, str]:
    """Environment for git/DVC subprocesses: a fixed identity, no prompts, our python first on PATH."""
    env = dict(os.environ)
    env.update(
        GIT_AUTHOR_NAME="test",
        GIT_AUTHOR_EMAIL="test@example.com",
        GIT_COMMITTER_NAME="test",
        GIT_COMMITTER_EMAIL="test@example.com",
        GIT_TERMINAL_PROMPT="0",
        DVC_NO_ANALYTICS="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    env.pop("DVC_ROOT", None)
    return env


def run(
    cmd: list[str], cwd: Path, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command (with `env` added to the environment), capturing output; on failure the assertion shows both
    streams."""
    proc = subprocess.run(cmd, cwd=cwd, env={**git_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if check:
        assert proc.returncode == 0, (
            f"{cmd} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """A fresh copy of this project (its tracked and unignored files) committed in a new git repo."""
    dest = tmp_path / "project"
    for rel in _project_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, target)
    run(["git", "init", "-q", "-b", "main"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "initial"], dest)
    return dest


SERVER_MARKERS = ("mlflow server", "mlflow.server", "uvicorn", "huey", "gunicorn")  # an MLflow server's processes
# Every process this test session starts inherits this mark, even one re-parented when its parent died: the
# leak check below counts only those, not a server another session (or a user) runs on the same machine.
SESSION_MARK = "PIPELINES_TEST_SESSION"
os.environ[SESSION_MARK] = str(os.getpid())


def _server_processes() -> dict[int, str]:
    """This session's MLflow-server processes (the server, uvicorn, its job runner and huey consumers) by pid."""
    import psutil

    found = {}
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            line = " ".join(process.info["cmdline"] or [])
            ours = any(m in line for m in SERVER_MARKERS) and process.environ().get(SESSION_MARK) == str(os.getpid())
        except (psutil.Error, TypeError):
            continue
        if process.info["status"] != psutil.STATUS_ZOMBIE and ours:
            found[process.info["pid"]] = line[:200]
    return found


@pytest.fixture(autouse=True)
def no_server_outlives_its_test():
    """Fail a test that leaves an MLflow server (or one of its workers) running: ~2 GB a leak, once seen."""
    import time

    before = _server_processes()
    yield
    deadline = time.monotonic() + 10  # SIGKILLed processes take a moment to leave the table
    while (left := {pid: line for pid, line in _server_processes().items() if pid not in before}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert not left, f"processes this test started outlived it: {left}"


def kill_session(session_id: int, timeout: float = 30) -> None:
    """SIGKILL every process of session `session_id`, one a test started with `start_new_session=True`.

    That is what the test started and nothing else: DVC, the stage, and the Ray cluster and trials
    the stage started (Ray's driver leaves the process group, with `setpgrp`, but not the session),
    or a server and its workers. Never Ray's own stop command, which kills every Ray process on the machine.
    """
    import signal
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == session_id and process.status() != psutil.STATUS_ZOMBIE:
                    os.kill(process.pid, signal.SIGKILL)
                    alive.append(process)
            except (OSError, psutil.Error):  # gone already, or not ours to signal
                continue
        if not alive:
            return
        psutil.wait_procs(alive, timeout=2)
    raise AssertionError(f"processes of session {session_id} outlived SIGKILL for {timeout} s")


# The stages the tests start join one Ray cluster, started once for the session, instead of each starting its own
# (Ray's daemons start once, not once per train stage): a QUICK train stage measured 25.5 and 27.4 CPU-s starting
# its own cluster, 20.2 and 21.1 joining one, on 2 cores. Tests of a stage's own local cluster opt out with the
# `own_ray_cluster` fixture. A RAY_ADDRESS set before pytest starts is used as it is.
SESSION_RAY = pytest.StashKey[tuple[int, Path]]()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_session_ray(logical_cpus: int, cwd: Path) -> int:
    """Start a Ray head for this test session, point RAY_ADDRESS at it, and return its session id (to kill it).

    Its processes, the trials' included, run in `cwd`.
    """
    port = free_port()
    # A token first, where this machine has none: `ray start --head` turns token auth on exactly when
    # ~/.ray/auth_token exists, and every driver that joins by address switches to token mode once it exists
    # (`use_cluster_token`, Ray's own rule), while the first stage that starts a local cluster of its own (ray.init)
    # writes one. Without it, the session's cluster ran without auth, and every trial placed on it after such a stage
    # was cancelled before it started ("The actor never ran"): the suite passed or failed by the order of its tests.
    ray_cli = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray_cli, "get-auth-token", "--generate"], env=git_env(), capture_output=True, timeout=60)
    # The dashboard agent's default port (52365) is chosen free too, so a test's own `ray start --head` can run.
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         f"--num-cpus={logical_cpus}", "--include-dashboard=false", "--disable-usage-stats",
         f"--dashboard-agent-listen-port={free_port()}", '--system-config={"prestart_worker_first_driver": false}'],
        cwd=cwd, env=git_env(), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    printed = head.communicate(timeout=120)[0]
    if head.returncode != 0:
        kill_session(head.pid)
        raise RuntimeError(f"the test session's Ray head did not start:\n{printed}")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    return head.pid


def pytest_configure(config: pytest.Config) -> None:
    """The session's Ray head, started by the xdist controller before its workers inherit RAY_ADDRESS."""
    import importlib.util

    # Not on a bare GPU machine without Ray (its tests, `pytest -m gpu tests/gpu`, start no stage).
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("RAY_ADDRESS") or not importlib.util.find_spec("ray"):
        return
    import tempfile

    cwd = Path(tempfile.mkdtemp(prefix="ray-session-"))
    # Logical CPUs: every concurrently running test's trials are placed at once, as each was on a cluster of its
    # own. A trial's threads do not follow them: they come from the machine's cores.
    config.stash[SESSION_RAY] = (start_session_ray(logical_cpus=8 * MAX_WORKERS, cwd=cwd), cwd)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the session's Ray head: its processes and nothing else (never `ray stop`)."""
    if SESSION_RAY in config.stash:
        session_id, cwd = config.stash[SESSION_RAY]
        kill_session(session_id)
        os.environ.pop("RAY_ADDRESS", None)
        shutil.rmtree(cwd, ignore_errors=True)


@pytest.fixture
def own_ray_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stages this test starts start a local Ray cluster of their own, as on a user's machine."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def up_to_date(dvc_output: str) -> bool:
    """Whether `dvc status` (or `dvc repro`) says nothing but the `source` stage needs to run: it runs on every
    repro by design (DVC's always_changed), to hash the data `data.source` names (`pipelines.data.fingerprint`)."""
    import re

    if "Data and pipelines are up to date" in dvc_output:
        return True
    ran = re.findall(r"Running stage '([\w-]+)'", dvc_output)
    if ran:
        return ran == ["source"]
    return dvc_output.split() == ["source:", "always", "changed"]


def write_params(root: Path, overrides: dict[str, Any]) -> None:
    """Set dotted-key overrides in `root/params.yaml` (what `dvc exp run -S` does)."""
    import yaml

    from pipelines.params import set_dotted

    path = root / "params.yaml"
    tree = yaml.safe_load(path.read_text())
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


# Small, fast settings for tests that run many trials (the corpus is still the generated one).
QUICK = {"data.generator.num_rows": 1500, "epochs": 1, "log_every_n_steps": 5}
FOUR_VARIANTS = {
    "vanilla": {"data.bucketing": False},
    "bf16": {"precision": "bf16"},
    "adafactor": {"optim": "adafactor"},
    "accumulation": {"batch_size": 8, "grad_accum_steps": 4},
}

# Final metrics every finished trial logs to MLflow.
FINAL_METRICS = (
    "train_time_s",
    "samples_per_s",
    "tokens_per_s",
    "padding_fraction",
    "peak_train_memory_bytes",
    "test_accuracy",
    "test_macro_f1",
    "val_accuracy",
    "optimizer_state_bytes",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first; tests marked `gpu` skipped with the reason where there is no CUDA.

    Slow first so that the workers (pytest-xdist, one test at a time each) start on the long real-pipeline
    runs and finish on short tests, instead of one worker ending alone on a two-minute run. The sort is
    stable, so every worker collects the same order (xdist requires it).
    """
    import torch

    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU visible); on a GPU machine: pytest -m gpu tests/gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


GIB_PER_WORKER = 6  # a real DVC + Ray + MLflow run's peak resident memory here is a few GiB
MAX_WORKERS = 4  # more only oversubscribe the cores: every trial already uses all of them


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core, at most MAX_WORKERS and as many as memory holds at GIB_PER_WORKER each."""
    import psutil

    by_memory = psutil.virtual_memory().available // (GIB_PER_WORKER * 2**30)
    return max(1, min(os.cpu_count() or 1, by_memory, MAX_WORKERS))
