"""Load models: a small BERT classifier from a config, or any pretrained model by hub id, folder or GGUF file."""

from __future__ import annotations

import copy
import functools
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from pipelines.errors import UserError
from pipelines.params import ModelParams


def resolve_model_name(model: ModelParams, root: Path) -> str:
    """A local folder (relative to `root`) when one is there, else the hub id; a missing local path fails at once."""
    assert model.name_or_path is not None
    local = Path(model.name_or_path).expanduser()
    local = local if local.is_absolute() else root / local
    if local.exists():
        return str(local)
    if model.name_or_path.startswith((".", "/", "~")):
        raise UserError(f"model.name_or_path = {model.name_or_path!r}: no such local folder ({local})")
    check_hub_reachable(model)
    return model.name_or_path


def check_hub_reachable(model: ModelParams) -> None:
    """Fail at once, in one line, when a hub id is neither cached nor downloadable (offline mode, or no route to
    the hub): transformers would otherwise retry for half a minute per file and print every attempt."""
    from huggingface_hub import constants, try_to_load_from_cache

    assert model.name_or_path is not None
    if isinstance(try_to_load_from_cache(model.name_or_path, model.gguf_file or "config.json",
                                         revision=model.revision), str):  # fmt: skip
        return  # in the local cache: loaded from there
    if constants.HF_HUB_OFFLINE:
        reason = "offline mode is set (HF_HUB_OFFLINE)"
    else:
        url = urlparse(constants.ENDPOINT)
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
            return
        except OSError as err:
            reason = f"the hub ({constants.ENDPOINT}) cannot be reached: {err}"
    raise UserError(
        f"model.name_or_path = {model.name_or_path!r}: not a local folder and not in the Hugging Face cache, and "
        f"{reason}; point model.name_or_path at a local folder (a save_pretrained output or a downloaded "
        "snapshot), or run where the hub is reachable"
    )


def build_model(
    model: ModelParams, label_names: list[str], vocab_size: int, max_length: int, root: Path, *, weights: bool = True,
    layers: int | None = None,
) -> PreTrainedModel:  # fmt: skip
    """Return a sequence classifier with `len(label_names)` outputs and named labels (see `load_pretrained`
    for `weights`; `layers`: that many blocks instead of the config's, for a plan by depth)."""
    depth = {"num_hidden_layers": layers} if layers else {}
    id2label = dict(enumerate(label_names))
    label2id = {name: i for i, name in id2label.items()}
    if model.name_or_path is None:
        cfg = model.config
        config = BertConfig(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=layers or cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            intermediate_size=cfg.intermediate_size,
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.dropout,
            max_position_embeddings=max(512, max_length),
            num_labels=len(label_names),
            id2label=id2label,
            label2id=label2id,
        )
        return BertForSequenceClassification(config)
    return load_pretrained(
        AutoModelForSequenceClassification,
        model,
        root,
        weights=weights,
        num_labels=len(label_names),
        id2label=id2label,
        label2id=label2id,
        **depth,
    )


def _where(model: ModelParams) -> str:
    gguf = f" (gguf_file {model.gguf_file!r})" if model.gguf_file else ""
    return f"model.name_or_path = {model.name_or_path!r}{gguf}"


@functools.lru_cache(maxsize=8)
def _read_config(name: str, revision: str | None, gguf_file: str | None, trust_remote_code: bool) -> PretrainedConfig:
    # Cached: a GGUF file's header takes seconds to parse, and a budget search plans many times.
    return AutoConfig.from_pretrained(name, revision=revision, gguf_file=gguf_file, trust_remote_code=trust_remote_code)


def pretrained_config(model: ModelParams, root: Path, **overrides: Any) -> PretrainedConfig:
    """The config of model.name_or_path (folder, hub id or GGUF file), with `overrides` set on a copy.

    A GGUF file's config says the weights are quantized; they load de-quantized (see `load_pretrained`),
    so that flag is dropped here too.
    """
    name = resolve_model_name(model, root)
    try:
        config = copy.deepcopy(_read_config(name, model.revision, model.gguf_file, model.trust_remote_code))
    except (OSError, ValueError) as err:
        raise UserError(
            f"{_where(model)}: cannot read its config from a local folder or the hub ({str(err).splitlines()[0]})"
        ) from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def load_pretrained(
    auto_class: Any, model: ModelParams, root: Path, *, weights: bool = True, **kwargs: Any
) -> PreTrainedModel:
    """`auto_class.from_pretrained` for model.name_or_path at model.revision, de-quantizing model.gguf_file.

    Master weights load in fp32 (autocast handles mixed precision). A GGUF file is de-quantized
    to fp32 weights, yet transformers leaves the model flagged as quantized (`hf_quantizer`,
    `config.quantization_config`): the Hugging Face Trainer then refuses to train it and
    `save_pretrained` writes the flag into the saved config. The weights are plain fp32
    tensors, so the flags are cleared here.

    `weights=False` builds the same architecture from its config alone, with freshly initialised
    weights and nothing read but the config: what the memory plan needs (memory depends on shapes,
    dtypes and code, not on weight values), and it works under FakeTensorMode, where GGUF
    de-quantization, which computes on real tensors, cannot run.
    """
    if not weights:
        config = pretrained_config(model, root, **kwargs)
        return auto_class.from_config(config, dtype=torch.float32, trust_remote_code=model.trust_remote_code)
    name = resolve_model_name(model, root)
    try:
        loaded = auto_class.from_pretrained(
            name,
            revision=model.revision,
            gguf_file=model.gguf_file,
            trust_remote_code=model.trust_remote_code,
            dtype=torch.float32,
            **kwargs,
        )
    except (OSError, ValueError) as err:
        raise UserError(
            f"{_where(model)}: cannot load a model from a local folder or the hub ({str(err).splitlines()[0]})"
        ) from None
    quantizer = getattr(loaded, "hf_quantizer", None)
    if model.gguf_file is not None and quantizer is not None:
        # The quantizer's own clean-up (its `dequantize` path): hf_quantizer, quantization_config,
        # is_quantized; plus the per-config flag it set on every sub-model.
        quantizer.remove_quantization_config(loaded)
        for module in loaded.modules():
            if isinstance(module, PreTrainedModel):
                module.config._is_quantized = False
    return loaded


def load_trained(folder: Path) -> PreTrainedModel:
    """Load a fine-tuned model folder written by `save_pretrained` (safetensors)."""
    return AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32)


def set_attention(model: PreTrainedModel, params: ModelParams) -> PreTrainedModel:
    """Switch `model` to `model.attn_implementation` (when set), with an error naming the key if it cannot run."""
    if params.attn_implementation is None:
        return model
    try:
        model.set_attn_implementation(params.attn_implementation)
    except (ImportError, ValueError) as err:
        name = params.attn_implementation
        raise UserError(f"model.attn_implementation = {name!r} cannot be used here: {err}") from None
    return model
