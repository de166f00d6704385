"""`python -m stages.<name> --help` in a fresh clone: the stage's purpose, the params it reads and what it writes,
with nothing started or written (no Ray, no MLflow, no mlflow.db, no checkpoints/); any other argument is refused
with the allowed ones."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import run

STAGES = ("validate", "source", "tokenize", "train", "evaluate", "report")
# Runs the stage as `python -m` would, then says whether Ray or MLflow was imported (neither may be).
PROBE = (
    "import runpy, sys\n"
    "sys.argv = ['x', '--help']\n"
    "try:\n    runpy.run_module('stages.{stage}', run_name='__main__', alter_sys=True)\n"
    "except SystemExit as end:\n    print('exit', end.code)\n"
    "print('imported', sorted(m for m in ('ray', 'mlflow', 'torch') if m in sys.modules))\n"
)


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".git" not in p.parts)


@pytest.mark.parametrize("stage", STAGES)
def test_help_describes_the_stage_and_touches_nothing(project_copy, stage):
    before = listing(project_copy)
    done = run([sys.executable, "-c", PROBE.format(stage=stage)], project_copy, timeout=120)
    out = done.stdout
    assert f"python -m stages.{stage}" in out and f"DVC stage `{stage}`" in out
    assert "Params read" in out and "Outputs written" in out
    assert "exit 0" in out and "imported []" in out, out[-500:]
    assert listing(project_copy) == before  # no mlflow.db, no checkpoints/, no output
    assert not (project_copy / "mlflow.db").exists() and not (project_copy / "checkpoints").exists()


def test_an_unknown_argument_is_refused_with_the_allowed_ones(project_copy):
    done = run([sys.executable, "-m", "stages.train", "--epochs", "3"], project_copy, check=False, timeout=120)
    assert done.returncode == 2
    assert "usage: python -m stages.train [-h]" in done.stderr and "unrecognized arguments: --epochs 3" in done.stderr
    assert not (project_copy / "mlflow.db").exists()
