"""The one strict schema for `params.yaml`.

Every stage loads the whole file through `load_params` before doing any work, so a
typo or a bad value fails in about a second with the key path, the bad value and
what is allowed. The schema holds types, bounds and rules; the values themselves
live only in `params.yaml`, so every field is required here. This module imports only
pydantic and PyYAML on purpose: it must not pay for torch or Ray before it has said no.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PlainValidator,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pipelines.errors import UserError

Optimizer = Literal["adamw", "adafactor", "adamw_8bit", "lion", "sgd"]
Precision = Literal["fp32", "fp16", "bf16", "auto"]
LrSchedule = Literal["constant", "linear", "cosine", "onecycle", "cyclic", "reduce_on_plateau"]
DeviceName = Literal["auto", "cpu", "cuda"]
TaskName = Literal["classification", "causal_lm", "seq2seq"]
AdapterType = Literal["none", "lora", "qlora"]

GENERATOR_SOURCE = "generator"


def _batch_size(value: Any) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise PydanticCustomError("batch_size", "must be an integer greater than 0, or 'auto'")


BatchSize = Annotated[int | Literal["auto"], PlainValidator(_batch_size, json_schema_input_type=int | str)]

_BYTE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_bytes(value: Any) -> int | None:
    """Bytes from an integer or a string like "8GB" (10^9), "8GiB" (2^30) or "512 MB"; None stays None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    if isinstance(value, str):
        text = value.strip().upper()
        number = text.rstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        unit, number = text[len(number) :], number.strip()
        try:
            amount = float(number)
        except ValueError:
            amount = -1.0
        if amount > 0 and unit in _BYTE_UNITS:
            return int(amount * _BYTE_UNITS[unit])
    raise PydanticCustomError(
        "bytes",
        "must be null, a positive number of bytes, or a size with a unit: B, KB, MB, GB, TB (powers of 1000) "
        "or KiB, MiB, GiB, TiB (powers of 1024), e.g. '8GB' or '512MiB'",
    )


Bytes = Annotated[int | None, PlainValidator(parse_bytes, json_schema_input_type=int | str | None)]


def _lr(value: Any) -> float | str:
    if value == "auto" or (isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1):
        return value if value == "auto" else float(value)
    raise PydanticCustomError("lr", "must be a number greater than 0 and less than 1, or 'auto' (an LR range test)")


LearningRate = Annotated[float | Literal["auto"], PlainValidator(_lr, json_schema_input_type=float | str)]


class StrictModel(BaseModel):
    """Base for every params section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class GeneratorParams(StrictModel):
    """The built-in synthetic topic corpus (used when `data.source` is `generator`)."""

    num_rows: PositiveInt = Field(ge=100, description="Rows generated in total, before splitting.")
    num_classes: int = Field(ge=2, le=8, description="Number of topics (classes), 2 to 8.")
    label_noise: float = Field(
        ge=0.0, lt=0.5, description="Fraction of rows whose label is replaced by a random topic."
    )


class DataParams(StrictModel):
    """Where the rows come from and how they are tokenized and batched."""

    source: str = Field(
        description=(
            "`generator` (built-in corpus), a local .csv/.jsonl/.parquet file, a folder holding "
            "train/validation/test files, or a Hugging Face hub dataset id."
        ),
    )
    generator: GeneratorParams = Field(description="Settings of the built-in corpus.")
    text_column: str | list[str] = Field(
        description="Text column, or a list of columns joined with the tokenizer's separator (classification); "
        "causal_lm: the one text column of plain language modelling, used when neither messages_column nor "
        "prompt_column/response_column are set."
    )
    label_column: str = Field(description="Label column (strings or integers); classification only.")
    prompt_column: str | None = Field(
        description="causal_lm: the instruction column (masked out of the loss unless train_on_prompt); "
        "with response_column. null: no prompt/response pair."
    )
    response_column: str | None = Field(description="causal_lm: the answer column the model learns to write.")
    source_column: str = Field(description="seq2seq: the input text column (what the encoder reads).")
    target_column: str = Field(description="seq2seq: the output text column (what the decoder learns to write).")
    messages_column: str | None = Field(
        description="causal_lm: a chat column (a list of {role, content}); rendered with the tokenizer's chat "
        "template, the last assistant message is the response. Takes precedence over prompt/response."
    )
    csv_columns: list[str] | None = Field(
        description="Column names of CSV files that have no header row (null: the first row is the header)."
    )
    max_length: int = Field(ge=8, le=8192, description="Tokens per row after truncation.")
    bucketing: bool = Field(
        description="Length-grouped batches padded to their longest row (false: pad to max_length, random batches)."
    )
    pad_to_multiple_of: PositiveInt | Literal["auto"] | None = Field(
        description="Round each batch's padded length up to a multiple of this (tensor-core friendly); null for none; "
        "auto: 8 on CUDA, none on CPU (where rounding only adds padding)."
    )
    max_tokens_per_batch: PositiveInt | None = Field(
        description="With bucketing, fill batches up to this many padded tokens instead of batch_size rows "
        "(short rows travel in bigger batches); null: batch_size rows per batch."
    )
    packing: bool = Field(
        description="causal_lm: pack several examples into each row of up to max_length tokens (best-fit "
        "decreasing), positions restarting and no attention across examples; batch_size then counts packed rows."
    )
    val_fraction: float = Field(gt=0.0, lt=0.5, description="Validation share when the source has no validation split.")
    test_fraction: float = Field(gt=0.0, lt=0.5, description="Test share when the source has no test split.")
    num_proc: PositiveInt | None = Field(
        description="Parallel tokenizer workers (Rust threads of the fast tokenizer); null: all cores."
    )

    @model_validator(mode="after")
    def _token_budget_needs_bucketing(self) -> DataParams:
        if self.max_tokens_per_batch is not None and not self.bucketing:
            raise ValueError(
                "data.max_tokens_per_batch needs data.bucketing: true (fixed padding has no length groups to fill)"
            )
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < self.max_length:
            raise ValueError(
                f"data.max_tokens_per_batch ({self.max_tokens_per_batch}) must be at least "
                f"data.max_length ({self.max_length}), or the longest rows fit in no batch"
            )
        return self

    @model_validator(mode="after")
    def _fractions_leave_training_rows(self) -> DataParams:
        if self.val_fraction + self.test_fraction >= 0.8:
            raise ValueError(
                f"data.val_fraction + data.test_fraction = {self.val_fraction + self.test_fraction:g} "
                "leaves too few training rows; keep the sum below 0.8"
            )
        return self


class ModelConfigParams(StrictModel):
    """A small BERT-style classifier built from a config (used when `model.name_or_path` is null)."""

    vocab_size: int = Field(
        ge=100, le=100_000, description="Vocabulary size of the word-level tokenizer built from the training split."
    )
    hidden_size: PositiveInt = Field(description="Width of the hidden states.")
    num_hidden_layers: PositiveInt = Field(description="Transformer layers.")
    num_attention_heads: PositiveInt = Field(description="Attention heads; must divide hidden_size.")
    intermediate_size: PositiveInt = Field(description="Width of the feed-forward layer.")
    dropout: float = Field(ge=0.0, lt=1.0, description="Dropout on hidden states and attention.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfigParams:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.config.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.config.num_attention_heads ({self.num_attention_heads})"
            )
        return self


class ModelParams(StrictModel):
    """Which model is fine-tuned."""

    name_or_path: str | None = Field(
        description="Hub model id or local folder; null builds `model.config` with a tokenizer trained on the data."
    )
    config: ModelConfigParams = Field(description="Used when name_or_path is null.")
    revision: str | None = Field(
        description="Hub revision (branch, tag or commit) of name_or_path; pin a commit so DVC sees a change of "
        "weights. null: the default branch."
    )
    gguf_file: str | None = Field(
        description="A GGUF file inside name_or_path, de-quantized to fp32 weights on load (e.g. "
        "SmolLM2-135M-Instruct.Q4_1.gguf); null: safetensors/bin weights."
    )
    trust_remote_code: bool = Field(description="Allow a hub model to run its own code (off unless you trust it).")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"] | None = (
        Field(
            description="The attention the model trains with (transformers' set_attn_implementation); "
            "flash_attention_2 needs CUDA and the flash-attn package, and takes packed rows as variable-length "
            "sequences; null: transformers' default (sdpa where the model supports it)."
        )
    )

    @model_validator(mode="after")
    def _gguf_needs_a_folder(self) -> ModelParams:
        if self.gguf_file is not None and self.name_or_path is None:
            raise ValueError("model.gguf_file names a file inside model.name_or_path; set model.name_or_path too")
        return self


class AdapterParams(StrictModel):
    """Parameter-efficient fine-tuning (peft): train small adapters, freeze the base model."""

    type: AdapterType = Field(
        description="none: full fine-tuning; lora: low-rank adapters (peft's LoRA); qlora: LoRA on a base quantized "
        "to 4-bit NF4 (bitsandbytes, CUDA only)."
    )
    r: PositiveInt = Field(description="LoRA rank.")
    alpha: PositiveFloat = Field(description="LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(ge=0.0, lt=1.0, description="Dropout on the LoRA branch's input.")
    target_modules: list[str] | None = Field(
        description="Module names that get adapters (e.g. [q_proj, v_proj]); null: peft's default for the "
        "model type (attention query and value)."
    )
    merge: bool = Field(description="Save the merged model (base + adapter, full size) instead of the adapter alone.")


class EvalParams(StrictModel):
    """How the test split is scored."""

    max_new_tokens: PositiveInt = Field(
        le=1024, description="causal_lm and seq2seq: the most tokens generation writes per row."
    )
    num_beams: PositiveInt = Field(le=16, description="seq2seq: beam size of generation (1: greedy).")
    model_uri: str | None = Field(
        pattern=r"^models:/[^/]+/[^/]+$",
        description="The model the evaluate stage scores: null for models/best (this run's best trial), or a "
        "registered version as models:/<name>/<version> (or /latest).",
    )


class ChoiceDim(StrictModel):
    """Sample one of `values` at random."""

    type: Literal["choice"]
    values: list[Any] = Field(min_length=1, description="The values to choose from.")


class GridDim(StrictModel):
    """Try every one of `values` (a grid axis; multiplies the number of trials)."""

    type: Literal["grid"]
    values: list[Any] = Field(min_length=1, description="Every value is tried.")


class UniformDim(StrictModel):
    """A float drawn uniformly from [low, high]."""

    type: Literal["uniform"]
    low: float = Field(description="Lower bound.")
    high: float = Field(description="Upper bound.")


class LogUniformDim(StrictModel):
    """A float drawn uniformly in log space from [low, high] (learning rates)."""

    type: Literal["loguniform"]
    low: PositiveFloat = Field(description="Lower bound (> 0).")
    high: PositiveFloat = Field(description="Upper bound.")


class RandIntDim(StrictModel):
    """An integer drawn uniformly from [low, high)."""

    type: Literal["randint"]
    low: int = Field(description="Lower bound (included).")
    high: int = Field(description="Upper bound (excluded).")


SearchDim = Annotated[ChoiceDim | GridDim | UniformDim | LogUniformDim | RandIntDim, Field(discriminator="type")]


def candidate_values(dim: ChoiceDim | GridDim | UniformDim | LogUniformDim | RandIntDim) -> list[Any]:
    """Values a dimension can produce at its edges (validated against the schema before any trial)."""
    if isinstance(dim, ChoiceDim | GridDim):
        return list(dim.values)
    if dim.low >= dim.high:
        raise ValueError(f"low ({dim.low}) must be below high ({dim.high})")
    return [dim.low, dim.high - 1] if isinstance(dim, RandIntDim) else [dim.low, dim.high]


class ResourcesParams(StrictModel):
    """What one trial reserves on the Ray cluster."""

    cpu: PositiveFloat | None = Field(
        description="CPUs per trial (per worker with distributed.num_workers > 1); null: an even share of the cores."
    )
    gpu: NonNegativeFloat | None = Field(
        description="GPUs per trial (fractions share a GPU); null: 1 with CUDA, else 0."
    )


# Sections every trial shares: the Tuner reserves one set of resources for all trials.
_SHARED_SECTIONS = ("tune", "tracking", "distributed")

# Keys the tokenize stage reads to build data/tokenized, once for every trial: a trial cannot change them.
TOKENIZE_STAGE_KEYS = (
    "seed",
    "task",
    "data.source",
    "data.generator",
    "data.text_column",
    "data.label_column",
    "data.prompt_column",
    "data.response_column",
    "data.messages_column",
    "data.source_column",
    "data.target_column",
    "data.csv_columns",
    "data.max_length",
    "data.val_fraction",
    "data.test_fraction",
    "data.num_proc",
    "model.name_or_path",
    "model.revision",
    "model.gguf_file",
    "model.config.vocab_size",
    "model.trust_remote_code",
)


def tokenize_stage_key(key: str) -> str | None:
    """The tokenize-stage key that overriding `key` would change (`data` covers `data.max_length`), else None."""
    for read in TOKENIZE_STAGE_KEYS:
        if key == read or read.startswith(key + ".") or key.startswith(read + "."):
            return read
    return None


def _refuse_tokenize_keys(where: str, keys: list[str]) -> None:
    for key in keys:
        read = tokenize_stage_key(key)
        if read is not None:
            raise ValueError(
                f"{where}: key {key!r} changes {read!r}, which the tokenize stage reads: the data is tokenized once "
                f"for every trial, so a trial cannot change it; run it as its own experiment: dvc exp run -S {read}=..."
                + (" (repeats with other seeds: tune.num_samples)" if read == "seed" else "")
            )


# Optimizers whose update is elementwise, so they run unchanged on FSDP's sharded (DTensor) weights.
FSDP_OPTIMIZERS = ("adamw", "sgd")


class DistributedParams(StrictModel):
    """Data-parallel training inside each trial (Ray Train workers, DDP)."""

    num_workers: PositiveInt = Field(
        description="Ray Train workers per trial (DDP: gloo on CPU, NCCL on GPUs); 1: the trial trains in its own "
        "process. batch_size is per worker: the global batch is num_workers x batch_size x grad_accum_steps."
    )
    use_gpu: bool | None = Field(description="One GPU per worker; null: when the driver sees CUDA.")
    strategy: Literal["ddp", "fsdp"] = Field(
        description="ddp: every worker holds the whole model and its optimizer state; fsdp: FSDP2 (fully_shard) "
        "shards weights, gradients and optimizer state across the workers, per transformer block (for models "
        "that outgrow one device). Only with num_workers > 1."
    )


class LrRangeTestParams(StrictModel):
    """`lr: auto`: an exponential sweep of the learning rate over a few steps (Smith 2015)."""

    min_lr: PositiveFloat = Field(description="The sweep's first learning rate.")
    max_lr: PositiveFloat = Field(description="The sweep's last learning rate (it stops earlier on divergence).")
    num_steps: PositiveInt = Field(
        ge=5, description="Optimizer steps of the sweep (each one batch of the training split)."
    )
    smoothing: float = Field(ge=0.0, lt=1.0, description="Exponential smoothing of the loss (0: none).")
    divergence: PositiveFloat = Field(
        gt=1.0, description="Stop when the smoothed loss exceeds this many times its minimum so far."
    )
    rule: Literal["steepest", "valley", "min_divided"] = Field(
        description="How the rate is read off the curve: min_divided (the rate at the minimum smoothed loss / 10; "
        "robust to the flat curves of models trained from scratch), valley (fastai's: halfway down the longest "
        "descent of the smoothed loss) or steepest (most negative slope of the smoothed loss before its minimum)."
    )

    @model_validator(mode="after")
    def _range(self) -> LrRangeTestParams:
        if self.min_lr >= self.max_lr:
            raise ValueError(f"lr_range_test.min_lr ({self.min_lr}) must be below max_lr ({self.max_lr})")
        return self


class TuneParams(StrictModel):
    """How the train stage runs its Ray Tune trials."""

    num_samples: PositiveInt = Field(
        description="Samples drawn from search_space per variant; without a search space, repeats of each variant "
        "with seeds seed, seed+1, ... (the report then shows mean ± sd and marks differences beyond the noise)."
    )
    variants: dict[str, dict[str, Any]] = Field(
        description="Named override sets by dotted key, run as a grid, e.g. {vanilla: {}, bf16: {precision: bf16}}.",
    )
    search_space: dict[str, SearchDim] = Field(
        description="Dotted key -> {type: choice|grid|uniform|loguniform|randint, ...}; combined with every variant."
    )
    max_concurrent_trials: PositiveInt = Field(description="Trials running at the same time.")
    metric: str = Field(
        description="Trial metric that picks the best trial (and that ASHA compares); auto: the task's own "
        "(classification: val_accuracy, causal_lm and seq2seq: val_loss)."
    )
    mode: Literal["max", "min", "auto"] = Field(
        description="Whether the metric is maximised or minimised; auto: as the task's metric wants (with "
        "metric: auto), else max for accuracies and min for losses."
    )
    scheduler: Literal["fifo", "asha"] = Field(
        description="fifo runs every trial to the end; asha stops weak ones early."
    )
    grace_period: PositiveInt = Field(description="ASHA: epochs every trial runs before it can be stopped.")
    reduction_factor: float = Field(gt=1.0, description="ASHA: 1/reduction_factor of trials go on at each rung.")
    resources_per_trial: ResourcesParams = Field(description="CPUs and GPUs each trial reserves.")
    time_budget_s: PositiveFloat | None = Field(
        description="Stop starting and running trials after this long; null: none."
    )
    address: str | None = Field(description="Ray cluster to join (else RAY_ADDRESS, else a local one); null: local.")


class TrackingParams(StrictModel):
    """Where runs are recorded."""

    uri: str = Field(
        description="MLflow tracking URI; relative sqlite/file paths resolve against the repository root.",
    )
    experiment: str = Field(min_length=1, description="MLflow experiment name.")
    registered_model: str | None = Field(
        min_length=1,
        description="Model Registry name under which each train run registers its best trial's model as a new "
        "version; auto: the experiment's name; null: register nothing.",
    )

    def registered_model_name(self) -> str | None:
        """The registered model's name (auto: the experiment's), or None to skip registration."""
        return self.experiment if self.registered_model == "auto" else self.registered_model


class Params(StrictModel):
    """Everything a pipeline run reads: training knobs at the top, one section per concern."""

    task: TaskName = Field(
        description="classification (a label per row), causal_lm (instruction or plain language-model "
        "fine-tuning of a decoder) or seq2seq (an encoder-decoder, e.g. T5: source text -> target text)."
    )
    train_on_prompt: bool = Field(
        description="causal_lm: also learn the prompt's tokens (false: only the response's tokens count in the loss)."
    )
    optim: Optimizer = Field(
        description="Optimizer: adamw (two moments per parameter), adafactor (factored second moment), adamw_8bit "
        "(bitsandbytes, CUDA), lion (one moment: half of AdamW's state; use a 3-10x lower lr), sgd (momentum)."
    )
    precision: Precision = Field(description="fp32, fp16 (autocast + loss scaling), bf16 (autocast), or auto.")
    batch_size: BatchSize = Field(
        description="Rows per micro-batch, or `auto`: the largest divisor of effective_batch_size that fits in memory."
    )
    effective_batch_size: PositiveInt | None = Field(
        description="Rows per optimizer step when batch_size is auto (accumulation makes up the rest); else null."
    )
    grad_accum_steps: PositiveInt = Field(description="Micro-batches accumulated per optimizer step.")
    grad_checkpointing: bool = Field(description="Recompute activations in backward to save memory.")
    lr: LearningRate = Field(
        description="Peak learning rate, or `auto`: an LR range test on the training split picks it before training "
        "(see lr_range_test; with lr_schedule: onecycle it is the cycle's maximum)."
    )
    lr_range_test: LrRangeTestParams = Field(description="The sweep `lr: auto` runs before training.")
    memory_budget: Bytes = Field(
        description="Training memory a trial may use (bytes, or e.g. '8GB', '8GiB'); null: no budget. A trial whose "
        "memory plan does not fit is refused before training; with strategy: auto the fastest plan that fits is chosen."
    )
    strategy: Literal["manual", "auto"] = Field(
        description="manual: train with the params as written; auto (needs memory_budget): choose precision, "
        "micro-batch and accumulation, checkpointing, then a lean optimizer, then LoRA, by the memory plan."
    )
    epochs: PositiveInt = Field(description="Passes over the training split.")
    seed: int = Field(ge=0, description="Seed for data splits, shuffling and initialisation.")
    lr_schedule: LrSchedule = Field(
        description="Learning-rate schedule, stepped per optimizer step (reduce_on_plateau: per epoch, on val loss)."
    )
    warmup_ratio: float = Field(ge=0.0, lt=1.0, description="Share of optimizer steps spent warming up.")
    weight_decay: NonNegativeFloat = Field(description="Decoupled weight decay (not on biases and norms).")
    max_grad_norm: PositiveFloat | None = Field(description="Clip the global gradient norm to this; null to skip.")
    device: DeviceName = Field(description="auto picks CUDA when present, else CPU.")
    num_workers: NonNegativeInt = Field(description="DataLoader worker processes.")
    persistent_workers: bool = Field(
        description="Keep DataLoader workers alive between epochs (needs num_workers > 0)."
    )
    prefetch_factor: PositiveInt = Field(description="Batches each DataLoader worker prepares ahead.")
    pin_memory: bool = Field(description="Pin host batches for faster, non-blocking copies (CUDA only).")
    compile: bool = Field(description="torch.compile the model.")
    tf32: bool | Literal["auto"] = Field(
        description="TF32 matmuls and convolutions on CUDA; auto: on for bf16/fp16 runs, off for fp32 (a real fp32 "
        "baseline). No effect on CPU."
    )
    fast_dropout: bool = Field(
        description="On CPU (without compile): dropout masks from 16-bit lanes of 64-bit draws, about 3x faster "
        "than torch's bernoulli; the attention's dropout only where the fast attention reproduces the model's own "
        "(not causal, no sliding window or soft-capping; checked at p=0), else the run's tags say why; "
        "no effect on CUDA."
    )
    log_every_n_steps: PositiveInt = Field(description="Optimizer steps between logged loss/lr points.")
    max_nonfinite_steps: PositiveInt = Field(
        description="Stop the run when the loss is NaN/inf this many optimizer steps in a row (checked when logging); "
        "such steps are skipped in every precision, never applied."
    )
    checkpoint_every_n_steps: PositiveInt | None = Field(
        description="Optimizer steps between checkpoints (one is also written at every epoch's end); null: epochs only."
    )
    data: DataParams = Field(description="Data source, tokenization, batching.")
    model: ModelParams = Field(description="The model fine-tuned.")
    adapter: AdapterParams = Field(description="LoRA adapters (peft) instead of full fine-tuning.")
    eval: EvalParams = Field(description="Test-split scoring.")
    distributed: DistributedParams = Field(description="Data-parallel workers per trial.")
    tune: TuneParams = Field(description="Ray Tune trials.")
    tracking: TrackingParams = Field(description="MLflow tracking.")

    @model_validator(mode="after")
    def _combinations_are_compatible(self) -> Params:
        if self.batch_size == "auto" and self.effective_batch_size is None:
            raise ValueError("batch_size: auto needs effective_batch_size (the rows per optimizer step to keep)")
        if self.batch_size == "auto" and self.grad_accum_steps != 1:
            raise ValueError(
                "batch_size: auto chooses grad_accum_steps itself; set grad_accum_steps: 1 "
                f"(got {self.grad_accum_steps})"
            )
        if self.batch_size != "auto" and self.effective_batch_size is not None:
            raise ValueError(
                f"effective_batch_size ({self.effective_batch_size}) is only used with batch_size: auto; "
                f"with batch_size {self.batch_size} the effective batch is batch_size x grad_accum_steps; "
                "set it to null"
            )
        if self.batch_size == "auto" and self.data.max_tokens_per_batch is not None:
            raise ValueError("batch_size: auto and data.max_tokens_per_batch both size batches; choose one")
        if self.adapter.type == "qlora" and self.device == "cpu":
            raise ValueError(
                "adapter.type = 'qlora' needs CUDA: its base model is quantized to 4-bit NF4 by bitsandbytes, whose "
                "4-bit kernels run on GPUs only; with device: cpu use adapter.type: lora"
            )
        if self.adapter.type == "qlora" and self.adapter.merge:
            raise ValueError(
                "adapter.merge: true with adapter.type: qlora would merge into a 4-bit base (rounding the update "
                "away); save the adapter (adapter.merge: false), or merge into an fp32 base after training"
            )
        if self.optim == "adamw_8bit" and self.device == "cpu":
            raise ValueError("optim: adamw_8bit runs on CUDA only (bitsandbytes); device: cpu cannot use it")
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError(
                "precision: fp16 (with loss scaling) is for GPUs; with device: cpu use precision: bf16, fp32 or auto"
            )
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError("persistent_workers: true needs num_workers > 0 (there are no workers to keep)")
        if self.distributed.use_gpu and self.device == "cpu":
            raise ValueError("distributed.use_gpu: true gives each worker a GPU; device: cpu cannot use it")
        if (
            self.task == "causal_lm"
            and self.data.messages_column is None
            and ((self.data.prompt_column is None) != (self.data.response_column is None))
        ):
            raise ValueError(
                f"task: causal_lm needs data.prompt_column and data.response_column together (got "
                f"{self.data.prompt_column!r} and {self.data.response_column!r}); set both, or neither for plain "
                "language modelling of data.text_column"
            )
        if self.data.packing and self.task != "causal_lm":
            raise ValueError(
                f"data.packing: true packs causal-LM examples; task: {self.task} keeps one example per row "
                "(set data.packing: false, or task: causal_lm)"
            )
        if self.task == "causal_lm" and not isinstance(self.data.text_column, str):
            raise ValueError("task: causal_lm reads one data.text_column (a string), not a list of columns")
        if self.strategy == "auto" and self.memory_budget is None:
            raise ValueError(
                "strategy: auto chooses the fastest plan that fits memory_budget; set memory_budget (e.g. '8GB'), "
                "or strategy: manual"
            )
        if self.distributed.num_workers > 1 and self.lr == "auto":
            raise ValueError(
                "lr: auto runs its range test in one process; with distributed.num_workers > 1 set lr explicitly "
                "(run the test once with num_workers: 1, then use the lr_found it logs)"
            )
        if self.distributed.strategy == "fsdp":
            self._check_fsdp()
        if self.distributed.num_workers > 1 and self.batch_size == "auto":
            raise ValueError(
                "batch_size: auto probes one process's memory; with distributed.num_workers > 1 set batch_size "
                "(per worker) explicitly"
            )
        return self

    def _check_fsdp(self) -> None:
        """What FSDP2 sharding supports here: elementwise optimizers, full fine-tuning, eager mode."""
        if self.optim not in FSDP_OPTIMIZERS:
            raise ValueError(
                f"distributed.strategy: fsdp shards every weight across workers, and optim = {self.optim!r} does not "
                f"run on sharded weights (Adafactor factors whole matrices); allowed with fsdp: "
                f"{', '.join(FSDP_OPTIMIZERS)}"
            )
        if self.adapter.type != "none":
            raise ValueError(
                f"distributed.strategy: fsdp with adapter.type = {self.adapter.type!r} is not supported: an adapter's "
                "trainable weights are small, so use distributed.strategy: ddp"
            )
        if self.compile:
            raise ValueError("distributed.strategy: fsdp with compile: true is not supported yet; use compile: false")

    @model_validator(mode="after")
    def _variants_are_valid(self) -> Params:
        # Validate every variant and search dimension now, so a bad one fails before the first trial.
        base = self.model_copy(update={"tune": self.tune.model_copy(update={"variants": {}, "search_space": {}})})
        _refuse_tokenize_keys("tune.search_space", list(self.tune.search_space))
        for name, overrides in self.tune.variants.items():
            _refuse_tokenize_keys(f"tune.variants.{name}", list(overrides))
        for key, dim in self.tune.search_space.items():
            if key.split(".")[0] in _SHARED_SECTIONS:
                raise ValueError(
                    f"tune.search_space: key {key!r} cannot vary per trial (tune, tracking and distributed are shared: "
                    "every trial reserves the same workers)"
                )
            try:
                for value in candidate_values(dim):
                    apply_overrides(base, {key: value})
            except (ParamsError, ValueError) as err:
                raise ValueError(f"tune.search_space.{key}: {_inner(err)}") from None
        for name, overrides in self.tune.variants.items():
            for key in overrides:
                if key.split(".")[0] in _SHARED_SECTIONS:
                    raise ValueError(
                        f"tune.variants.{name}: key {key!r} cannot be overridden per trial "
                        "(tune, tracking and distributed settings are shared by all trials)"
                    )
            try:
                apply_overrides(base, overrides)
            except ParamsError as err:
                raise ValueError(f"tune.variants.{name}: {_inner(err)}") from None
        return self


class ParamsError(UserError):
    """params.yaml (or an override) is not valid."""


def _inner(err: Exception) -> str:
    """The problems of a nested validation, without its "... is invalid:" header."""
    lines = str(err).splitlines()
    problems = [line.strip().removeprefix("- ") for line in lines[1:]] if len(lines) > 1 else lines
    return "; ".join(problems)


def _describe_error(err: Mapping[str, Any]) -> str:
    loc = ".".join(str(part) for part in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key (check the spelling; see the params reference in README.md)"
    if err["type"] == "missing":
        return f"{loc}: required key is missing (params.yaml holds every key; see the params reference in README.md)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        # Our own cross-field rules already name their keys and values.
        return f"{loc}: {msg}" if err["loc"] else msg
    return f"{loc} = {err['input']!r}: {msg}"


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: key path, bad value, what is allowed."""
    lines = [f"{source} is invalid:"]
    lines += [f"  - {_describe_error(e)}" for e in err.errors()]
    return "\n".join(lines)


def parse_params(raw: Mapping[str, Any] | None, source: str = "params.yaml") -> Params:
    """Validate a mapping (e.g. parsed YAML) into `Params`, raising `ParamsError` with readable lines."""
    try:
        return Params.model_validate(raw or {})
    except ValidationError as err:
        raise ParamsError(format_validation_error(err, source)) from None


def load_params(path: str | os.PathLike[str] = "params.yaml") -> Params:
    """Read and validate a params file; every failure is a `ParamsError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found (run from the repository root)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ParamsError(f"{path}: cannot be read: {err}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return parse_params(raw, str(path))


def set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    """Set `tree["a"]["b"] = value` for `dotted_key="a.b"`, creating sections as needed."""
    *parents, leaf = dotted_key.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ParamsError(f"override {dotted_key!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def apply_overrides(params: Params, overrides: Mapping[str, Any], source: str = "overrides") -> Params:
    """Return a new, re-validated `Params` with dotted-key overrides merged in."""
    tree = copy.deepcopy(params.model_dump(mode="python"))
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    return parse_params(tree, source)


def flatten_params(params: Params) -> dict[str, Any]:
    """Flatten to dotted keys (`data.max_length`); variants are logged as one JSON-ish string."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and not prefix.endswith("variants"):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        else:
            flat[prefix] = node

    walk("", params.model_dump(mode="json"))
    return flat


def resolve_repo_root(params_path: str | os.PathLike[str] = "params.yaml") -> Path:
    """The repository whose MLflow store and results the run uses.

    DVC sets `DVC_ROOT` for every stage and points it at the original repository even
    when a queued experiment runs in a temporary copy, so runs from `dvc exp run --queue`
    land in the same store as runs from the workspace.
    """
    root = os.environ.get("DVC_ROOT")
    return Path(root).resolve() if root else Path(params_path).resolve().parent


# The validation metric that picks the best trial when tune.metric is auto, and its direction.
TASK_OBJECTIVES: dict[str, tuple[str, Literal["max", "min"]]] = {
    "classification": ("val_accuracy", "max"),
    "causal_lm": ("val_loss", "min"),
    "seq2seq": ("val_loss", "min"),
}
_LOWER_IS_BETTER = ("loss", "perplexity", "time", "bytes")


def tune_objective(params: Params) -> tuple[str, Literal["max", "min"]]:
    """(metric, mode) that picks the best trial: tune.metric/mode, with auto resolved for the task."""
    metric, mode = params.tune.metric, params.tune.mode
    if metric == "auto":
        metric, task_mode = TASK_OBJECTIVES[params.task]
        return metric, task_mode if mode == "auto" else mode
    if mode == "auto":
        mode = "min" if any(word in metric for word in _LOWER_IS_BETTER) else "max"
    return metric, mode


def ray_address(params: Params) -> str | None:
    """The Ray cluster to join: `tune.address`, else RAY_ADDRESS, else None (a local Ray)."""
    return params.tune.address or os.environ.get("RAY_ADDRESS") or None
