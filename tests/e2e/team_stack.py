"""A team's tracking stack, real and throw-away, as `docs/how-to/team-server.md` sets it up: PostgreSQL for the store
(Debian's `initdb` + `pg_ctl`), an S3 emulator for the artifacts (moto's server, from the package registry) and
`mlflow server --app-name basic-auth` in front of both, proxying the artifacts and serving HTTPS with a self-signed
certificate for 127.0.0.1 and localhost. The server's command and the certificate's are the how-to's own lines, read
from the page (`doc_command`) with this stack's ports, paths and names put in. Each listens on 127.0.0.1 on a free
port, keeps its files in a temporary folder, and can be stopped and started again on the same port and data. (The
page as a whole, in order, is run by tests/e2e/test_team_server_doc.py.)"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shlex
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port, git_env, kill_session

DOC = Path(__file__).resolve().parents[2] / "docs/how-to/team-server.md"
BUCKET = "team"
EXPERIMENT = "finetune"
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
S3_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def doc_command(program: str, values: dict[str, str]) -> list[str]:
    """The how-to's one command line that starts with `program` (continuation lines joined), each key of `values`
    replaced by its value in order (the page's paths, ports and names by this stack's), as an argv."""
    text = re.sub(r"\\\n\s*", " ", DOC.read_text())
    found = [line.strip() for line in text.splitlines() if line.strip().startswith(f"{program} ")]
    assert len(found) == 1, f"{DOC.name} has {len(found)} `{program}` commands, not one: {found}"
    line = found[0]
    for doc, here in values.items():
        line = line.replace(doc, here)
    return shlex.split(line)


def postgres_bin(tool: str) -> str | None:
    """A PostgreSQL server program (`initdb`, `pg_ctl`): on PATH, or in Debian's versioned folder."""
    found = shutil.which(tool)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    return candidates[-1] if candidates else None


def wait_until(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not come up within {seconds:.0f} s")
        time.sleep(0.3)


def answers(url: str, cafile: Path | None = None) -> bool:
    """Whether `url` answers 200; an https one verified against `cafile` (a self-signed server's certificate)."""
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200
    except OSError:
        return False


class Postgres:
    """A PostgreSQL cluster in a fresh folder made by the how-to's commands: its superuser `mlflow` with a random
    password, scram-sha-256 for every connection. Run by the `postgres` user when the tests run as root (it refuses
    root). Clients find the password in `pgpass` (`client_env`: PGPASSFILE), as the how-to's server does."""

    def __init__(self) -> None:
        initdb, self.pg_ctl = postgres_bin("initdb"), postgres_bin("pg_ctl")
        if initdb is None or self.pg_ctl is None:
            pytest.skip("PostgreSQL's server programs are not installed (.ci/run installs Debian's postgresql)")
        # Not under pytest's tmp_path: its parents are root's alone, and the server runs as another user.
        self.folder = Path(tempfile.mkdtemp(prefix="team-pg-"))
        self.port, self.as_user = free_port(), (["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else [])
        self.password = secrets.token_urlsafe(18)
        self.client_env = {"PGPASSFILE": str(self._write_pgpass())}
        if self.as_user:
            shutil.chown(self.folder, "postgres")
        # The how-to's initdb as written; --pwprompt asks twice. Run in a session of its own, without a terminal,
        # so PostgreSQL's prompt reads stdin (it reads /dev/tty when there is one), and the password is in no argv.
        self._run([initdb, "-D", str(self.folder / "data"), "--auth=scram-sha-256", "-U", "mlflow", "--pwprompt",
                   "--no-sync"], typed=f"{self.password}\n{self.password}\n")  # fmt: skip
        self.start()
        createdb = postgres_bin("createdb") or "createdb"
        self._run([createdb, "-h", "127.0.0.1", "-p", str(self.port), "-U", "mlflow", "mlflow"])
        # The how-to's URI: the user, no password (that is in PGPASSFILE, and so in no `ps`).
        self.uri = f"postgresql+psycopg://mlflow@127.0.0.1:{self.port}/mlflow"

    def _write_pgpass(self) -> Path:
        """libpq's password file (host:port:database:user:password), mode 600: libpq ignores one others may read."""
        pgpass = self.folder / "pgpass"
        pgpass.write_text(f"127.0.0.1:{self.port}:*:mlflow:{self.password}\n")
        pgpass.chmod(0o600)
        if self.as_user:
            shutil.chown(pgpass, "postgres")  # createdb runs as postgres; root's server reads it all the same
        return pgpass

    def _run(self, cmd: list[str], typed: str | None = None) -> None:
        subprocess.run([*self.as_user, *cmd], check=True, capture_output=True, cwd=self.folder, timeout=120,
                       input=typed, text=True, env={**os.environ, **self.client_env},
                       start_new_session=True)  # fmt: skip

    def start(self) -> None:
        # The how-to's options on a free port; -k: the socket in the folder (Debian's /var/run/postgresql is not
        # everyone's), fsync off: a throw-away store.
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off"
        self._run([self.pg_ctl, "-D", str(self.folder / "data"), "-o", options, "-l", str(self.folder / "log"),
                   "-w", "start"])  # fmt: skip

    def stop(self) -> None:
        self._run([self.pg_ctl, "-D", str(self.folder / "data"), "-m", "fast", "-w", "stop"])

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.folder, ignore_errors=True)


class S3Bucket:
    """moto's S3 server on a free port with the bucket `team`; `objects()` lists what the bucket holds."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port, self.proc = folder, free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import boto3

        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
            cwd=self.folder, env=git_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        wait_until(lambda: answers(f"{self.url}/moto-api/"), 60, "the S3 emulator")
        boto3.client("s3", endpoint_url=self.url, **_boto_keys()).create_bucket(Bucket=BUCKET)

    def objects(self, prefix: str = "") -> list[str]:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.url, **_boto_keys())
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def stop(self) -> None:
        if self.proc is not None:
            kill_session(self.proc.pid)
            self.proc.wait(timeout=30)
            self.proc = None


def _boto_keys() -> dict[str, str]:
    names = {"aws_access_key_id": "AWS_ACCESS_KEY_ID", "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
             "region_name": "AWS_DEFAULT_REGION"}  # fmt: skip
    return {argument: S3_KEYS[variable] for argument, variable in names.items()}


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """The how-to's openssl command for this host's names (localhost, 127.0.0.1): (certificate, private key).
    Clients verify the server's name against the subjectAltName, so it names every address they dial."""
    cert, key = folder / "mlflow-cert.pem", folder / "mlflow-key.pem"
    names = {"mlflow.internal": "localhost", "<private-ip>": "127.0.0.1", "/srv/mlflow/key.pem": str(key),
             "/srv/mlflow/cert.pem": str(cert)}  # fmt: skip
    subprocess.run(doc_command("openssl", names), check=True, capture_output=True, timeout=120)
    return cert, key


class TeamServer:
    """`mlflow server --app-name basic-auth` over `store` (a PostgreSQL URI; `store_env`: how the server finds its
    password) with artifacts proxied to the bucket, over HTTPS (`cert`: what clients trust); an admin with a random
    password, made on first start. `credentials(user)` is what a member exports."""

    def __init__(self, folder: Path, store: str, bucket: S3Bucket, store_env: dict[str, str] | None = None) -> None:
        self.folder, self.store, self.bucket, self.store_env = folder, store, bucket, store_env or {}
        self.port, self.proc = free_port(), None
        self.url = f"https://127.0.0.1:{self.port}"
        self.cert, self.key = self_signed_certificate(folder)
        self.passwords = {"admin": secrets.token_urlsafe(18)}
        self.secret_key = secrets.token_hex(16)  # CSRF tokens' key: the same across restarts
        (folder / "auth.ini").write_text(
            "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
            f"database_uri = sqlite:///{folder / 'auth.db'}\nadmin_username = admin\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            "auth_cache_ttl_seconds = 60\n"  # as the how-to advises: a password's hash checked once a minute
        )

    def command(self) -> list[str]:
        """The how-to's `mlflow server` command on this stack's port, store, bucket and certificate."""
        values = {
            "postgresql+psycopg://mlflow@127.0.0.1:5432/mlflow": self.store,
            "<private-ip>": "127.0.0.1",
            "mlflow.internal": "localhost",
            ":5000": f":{self.port}",
            "--port 5000": f"--port {self.port}",
            # Inside --uvicorn-opts, which uvicorn splits again: quoted (a temporary folder's name has no space).
            "/srv/mlflow/key.pem": shlex.quote(str(self.key)),
            "/srv/mlflow/cert.pem": shlex.quote(str(self.cert)),
        }
        argv = doc_command("mlflow server", values)
        assert f"s3://{BUCKET}/mlartifacts" in argv, argv  # the bucket this stack makes
        # This interpreter's mlflow; two workers: two experiments' trials at once (dvc queue start -j 2).
        return [sys.executable, "-m", "mlflow", *argv[1:], "--workers", "2"]

    def start(self) -> None:
        # AWS_MAX_ATTEMPTS=1: the server tries the bucket once per request (boto3's default is 5 tries), so a test
        # of a bucket that is down waits seconds; the client and the pipeline retry on their side.
        env = {
            **git_env(),
            **SERVER_ENV,
            **S3_KEYS,
            **self.store_env,
            "AWS_MAX_ATTEMPTS": "1",
            "MLFLOW_S3_ENDPOINT_URL": self.bucket.url,
            "MLFLOW_AUTH_CONFIG_PATH": str(self.folder / "auth.ini"),
            "MLFLOW_AUTH_ADMIN_PASSWORD": self.passwords["admin"],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": self.secret_key,
        }
        self.proc = proc = subprocess.Popen(
            self.command(), cwd=self.folder, env=env, stdout=(self.folder / "server.log").open("ab"),
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

        def up() -> bool:
            return answers(f"{self.url}/health", self.cert) or proc.poll() is not None

        wait_until(up, 120, "the MLflow server")
        if proc.poll() is not None:
            raise AssertionError(f"the MLflow server exited:\n{(self.folder / 'server.log').read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None:
            kill_session(self.proc.pid)  # the server and its workers
            self.proc.wait(timeout=30)
            self.proc = None

    def credentials(self, user: str) -> dict[str, str]:
        """The environment a member sets to reach the server as `user`: the name, the password, and the server's
        certificate to trust (self-signed: in no CA bundle, so every client is told where it is)."""
        return {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": self.passwords[user],
                "MLFLOW_TRACKING_SERVER_CERT_PATH": str(self.cert)}  # fmt: skip

    def add_user(self, user: str, permission: str | None, experiment_id: str | None = None) -> None:
        """Make `user` (a random password) and grant `permission` on the experiment, as the admin."""
        from mlflow.server.auth.client import AuthServiceClient

        self.passwords[user] = secrets.token_urlsafe(18)
        with as_user(self, "admin"):
            admin = AuthServiceClient(self.url)
            admin.create_user(user, self.passwords[user])
            if permission is not None:
                admin.grant_user_permission(user, "experiment", experiment_id, permission)

    def create_experiment(self, name: str = EXPERIMENT) -> str:
        from mlflow.tracking import MlflowClient

        with as_user(self, "admin"):
            return MlflowClient(self.url).create_experiment(name)


class as_user:  # noqa: N801 - used as a context manager, like a function
    """MLflow's credentials variables set to `user`'s for the block (this test process's own client calls)."""

    def __init__(self, server: TeamServer, user: str) -> None:
        self.values, self.saved = server.credentials(user), {}

    def __enter__(self) -> None:
        self.saved = {key: os.environ.get(key) for key in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class TeamStack:
    """PostgreSQL, the bucket and the server, started in that order; `close()` stops all three."""

    def __init__(self, folder: Path) -> None:
        self.postgres = Postgres()
        self.bucket = S3Bucket(folder)
        self.server = TeamServer(folder, self.postgres.uri, self.bucket, self.postgres.client_env)
        self.experiment_id: str | None = None  # the team's experiment, once the admin made it
        try:
            self.bucket.start()
            self.server.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.server.kill()
        self.bucket.stop()
        self.postgres.close()
