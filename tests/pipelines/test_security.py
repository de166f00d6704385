"""Security rules of the package: no code execution or unpickling of user input, safe loading and saving, no
credential in Ray's files."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO_ROOT

SOURCES = sorted((REPO_ROOT / "pipelines").rglob("*.py")) + sorted((REPO_ROOT / "stages").rglob("*.py"))


def test_no_eval_exec_or_pickle_in_the_package():
    for path in SOURCES:
        text = path.read_text()
        assert not re.search(r"(?<![\w.])(eval|exec)\(", text), path
        assert "import pickle" not in text and "pickle.load" not in text, path
        assert "yaml.load(" not in text and "yaml.unsafe_load" not in text, path  # safe_load only


def test_torch_load_is_weights_only_and_models_are_saved_as_safetensors():
    loads = [(p, line) for p in SOURCES for line in p.read_text().splitlines() if "torch.load(" in line]
    assert loads and all("weights_only=True" in line for _, line in loads), loads
    saves = [line for p in SOURCES for line in p.read_text().splitlines() if "model.save_pretrained(" in line]
    assert saves and all("safe_serialization=True" in line for line in saves), saves


def test_remote_code_is_off_by_default_and_docs_bind_servers_to_loopback(default_params):
    assert default_params.model.trust_remote_code is False
    docs = "\n".join(p.read_text() for p in [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])
    for command in re.findall(r"mlflow (?:ui|server) --[^\n`]*", docs):
        # Loopback, or (the cluster section) a private address the reader fills in; never all interfaces.
        assert "--host 127.0.0.1" in command or "--host <private-ip>" in command, command
        assert "--host 0.0.0.0" not in command, command


# A driver whose cluster started without the credentials: they reach a task (its own process) by the object store.
CHANNEL = """
import os, sys, ray
from pipelines.trials.ray_cluster import init_ray, seal_credentials, use_tracking_credentials

init_ray(1, None)
os.environ["MLFLOW_TRACKING_PASSWORD"] = sys.stdin.readline().strip()  # after the cluster's processes started


@ray.remote
def seen(sealed):
    before = os.environ.get("MLFLOW_TRACKING_PASSWORD")
    use_tracking_credentials(sealed)
    return before, os.environ.get("MLFLOW_TRACKING_PASSWORD"), os.environ.get("TQDM_DISABLE")


print(ray.get(seen.remote(seal_credentials())))
ray.shutdown()
"""


def test_credentials_reach_a_ray_worker_by_the_object_store_and_no_ray_file_holds_them(monkeypatch):
    from pipelines.trials.ray_cluster import TRACKING_CREDENTIALS, worker_env

    for key in TRACKING_CREDENTIALS:
        monkeypatch.setenv(key, "x")
    assert set(worker_env()) & set(TRACKING_CREDENTIALS) == set()  # never in Ray's runtime environment
    password = secrets.token_urlsafe(18)
    temp = Path(tempfile.mkdtemp(prefix="rs-"))  # short: Ray's Unix sockets live under it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *TRACKING_CREDENTIALS)}
    try:
        done = subprocess.run([sys.executable, "-c", CHANNEL], input=f"{password}\n", capture_output=True, text=True,
                              env={**env, "RAY_TMPDIR": str(temp), "PYTHONPATH": str(REPO_ROOT)}, cwd=temp,
                              timeout=180, check=True)  # fmt: skip
        assert done.stdout.strip().splitlines()[-1] == str((None, password, "1")), done.stdout + done.stderr
        logs = [p for p in temp.rglob("*") if p.is_file() and not p.is_symlink()]
        assert any(b"TQDM_DISABLE" in p.read_bytes() for p in logs)  # the runtime env Ray logs was searched
        assert [p for p in logs if password.encode() in p.read_bytes()] == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)
