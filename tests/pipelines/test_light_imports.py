"""The training engine imports without mlflow, ray, dvc or datasets: it must run alone on a GPU machine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO_ROOT

# What a bare GPU machine runs: the engine, its parts, the batching, the tasks and the memory plan.
LIGHT_MODULES = [
    "pipelines.train.engine",
    "pipelines.train.optim",
    "pipelines.train.memory",
    "pipelines.runtime",
    "pipelines.train.checkpoint",
    "pipelines.train.batch_size",
    "pipelines.train.flops",
    "pipelines.data.batching",
    "pipelines.data.packing",
    "pipelines.data.tokenization",
    "pipelines.tasks",
    "pipelines.model",
    "pipelines.adapters",
    "pipelines.evaluation",
    "pipelines.resolve.memory_plan",
    "benchmarks.bench_gpu",
]
ABSENT = ("mlflow", "ray", "dvc", "datasets")


def test_the_engine_imports_with_mlflow_ray_dvc_and_datasets_absent():
    # The modules are hidden from the import system (as if not installed), not merely pre-imported as None:
    # transformers probes optional packages with find_spec, which must answer "not installed".
    script = textwrap.dedent(
        f"""
        import importlib, importlib.machinery, sys
        ABSENT = {ABSENT!r}
        find = importlib.machinery.PathFinder.find_spec

        def hidden(cls, name, path=None, target=None):
            return None if name.split(".")[0] in ABSENT else find(name, path, target)

        importlib.machinery.PathFinder.find_spec = classmethod(hidden)
        for module in {LIGHT_MODULES!r}:
            importlib.import_module(module)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ABSENT)
        print("LOADED", loaded)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED []" in proc.stdout
