"""A trial's model as an MLflow model: logged on its run, the best one registered, loadable by URI.

The flavour is a `mlflow.pyfunc` model wrapping the trial's own folder (what `save_trained`
writes: the Hugging Face `save_pretrained` files or a LoRA adapter with its base, the tokenizer,
the label names and the params it was trained with), rather than `mlflow.transformers`: one
wrapper serves every task and adapter here the way the pipeline itself loads them
(`load_trained_model`), including adapters on a base built from a config, which the transformers
flavour cannot reload offline. Its `predict` takes what a user has, raw text, and returns what
the task answers: a classifier's label names, or a language model's greedy continuation.

The model is logged from code (`pipelines/tracking/mlflow_pyfunc.py`), not pickled.
`mlflow.pyfunc.load_model("models:/<name>/<version>")` then predicts, and
`python -m stages.evaluate` can score a registered version (`eval.model_uri`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from pipelines.params import Params

MODEL_NAME = "model"  # the logged model's name on its run
MODEL_URI_TAG = "model_uri"  # the trial run's tag holding its logged model's URI
EXAMPLES_FILE = "input_examples.json"  # in a trial folder whose model was not sent: its model's input examples


def predict_texts(model: Any, tokenizer: Any, params: Params, labels: list[str] | None, texts: list[str]) -> list[str]:
    """What the trained model answers to raw texts, as its task serves them (label names or generated text)."""
    import torch

    from pipelines.tasks import get_task

    with torch.inference_mode():
        return get_task(params.task).predict_texts(model, tokenizer, params, labels, texts)


# What the served model imports (the pipeline's loader and the task's prediction), not the training stack.
SERVING_PACKAGES = ("torch", "transformers", "tokenizers", "peft", "safetensors", "pydantic", "pyyaml", "numpy",
                    "pandas", "scikit-learn", "sacrebleu", "gguf")  # fmt: skip


def serving_requirements() -> list[str]:
    """`SERVING_PACKAGES` pinned to the installed versions (a local build label such as torch's +cpu dropped)."""
    from importlib.metadata import PackageNotFoundError, version

    pinned = []
    for name in SERVING_PACKAGES:
        try:
            pinned.append(f"{name}=={version(name).split('+')[0]}")
        except PackageNotFoundError:
            pinned.append(name)
    return pinned


def save_trial_model(folder: Path, params: Params, examples: list[str], dst: Path) -> Path:
    """Write the trial folder as a pyfunc model into `dst` (local: no store involved), with its signature and
    an input example; returns the model's folder."""
    import mlflow.pyfunc
    from mlflow.models import infer_signature

    example = pd.DataFrame({input_column(params.task): examples[:3]})
    local = dst / MODEL_NAME
    mlflow.pyfunc.save_model(
        str(local),
        python_model=str(Path(__file__).with_name("mlflow_pyfunc.py")),  # models from code: nothing pickled
        artifacts={"model_dir": str(folder)},
        signature=infer_signature(example, pd.Series(["answer"] * len(example))),
        input_example=example,
        # The code travels with the model (this package, under the model's code/): "pipelines" on the package
        # index is an unrelated project. The requirements are what serving imports, pinned to the versions that
        # trained it (inferring them would load and trace the model).
        code_paths=[str(Path(__file__).resolve().parents[1])],
        pip_requirements=serving_requirements(),
    )
    return local


UPLOAD_WORKERS = 8


def upload_folder(client: Any, artifact_location: str, local: Path) -> None:
    """Upload `local`'s files to `artifact_location` side by side. MLflow's `log_model_artifacts` sends them one
    after another, and through a server's artifact proxy each file is a request: the default model's 117 files
    (most of them the package's code, which travels with the model) took 2.6-3.1 s that way, against 0.47 s into a
    local store."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(artifact_location, tracking_uri=client.tracking_uri)

    def send(path: Path) -> None:
        folder = path.parent.relative_to(local).as_posix()
        repo.log_artifact(str(path), None if folder == "." else folder)

    with ThreadPoolExecutor(max_workers=UPLOAD_WORKERS) as pool:
        list(pool.map(send, [path for path in sorted(local.rglob("*")) if path.is_file()]))


def trial_logged_model(client: Any, experiment_id: str, run_id: str) -> Any:
    """The run's logged model named `MODEL_NAME`, whatever its status (the newest where earlier code left several),
    or a new one. Every attempt to send a trial's model, a retry or `--resume-upload`, fills this one model: a new
    model per attempt left a FAILED model in MLflow's Models list for each retry."""
    found = client.search_logged_models(
        [experiment_id], filter_string=f"source_run_id = '{run_id}' AND name = '{MODEL_NAME}'"
    )
    if found:
        return max(found, key=lambda model: model.creation_timestamp)
    return client.create_logged_model(experiment_id, name=MODEL_NAME, source_run_id=run_id)


def upload_trial_model(client: Any, experiment_id: str, run_id: str, local: Path, retry_s: float = 0.0) -> str:
    """Log a saved model as the run's logged model (MLflow's Models column) with plain client calls; its URI. The
    files' upload is retried for `retry_s`; a model whose files never arrive is marked FAILED, and the error raised.
    A later attempt reuses that model (`trial_logged_model`) and marks it READY once its files are there.

    Client calls, not `mlflow.start_run(run_id=...)`: the fluent API would end the trial's run on exit,
    and leave it on its run stack when the store fails mid-way.
    """
    from mlflow.entities import LoggedModelOutput

    from pipelines.tracking.uploads import with_retries

    model = trial_logged_model(client, experiment_id, run_id)
    try:
        with_retries(lambda: upload_folder(client, model.artifact_location, local), retry_s)
    except Exception:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    return f"models:/{model.model_id}"


def register_best(tracking_uri: str, model_uri: str, name: str, task: str) -> str:
    """Register `model_uri` as a new version of the registered model `name` (created if needed), tagged with its
    task; its version."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    return str(mlflow.register_model(model_uri, name, tags={"task": task}).version)


def input_column(task: str) -> str:
    """The column the served model of `task` reads its raw texts from."""
    from pipelines.tasks import get_task

    return get_task(task).input_column


def input_examples(tokenizer: Any, split: Any, task: str, count: int = 3) -> list[str]:
    """Raw-text inputs for the model's example, decoded from the first rows of a tokenized split (as the task
    serves them: a causal LM's prompts only)."""
    from pipelines.tasks import get_task

    return get_task(task).example_texts(tokenizer, split, count)


def download_registered(model_uri: str, tracking_uri: str, dst: Path) -> tuple[Path, str]:
    """Fetch a registered version's trial folder (what `models/best` holds) into `dst`; (folder, its run id)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from pipelines.errors import UserError

    mlflow.set_tracking_uri(tracking_uri)
    name, version = model_uri.removeprefix("models:/").split("/", 1)
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        found = client.get_latest_versions(name)[-1] if version == "latest" else client.get_model_version(name, version)
    except Exception as err:  # noqa: BLE001 - the registry raises several kinds; all mean "no such version"
        raise UserError(f"eval.model_uri = {model_uri!r}: no such registered model version ({err})") from None
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst)))
    folders = [p.parent for p in (local / "artifacts").glob("*/params.json")]
    if len(folders) != 1:
        raise UserError(f"eval.model_uri = {model_uri!r}: not a model this pipeline logged (no trial folder in it)")
    return folders[0], found.run_id


def model_to_evaluate(params: Params, root: Path, best: Path, trials: Path, tmp: Path) -> tuple[Path, str]:
    """The folder the evaluate stage scores and the run it logs to: `best` and the best trial's run, or the
    registered version `eval.model_uri` (downloaded into `tmp`) and the run that trained it."""
    import json

    from pipelines.tracking.runs import resolve_tracking_uri

    if params.eval.model_uri is None:
        return best, json.loads(trials.read_text())["best"]["mlflow_run_id"]
    return download_registered(params.eval.model_uri, resolve_tracking_uri(params.tracking.uri, root), tmp)


def model_logger(logger: Any, experiment_id: str, run_id: str, trial_id: str) -> Callable[..., None]:
    """Logs a trial's saved folder as its run's MLflow model through `logger` (a RunLogger), tagging its URI.

    The upload is retried with backoff for `tracking.upload_retry_s` (as the run's metrics are); then the model
    stays in the trial's folder, with its input examples, recorded as pending on the run, and the log says so.
    """
    import json
    import tempfile

    from pipelines.tracking.uploads import TRIAL_PREFIX, Upload, send_or_defer

    client = logger.client

    def log(folder: Path, params: Params, tokenizer: Any, test: Any, say: Callable[[str], None]) -> None:
        examples = input_examples(tokenizer, test, params.task)
        retry_s = params.tracking.upload_retry_s
        with tempfile.TemporaryDirectory() as tmp:
            saved = save_trial_model(folder, params, examples, Path(tmp))
            send = lambda: upload_trial_model(client, experiment_id, run_id, saved, retry_s)  # noqa: E731
            model_uri = send_or_defer(
                client, run_id, Upload(MODEL_NAME, f"{TRIAL_PREFIX}{trial_id}", send), retry_s, say
            )
        if model_uri is None:  # what `--resume-upload` rebuilds the same model from
            (folder / EXAMPLES_FILE).write_text(json.dumps(examples), encoding="utf-8")
        else:
            logger.log_tags({MODEL_URI_TAG: model_uri})

    return log
