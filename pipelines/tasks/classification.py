"""Sequence classification: a label per row, cross-entropy per row, accuracy and macro-F1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.data.batching import PadCollator, Padding
from pipelines.data.sources import check_columns, drop_or_refuse_empty
from pipelines.data.synthetic import generate_corpus
from pipelines.data.tokenization import (
    LABELS_FILE,
    TokenizedSplit,
    class_keys,
    encode_texts,
    join_texts,
    label_names,
    load_label_names,
    train_word_tokenizer,
)
from pipelines.params import DataParams, ModelParams, Params
from pipelines.runtime import FULL_LOSS, LossImpl, Runtime
from pipelines.tasks import classification_scoring as scoring
from pipelines.tasks.base import Encoded, EvaluationResult, QualityMetric, Task

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def _text_columns(data: DataParams) -> list[str]:
    return [data.text_column] if isinstance(data.text_column, str) else list(data.text_column)


def normalize_table(table: pd.DataFrame, data: DataParams, where: str) -> pd.DataFrame:
    """Check the columns and rows of one classification split; return columns `texts` (tuples) and `label` (str),
    indexed by row position in `table` (rows with an empty text or label dropped where data.drop_empty)."""
    check_columns(table, _text_columns(data) + [data.label_column], where)
    texts = table[_text_columns(data)].astype(str)
    labels = table[data.label_column]
    # Labels are data: kept as written (spaces and all); an empty one is no class.
    out = pd.DataFrame({"texts": list(texts.itertuples(index=False, name=None)), "label": labels.astype(str)})
    out.index = table.index
    empty_text = (texts.apply(lambda col: col.str.strip() == "")).all(axis=1).to_numpy()
    out = drop_or_refuse_empty(out, empty_text, f"text in {_text_columns(data)}", where, data, table.attrs)
    labels = labels.loc[out.index]
    no_label = (labels.isna() | (labels.astype(str).str.strip() == "")).to_numpy()
    return drop_or_refuse_empty(out, no_label, f"label in column {data.label_column!r}", where, data, table.attrs)


class ClassificationTask(Task):
    """A label per row; the encoder's [CLS] logits against it."""

    name = "classification"
    peft_task_type = "SEQ_CLS"
    objective = ("val_accuracy", "max")
    validation_metric_names = ("val_loss", "val_accuracy")
    quality = (
        QualityMetric("Accuracy", "test_accuracy", scale=100, binomial=True, interval=True),
        QualityMetric("Macro-F1", "test_macro_f1", scale=100, interval=True),
    )
    validation_quality = (QualityMetric("Validation accuracy", "val_accuracy", scale=100, binomial=True),)
    input_column = "text"

    def chance_level(self, validation: TokenizedSplit) -> tuple[str, float] | None:
        counts = np.bincount(np.asarray(validation.labels, dtype=np.int64))
        return ("val_accuracy", float(counts.max() / counts.sum())) if counts.sum() else None

    @torch.inference_mode()
    def predict_texts(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, params: Params, labels: list[str] | None,
        texts: list[str],
    ) -> list[str]:  # fmt: skip
        answers: list[str] = []
        for start in range(0, len(texts), 32):
            encoded = tokenizer(texts[start : start + 32], truncation=True, max_length=params.data.max_length,
                                padding=True, return_tensors="pt")  # fmt: skip
            ids = model(**encoded).logits.argmax(-1).tolist()
            answers += [labels[i] if labels else str(i) for i in ids]
        return answers

    def generate(self, data: DataParams) -> pd.DataFrame:
        return generate_corpus(data.generator)

    def normalize_table(self, table: pd.DataFrame, data: DataParams, where: str) -> pd.DataFrame:
        return normalize_table(table, data, where)

    def tokenizer_corpus(self, train: pd.DataFrame) -> list[str]:
        return join_texts(train["texts"].tolist(), "[SEP]")

    def train_tokenizer(self, train: pd.DataFrame, vocab_size: int) -> PreTrainedTokenizerBase:
        return train_word_tokenizer(self.tokenizer_corpus(train), vocab_size)

    def encode(
        self, tokenizer: PreTrainedTokenizerBase, table: pd.DataFrame, params: Params, meta_dir: Path
    ) -> Encoded:
        # Label ids index the sorted names write_metadata saved, which every split shares.
        names = load_label_names(meta_dir)
        texts = join_texts(table["texts"].tolist(), tokenizer.sep_token or "[SEP]")
        ids, lengths, truncated = encode_texts(tokenizer, texts, params.data.max_length)
        labels = table["label"].map({name: i for i, name in enumerate(names)}).to_numpy(dtype=np.int64)
        return Encoded(TokenizedSplit(ids, lengths, labels), truncated)

    def write_metadata(self, train: pd.DataFrame, out_dir: Path) -> dict[str, float]:
        names = label_names(train["label"])
        keys = class_keys(names)  # refuses two labels with one metric key, before anything trains
        labels = {"names": names, "metric_keys": dict(zip(names, keys, strict=True))}
        (out_dir / LABELS_FILE).write_text(json.dumps(labels, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return {"num_labels": len(names)}

    def build_model(
        self, params: Params, tokenizer: PreTrainedTokenizerBase, meta_dir: Path, root: Path, *, weights: bool = True,
        layers: int | None = None,
    ) -> PreTrainedModel:  # fmt: skip
        from pipelines.model import build_model

        labels = load_label_names(meta_dir)
        return build_model(params.model, labels, len(tokenizer), params.data.max_length, root, weights=weights,
                           layers=layers)  # fmt: skip

    def load_model(self, folder: Path, model: ModelParams) -> PreTrainedModel:
        from pipelines.model import load_trained

        return load_trained(folder)

    def collator(
        self,
        split: TokenizedSplit,
        pad_id: int,
        *,
        fixed_length: int | None,
        pad_to_multiple_of: Padding,
        params: Params,
    ) -> PadCollator:
        return PadCollator(split, pad_id, fixed_length=fixed_length, pad_to_multiple_of=pad_to_multiple_of)

    def loss_units(self, split: TokenizedSplit, params: Params) -> np.ndarray:
        return np.ones(len(split), dtype=np.int64)

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], loss_impl: LossImpl = FULL_LOSS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A classifier's head projects to its classes, not a vocabulary: `loss_impl` does not apply.
        # Looked up on the module at call time: tests substitute scoring.forward_logits for wrapped models.
        logits = scoring.forward_logits(model, batch)
        # Cross-entropy in fp32 even under autocast: a bf16 log-softmax loses the small differences.
        total = F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
        return total, torch.tensor(len(batch["labels"]), device=total.device)

    def probe_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(input_ids), dtype=torch.long, device=input_ids.device)

    def validation_metrics(
        self, model: nn.Module, split: TokenizedSplit, params: Params, runtime: Runtime
    ) -> dict[str, float]:
        logits, loss = scoring.predict_logits(model, split, params, runtime, self)
        return {"val_loss": loss, "val_accuracy": float((logits.argmax(1) == split.labels).mean())}

    def evaluate(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, meta_dir: Path,
                 params: Params, runtime: Runtime) -> EvaluationResult:  # fmt: skip
        names = load_label_names(meta_dir)
        result = scoring.evaluate_model(model, split, names, params, runtime, self)
        plots = {
            "confusion": scoring.confusion_rows(result.confusion, names),
            "per_class": scoring.per_class_rows(result.metrics, names),
        }
        return EvaluationResult(result.metrics, result.predictions, plots)
