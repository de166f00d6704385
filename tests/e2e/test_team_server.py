"""A team's tracking server, as docs/how-to/team-server.md sets it up: PostgreSQL, an S3 bucket behind the MLflow
server, basic auth over HTTPS. Two experiments at once, restarts mid-run, a bucket that fails, users it refuses, a
client that does not trust its certificate, and what crosses the wire."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request

from tests.conftest import FOUR_VARIANTS, QUICK, git_env, run, write_params
from tests.e2e.team_stack import EXPERIMENT, Postgres, TeamStack, as_user, postgres_bin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def team(tmp_path: Path):
    """PostgreSQL, the bucket and the MLflow server with basic auth, running for one test."""
    stack = TeamStack(tmp_path)
    yield stack
    stack.close()


def team_params(root: Path, team: TeamStack, **overrides: object) -> None:
    write_params(root, {**QUICK, "log_every_n_steps": 1, "tracking.uri": team.server.url,
                        "tracking.experiment": EXPERIMENT, **overrides})  # fmt: skip
    run(["git", "commit", "-qam", "team server"], root)


def member(team: TeamStack, user: str = "trainer", permission: str | None = "EDIT") -> dict[str, str]:
    """A member of the team with `permission` on the experiment; the environment their commands run with."""
    team.experiment_id = team.experiment_id or team.server.create_experiment()
    team.server.add_user(user, permission, team.experiment_id)
    return team.server.credentials(user)


def stage(root: Path, name: str, env: dict[str, str], *args: str, check: bool = True):
    return run([sys.executable, "-m", f"stages.{name}", *args], root, timeout=800, check=check, env=env)


def runs_of(team: TeamStack) -> list:
    with as_user(team.server, "admin"):
        client = MlflowClient(team.server.url)
        return client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id], max_results=1000)


def assert_every_step_arrived(client: MlflowClient, child) -> None:
    steps = int(child.data.metrics["optimizer_steps"])
    history = client.get_metric_history(child.info.run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1)), child.data.tags.get("variant")


def assert_no_password_anywhere(team: TeamStack, root: Path) -> None:
    """No password (the members', the admin's, the store's) in a file under `root` (the pipeline's outputs, DVC's and
    Ray's files), nor in the store."""
    secrets = [p.encode() for p in [*team.server.passwords.values(), team.postgres.password]]
    for path in root.rglob("*"):
        if path.is_file() and ".git" not in path.parts:
            data = path.read_bytes()
            assert not any(s in data for s in secrets), f"a password is in {path}"
    dump = subprocess.run(
        [*team.postgres.as_user, postgres_bin("pg_dump"), "-h", "127.0.0.1", "-p", str(team.postgres.port),
         "-U", "mlflow", "mlflow"], capture_output=True, check=True, cwd=team.postgres.folder,
        env={**os.environ, **team.postgres.client_env},
    ).stdout  # fmt: skip
    assert b"CREATE TABLE" in dump and not any(s in dump for s in secrets)


def test_two_experiments_at_once_on_the_team_server_lose_nothing(project_copy: Path, team: TeamStack):
    env = member(team)
    team_params(project_copy, team, **{"tune.variants": FOUR_VARIANTS, "tune.max_concurrent_trials": 2})
    # Two experiments at once: a grid of 4 variants (2 trials at a time), and one trial with another seed (the queue
    # takes the workspace's params as they are when it is queued).
    run(["dvc", "exp", "run", "--queue", "-n", "grid"], project_copy, env=env)
    write_params(project_copy, {"tune.variants": {}, "seed": 7})
    run(["dvc", "exp", "run", "--queue", "-n", "single"], project_copy, env=env)
    run(["git", "checkout", "--", "params.yaml"], project_copy)
    run(["dvc", "queue", "start", "-j", "2"], project_copy, env=env)
    deadline = time.monotonic() + 800
    while time.monotonic() < deadline:
        status = run(["dvc", "queue", "status"], project_copy, env=env).stdout
        if "Queued" not in status and "Running" not in status:
            break
        time.sleep(3)
    assert status.count("Success") == 2, (
        status
        + "".join(  # both logs: either may be the one that failed
            run(["dvc", "queue", "logs", name], project_copy, check=False).stdout[-6000:] for name in ("grid", "single")
        )
    )

    runs = runs_of(team)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert sorted(p.data.tags["dvc_exp_name"] for p in parents) == ["grid", "single"]  # no duplicate, none lost
    by_parent = {p.data.tags["dvc_exp_name"]: sorted(c.data.tags["variant"] for c in children
                 if c.data.tags["mlflow.parentRunId"] == p.info.run_id) for p in parents}  # fmt: skip
    assert by_parent == {"grid": sorted(FOUR_VARIANTS), "single": ["default"]}
    assert len(children) == 5 and all(r.info.status == "FINISHED" for r in runs)
    # Each trial records how many trials of the project trained on the host at once: the grid's 2 at a time at
    # least, and the queue's -j 2 ran the other experiment beside them.
    together = {c.data.tags["variant"]: c.data.metrics["concurrent_trials"] for c in children}
    assert all(count >= 2 for count in together.values()), together
    assert all(c.data.tags["concurrent_trials"] == f"{c.data.metrics['concurrent_trials']:.0f}" for c in children)
    objects = set(team.bucket.objects())
    with as_user(team.server, "admin"):
        client = MlflowClient(team.server.url)
        for child in children:
            assert_every_step_arrived(client, child)
            run_id, model_id = child.info.run_id, child.data.tags["model_uri"].removeprefix("models:/")
            assert any(k.endswith(f"{run_id}/artifacts/params.json") for k in objects)
            assert any(model_id in k and k.endswith("model.safetensors") for k in objects), child.data.tags["variant"]
            assert {d.dataset.name for d in client.get_run(run_id).inputs.dataset_inputs} == {
                "train", "validation", "test"}  # fmt: skip
    for parent in parents:
        assert any(k.endswith(f"{parent.info.run_id}/artifacts/report/report.md") for k in objects)
    assert_no_password_anywhere(team, project_copy)


def test_restarts_of_the_store_and_the_server_mid_trial_lose_nothing(project_copy: Path, team: TeamStack):
    env = member(team)
    team_params(project_copy, team, **{"data.generator.num_rows": 3000, "epochs": 3})
    stage(project_copy, "tokenize", env)
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=project_copy, env={**git_env(), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    with as_user(team.server, "admin"):
        client = MlflowClient(team.server.url)
        deadline, child = time.monotonic() + 300, None
        while child is None and time.monotonic() < deadline and proc.poll() is None:
            child = next((r for r in runs_of(team) if "mlflow.parentRunId" in r.data.tags
                          and client.get_metric_history(r.info.run_id, "train_loss")), None)  # fmt: skip
            time.sleep(0.5)
        assert child is not None, "the trial never logged"
        team.postgres.restart()  # the store goes away and comes back...
        team.server.kill()  # ...then the server dies...
        time.sleep(8)
        back = time.time()
        team.server.start()  # ...and comes back on the same port, store and bucket
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-3000:]
        assert "buffering metrics" in output and "reachable again" in output
        finished = client.get_run(child.info.run_id)
        assert finished.info.status == "FINISHED"
        assert_every_step_arrived(client, finished)
        # The system metrics resumed after the outage (sampled every 5 s), and the run says what they missed.
        cpu = client.get_metric_history(child.info.run_id, "system/cpu_utilization_percentage")
        assert cpu and max(m.timestamp for m in cpu) / 1000 > back, "no system metric after the server came back"
        assert "tracking server unreachable" in finished.data.tags["system_metrics.gaps"]
        assert 0 < finished.data.metrics["system_metrics_gap_s"] < 120
    assert not list((project_copy / "mlflow-fallback").glob("*.json"))


def test_a_failing_bucket_keeps_the_models_and_resume_upload_sends_them(project_copy: Path, team: TeamStack):
    env = member(team)
    variants = {"adamw": {}, "adafactor": {"optim": "adafactor"}}
    team_params(project_copy, team, **{"tune.variants": variants, "tracking.upload_retry_s": 3})
    stage(project_copy, "tokenize", env)
    team.bucket.stop()  # the bucket is unreachable while the trials log their models
    trained = stage(project_copy, "train", env)
    said = trained.stdout + trained.stderr
    assert "could not send 'model'" in said and "--resume-upload" in said

    summary = json.loads((project_copy / "models/trials.json").read_text())
    best = summary["best"]
    other = next(t for t in summary["trials"] if t["trial_id"] != best["trial_id"])
    assert (project_copy / "models/best/model.safetensors").is_file()  # both models stay on disk
    assert (project_copy / "models/unsent" / other["trial_id"] / "model.safetensors").is_file()
    with as_user(team.server, "admin"):
        client = MlflowClient(team.server.url)
        for trial in summary["trials"]:
            tags = client.get_run(trial["mlflow_run_id"]).data.tags
            assert set(json.loads(tags["upload.pending"])) == {"model", "params.json"} and "model_uri" not in tags
            assert client.get_run(trial["mlflow_run_id"]).info.status == "FINISHED"
        assert "trials.json" in json.loads(client.get_run(summary["parent_run_id"]).data.tags["upload.pending"])

    team.bucket.start()  # the bucket is back (empty: the emulator keeps nothing)
    resumed = stage(project_copy, "train", env, "--resume-upload")
    assert "5 pending artifact(s) sent" in resumed.stdout and "registered the best model" in resumed.stdout
    objects = set(team.bucket.objects())
    with as_user(team.server, "admin"):
        for trial in summary["trials"]:
            tags = client.get_run(trial["mlflow_run_id"]).data.tags
            assert "upload.pending" not in tags
            model_id = tags["model_uri"].removeprefix("models:/")
            assert any(model_id in k and k.endswith("model.safetensors") for k in objects)
        assert any(k.endswith(f"{summary['parent_run_id']}/artifacts/trials.json") for k in objects)
        assert client.get_latest_versions(f"{EXPERIMENT}-classification")
    again = stage(project_copy, "train", env, "--resume-upload")
    assert "nothing was pending" in again.stdout


def test_the_server_refuses_a_reader_and_a_wrong_password_before_any_trial(project_copy: Path, team: TeamStack):
    reader = member(team, "reader", "READ")
    team_params(project_copy, team)
    stage(project_copy, "tokenize", reader)
    refused = stage(project_copy, "train", reader, check=False)
    assert refused.returncode == 1
    assert "user 'reader' may not write" in refused.stderr and "403" in refused.stderr, refused.stderr[-2000:]
    wrong = {**member(team), "MLFLOW_TRACKING_PASSWORD": "not-the-password"}
    refused = stage(project_copy, "train", wrong, check=False)
    assert refused.returncode == 1 and "refused the credentials of user 'trainer'" in refused.stderr
    assert "not-the-password" not in refused.stderr + refused.stdout
    assert runs_of(team) == [] and not (project_copy / "checkpoints").exists()  # no run opened, no trial started
    assert_no_password_anywhere(team, project_copy)


def test_the_store_lets_in_only_the_how_tos_user_with_its_password():
    """The store as the how-to's initdb makes it: every connection rule scram-sha-256, so user `mlflow` is refused
    without its password and let in with it (from PGPASSFILE, as the server finds it)."""
    store = Postgres()
    try:
        query = [*store.as_user, postgres_bin("psql"), "-h", "127.0.0.1", "-p", str(store.port), "-U", "mlflow", "-w",
                 "-Atc", "SELECT DISTINCT auth_method FROM pg_hba_file_rules", "mlflow"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "PGPASSWORD"}
        refused = subprocess.run(query, capture_output=True, text=True, cwd=store.folder, timeout=60,
                                 env={**env, "PGPASSFILE": str(store.folder / "absent")})  # fmt: skip
        assert refused.returncode != 0 and "password" in refused.stderr, refused
        allowed = subprocess.run(query, capture_output=True, text=True, cwd=store.folder, timeout=60,
                                 env={**env, **store.client_env})  # fmt: skip
        assert allowed.returncode == 0 and allowed.stdout.split() == ["scram-sha-256"], allowed
    finally:
        store.close()


def test_a_member_without_the_servers_certificate_is_refused_before_any_trial(
    project_copy: Path, team: TeamStack, monkeypatch: pytest.MonkeyPatch
):
    """The server's certificate is self-signed: a client not told to trust it (no MLFLOW_TRACKING_SERVER_CERT_PATH)
    refuses the connection, so it never sends the password to a server it cannot tell from an impostor."""
    trusting = member(team)
    untrusting = {key: value for key, value in trusting.items() if key != "MLFLOW_TRACKING_SERVER_CERT_PATH"}
    team_params(project_copy, team)
    stage(project_copy, "tokenize", untrusting)
    refused = stage(project_copy, "train", untrusting, check=False)
    assert refused.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused.stderr[-2000:]
    assert runs_of(team) == [] and not (project_copy / "checkpoints").exists()  # no run opened, no trial started
    # MLflow's own client (the trials' and the system metrics' way to the server) refuses it too. No retries: MLflow
    # retries a refused handshake 7 times by default (4 minutes), and the first refusal is the one that counts.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    for key, value in untrusting.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_SERVER_CERT_PATH", raising=False)
    with pytest.raises(MlflowException, match="CERTIFICATE_VERIFY_FAILED"):
        MlflowClient(team.server.url).get_experiment(team.experiment_id)
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", trusting["MLFLOW_TRACKING_SERVER_CERT_PATH"])
    assert MlflowClient(team.server.url).get_experiment(team.experiment_id).name == EXPERIMENT  # with it, let in


class Relay:
    """A TCP relay from a free port of 127.0.0.1 to `port` that keeps every byte each way (`sent`: client to server,
    `received`: server to client): what anyone on the network path between a member and the server can read."""

    def __init__(self, port: int) -> None:
        self.target, self.sent, self.received = port, bytearray(), bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        """Take each connection and relay it both ways, one thread a direction, until the relay is closed."""
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=30)
            for source, sink, record in ((client, upstream, self.sent), (upstream, client, self.received)):
                threading.Thread(target=self._pump, args=(source, sink, record), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, record: bytearray) -> None:
        """Copy `source` to `sink`, recording it, until `source` closes; then close `sink`'s sending side."""
        try:
            while chunk := source.recv(65536):
                record += chunk  # before it is passed on: whatever the far side saw, the record holds
                sink.sendall(chunk)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the other side went away: the exchange is over

    def close(self) -> None:
        """Take no more connections (those open end with their sides)."""
        self.listener.close()


def test_the_password_crosses_the_wire_only_encrypted(project_copy: Path, team: TeamStack):
    """MLflow's client, with a member's environment, reads the experiment through a relay that records the traffic:
    the request and its answer arrive, and the recording holds no password, no basic-auth header, no plain HTTP.
    The same client writing http:// to the same port sends its password in clear (what the recording shows without
    TLS), and the server answers it nothing: its port speaks only TLS. The pipeline given http:// by mistake stops at
    its health probe, which carries no credentials, before it sends the password."""
    user, env = "trainer", member(team)
    token = base64.b64encode(f"{user}:{env['MLFLOW_TRACKING_PASSWORD']}".encode())
    secrets = (env["MLFLOW_TRACKING_PASSWORD"].encode(), token)
    relay = Relay(team.server.port)
    try:
        with as_user(team.server, user):
            # Host: the server's own name and port, which --allowed-hosts lets in (the relay's port it would refuse).
            answer = http_request(get_default_host_creds(f"https://127.0.0.1:{relay.port}"),
                                  "/api/2.0/mlflow/experiments/get", "GET", max_retries=0,
                                  params={"experiment_id": team.experiment_id},
                                  extra_headers={"Host": f"127.0.0.1:{team.server.port}"})  # fmt: skip
            assert answer.status_code == 200 and answer.json()["experiment"]["name"] == EXPERIMENT
            encrypted, answered = bytes(relay.sent), bytes(relay.received)
            assert encrypted[:1] == answered[:1] == b"\x16"  # both sides open with a TLS handshake record
            assert not any(s in encrypted for s in secrets) and b"Authorization" not in encrypted
            assert b"HTTP/1.1" not in encrypted + answered and EXPERIMENT.encode() not in answered
            del relay.sent[:], relay.received[:]
            with pytest.raises(MlflowException):
                http_request(get_default_host_creds(f"http://127.0.0.1:{relay.port}"),
                             "/api/2.0/mlflow/experiments/get", "GET", max_retries=0,
                             params={"experiment_id": team.experiment_id})  # fmt: skip
        assert token in relay.sent  # without TLS, anyone on the path reads it
        assert not relay.received.startswith(b"HTTP/")  # the server did not take the request
        del relay.sent[:], relay.received[:]
        team_params(project_copy, team, **{"tracking.uri": f"http://127.0.0.1:{relay.port}"})
        stage(project_copy, "tokenize", env)
        mistaken = stage(project_copy, "train", env, check=False)
        assert mistaken.returncode == 1 and "unreachable" in mistaken.stderr, mistaken.stderr[-2000:]
        assert b"GET /health" in relay.sent and not any(s in relay.sent for s in secrets)
    finally:
        relay.close()
