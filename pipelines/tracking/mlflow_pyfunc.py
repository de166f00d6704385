"""The pyfunc model MLflow loads from code (models-from-code): a trial folder that predicts from raw text.

MLflow copies this file into every logged model and runs it when the model is loaded; the `pipelines`
package travels with it (the model's `code/`, on the path when MLflow loads it). See
`pipelines.tracking.mlflow_model` for why a pyfunc over the folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow.models
import mlflow.pyfunc
import pandas as pd

from pipelines.params import Params
from pipelines.tracking.mlflow_model import input_column, predict_texts


class PipelinesModel(mlflow.pyfunc.PythonModel):
    """Loads the folder with the pipeline's own loader (full model, or adapter on its base) and tokenizer."""

    def load_context(self, context: Any) -> None:
        from transformers import AutoTokenizer

        from pipelines.adapters import load_trained_model
        from pipelines.data.tokenization import LABELS_FILE, load_label_names
        from pipelines.tasks import get_task

        folder = Path(context.artifacts["model_dir"])
        self.params = Params.model_validate(json.loads((folder / "params.json").read_text(encoding="utf-8")))
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = load_trained_model(folder, self.params, get_task(self.params.task), self.tokenizer).eval()
        self.labels = load_label_names(folder) if (folder / LABELS_FILE).is_file() else None

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        texts = model_input[input_column(self.params.task)].astype(str).tolist()
        return predict_texts(self.model, self.tokenizer, self.params, self.labels, texts)


mlflow.models.set_model(PipelinesModel())
