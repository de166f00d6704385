"""Ray's token-auth notice is not printed when the train stage starts its own local cluster (a token exists, auth
stays on), unless the user asks for it with RAY_LOG_TOKEN_NOTICE=1."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

START = "from pipelines.trials.ray_cluster import init_ray; import ray; init_ray(1, None); ray.shutdown()"
NOTICE = "Token authentication is enabled for this Ray cluster"


@pytest.mark.parametrize(("asked", "shown"), [(False, False), (True, True)])
def test_the_token_notice_is_quiet_on_our_own_local_cluster(tmp_path, asked, shown):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # Ray then turns token auth on
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO_ROOT), **({"RAY_LOG_TOKEN_NOTICE": "1"} if asked else {}))
    done = subprocess.run([sys.executable, "-c", START], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180, check=True)  # fmt: skip
    assert (NOTICE in done.stdout + done.stderr) is shown
