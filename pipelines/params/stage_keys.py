"""Which params each DVC stage reads: declared here once, and dvc.yaml is checked against it.

A stage re-runs when a param it lists in dvc.yaml changes; a key it reads but does not list would leave an
old result under a new experiment's name. `tests/pipelines/test_stage_contracts.py` checks dvc.yaml's
`params:` against STAGE_PARAMS, every key of params.yaml against some stage, and every `params.<key>` the
train stage's code reads against its list.
"""

from __future__ import annotations

# Sections every trial shares: the Tuner reserves one set of resources for all trials.
SHARED_SECTIONS = ("tune", "tracking", "distributed")

# Keys the tokenize stage reads to build data/tokenized, once for every trial: a trial cannot change them.
TOKENIZE_STAGE_KEYS = (
    "seed",
    "task",
    "data.source",
    "data.revision",
    "data.generator",
    "data.text_column",
    "data.label_column",
    "data.prompt_column",
    "data.response_column",
    "data.prompt_template",
    "data.messages_column",
    "data.source_column",
    "data.target_column",
    "data.csv_columns",
    "data.drop_empty",
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


def refuse_tokenize_keys(where: str, keys: list[str]) -> None:
    """Refuse a per-trial override (`where`) of a key the tokenize stage reads."""
    for key in keys:
        read = tokenize_stage_key(key)
        if read is not None:
            raise ValueError(
                f"{where}: key {key!r} changes {read!r}, which the tokenize stage reads: the data is tokenized once "
                f"for every trial, so a trial cannot change it; run it as its own experiment: dvc exp run -S {read}=..."
                + (" (repeats with other seeds: tune.num_samples)" if read == "seed" else "")
            )


# Each stage's params, as dvc.yaml lists them (a section covers all its keys). The train stage lists only
# the data keys training itself reads: the rest reach it through data/tokenized, which tokenize rebuilds.
# `validate` reads the whole file (WHOLE_FILE), which dvc.yaml lists as a file dependency, not as params: any
# change, an added key included, re-runs it, and no knob becomes a `dvc exp show` column through it.
WHOLE_FILE = "params.yaml"
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "validate": (WHOLE_FILE,),
    "source": ("data.source", "data.revision", "model.name_or_path"),
    "tokenize": ("task", "data", "model", "seed", "batch_size", "device"),
    "train": (
        "task", "train_on_prompt", "optim", "precision", "weights_dtype", "batch_size", "grad_accum_steps",
        "grad_checkpointing", "grad_checkpointing_every", "activation_offload", "loss_impl", "kernels",
        "lr", "lr_range_test", "memory_budget", "strategy", "epochs", "seed", "lr_schedule", "warmup_ratio",
        "weight_decay", "max_grad_norm", "effective_batch_size", "device", "target_device", "num_workers",
        "persistent_workers", "prefetch_factor", "pin_memory", "compile", "tf32", "fast_dropout", "log_every_n_steps",
        "max_nonfinite_steps", "checkpoint_every_n_steps", "data.bucketing", "data.pad_to_multiple_of",
        "data.max_length", "data.max_tokens_per_batch", "data.packing", "model", "adapter", "eval.max_new_tokens",
        "eval.num_beams", "distributed", "tune", "tracking",
    ),
    "evaluate": ("tracking", "eval.model_uri"),
    "report": ("tracking",),
}  # fmt: skip


def covers(listed: str, key: str) -> bool:
    """Whether a stage listing `listed` re-runs when `key` changes (a section covers its keys)."""
    return key == listed or key.startswith(listed + ".")
