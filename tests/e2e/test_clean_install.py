"""`pip install .` alone, in a new virtual environment, imports every module of `pipelines/`: an import whose
distribution pyproject does not declare fails here, where on a developer's machine something else had brought it.
The static twin (tests/pipelines/test_declared_dependencies.py) reads the source in a second; this one installs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

IMPORT_ALL = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import pipelines
    assert "site-packages" in pipelines.__file__, pipelines.__file__  # the installed copy, not this checkout
    names = [m.name for m in pkgutil.walk_packages(pipelines.__path__, "pipelines.")]
    for name in names:
        importlib.import_module(name)
    print(len(names), "modules")
    """
)


def test_pip_install_alone_imports_every_module(tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # The CPU build of torch first, as .ci/run does, so pip does not pull the CUDA packages; then the package alone.
    for args in (["torch==2.13.0"], [str(REPO_ROOT)]):
        done = subprocess.run(pip + args, env=env, capture_output=True, text=True, timeout=700)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([python, "-c", IMPORT_ALL], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    count = sum(1 for p in (REPO_ROOT / "pipelines").rglob("*.py") if p.name != "__init__.py")
    count += sum(1 for p in (REPO_ROOT / "pipelines").rglob("__init__.py") if p.parent.name != "pipelines")
    assert done.stdout.split()[0] == str(count)  # every module, not a package that stopped walking early
