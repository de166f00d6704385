"""docs/how-to/team-server.md runs as written, in order, on this machine: every block of the page, with only the
substitutions of `Stack.as_here` (a temporary folder for /srv, free ports, this host's names, random passwords), the
commands in NOT_RUN_HERE left to the tests named there, and the answers to its prompts typed on stdin. Then a member
logs a run, as the page's last block sets them up, and its artifact lands in the bucket.

Runs as root (as .ci/run does): the page's `sudo -u postgres` is `runuser -u postgres --` here (CI has no sudo)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port, git_env, kill_session
from tests.e2e.team_stack import answers, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DOC = REPO_ROOT / "docs/how-to/team-server.md"
# Installed by .ci/run (`pip install -e ".[dev]"`: the dev extra has the team extra and moto[server]); the pipeline
# against this stack (`dvc repro`) and `--resume-upload` are tests/e2e/test_team_server.py's. A member's `dvc repro`
# is a client logging one run here, with the environment the page's block set.
NOT_RUN_HERE = {
    'pip install -e ".[team]"': ":",
    'pip install "moto[server]"': ":",
    "python -m stages.train --resume-upload": ":",
    "dvc repro": 'python -c "$MEMBER_LOGS_A_RUN"',
}
MEMBER_LOGS_A_RUN = """
import mlflow
mlflow.set_tracking_uri('https://mlflow.internal:5000')
mlflow.set_experiment('finetune')
with mlflow.start_run(run_name='member') as run:
    mlflow.log_metric('test_accuracy', 0.75)
    mlflow.log_text('proxied to the bucket', 'note.txt')
print(run.info.run_id)
"""


class Stack:
    """The page's names for what this machine has instead, and the answers its prompts get."""

    def __init__(self) -> None:
        self.srv = Path(tempfile.mkdtemp(prefix="team-doc-srv-"))
        self.srv.chmod(0o755)  # as /srv: the postgres account goes through it to its own folder
        self.ports = {"5432": free_port(), "5000": free_port(), "9000": free_port()}
        self.db_password, self.admin_password, self.alice_password = (secrets.token_urlsafe(18) for _ in range(3))
        self.secret_key = secrets.token_hex(16)
        self.sessions: list[int] = []  # every block's process session, to end whatever it left running

    def substitutions(self) -> list[tuple[str, str]]:
        """Applied in this order, after the ports (`as_here`)."""
        return [
            ("sudo -u postgres ", "runuser -u postgres -- "),  # root on CI, without sudo
            ("sudo ", ""),
            ("<private-ip>", "127.0.0.1"),
            ("mlflow.internal", "localhost"),
            ("/etc/mlflow/mlflow-cert.pem", "/srv/mlflow/cert.pem"),  # the member's copy: the server's own file
            ("/srv/", f"{self.srv}/"),
            ("<server-key-id>", "testing"),
            ("<server-secret-key>", "testing"),
            ("<s3-endpoint>", f"http://127.0.0.1:{self.ports['9000']}"),
            ("<a long random password>", self.admin_password),
            ("<admin password>", self.admin_password),
            ("<another random string>", self.secret_key),
            ("<alice's password>", self.alice_password),
        ]

    def as_here(self, text: str) -> str:
        for line, instead in NOT_RUN_HERE.items():
            text = re.sub(rf"^{re.escape(line)}$", instead, text, flags=re.M)
        # The ports first, as whole numbers (a path or a password must not have one replaced inside it).
        text = re.sub(r"\b(5432|5000|9000)\b", lambda m: str(self.ports[m.group(1)]), text)
        for doc, here in self.substitutions():
            text = text.replace(doc, here)
        return text

    def bash(self, name: str, block: str, typed: str = "", env: dict[str, str] | None = None) -> subprocess.Popen:
        """A block as one bash script (`set -e`: it stops at its first failing command), with `typed` on stdin; what
        it prints goes to `<name>.out` (a server's output never fills a pipe)."""
        with (self.srv / f"{name}.out").open("w") as out:
            proc = subprocess.Popen(["bash", "-ec", self.as_here(block)], cwd=self.srv,
                                    env={**git_env(), **(env or {})}, stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        self.sessions.append(proc.pid)
        assert proc.stdin is not None
        proc.stdin.write(typed)
        proc.stdin.close()
        return proc

    def finished(self, name: str, block: str, typed: str = "", env: dict[str, str] | None = None) -> str:
        """Run a block to its end; what it printed."""
        proc = self.bash(name, block, typed, env)
        proc.wait(timeout=300)
        printed = (self.srv / f"{name}.out").read_text()
        assert proc.returncode == 0, f"the {name} block exited {proc.returncode}:\n{printed[-4000:]}"
        return printed

    def close(self) -> None:
        data = self.srv / "mlflow-pg/data"
        bindir = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None)
        if data.is_dir() and bindir is not None:
            subprocess.run(["runuser", "-u", "postgres", "--", str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast",
                            "stop"], capture_output=True, timeout=60)  # fmt: skip
        for session in self.sessions:
            kill_session(session)
        shutil.rmtree(self.srv, ignore_errors=True)


def blocks() -> list[tuple[str, str]]:
    """The page's fenced blocks in order: (language, text)."""
    return re.findall(r"^```(\w+)\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def test_the_team_how_to_runs_as_written_and_a_member_logs_a_run():
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("runs the page's `sudo -u postgres` as root with runuser (as .ci/run does)")
    if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("Debian's PostgreSQL is not installed (.ci/run installs it)")
    page = blocks()
    bash_blocks = [text for lang, text in page if lang == "bash"]
    python_blocks = [text for lang, text in page if lang == "python"]
    assert len(bash_blocks) == 9 and len(python_blocks) == 1, "the page's blocks changed: update this test"
    install, database, password_file, moto, auth_config, certificate, server, member, resume = bash_blocks
    stack = Stack()
    try:
        stack.finished("install", install)
        # initdb asks for the password twice; `read -rs` once more. Every block after runs in the environment the
        # earlier ones exported, as in one shell: the password-file block's PGPASSFILE is the server's.
        stack.finished("database", database, typed=f"{stack.db_password}\n{stack.db_password}\n")
        stack.finished("password-file", password_file + "\nexport -p > exported.sh\n", typed=f"{stack.db_password}\n")
        shell = {"BASH_ENV": str(stack.srv / "exported.sh")}  # bash reads it first, as a shell's earlier exports
        stack.finished("moto", moto, env=shell)
        # The page starts moto in the background and goes on; a person typing the next block gives it the second
        # it needs to listen, which this test waits for.
        wait_until(lambda: answers(f"http://127.0.0.1:{stack.ports['9000']}/moto-api/"), 60, "moto's S3 server")
        stack.finished("auth-config", auth_config, env=shell)
        stack.finished("certificate", certificate, env=shell)
        cert = stack.srv / "mlflow/cert.pem"
        url = f"https://localhost:{stack.ports['5000']}"
        running = stack.bash("server", server, env=shell)
        wait_until(lambda: answers(f"{url}/health", cert) or running.poll() is not None, 180, "the MLflow server")
        assert running.poll() is None, (stack.srv / "server.out").read_text()[-4000:]
        admin = subprocess.run([sys.executable, "-c", stack.as_here(python_blocks[0])], env=git_env(),
                               capture_output=True, text=True, timeout=180)  # fmt: skip
        assert admin.returncode == 0, admin.stderr[-4000:]
        member_env = {"MEMBER_LOGS_A_RUN": stack.as_here(MEMBER_LOGS_A_RUN)}
        printed = stack.finished("member", member, typed=f"{stack.alice_password}\n", env=member_env)
        check_the_members_run(stack, url, cert, printed.strip().splitlines()[-1])
        assert stack.as_here(resume).strip() == ":"  # the last block: test_team_server.py's (NOT_RUN_HERE)
    finally:
        stack.close()


def check_the_members_run(stack: Stack, url: str, cert: Path, run_id: str) -> None:
    """As the admin: the run is in `finetune`, with its metric; its file went through the server to the bucket
    (moto's, read with the server's keys)."""
    import boto3
    from mlflow.tracking import MlflowClient

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                                            "MLFLOW_TRACKING_SERVER_CERT_PATH")}  # fmt: skip
    os.environ.update({"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": stack.admin_password,
                       "MLFLOW_TRACKING_SERVER_CERT_PATH": str(cert)})  # fmt: skip
    try:
        run = MlflowClient(url).get_run(run_id)
        experiment = MlflowClient(url).get_experiment(run.info.experiment_id)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert (experiment.name, run.data.metrics) == ("finetune", {"test_accuracy": 0.75})
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{stack.ports['9000']}", aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
    keys = [item["Key"] for item in s3.list_objects_v2(Bucket="team").get("Contents", [])]
    assert any(key.endswith(f"{run_id}/artifacts/note.txt") for key in keys), keys
