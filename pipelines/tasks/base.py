"""The task interface: everything the pipeline does differently for a classifier and a language model.

The engine, the stages and the tuning driver call these methods and never ask which task
they hold. A task says how source rows become token ids (and what the loss learns), which
model class to build or load, the loss of a batch as (sum, count), so that accumulation can
normalize over a whole window, and how a split is scored during and after training.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipelines.params import DataParams, ModelParams, Params
from pipelines.runtime import FULL_LOSS

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from pipelines.data.batching import PadCollator, Padding
    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.runtime import LossImpl, Runtime


@dataclass
class EvaluationResult:
    """A test split's scalar metrics, one prediction row per test row (in row order), and DVC plot rows."""

    metrics: dict[str, float]
    predictions: pd.DataFrame
    plots: dict[str, list[dict[str, object]]] = field(default_factory=dict)


@dataclass(frozen=True)
class QualityMetric:
    """A metric the report compares trials on: its header, the MLflow metric, and how it reads."""

    header: str
    metric: str
    scale: float = 1.0  # 100 for a share shown in %
    digits: int = 2
    binomial: bool = False  # a share of the split's rows (`test_rows`, `val_rows`): its noise is binomial
    interval: bool = False  # logged with `<metric>_ci_low` / `_ci_high` (a 95% interval)


@dataclass(frozen=True)
class Encoded:
    """A split after tokenization, how many of its rows were cut at data.max_length, and the max_length that would
    keep 95% of them whole (0: not known)."""

    split: TokenizedSplit
    truncated: int
    length_for_95pct: int = 0


@dataclass(frozen=True)
class GenerationProbe:
    """Generation's memory in two forwards: the prefill of the largest batch (which makes the key/value cache),
    then, with the cache grown by `new_tokens` positions, the last decoding step (`step(prefill output, cache)`
    gives its inputs). Values do not matter: the plan runs them on fake tensors."""

    prefill: dict[str, Any]
    step: Callable[[Any, Any], dict[str, Any]]
    new_tokens: int


class Task(ABC):
    """One kind of fine-tune. Subclasses are stateless; `pipelines.tasks.get_task` returns them by name."""

    name: str
    # The peft task type of LoRA adapters on this task's models (see pipelines.adapters).
    peft_task_type: str
    # The validation metric that picks the best trial when tune.metric is auto, and its direction.
    objective: tuple[str, Literal["max", "min"]]
    # What validation_metrics reports at every epoch's end: the metrics tune.metric can name.
    validation_metric_names: tuple[str, ...]
    # The report's quality columns; the first is the headline (its Δ to the baseline is shown).
    quality: tuple[QualityMetric, ...]
    # The same on the validation split, the trials' columns where an experiment has several: they are compared and
    # chosen on validation, and only the chosen model is scored on the test split (the evaluate stage). Each is
    # higher-is-better, as the headline's Pareto chart reads it.
    validation_quality: tuple[QualityMetric, ...]
    # The column a served model (pipelines.tracking.mlflow_pyfunc) reads its raw texts from.
    input_column: str
    # Whether the loss projects hidden states to a vocabulary through the model's output head (then `loss_impl`
    # may chunk it: pipelines.tasks.linear_ce); a classifier's head has one output per class.
    projects_vocabulary: bool = False

    # ---- serving: raw texts in, texts out (the logged MLflow model) -----------------------
    @abstractmethod
    def predict_texts(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, params: Params, labels: list[str] | None,
        texts: list[str],
    ) -> list[str]:  # fmt: skip
        """What the model answers to raw `texts`, on the CPU: label names, or generated text."""

    def example_texts(self, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, count: int = 3) -> list[str]:
        """Raw-text inputs decoded from the first rows of a tokenized split (the served model's input example)."""
        rows = range(min(count, len(split)))
        return [tokenizer.decode(split.input_ids[split.offsets[i] : split.offsets[i] + split.lengths[i]],
                                 skip_special_tokens=True) for i in rows]  # fmt: skip

    # ---- quality: did it learn at all (pipelines.tasks.chance) ---------------------------
    def chance_level(self, validation: TokenizedSplit) -> tuple[str, float] | None:
        """(validation metric, what always giving the commonest answer scores on it), where the task has such a
        level; None where it has not (generation: no single commonest answer)."""
        return None

    # ---- data: source rows -> token ids -------------------------------------------------
    @abstractmethod
    def generate(self, data: DataParams) -> pd.DataFrame:
        """The built-in, offline, deterministic corpus (`data.source: generator`) in this task's source columns."""

    @abstractmethod
    def normalize_table(self, table: pd.DataFrame, data: DataParams, where: str) -> pd.DataFrame:
        """Check one split's columns and rows (errors name `where`); return the task's canonical columns."""

    @abstractmethod
    def tokenizer_corpus(self, train: pd.DataFrame) -> list[str]:
        """The training texts a word-level tokenizer is built from when no pretrained model is named."""

    @abstractmethod
    def train_tokenizer(self, train: pd.DataFrame, vocab_size: int) -> PreTrainedTokenizerBase:
        """A tokenizer built from the training split (used with a model built from model.config)."""

    def write_metadata(self, train: pd.DataFrame, out_dir: Path) -> dict[str, float]:
        """Files the model needs beside the tokenizer (a classifier's label names); returns stats for metrics.

        Written before any split is encoded, into the folder `encode` then reads as `meta_dir`.
        """
        return {}

    @abstractmethod
    def encode(
        self, tokenizer: PreTrainedTokenizerBase, table: pd.DataFrame, params: Params, meta_dir: Path
    ) -> Encoded:
        """Token ids of every row of a normalized split, truncated to data.max_length."""

    # ---- model ----------------------------------------------------------------------------
    @abstractmethod
    def build_model(
        self, params: Params, tokenizer: PreTrainedTokenizerBase, meta_dir: Path, root: Path, *, weights: bool = True,
        layers: int | None = None,
    ) -> PreTrainedModel:  # fmt: skip
        """The model to fine-tune: from model.config (offline) or pretrained by name, folder or GGUF file.

        `weights=False`: a pretrained model's architecture from its config alone, weights freshly initialised
        and none read (the memory plan builds it so, under FakeTensorMode); config-built models are the same.
        `layers` (with `weights=False`): the same architecture with that many blocks, for a plan by depth.
        """

    def stacked_layers(self, params: Params, root: Path) -> int | None:
        """How many identical blocks the model stacks (`num_hidden_layers`), so a plan can be made at two small
        depths and extrapolated (`pipelines.resolve.plan_depth`); None: plan the model whole."""
        if params.model.name_or_path is None:
            return params.model.config.num_hidden_layers
        from pipelines.model import pretrained_config

        config = pretrained_config(params.model, root)
        return None if config.is_encoder_decoder else getattr(config, "num_hidden_layers", None)

    @abstractmethod
    def load_model(self, folder: Path, model: ModelParams) -> PreTrainedModel:
        """A full (not adapter) model folder written by `save_pretrained`."""

    # ---- batches and loss -----------------------------------------------------------------
    @abstractmethod
    def collator(
        self,
        split: TokenizedSplit,
        pad_id: int,
        *,
        fixed_length: int | None,
        pad_to_multiple_of: Padding,
        params: Params,
    ) -> PadCollator:
        """Rows -> a padded batch with this task's `labels`."""

    def training_split(self, split: TokenizedSplit, params: Params, model: nn.Module | None) -> TokenizedSplit:
        """The rows training iterates over (a causal LM's packs with data.packing); returns `split` when already so.

        `model` None: the rows alone, without the checks a trial makes on its real model (the plan stage)."""
        return split

    @abstractmethod
    def loss_units(self, split: TokenizedSplit, params: Params) -> np.ndarray:
        """Per row, how many terms it adds to the loss (1 per row, or its target tokens).

        Known before any forward pass, so a window's loss can be divided by the window's total
        from its first micro-batch on: k accumulated micro-batches then equal one big batch.
        """

    @abstractmethod
    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], loss_impl: LossImpl = FULL_LOSS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the batch's loss terms in fp32, number of terms) for a batch on the model's device.

        `loss_impl`: how a vocabulary projection is computed (the runtime's; by default the full projection); a task
        whose loss projects no vocabulary ignores it."""

    def generation_probe(self, split: TokenizedSplit, params: Params) -> GenerationProbe | None:
        """What the memory plan runs for the evaluate stage's largest generation batch, or None for a task that
        does not generate (`pipelines.resolve.eval_memory.generation_peak`)."""
        return None

    @abstractmethod
    def probe_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Labels of the right shape for a synthetic batch (memory probes: memory depends on shape, not values)."""

    # ---- scoring --------------------------------------------------------------------------
    @abstractmethod
    def validation_metrics(
        self, model: nn.Module, split: TokenizedSplit, params: Params, runtime: Runtime
    ) -> dict[str, float]:
        """Cheap metrics at every epoch's end (`val_loss` and the task's own), teacher-forced, in `runtime`."""

    @abstractmethod
    def evaluate(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, meta_dir: Path,
                 params: Params, runtime: Runtime) -> EvaluationResult:  # fmt: skip
        """The test split's metrics (with 95% intervals), predictions in row order, and plot rows."""
