"""LoRA adapters through peft, and saving/loading a fine-tuned model with or without them.

A LoRA run saves the adapter alone (a few MB) plus what is needed to rebuild its base: a
reference to a pretrained base (`base.json`: the resolved folder or hub id, revision and GGUF
file), or, for a base built from `model.config` (random weights no hub holds), the base's own
weights in `base/`. With `adapter.merge: true` the merged, full-size model is saved instead.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.errors import UserError, warn_user
from pipelines.params import AdapterParams, Params

if TYPE_CHECKING:
    from torch import nn
    from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase

    from pipelines.tasks.base import Task

ADAPTER_CONFIG = "adapter_config.json"
BASE_DIR = "base"
BASE_REF = "base.json"

# peft (0.21) reads transformers' deprecated `is_gradient_checkpointing` whenever it wraps a model: a
# FutureWarning in every trial's and evaluation's output that is not ours to fix.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
# Saving an adapter over a GGUF base: peft looks for the base's config.json (to see whether embeddings were
# resized) and warns when the folder holds a GGUF file instead; the base's embeddings are frozen here.
warnings.filterwarnings("ignore", message="Could not find a config file in", category=UserWarning)


def quantize_4bit(model: PreTrainedModel, params: Params) -> PreTrainedModel:
    """QLoRA's base: `model` reloaded with its linear weights in 4-bit NF4 (bitsandbytes, CUDA only).

    Reloaded from a temporary save of the fp32 model, so a base built from a config or
    de-quantized from GGUF is quantized the same way as a hub model. Double quantization
    (the quantization constants quantized too) as in the QLoRA paper; compute in bf16 unless
    the run is fp16. peft's `prepare_model_for_kbit_training` then keeps norms and the head in fp32.
    """
    import tempfile

    import torch
    from peft import prepare_model_for_kbit_training

    config = quantization_config(params)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        quantized = type(model).from_pretrained(
            tmp, quantization_config=config, dtype=torch.float32, device_map={"": torch.cuda.current_device()}
        )
    return prepare_model_for_kbit_training(quantized, use_gradient_checkpointing=params.grad_checkpointing)


def quantization_config(params: Params) -> BitsAndBytesConfig:
    """QLoRA's 4-bit NF4 config: double quantization, compute in bf16 unless the run is fp16.

    Under `distributed.strategy: fsdp` the packed 4-bit weights are stored in the compute dtype
    (`bnb_4bit_quant_storage`, as Answer.AI's FSDP-QLoRA and TRL do): FSDP shards floating-point tensors only, and
    with the storage in the dtype of the rest of the frozen base every block is one unit of one dtype. In uint8
    (bitsandbytes' default) `fully_shard` fails on them (a uint8 tensor cannot be a parameter that requires grad) or,
    forced past that, scrambles their quantization (huggingface/accelerate#3983).
    """
    import torch
    from transformers import BitsAndBytesConfig

    compute = torch.float16 if params.precision == "fp16" else torch.bfloat16
    storage = compute if params.distributed.strategy == "fsdp" else torch.uint8
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=storage,
    )  # fmt: skip


def apply_adapter(
    model: PreTrainedModel, adapter: AdapterParams, task: Task, params: Params | None = None
) -> nn.Module:
    """Wrap `model` in LoRA adapters (the base frozen), or return it as it is with `adapter.type: none`.

    peft adds the task's head (a classifier's `classifier`/`score`) to the trained modules, so a
    LoRA classifier still learns its new output layer. With `qlora` (needs `params`), the base is
    first quantized to 4-bit (`quantize_4bit`).
    """
    if adapter.type == "none":
        return model
    from peft import LoraConfig, get_peft_model

    if adapter.type == "qlora":
        assert params is not None, "qlora quantizes with the run's precision"
        model = quantize_4bit(model, params)

    config = LoraConfig(
        task_type=task.peft_task_type,
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules,
    )
    try:
        adapted = get_peft_model(model, config)
    except ValueError as err:
        raise UserError(
            f"adapter.target_modules = {adapter.target_modules!r}: {str(err).splitlines()[0]} "
            f"(module names of this model: e.g. {_linear_names(model)[:8]})"
        ) from None
    if params is not None and params.model.name_or_path is None:
        warn_random_base(adapted, adapter)
    return adapted


def warn_random_base(model: nn.Module, adapter: AdapterParams) -> None:
    """Say, before training, that adapters on a base built from `model.config` (random weights) learn almost
    nothing: the frozen base encodes no language, and the few weights that train cannot make up for it (LoRA on
    the default offline model trained to chance, 25.6% on 4 classes, without a word).

    Said once per trial: not for a memory plan's model (its base weights fake, the adapter only a candidate of
    `strategy: auto`), nor by a distributed trial's ranks other than 0."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    weights = list(model.parameters())
    if any(isinstance(w, FakeTensor) for w in weights):
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return
    total = sum(w.numel() for w in weights)
    trained = sum(w.numel() for w in weights if w.requires_grad)
    warn_user(
        f"adapter.type = {adapter.type!r} with model.name_or_path: null: the base is built from model.config with "
        f"random weights and stays frozen: only {trained:,} of the model's {total:,} weights ({trained / total:.1%}: "
        "the adapters and any new head) train, so it learns almost nothing (near chance); set "
        "model.name_or_path to a pretrained model, or adapter.type: none to train every weight"
    )


def _linear_names(model: nn.Module) -> list[str]:
    from torch import nn

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def is_adapter(model: nn.Module) -> bool:
    """Whether `model` carries peft adapters."""
    return hasattr(model, "peft_config")


def save_base_reference(params: Params, root: Path, out: Path) -> None:
    """Record the pretrained base an adapter needs (the resolved local folder or hub id, revision, GGUF file)."""
    from pipelines.model import resolve_model_name

    assert params.model.name_or_path is not None
    name = resolve_model_name(params.model, root)
    base = params.model.model_copy(update={"name_or_path": name})
    out.mkdir(parents=True, exist_ok=True)  # written before the model: the trial's folder may not exist yet
    # Only what names a pretrained base: model.config builds a model from scratch, which this base is not.
    reference = base.model_dump(mode="json", exclude={"config"})
    (out / BASE_REF).write_text(json.dumps(reference, indent=2, sort_keys=True) + "\n")


def save_trained(model: nn.Module, out: Path, params: Params) -> nn.Module:
    """Save `model` for evaluation and deployment; returns what was saved (the merged model with merge: true).

    Gradient checkpointing is switched off first, so the saved config does not turn it on at load.
    """
    if params.grad_checkpointing and hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    if is_adapter(model) and params.adapter.merge:
        model = model.merge_and_unload()  # type: ignore[operator]
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    return model


def load_trained_model(folder: Path, params: Params, task: Task, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """Load a model folder written by `save_trained`: a full model, or an adapter on its base."""
    if not (folder / ADAPTER_CONFIG).is_file():
        return task.load_model(folder, params.model)
    from peft import PeftModel

    if (folder / BASE_DIR).is_dir():
        base = task.load_model(folder / BASE_DIR, params.model)
    elif (folder / BASE_REF).is_file():
        reference = json.loads((folder / BASE_REF).read_text(encoding="utf-8"))
        model = params.model.model_validate({**params.model.model_dump(mode="json"), **reference})
        base_params = params.model_copy(update={"model": model})
        base = task.build_model(base_params, tokenizer, folder, folder)
    else:
        raise UserError(f"{folder}: an adapter without its base ({BASE_DIR}/ or {BASE_REF}); re-run the train stage")
    if params.adapter.type == "qlora":
        base = quantize_4bit(base, params)  # evaluated on the 4-bit base it was trained on
    return PeftModel.from_pretrained(base, str(folder))
