"""What a saved model folder needs to be reloaded by the standard Hugging Face one-liners, and its model card.

- An adapter folder names its base (`base_model_name_or_path` in `adapter_config.json`): the hub id or folder of a
  pretrained base, or the `base/` folder saved beside it for a base built from `model.config`. peft writes null
  when the model was not loaded by name, and `AutoPeftModelFor...from_pretrained(folder)` then asks the hub for
  `None/config.json`.
- The tokenizer's `model_max_length` is the model's real maximum: a tokenizer built here has none (transformers'
  1e30 sentinel), so `pipeline(..., truncation=True)` would not cut a long text at all.
- `README.md` is a model card (task, base, data digest, metrics, how to load), not peft's empty template; its front
  matter is huggingface_hub's `ModelCardData`, written by `ModelCard`, so the hub and its tools read what they
  expect (`ModelCard.load(folder / "README.md").data`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.adapters import ADAPTER_CONFIG, BASE_DIR
from pipelines.params import Params

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

# peft's task type -> the hub's pipeline tag and the peft class whose from_pretrained reloads the folder.
_BY_PEFT_TASK = {
    "SEQ_CLS": ("text-classification", "AutoPeftModelForSequenceClassification"),
    "CAUSAL_LM": ("text-generation", "AutoPeftModelForCausalLM"),
    "SEQ_2_SEQ_LM": ("text2text-generation", "AutoPeftModelForSeq2SeqLM"),
}
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_NO_LIMIT = 1e18  # above this, transformers' "no maximum" sentinel (int(1e30))


def pretrained_base(params: Params, root: Path) -> str | None:
    """The pretrained base's hub id or resolved folder; None for a model built from model.config."""
    # Deferred: the train stage's driver imports this module (follow_move), and pipelines.model imports transformers'
    # model classes, which only a trial's own process needs.
    from pipelines.model import resolve_model_name

    return resolve_model_name(params.model, root) if params.model.name_or_path is not None else None


def base_model_name(folder: Path, base_name: str | None) -> str:
    """What the folder's adapter loads on: the pretrained base's hub id or path, else the `base/` saved beside it."""
    return base_name if base_name is not None else str((folder / BASE_DIR).resolve())


def record_adapter_base(folder: Path, base_name: str | None) -> None:
    """Write the base into the folder's adapter config (no-op for a full model folder); see `follow_move`."""
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_model_name(folder, base_name)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def set_model_max_length(tokenizer: PreTrainedTokenizerBase, model: nn.Module, params: Params) -> None:
    """Give a tokenizer without a maximum the model's (its position limit; data.max_length for relative positions)."""
    if tokenizer.model_max_length < _NO_LIMIT:
        return
    config = getattr(model, "config", None)
    limits = [getattr(config, name, None) for name in _POSITION_LIMITS]
    tokenizer.model_max_length = next((int(v) for v in limits if isinstance(v, int) and v > 0), params.data.max_length)


@dataclass(frozen=True)
class CardQuality:
    """The quality figures a model card shows: the task's on the test split, or (`on_test=False`) on validation,
    where the trial was one of several and the evaluate stage scores the test split."""

    metrics: dict[str, float]
    on_test: bool = True


# Under the validation figures of a trial that was one of several (issue 69): no trial scores the test split then.
VALIDATION_NOTE = ("This model was chosen among the experiment's trials on the validation split, which these figures "
                   "are from. The evaluate stage scores it on the test split: `metrics/evaluate.json`, and this "
                   "model's MLflow run.")  # fmt: skip


def write_model_card(
    folder: Path, params: Params, peft_task_type: str, base_name: str | None, data_digest: str,
    quality: CardQuality,
) -> None:  # fmt: skip
    """The folder's README.md: front matter the hub reads, then the task, base, data digest, `quality` and how to
    load it."""
    tag, peft_class = _BY_PEFT_TASK.get(peft_task_type, ("", ""))
    adapter = (folder / ADAPTER_CONFIG).is_file()
    base = base_name or (f"{BASE_DIR}/ beside this card (built from model.config)" if adapter else "model.config")
    from huggingface_hub import ModelCard, ModelCardData

    local_base = base_name is not None and Path(base_name).is_absolute()
    # The front matter as the hub's own classes write and validate it; base_model names a hub id, never a path.
    data = ModelCardData(library_name="peft" if adapter else "transformers", pipeline_tag=tag or None,
                         tags=["pipelines", params.task] + (["lora"] if adapter else []),
                         base_model=base_name if base_name is not None and not local_base else None)  # fmt: skip
    if local_base:
        base = f"{Path(base_name).name} (a local folder; on the machine that trained it: {base_name})"  # type: ignore[arg-type]
    rows = [f"| {name} | {value:.4g} |" for name, value in quality.metrics.items()]
    gguf = f', gguf_file="{params.model.gguf_file}"' if params.model.gguf_file else ""
    load = (
        f'from peft import {peft_class}\nmodel = {peft_class}.from_pretrained("path/to/this/folder"{gguf})'
        if adapter
        else f'from transformers import pipeline\npipe = pipeline("{tag}", "path/to/this/folder", truncation=True)'
    )
    body = [
        f"# {params.task} fine-tune",
        "",
        f"- Task: `{params.task}`; base model: `{base}`"
        + (f"; adapter: {params.adapter.type} (r {params.adapter.r})" if adapter else ""),
        f"- Training data: `{params.data.source}`, tokenized train split digest `{data_digest}` "
        "(sha256 of its token ids, lengths and labels; the MLflow run's dataset input shows the same)",
        f"- {params.epochs} epoch(s), batch {params.batch_size} x {params.grad_accum_steps} accumulation, "
        f"lr {params.lr}, optimizer {params.optim}, precision {params.precision}, seed {params.seed}",
        "",
        "| Test metric | Value |" if quality.on_test else "| Validation metric | Value |",
        "|---|---|",
        *rows,
        *([] if quality.on_test else ["", VALIDATION_NOTE]),
        "",
        "Load it:",
        "",
        "```python",
        load,
        "```",
    ]
    if adapter and params.model.gguf_file:
        body += ["", f"The base is a GGUF file, `{params.model.gguf_file}` (de-quantized on load): `gguf_file` above."]
    ModelCard(f"---\n{data.to_yaml()}\n---\n" + "\n".join(body) + "\n").save(folder / "README.md")


def follow_move(folder: Path) -> None:
    """After moving an adapter folder whose base was saved beside it, point its config at the base's new place."""
    if (folder / BASE_DIR).is_dir():
        record_adapter_base(folder, None)
