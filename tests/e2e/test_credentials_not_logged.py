"""The tracking password reaches the trials and is written nowhere: not in Ray's logs, its job table, nor the project.

A Ray cluster of two nodes started by `ray start` without the credentials (as another terminal's would be), the
trials placed on the node that is not the driver's, and a real `mlflow server --app-name basic-auth` (sqlite, a local
artifacts folder) that refuses any request without them: the trials' runs finish only if the password reached them.
Ray's runtime-env agent logs a job's whole runtime environment, and `ray list jobs --detail` and the dashboard show
it, so the test searches every file under both nodes' temp dirs, the job table and every file of the project.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.trials.ray_cluster import TRACKING_CREDENTIALS
from tests.conftest import QUICK, free_port, git_env, kill_session, run, write_params
from tests.e2e.mlflow_ui import SERVER_ENV
from tests.e2e.team_stack import answers, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXPERIMENT = "finetune"
RAY = str(Path(sys.executable).parent / "ray")


class AuthServer:
    """`mlflow server --app-name basic-auth` on 127.0.0.1 over a sqlite store in `folder`: an admin and a member,
    each with a random password, the member allowed to edit the experiment; anonymous requests refused."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.passwords = {"admin": secrets.token_urlsafe(18), "trainer": secrets.token_urlsafe(18)}
        (folder / "auth.ini").write_text(
            "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
            f"database_uri = sqlite:///{folder / 'auth.db'}\nadmin_username = admin\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )
        env = {**git_env(), **SERVER_ENV, "MLFLOW_AUTH_CONFIG_PATH": str(folder / "auth.ini"),
               "MLFLOW_AUTH_ADMIN_PASSWORD": self.passwords["admin"],
               "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth", "--host", "127.0.0.1",
             "--port", str(self.port), "--backend-store-uri", f"sqlite:///{folder / 'store.db'}",
             "--artifacts-destination", str(folder / "artifacts"), "--workers", "1",
             "--allowed-hosts", f"127.0.0.1:{self.port},localhost:{self.port}"],
            cwd=folder, env=env, stdout=(folder / "server.log").open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        proc = self.proc
        wait_until(lambda: answers(f"{self.url}/health") or proc.poll() is not None, 120, "the MLflow server")
        assert proc.poll() is None, (folder / "server.log").read_text()[-3000:]

    def credentials(self, user: str) -> dict[str, str]:
        """What `user` exports to reach the server."""
        return {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": self.passwords[user]}

    def stop(self) -> None:
        kill_session(self.proc.pid)  # the server and its workers
        self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AuthServer]:
    """The server with the team's experiment, which the member `trainer` may edit."""
    from mlflow.server.auth.client import AuthServiceClient

    folder = tmp_path / "server"
    folder.mkdir()
    srv = AuthServer(folder)
    try:
        with monkeypatch.context() as admin:
            for key, value in srv.credentials("admin").items():
                admin.setenv(key, value)
            AuthServiceClient(srv.url).create_user("trainer", srv.passwords["trainer"])
            experiment_id = MlflowClient(srv.url).create_experiment(EXPERIMENT)
            AuthServiceClient(srv.url).grant_user_permission("trainer", "experiment", experiment_id, "EDIT")
        yield srv
    finally:
        srv.stop()


def start_node(temp_dir: Path, head_port: int, head: bool) -> int:
    """`ray start` of a head (no CPUs: no trial runs beside the driver) or a worker node (3 CPUs: a distributed trial's
    driver and its 2 workers), in an environment
    without any tracking credential; its temp dir is `temp_dir`. Returns its session id (to kill it)."""
    env = {k: v for k, v in git_env().items() if k not in TRACKING_CREDENTIALS}
    if not head and (Path.home() / ".ray" / "auth_token").exists():
        # `ray start --head` turns token auth on where a token exists; a joining node must be told to send it.
        env.setdefault("RAY_AUTH_MODE", "token")
    role = (["--head", f"--port={head_port}", "--num-cpus=0", "--include-dashboard=false"] if head
            else [f"--address=127.0.0.1:{head_port}", "--num-cpus=3"])  # fmt: skip
    node = subprocess.Popen(
        [RAY, "start", *role, "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}", "--disable-usage-stats",
         f"--dashboard-agent-listen-port={free_port()}"],
        cwd=temp_dir, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    printed = node.communicate(timeout=180)[0]
    if node.returncode != 0:
        kill_session(node.pid)
        raise AssertionError(printed)
    return node.pid


def job_table(address: str) -> str:
    """Every job of the cluster at `address` as `ray list jobs --detail` shows it (runtime environment included).

    The CLI asks the dashboard, which needs `ray[default]` (this project installs `ray[tune]`); the dashboard's
    rows come from this function, which reads the GCS job table directly.
    """
    import asyncio

    from ray._raylet import GcsClient
    from ray.dashboard.modules.job.utils import get_driver_jobs

    from pipelines.trials.ray_cluster import use_cluster_token

    use_cluster_token()  # `ray start` clusters require Ray's token, as the stage's driver sends it
    jobs, _ = asyncio.run(get_driver_jobs(GcsClient(address=address)))
    return "\n".join(str(job.model_dump()) for job in jobs.values())


def files_holding(secrets_: list[bytes], root: Path) -> list[str]:
    """Every file under `root` that holds one of `secrets_`."""
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and any(s in path.read_bytes() for s in secrets_):
                found.append(str(path))
        except OSError:  # a socket, or a file Ray removed while we walked
            continue
    return found


@pytest.fixture
def ray_dirs() -> Iterator[tuple[Path, Path]]:
    """The head's and the worker node's temp dirs: short paths (Ray's Unix sockets live there, and a socket's path
    is limited to 107 bytes), removed after the test."""
    dirs = Path(tempfile.mkdtemp(prefix="rh-")), Path(tempfile.mkdtemp(prefix="rw-"))
    yield dirs
    for folder in dirs:
        shutil.rmtree(folder, ignore_errors=True)


# One trial in one process, and a distributed one: its Ray Train workers (rank 0 logs the steps and the model) get
# the credentials from the trial, through a config that Ray Train also shows on its dashboard.
@pytest.mark.parametrize("workers", [1, 2], ids=["one-process-trial", "distributed-trial"])
def test_the_password_reaches_the_trials_on_another_node_and_is_written_nowhere(
    project_copy: Path, server: AuthServer, ray_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, workers: int
):
    head_dir, worker_dir = ray_dirs
    head_port = free_port()
    write_params(project_copy, {**QUICK, "log_every_n_steps": 1, "tracking.uri": server.url,
                                "tracking.experiment": EXPERIMENT, "distributed.num_workers": workers})  # fmt: skip
    member = server.credentials("trainer")
    sessions = []
    try:
        sessions.append(start_node(head_dir, head_port, head=True))
        sessions.append(start_node(worker_dir, head_port, head=False))
        env = {"RAY_ADDRESS": f"127.0.0.1:{head_port}", **member}
        outputs = [run([sys.executable, "-m", f"stages.{stage}"], project_copy, timeout=800, env=env)
                   for stage in ("tokenize", "train")]  # fmt: skip
        jobs = job_table(f"127.0.0.1:{head_port}")
    finally:
        for session in sessions:
            kill_session(session)

    with monkeypatch.context() as as_member:
        for key, value in member.items():
            as_member.setenv(key, value)
        client = MlflowClient(server.url)
        runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
        trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
        assert len(runs) == 2 and len(trials) == 1, [r.info.run_name for r in runs]
        # The trial (and, distributed, its rank 0) authenticated: its run finished with every step and its model.
        assert all(r.info.status == "FINISHED" for r in runs)
        steps = client.get_metric_history(trials[0].info.run_id, "train_loss")
        assert len(steps) == int(trials[0].data.metrics["optimizer_steps"]) > 0
        assert "upload.pending" not in trials[0].data.tags and trials[0].data.tags["model_uri"]

    passwords = [p.encode() for p in server.passwords.values()]
    # The runtime environment that carried the password before is still logged and shown: the search sees it.
    assert "TQDM_DISABLE" in jobs, jobs
    agent_logs = [p.read_text() for d in ray_dirs for p in d.rglob("runtime_env_agent.log")]
    assert any("TQDM_DISABLE" in log for log in agent_logs), "Ray's runtime-env agent logged no runtime env"
    assert list(worker_dir.glob("session_*/logs/worker-*.out")), "no trial ran on the worker node"
    leaks = [*files_holding(passwords, head_dir), *files_holding(passwords, worker_dir),
             *files_holding(passwords, project_copy)]  # fmt: skip
    leaks += ["the job table (`ray list jobs --detail`)"] if any(p.decode() in jobs for p in passwords) else []
    printed = "".join(out.stdout + out.stderr for out in outputs)
    leaks += ["the stages' output"] if any(p.decode() in printed for p in passwords) else []
    assert leaks == [], "\n".join(leaks)
