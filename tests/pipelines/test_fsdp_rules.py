"""What combines with `distributed.strategy: fsdp` and what the rule table refuses, each refusal naming its keys,
the values and the fix; and the QLoRA config FSDP needs (its 4-bit storage in the compute dtype)."""

from __future__ import annotations

import pytest
import torch

from pipelines.adapters import quantization_config
from pipelines.params import ParamsError
from tests.conftest import tiny_params

FSDP = {"distributed.strategy": "fsdp", "distributed.num_workers": 2, "lr": 1e-3}


@pytest.mark.parametrize(
    "changes",
    [
        {"adapter.type": "lora"},
        {"adapter.type": "lora", "grad_checkpointing": True, "distributed.cpu_offload": True},
        {"distributed.reshard_after_forward": False},
        {"optim": "sgd", "compile": "auto"},
    ],
)
def test_fsdp_takes_adapters_checkpointing_offload_and_its_knobs(default_params, changes):
    params = tiny_params(default_params, **FSDP, **changes)
    assert params.distributed.strategy == "fsdp"


def test_qlora_under_fsdp_passes_the_fsdp_rules(default_params):
    """QLoRA is refused on the CPU (bitsandbytes), never for being sharded."""
    with pytest.raises(ParamsError) as err:
        tiny_params(default_params, **FSDP, **{"adapter.type": "qlora", "device": "cpu"})
    assert "needs CUDA" in str(err.value) and "fsdp" not in str(err.value)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"compile": True}, ["distributed.strategy: fsdp with compile: true", "compile: false or auto",
                             "distributed.strategy: ddp"]),
        ({"adapter.type": "qlora", "device": "cuda"}, ["distributed.strategy: fsdp with adapter.type: qlora",
                                                        "bitsandbytes #1945", "adapter.type: lora with fsdp"]),
        ({"optim": "adafactor"}, ["distributed.strategy: fsdp", "optim = 'adafactor'", "adamw, sgd",
                                  "distributed.strategy: ddp"]),
        ({"distributed.strategy": "ddp", "distributed.cpu_offload": True},
         ["distributed.cpu_offload: true", "distributed.strategy: ddp", "distributed.cpu_offload: false"]),
        ({"distributed.strategy": "ddp", "distributed.reshard_after_forward": False},
         ["distributed.reshard_after_forward: false", "distributed.strategy: ddp",
          "distributed.reshard_after_forward: true"]),
    ],
)  # fmt: skip
def test_what_cannot_combine_with_fsdp_is_refused_naming_keys_values_and_the_fix(default_params, changes, expected):
    with pytest.raises(ParamsError) as err:
        tiny_params(default_params, **{**FSDP, **changes})
    for text in expected:
        assert text in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("strategy", "precision", "storage"),
    [("fsdp", "bf16", torch.bfloat16), ("fsdp", "fp16", torch.float16), ("ddp", "bf16", torch.uint8)],
)
def test_qlora_stores_its_4bit_weights_in_the_compute_dtype_under_fsdp(default_params, strategy, precision, storage):
    """FSDP shards floating-point tensors only: the packed NF4 weights must be stored as the compute dtype, as
    Answer.AI's FSDP-QLoRA and TRL set `bnb_4bit_quant_storage` (uint8, bitsandbytes' default, elsewhere)."""
    params = tiny_params(default_params, **{"distributed.strategy": strategy, "precision": precision})
    config = quantization_config(params)
    assert config.bnb_4bit_quant_storage == storage
    assert config.bnb_4bit_compute_dtype == (torch.float16 if precision == "fp16" else torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
