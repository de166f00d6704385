"""The training engine imports without mlflow, ray, dvc or datasets: it must run alone on a GPU machine."""

from __future__ import annotations

import json
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
    "pipelines.resolve.batch_size",
    "pipelines.train.flops",
    "pipelines.data.batching",
    "pipelines.data.packing",
    "pipelines.data.tokenization",
    "pipelines.tasks",
    "pipelines.model",
    "pipelines.adapters",
    "pipelines.evaluation",
    "pipelines.resolve.memory_plan",
    "pipelines.resolve.step_time",
    "pipelines.train.compiled_step",
    "pipelines.train.compile_decision",
    "benchmarks.bench_gpu",
    "benchmarks.bench_gpu_parts",
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


# What only a trial (or the evaluate stage) needs: transformers' model code, peft, sklearn, the engine.
HEAVY = ("transformers.modeling_utils", "peft", "sklearn", "pipelines.recipe", "pipelines.train.engine")


def test_the_train_driver_and_the_report_read_tasks_without_importing_model_code():
    # Every stage process pays its imports: the train stage's driver (it checks the libraries, asks the task for its
    # objective and hands Tune a trial it never runs) and the report (the task's quality columns) load no model.
    script = textwrap.dedent(
        f"""
        import sys
        from pipelines.library_check import check_library_internals
        from pipelines.tasks import get_task
        from pipelines.task_registry import TASKS
        import pipelines.trials.tuning, pipelines.report, stages.train, stages.report

        check_library_internals()
        for name in TASKS:
            get_task(name).objective, get_task(name).quality
        print("LOADED", sorted(m for m in {HEAVY!r} if m in sys.modules))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED []" in proc.stdout, proc.stdout


def test_the_report_reads_the_quality_columns_its_runs_recorded_and_imports_no_torch():
    # Each trial records its task's quality columns (QUALITY_TAG); the report builds its table from them alone.
    script = textwrap.dedent(
        """
        import json, sys
        from dataclasses import asdict
        import pipelines.report, stages.report
        from pipelines.comparison import TrialRow, comparison_table
        from pipelines.trial_context import QUALITY_TAG

        bleu = [{"header": "BLEU", "metric": "test_bleu", "scale": 1.0, "digits": 2, "binomial": False,
                 "interval": False}]
        rows = [TrialRow(name, name, "FINISHED", {"train_time_s": 1.0, "test_bleu": bleu_value},
                         {"task": "seq2seq", QUALITY_TAG: json.dumps(bleu)})
                for name, bleu_value in (("vanilla", 20.0), ("fast", 21.5))]
        print("TABLE", comparison_table(rows))
        print("LOADED", sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED []" in proc.stdout, proc.stdout
    assert "'BLEU'" in proc.stdout and "'Δ BLEU vs baseline'" in proc.stdout and "'21.50'" in proc.stdout


def test_the_recorded_quality_columns_are_the_tasks_own():
    from dataclasses import asdict

    from pipelines.comparison import TrialRow, quality_columns
    from pipelines.task_registry import TASKS
    from pipelines.tasks import get_task
    from pipelines.trial_context import QUALITY_TAG

    for task in TASKS:  # what pipelines.recipe logs, read back
        tag = json.dumps([asdict(q) for q in get_task(task).quality])
        row = TrialRow("v", "r", "FINISHED", {}, {"task": task, QUALITY_TAG: tag})
        assert quality_columns(task, [row]) == quality_columns(task), task
