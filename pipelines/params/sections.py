"""The params sections other than the tune section: data, model, adapter, eval, distributed, tracking."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from pipelines.params.fields import AdapterType, StrictModel, template_fields


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
    revision: str | None = Field(
        description="A hub dataset's revision (a commit, tag or branch); pin a commit so the data of every "
        "experiment is known (DVC sees a local source's contents, not a hub's). null: the default branch."
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
    prompt_template: str | None = Field(
        description="causal_lm: the prompt built from several columns, each named in braces (Alpaca: "
        '"{instruction}\\n\\n{input}"); a paragraph (text between blank lines) whose every field is empty is '
        "left out, so a row with no input reads as its instruction alone. Replaces prompt_column; "
        "null: prompt_column as it is."
    )
    source_column: str = Field(description="seq2seq: the input text column (what the encoder reads).")
    target_column: str = Field(description="seq2seq: the output text column (what the decoder learns to write).")
    messages_column: str | None = Field(
        description="causal_lm: a chat column (a list of {role, content}, or ShareGPT's {from, value} with "
        "human/gpt/system turns, mapped to user/assistant/system); rendered with the tokenizer's chat template, the "
        "last assistant message is the response. Takes precedence over prompt/response."
    )
    csv_columns: list[str] | None = Field(
        description="Column names of CSV files that have no header row (null: the first row is the header)."
    )
    drop_empty: bool = Field(
        description="Drop rows whose text (or prompt/response, source/target, label) is empty, counting them per "
        "split in metrics/tokenize.json (`dropped_empty_rows`); false: refuse them, naming their rows."
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

    @model_validator(mode="before")
    @classmethod
    def _one_prompt_column(cls, values: Any) -> Any:
        if isinstance(values, dict) and isinstance(values.get("prompt_column"), list):
            columns = values["prompt_column"]
            raise ValueError(
                f"data.prompt_column = {columns!r}: takes one column; to build the prompt from several (Alpaca's "
                "instruction and input), set data.prompt_template, e.g. '{instruction}\\n\\n{input}' (a paragraph "
                "whose fields are all empty is left out), and data.prompt_column: null"
            )
        return values

    @model_validator(mode="after")
    def _template_names_columns(self) -> DataParams:
        if self.prompt_template is not None:
            template_fields(self.prompt_template)  # a ValueError naming the bad field
            if self.response_column is None:
                raise ValueError("data.prompt_template needs data.response_column: the answer the model learns")
        return self

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


class DistributedParams(StrictModel):
    """Data-parallel training inside each trial (Ray Train workers, DDP or FSDP2)."""

    num_workers: PositiveInt = Field(
        description="Ray Train workers per trial (DDP: gloo on CPU, NCCL on GPUs); 1: the trial trains in its own "
        "process. batch_size is per worker: the global batch is num_workers x batch_size x grad_accum_steps."
    )
    use_gpu: bool | None = Field(description="One GPU per worker; null: when the driver sees CUDA.")
    strategy: Literal["ddp", "fsdp"] = Field(
        description="ddp: every worker holds the whole model and its optimizer state; fsdp: FSDP2 (fully_shard) "
        "shards weights, gradients and optimizer state across the workers, per transformer block (for models "
        "that outgrow one device), LoRA included (the frozen base sharded in the compute dtype; QLoRA not yet). Only "
        "with num_workers > 1."
    )
    reshard_after_forward: bool = Field(
        description="fsdp: free each block's gathered weights after its forward and gather them again for its "
        "backward (true: less memory), or keep them until the backward (false: one all-gather fewer per block, "
        "the whole unsharded model alive between forward and backward)."
    )
    cpu_offload: bool = Field(
        description="fsdp: keep the weight shards, their gradients and the optimizer step in host memory "
        "(FSDP2's CPUOffloadPolicy), copying each block to the GPU as it runs: the least GPU memory, the "
        "slowest step. On device: cpu everything is in host memory already (no change)."
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


class TrackingParams(StrictModel):
    """Where runs are recorded."""

    uri: str = Field(
        description="MLflow tracking URI; relative sqlite/file paths resolve against the repository root.",
    )
    experiment: str = Field(min_length=1, description="MLflow experiment name.")
    registered_model: str | None = Field(
        min_length=1,
        description="Model Registry name under which each train run registers its best trial's model as a new "
        "version (tagged with its task); auto: the experiment's name and the task (finetune-classification), so "
        "`models:/<name>/latest` always takes the input its task serves; null: register nothing.",
    )

    upload_retry_s: float = Field(
        ge=0,
        description="How long an artifact upload (a trial's model, its params, the report) is retried with backoff "
        "when the artifact store fails; then it stays on disk, recorded on its run as `upload.pending`, for "
        "`python -m stages.train --resume-upload` to send.",
    )

    def registered_model_name(self, task: str) -> str | None:
        """The registered model's name (auto: `<experiment>-<task>`), or None to skip registration."""
        return f"{self.experiment}-{task}" if self.registered_model == "auto" else self.registered_model
