"""The main job end to end, as a user runs it: real DVC in a temporary git repo, real Ray, real MLflow."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from pipelines.comparison import COLUMNS
from pipelines.report import format_metric
from pipelines.scored import RECORD
from tests.conftest import FINAL_METRICS, run, up_to_date

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# Lines a default run used to print that read like errors or are of no use to the user (issue 17).
KNOWN_NOISE = (
    "`max_concurrent_trials` will be ignored",
    "To visualize your results with TensorBoard",
    "Creating initial MLflow database tables",
    "Updating database tables",
    "Started monitoring system metrics",
    "Trial status:",  # Ray Tune's status table: only for a sweep of several trials
    "Configuration for experiment",  # Tune's header box, printed by its newer output engine even at verbose 0
    "de-quantizing",  # per-tensor progress bars of the model loaders
)


def experiments(shown: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flatten `dvc exp show --json` into (name, params, metrics) of baselines and experiments."""
    found = []

    def add(entry: dict[str, Any]) -> None:
        data = entry.get("data") or {}
        params = (data.get("params") or {}).get("params.yaml", {}).get("data", {})
        metrics = {k: v for f in (data.get("metrics") or {}).values() for k, v in (f.get("data") or {}).items()}
        found.append({"name": entry.get("name") or data.get("rev"), "params": params, "metrics": metrics})

    for baseline in shown:
        add(baseline)
        for exp in baseline.get("experiments") or []:
            for rev in exp.get("revs") or []:
                add(rev)
    return found


# Every MLflow metric says its unit in its name: a suffix, a count's noun, or a share (a fraction in 0..1 in
# MLflow, the console and DVC; the report prints shares as percentages with a % sign).
UNIT_SUFFIXES = ("_s", "_ms", "_bytes", "_per_s", "_fraction", "_pct", "_flops", "_per_step", "_mib")
COUNT_NOUNS = ("steps", "rows", "graphs", "graphs_in_loop", "recompiles", "skips", "halvings", "labels", "cores",
               "trials", "length_max", "length_p50", "length_p90", "length_p99")  # fmt: skip
SHARES = ("pad_fraction", "accuracy", "macro_f1", "exact_match", "precision", "recall", "ci_low", "ci_high")
UNITLESS = ("loss", "lr", "host_load_mean", "host_load_max", "host_load_per_core", "perplexity")


def unit_of(key: str) -> str | None:
    """The unit a metric's name states, or None when it states none (the test fails on it)."""
    name = key.rsplit(".", 1)[-1]
    if key.startswith("system/"):
        return "MLflow's system metrics (named with their units)"
    if name.endswith(UNIT_SUFFIXES):
        return name.rsplit("_", 1)[-1]
    if name.endswith(COUNT_NOUNS):
        return "count"
    if any(share in key for share in SHARES):
        return "fraction"
    if name.endswith(UNITLESS) or name in UNITLESS:
        return "unitless"
    return None


def output_digests(root: Path) -> dict[str, str]:
    paths = [
        p for d in ("data/tokenized", "models", "metrics", "reports") for p in (root / d).rglob("*") if p.is_file()
    ]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(paths)}


def assert_registered_model_predicts_as_models_best(root: Path, client: MlflowClient) -> None:
    """`models:/finetune-classification/latest` through pyfunc, `models/best` through our loader: the same labels."""
    import mlflow
    import pandas as pd
    from transformers import AutoTokenizer

    from pipelines.adapters import load_trained_model
    from pipelines.data.tokenization import TokenizedSplit, load_label_names
    from pipelines.params import Params
    from pipelines.tasks import get_task
    from pipelines.tracking.mlflow_model import input_examples, predict_texts

    best = root / "models" / "best"
    params = Params.model_validate(json.loads((best / "params.json").read_text()))
    tokenizer = AutoTokenizer.from_pretrained(best)
    texts = input_examples(tokenizer, TokenizedSplit.load(root / "data" / "tokenized" / "test"), "classification", 20)
    model = load_trained_model(best, params, get_task(params.task), tokenizer).eval()
    expected = predict_texts(model, tokenizer, params, load_label_names(best), texts)
    mlflow.set_tracking_uri(client.tracking_uri)
    registered = mlflow.pyfunc.load_model("models:/finetune-classification/latest")
    assert list(registered.predict(pd.DataFrame({"text": texts}))) == expected
    assert len(set(expected)) > 1  # a model that answers, not a constant


def assert_test_split_scored_once(root: Path, printed: str) -> None:
    """The evaluate stage took the trial's scoring of the test split (issue 69), importing no torch or transformers
    to do so, and wrote what scoring the saved model itself writes (counted and compared, not timed)."""
    assert "so it is not scored again" in printed
    outputs = ("metrics/evaluate.json", "predictions/test.csv", "plots/confusion.json", "plots/per_class.json")
    reused = {name: (root / name).read_text() for name in outputs}
    imports = run([sys.executable, "-X", "importtime", "-m", "stages.evaluate"], root).stderr
    modules = {line.split("|")[-1].strip() for line in imports.splitlines() if line.startswith("import time:")}
    assert not {"torch", "transformers", "ray"} & modules
    assert {name: (root / name).read_text() for name in outputs} == reused  # the same files, again
    record = root / "models/best" / RECORD
    kept = record.read_bytes()
    record.unlink()
    try:
        scored = run([sys.executable, "-m", "stages.evaluate"], root)
        assert "not scored again" not in scored.stdout
        for name in outputs[1:]:  # the same predictions and plots from the model loaded anew and scored here
            assert (root / name).read_text() == reused[name], name
        fresh, before = (json.loads(text) for text in ((root / outputs[0]).read_text(), reused[outputs[0]]))
        assert {k: v for k, v in fresh.items() if k != "eval_samples_per_s"} == {
            k: v for k, v in before.items() if k != "eval_samples_per_s"}  # fmt: skip
    finally:
        record.write_bytes(kept)
    run([sys.executable, "-m", "stages.evaluate"], root)  # the outputs as dvc repro left them, for the steps below
    assert {name: (root / name).read_text() for name in outputs} == reused


def test_repro_noop_exp_run_and_bad_values(project_copy: Path, own_ray_cluster: None):
    root = project_copy

    # 1. The main job on the defaults.
    repro = run(["dvc", "repro"], root, timeout=600)
    printed = repro.stdout + repro.stderr
    for noise in KNOWN_NOISE:
        assert noise not in printed, f"{noise!r} in the output of dvc repro"
    assert "[default] epoch 3/3" in printed  # the trial's own progress line per epoch
    for path in (
        "models/best/model.safetensors",
        "models/best/config.json",
        "reports/report.md",
        "reports/comparison.png",
        "predictions/test.csv",
        "plots/confusion.json",
    ):
        assert (root / path).is_file(), path
    evaluate = json.loads((root / "metrics/evaluate.json").read_text())
    assert 0.5 < evaluate["test_accuracy"] < 0.98  # learns, and the corpus is not trivially separable
    report = (root / "reports/report.md").read_text()
    assert "| default |" in report and "Train time" in report and "Peak train memory" in report

    # The report's numbers are the DVC metrics and the MLflow metrics, under one rounding rule.
    accuracy = next(c for c in COLUMNS if c.metric == "test_accuracy")
    best_run = json.loads((root / "metrics/train.json").read_text())["mlflow_run_id"]
    stored = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").get_run(best_run).data.metrics
    assert stored["test_accuracy"] == evaluate["test_accuracy"]
    # The trial's run lists the three tokenized splits as its datasets, each with a content digest.
    inputs = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").get_run(best_run).inputs.dataset_inputs
    contexts = {tag.value: i.dataset for i in inputs for tag in i.tags if tag.key == "mlflow.data.context"}
    assert sorted(contexts) == ["test", "train", "validation"]
    assert all(len(d.digest) == 12 and d.source_type == "code" for d in contexts.values())
    low, high = (f"{100 * evaluate[f'test_accuracy_ci_{end}']:.1f}" for end in ("low", "high"))
    assert f"| {format_metric(evaluate['test_accuracy'], accuracy)} [{low}, {high}] |" in report
    plots = run(["dvc", "plots", "show", "-o", str(root.parent / "plots_html")], root)
    page = (root.parent / "plots_html" / "index.html").read_text()
    assert "Confusion matrix" in page and "Training loss" in page, plots.stdout
    assert_test_split_scored_once(root, printed)

    # 2. A second repro does nothing, in seconds.
    start = time.monotonic()
    again = run(["dvc", "repro"], root)
    assert up_to_date(again.stdout), again.stdout  # only the source stage re-hashes the data
    assert time.monotonic() - start < 30
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "baseline results"], root)

    # 3. One knob changed as an experiment; both listed; the MLflow store has it, complete.
    run(["dvc", "exp", "run", "-S", "optim=adafactor"], root, timeout=600)
    shown = experiments(json.loads(run(["dvc", "exp", "show", "--json"], root).stdout))
    optims = {e["params"].get("optim") for e in shown if "test_accuracy" in e["metrics"]}
    assert {"adamw", "adafactor"} <= optims, shown
    # Each experiment opens on what it changed from its baseline commit, then the figures a comparison needs (memory
    # in MiB) and what to know before comparing its time; its MLflow run id is in metrics/train.json (an output),
    # not a metric `dvc metrics diff` would compare.
    tried = next(e for e in shown if e["params"].get("optim") == "adafactor")
    assert list(tried["metrics"])[:5] == ["changed", "test_accuracy", "train_time_s", "peak_train_memory_mib", "timing"]
    assert tried["metrics"]["changed"] == "optim=adafactor"
    # The baseline was timed here too (its committed metrics name this host), so only the load may mark the time.
    assert not re.search("other host|host unknown|no baseline", tried["metrics"]["timing"]), tried
    assert next(e for e in shown if e["name"] == "main")["metrics"]["changed"] == "-"
    assert "mlflow_run_id" not in tried["metrics"]
    headline = json.loads((root / "metrics/train.json").read_text())
    assert len(headline) < 25 and not [k for k in headline if "." in k and not k.startswith(("best.", "trials."))]
    # What a person sees of `dvc exp show` in a 120-column terminal: its pager's left edge (less -S chops the
    # lines; DVC renders the table at full width for it). What changed, quality, time and memory, on one line.
    screen = [line[:120] for line in run(["dvc", "exp", "show"], root, env={"COLUMNS": "120"}).stdout.splitlines()]
    header = next(line for line in screen if "Experiment" in line)
    assert header.split()[:6] == [
        "Experiment", "Created", "changed", "test_accuracy", "train_time_s", "peak_train_memory_mib"]  # fmt: skip
    row = next(line for line in screen if "[" in line and "]" in line)  # the experiment's row: `├── 1a2b3c4 [name]`
    assert "optim=adafactor" in row, screen
    for name in ("test_accuracy", "train_time_s", "peak_train_memory_mib"):  # right-aligned under their headers
        start = header.index(name)
        assert float(row[start : start + len(name)]) > 0, screen
    # Its report compares its one trial with the last commit's (the baseline experiment's) best trial.
    assert "| last commit " in (root / "reports/report.md").read_text()

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune")
    runs = client.search_runs([experiment.experiment_id])
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    adafactor = [r for r in trials if r.data.params.get("optim") == "adafactor"]
    assert len(adafactor) == 1 and adafactor[0].info.status == "FINISHED"
    for name in FINAL_METRICS:
        assert adafactor[0].data.metrics.get(name, 0) > 0, name
    # The memory plan, logged before training beside the measured peak: optimizer state exact, peak close.
    logged = adafactor[0].data.metrics
    assert logged["predicted_optimizer_state_bytes"] == logged["optimizer_state_bytes"]
    assert abs(logged["predicted_peak_train_memory_bytes"] / logged["peak_train_memory_bytes"] - 1) < 0.15
    assert adafactor[0].data.params["data.max_length"] == "64"  # every param, flattened
    assert [k for k in logged if unit_of(k) is None] == []  # a metric whose name gives no unit
    assert 0 <= logged["test_accuracy"] <= 1 and 0 <= logged["padding_fraction"] <= 1  # shares as fractions
    report = (root / "reports/report.md").read_text()
    for text in (report, printed):  # MiB written as MiB, shares with their % sign
        assert not re.search(r"\d MB\b", text), text
    assert re.search(r"\| \d+\.\d+% \[", report)
    loss_curve = client.get_metric_history(adafactor[0].info.run_id, "train_loss")
    assert len(loss_curve) > 10

    # Every trial run has its three datasets and a logged model; each train run registered its best trial's
    # model as a new version, and the latest loads by URI and predicts as models/best does.
    for trial in trials:
        assert len(trial.inputs.dataset_inputs) == 3 and all(i.dataset.digest for i in trial.inputs.dataset_inputs)
        assert [o.model_id for o in trial.outputs.model_outputs] and trial.data.tags["model_uri"].startswith("models:/")
    versions = client.search_model_versions("name = 'finetune-classification'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    latest = max(versions, key=lambda v: int(v.version))
    assert (
        latest.run_id
        == adafactor[0].info.run_id
        == json.loads((root / "metrics/train.json").read_text())["mlflow_run_id"]
    )
    assert_registered_model_predicts_as_models_best(root, client)

    # A second experiment scores a registered version instead of models/best (eval.model_uri): version 1, the
    # baseline's best, gives the baseline's test accuracy. `dvc exp show` lists both experiments, each with
    # its MLflow run id and headline figures.
    run(["dvc", "exp", "run", "-S", "eval.model_uri=models:/finetune-classification/1"], root, timeout=600)
    assert json.loads((root / "metrics/evaluate.json").read_text())["test_accuracy"] == evaluate["test_accuracy"]
    shown = experiments(json.loads(run(["dvc", "exp", "show", "--json"], root).stdout))
    both = [e for e in shown if e["params"].get("optim") == "adafactor" and "test_accuracy" in e["metrics"]]
    assert len(both) >= 2, shown  # the adafactor experiment and the one scoring version 1
    for entry in both:
        assert {"test_accuracy", "train_time_s", "peak_train_memory_mib"} <= set(entry["metrics"]), entry
    assert len(client.search_model_versions("name = 'finetune-classification'")) == 2  # evaluating registers nothing

    # 4. Bad values fail fast, before training, naming key, value and allowed values; outputs untouched.
    run(["dvc", "exp", "apply", "--help"], root)  # (warm the CLI; keeps the timings below about our stage)
    before = output_digests(root)
    for setting, expected in (
        ("optim=adafator", ["optim = 'adafator'", "'adafactor'", "'sgd'"]),
        ("batch_size=-4", ["batch_size = -4", "greater than 0"]),
        # An added key (DVC's own suggestion for a typo'd one) is validated too: the validate stage lists the file.
        ("+optimizer=adafactor", ["optimizer: unknown key"]),
    ):
        run(["git", "checkout", "--", "params.yaml"], root)
        start = time.monotonic()
        failed = run(["dvc", "exp", "run", "-S", setting], root, check=False)
        assert failed.returncode != 0
        assert time.monotonic() - start < 60
        output = failed.stdout + failed.stderr
        for text in expected:
            assert text in output, output
        assert "Traceback" not in output
        assert output_digests(root) == before
