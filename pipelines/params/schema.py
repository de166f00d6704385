"""The top-level `Params`: the training knobs, one field per section, and the rules across fields."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from pipelines.optimizer_registry import optimizers_described
from pipelines.params.errors import ParamsError, inner_problems
from pipelines.params.fields import (
    BatchSize,
    DeviceName,
    LearningRate,
    LrSchedule,
    MemoryBudget,
    Optimizer,
    Precision,
    StrictModel,
    TargetDevice,
    TaskName,
    WeightsDtype,
)
from pipelines.params.overrides import apply_overrides
from pipelines.params.rules import first_broken_rule
from pipelines.params.sections import (
    AdapterParams,
    DataParams,
    DistributedParams,
    EvalParams,
    LrRangeTestParams,
    ModelParams,
    TrackingParams,
)
from pipelines.params.stage_keys import SHARED_SECTIONS, refuse_tokenize_keys
from pipelines.params.tune import TuneParams, candidate_values


class Params(StrictModel):
    """Everything a pipeline run reads: training knobs at the top, one section per concern."""

    task: TaskName = Field(
        description="classification (a label per row), causal_lm (instruction or plain language-model "
        "fine-tuning of a decoder) or seq2seq (an encoder-decoder, e.g. T5: source text -> target text)."
    )
    train_on_prompt: bool = Field(
        description="causal_lm: also learn the prompt's tokens (false: only the response's tokens count in the loss)."
    )
    optim: Optimizer = Field(description=f"Optimizer: {optimizers_described()}.")
    precision: Precision = Field(
        description="fp32, fp16 (autocast + loss scaling), bf16 (autocast), or auto: bf16 on a CUDA card since "
        "Ampere, fp16 on an older card; on a CPU, bf16 only where it is native (avx512_bf16, amx_bf16) and measured "
        "faster for that kind of host (benchmarks/bench_cpu_bf16.py), else fp32."
    )
    weights_dtype: WeightsDtype = Field(
        description="How trained weights are stored: fp32 (master copies under mixed precision) or bf16 (pure "
        "16-bit training, as torchtune's default: weights, gradients and optimizer state in bf16; needs "
        "precision bf16; updates below bf16's resolution are lost). Frozen weights follow the precision either way."
    )
    batch_size: BatchSize = Field(
        description="Rows per micro-batch, or `auto`: the largest divisor of effective_batch_size that fits in memory."
    )
    effective_batch_size: PositiveInt | None = Field(
        description="Rows per optimizer step when batch_size is auto (accumulation makes up the rest); else null."
    )
    grad_accum_steps: PositiveInt = Field(description="Micro-batches accumulated per optimizer step.")
    grad_checkpointing: bool = Field(description="Recompute activations in backward to save memory.")
    grad_checkpointing_every: PositiveInt = Field(
        description="With grad_checkpointing: checkpoint every n-th transformer block (1: all of them; 2: half, "
        "keeping the others' activations for speed); transformers' every_n_layers."
    )
    activation_offload: bool = Field(
        description="CUDA: keep saved activations in pinned host memory, copied asynchronously (with "
        "grad_checkpointing: the checkpointed blocks' inputs, via transformers; without: every saved tensor, via "
        "torch's save_on_cpu). Refused on the CPU, where activations already live in host memory."
    )
    loss_impl: Literal["auto", "full", "chunked"] = Field(
        description="causal_lm and seq2seq: full (project every target position to the vocabulary at once) or "
        "chunked (project and score a chunk of positions at a time, recomputed in backward: one chunk of logits "
        "is ever held); auto: chunked where the vocabulary has at least 32,768 entries and the model allows it."
    )
    kernels: Literal["none", "liger"] = Field(
        description="CUDA: liger swaps in Liger-Kernel's fused Triton kernels (RMSNorm, SwiGLU) for the model "
        "families it supports, on this model only; the loss's lever is loss_impl; none: the model's own code."
    )
    lr: LearningRate = Field(
        description="Peak learning rate, or `auto`: an LR range test on the training split picks it before training "
        "(see lr_range_test; with lr_schedule: onecycle it is the cycle's maximum)."
    )
    lr_range_test: LrRangeTestParams = Field(description="The sweep `lr: auto` runs before training.")
    memory_budget: MemoryBudget = Field(
        description="Training memory a trial may use (bytes, or e.g. '8GB', '8GiB'), or a GPU profile's name "
        "(e.g. A100-40GB: the card's memory less the CUDA context and allocator reserve); null: no budget. A trial "
        "whose memory plan does not fit is refused before training; with strategy: auto the fastest plan that fits "
        "is chosen."
    )
    strategy: Literal["manual", "auto"] = Field(
        description="manual: train with the params as written; auto (needs memory_budget): choose precision, "
        "micro-batch and accumulation, checkpointing, then a lean optimizer, then LoRA, then QLoRA (on a GPU with "
        "bitsandbytes), by the memory plan."
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
    target_device: TargetDevice = Field(
        description="The device the memory plan models: auto (where the run trains), cpu, or a GPU profile "
        "(H100-80GB, H200, A100-40GB, A100-80GB, L4, A10G, T4, RTX4090) to plan a CUDA run from any machine "
        "(`python -m stages.plan`), or several GPUs of one: <gpus>x<card> (8xA100-80GB) or <nodes>x<gpus>x<card> "
        "(2x8xH100-80GB), planned per GPU for DDP and FSDP with their collectives; a trial's own plan models where "
        "it trains."
    )
    num_workers: NonNegativeInt = Field(description="DataLoader worker processes.")
    persistent_workers: bool = Field(
        description="Keep DataLoader workers alive between epochs (needs num_workers > 0)."
    )
    prefetch_factor: PositiveInt = Field(description="Batches each DataLoader worker prepares ahead.")
    pin_memory: bool = Field(description="Pin host batches for faster, non-blocking copies (CUDA only).")
    compile: bool | Literal["auto"] = Field(
        description="torch.compile the whole step (forward, loss, backward; the optimizer's fused step) once for "
        "every padded width (widths rounded to at most 8 from the length histogram; the width dynamic), each batch "
        "shape warmed before timing, cached under .cache/ with a manifest and a Mega-Cache blob; CUDA graphs on a "
        "GPU, one recording per width. auto: on when the plan predicts its compile time, cold or warm as the cache "
        "holds it, is repaid within the run, else off (the tag compile.resolved says why)."
    )
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
        broken = first_broken_rule(self)
        if broken is not None:
            raise ValueError(broken)
        return self

    @model_validator(mode="after")
    def _variants_are_valid(self) -> Params:
        # Validate every variant and search dimension now, so a bad one fails before the first trial.
        base = self.model_copy(update={"tune": self.tune.model_copy(update={"variants": {}, "search_space": {}})})
        refuse_tokenize_keys("tune.search_space", list(self.tune.search_space))
        for name, overrides in self.tune.variants.items():
            refuse_tokenize_keys(f"tune.variants.{name}", list(overrides))
        for key, dim in self.tune.search_space.items():
            if key.split(".")[0] in SHARED_SECTIONS:
                raise ValueError(
                    f"tune.search_space: key {key!r} cannot vary per trial (tune, tracking and distributed are shared: "
                    "every trial reserves the same workers)"
                )
            try:
                for value in candidate_values(dim):
                    apply_overrides(base, {key: value})
            except (ParamsError, ValueError) as err:
                raise ValueError(f"tune.search_space.{key}: {inner_problems(err)}") from None
        for name, overrides in self.tune.variants.items():
            for key in overrides:
                if key.split(".")[0] in SHARED_SECTIONS:
                    raise ValueError(
                        f"tune.variants.{name}: key {key!r} cannot be overridden per trial "
                        "(tune, tracking and distributed settings are shared by all trials)"
                    )
            try:
                apply_overrides(base, overrides)
            except ParamsError as err:
                raise ValueError(f"tune.variants.{name}: {inner_problems(err)}") from None
        return self
