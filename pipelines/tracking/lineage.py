"""What the MLflow UI shows in a run's Dataset column: the tokenized splits the trial trained and was scored on.

Each split is logged with `MlflowClient.log_inputs` under MLflow's convention: a name, a digest
and a source, and the split's role as the `mlflow.data.context` tag (train / validation / test).
The digest is a hash of the tokenized split's own arrays (token ids, lengths, labels or prompt
lengths), so two runs show the same digest exactly when they saw the same tokens. The source
is `data.source` as declared: the built-in generator, a local file or folder, or a hub id.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np

from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import DataParams

SPLITS = ("train", "validation", "test")
DIGEST_CHARS = 12
RETRIES = 3


def dataset_source(data: DataParams, root: Path) -> object:
    """MLflow's source object for `data.source`: the generator (code), a local path, or a hub dataset."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if data.source == "generator":
        return CodeDatasetSource({"generator": "pipelines.data.synthetic", **data.generator.model_dump(mode="json")})
    local = Path(data.source) if Path(data.source).is_absolute() else root / data.source
    if local.exists():
        with warnings.catch_warnings():  # mlflow registers two equal local-file sources and warns that it picked one
            warnings.simplefilter("ignore", UserWarning)
            return resolve_dataset_source(str(local.resolve()))
    return HuggingFaceDatasetSource(path=data.source, revision=data.revision)  # the pinned commit, recorded


def log_datasets(client: object, run_id: str, data: DataParams, root: Path, tokenized_dir: Path) -> None:
    """Log the train, validation and test splits as the run's dataset inputs (name, digest, source, context)."""
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag

    source = dataset_source(data, root)
    inputs = []
    for name in SPLITS:
        if not (tokenized_dir / name / "lengths.npy").is_file():
            continue
        split = TokenizedSplit.load(tokenized_dir / name)
        targets = split.labels if split.labels is not None else split.prompt_lengths
        dataset = mlflow.data.from_numpy(
            np.asarray(split.lengths), source=source, targets=None if targets is None else np.asarray(targets),
            name=name, digest=split.digest(DIGEST_CHARS),
        )  # fmt: skip
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", name)]))
    # Concurrent trials insert the same datasets (the store keys them by experiment, name and digest) at the same
    # moment; the one that loses that race gets a uniqueness error, and its retry links the row the other wrote.
    for attempt in range(RETRIES + 1):
        try:
            client.log_inputs(run_id, datasets=inputs)  # type: ignore[attr-defined]
            return
        except Exception:  # noqa: BLE001 - a store error of any kind; the last one is raised
            if attempt == RETRIES:
                raise
            time.sleep(0.5 * (attempt + 1))
