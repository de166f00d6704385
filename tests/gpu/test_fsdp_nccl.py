"""FSDP2 over NCCL, two GPUs: the reduced gradients equal one process's on the same global batch (the gloo test's
cases, tests/pipelines/train/test_fsdp_gradients.py, on CUDA), and QLoRA sharded with its 4-bit storage in bf16
(`bnb_4bit_quant_storage`) gives one process's adapter gradients. Skipped without two visible GPUs (and QLoRA
without bitsandbytes). Run with `pytest -m gpu tests/gpu/test_fsdp_nccl.py`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pipelines.data.loader import to_device
from pipelines.runtime import Runtime
from pipelines.tasks import get_task
from pipelines.train.parallel import ParallelConfig, parallelize
from pipelines.train.step import TrainStep, make_scaler
from tests.pipelines.train.helpers import loopback_init_method
from tests.pipelines.train.test_ddp import _spawn_and_wait
from tests.pipelines.train.test_fsdp_gradients import (
    BATCHES,
    CASES,
    GLOBAL_ROWS,
    RANK_BATCHES,
    build_model,
    collated,
    worst_gap,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (NCCL between them)"),
]
# fp32 on CUDA (TF32 off): the order of the additions only; NCCL's ring sums in another order than one process.
FP32_TOLERANCE = 1e-4
# QLoRA computes in bf16: 8 significant bits, and the two ranks' halves are summed in fp32 after.
BF16_TOLERANCE = 0.05


def _window(model: torch.nn.Module, indices: list[list[int]], units: float, device: torch.device,
            precision: str = "fp32") -> dict[str, torch.Tensor]:  # fmt: skip
    """The whole gradients after one window of the trial's step on `device`."""
    runtime = Runtime(device, precision, False, None, 0)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    step = TrainStep(model, optimizer, get_task("classification"), runtime, make_scaler(runtime, enabled=False), None)
    step.accumulate([to_device(b, device) for b in collated(indices)], units)
    full = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()
            if p.grad is not None}  # fmt: skip
    return {n: g.float().cpu() for n, g in full.items()}


def _qlora_model(device: torch.device) -> torch.nn.Module:
    """A tiny Llama classifier, quantized to NF4 with its storage in bf16, LoRA on q and v (B not zero)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from pipelines.adapters import apply_adapter
    from pipelines.params import load_params
    from tests.conftest import REPO_ROOT, tiny_params

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, num_labels=3, pad_token_id=0)  # fmt: skip
    params = tiny_params(load_params(REPO_ROOT / "params.yaml"), **{
        "adapter.type": "qlora", "adapter.r": 4, "adapter.alpha": 8, "adapter.dropout": 0.0,
        "adapter.target_modules": ["q_proj", "v_proj"], "distributed.strategy": "fsdp", "precision": "bf16",
        "device": "cuda",
    })  # fmt: skip
    model = apply_adapter(LlamaForSequenceClassification(config), params.adapter, get_task("classification"), params)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model.to(device)


def _rank(rank: int, init_method: str, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=2, device_id=device)
    results: dict[str, object] = {}
    try:
        for name, (kind, ckpt, offload) in CASES.items():
            config = ParallelConfig(2, device, "fp32", grad_checkpointing=ckpt, cpu_offload=offload)
            sharded = parallelize(build_model(kind, ckpt).to(device), config)
            results[name] = _window(sharded, RANK_BATCHES[rank], GLOBAL_ROWS / 2, device)
        if importlib.util.find_spec("bitsandbytes") is not None:
            sharded = parallelize(_qlora_model(device), ParallelConfig(2, device, "bf16"))
            results["qlora"] = _window(sharded, RANK_BATCHES[rank], GLOBAL_ROWS / 2, device, "bf16")
            results["qlora shard dtypes"] = {
                str(p.to_local().dtype) for p in sharded.parameters() if not p.requires_grad
            }
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out: Path = tmp_path_factory.mktemp("nccl") / "results.pt"
    _spawn_and_wait(_rank, args=(loopback_init_method(), str(out)), nprocs=2, seconds=600)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", list(CASES))
def test_each_nccl_reduced_gradient_equals_one_process_on_the_same_global_batch(two_gpus, case):
    kind, ckpt, _ = CASES[case]
    torch.backends.cuda.matmul.allow_tf32 = False
    expected = _window(build_model(kind, ckpt).cuda(), BATCHES, GLOBAL_ROWS, torch.device("cuda"))
    assert worst_gap(two_gpus[case], expected) < FP32_TOLERANCE, case


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="QLoRA needs bitsandbytes")
def test_qlora_sharded_with_bf16_storage_gives_one_process_adapter_gradients(two_gpus):
    # Every frozen shard is bf16: the packed NF4 weights (their storage) and the rest of the base alike.
    assert two_gpus["qlora shard dtypes"] == {"torch.bfloat16"}, two_gpus["qlora shard dtypes"]
    expected = _window(_qlora_model(torch.device("cuda")), BATCHES, GLOBAL_ROWS, torch.device("cuda"), "bf16")
    assert expected and all("lora_" in n or "modules_to_save" in n for n in expected), sorted(expected)
    assert worst_gap(two_gpus["qlora"], expected) < BF16_TOLERANCE
