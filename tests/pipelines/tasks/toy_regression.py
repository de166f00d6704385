"""A toy fourth task, written as `pipelines/tasks/regression.py` would be: a regression head on the
classification data (the label id as a number). Not shipped: `test_adding_a_task.py` registers it with one
registry line and runs it through the engine, the report's columns, tune's objective and serving.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from pipelines.data.loader import score_batches
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import Runtime
from pipelines.tasks.base import QualityMetric
from pipelines.tasks.classification import ClassificationTask


class RegressionTask(ClassificationTask):
    """One number per row: the model's first logit against the label id, by mean squared error."""

    name = "regression"
    objective = ("val_loss", "min")
    validation_metric_names = ("val_loss", "val_mae")
    quality = (QualityMetric("MAE", "test_mae", digits=3),)
    input_column = "text"

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], loss_impl: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].float()
        total = F.mse_loss(out, batch["labels"].float(), reduction="sum")
        return total, torch.tensor(len(out), device=out.device)

    def validation_metrics(
        self, model: nn.Module, split: TokenizedSplit, params: Params, runtime: Runtime
    ) -> dict[str, float]:
        errors = np.zeros(len(split))

        def predict(batch: dict[str, torch.Tensor]) -> None:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
            errors[batch["row_index"].numpy()] = (out.float() - batch["labels"].float()).numpy()

        score_batches(model, split, params, runtime, self, predict)
        return {"val_loss": float((errors**2).mean()), "val_mae": float(np.abs(errors).mean())}

    def predict_texts(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, params: Params, labels: list[str] | None,
        texts: list[str],
    ) -> list[str]:  # fmt: skip
        encoded = tokenizer(
            texts, truncation=True, max_length=params.data.max_length, padding=True, return_tensors="pt"
        )
        return [f"{value:.3f}" for value in model(**encoded).logits[:, 0].tolist()]
