"""LoRA under FSDP2 through the trainer (`train_model`), two gloo processes: DDP's loss curve, the adapters back
in rank 0's whole model, and in bf16 the frozen base sharded in 16 bits."""

from __future__ import annotations

from pathlib import Path

import torch

from pipelines.adapters import apply_adapter
from pipelines.tasks import get_task
from tests.pipelines.train.helpers import loopback_init_method, loopback_process_group, tiny_model, tiny_split
from tests.pipelines.train.test_ddp import _spawn_and_wait
from tests.pipelines.train.test_fsdp import fsdp_params

CPU = torch.device("cpu")
# Per logged loss, FSDP against DDP (as tests/pipelines/train/test_fsdp.py): fp32 differs in the order of the
# reductions only; bf16 casts the gathered weights once where DDP's autocast casts them per matmul.
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 0.03
LORA = {"adapter.type": "lora", "adapter.r": 4, "adapter.alpha": 8, "adapter.target_modules": ["query", "value"],
        "lr": 1e-2}  # fmt: skip


def _train_all(rank: int, init_method: str, out: str) -> None:
    from pipelines.train.engine import TrainRequest, train_model

    torch.set_num_threads(1)
    runs = {}
    with loopback_process_group(rank, 2, init_method):
        for strategy in ("ddp", "fsdp"):
            for precision, extra in (("fp32", {}), ("bf16", {"grad_checkpointing": True})):
                params = fsdp_params(**LORA, **extra, **{"distributed.strategy": strategy, "precision": precision})
                torch.manual_seed(0)
                model = apply_adapter(tiny_model(seed=0), params.adapter, get_task("classification"), params)
                result = train_model(TrainRequest(
                    model, tiny_split(rows=256, seed=3), tiny_split(rows=32, seed=4), params, pad_id=0, device=CPU,
                    precision=params.precision, say=lambda _: None,
                ))  # fmt: skip
                trained = {k: v.detach().float().clone() for k, v in model.named_parameters() if v.requires_grad}
                runs[f"{strategy} {precision}"] = {
                    "losses": [h["loss"] for h in result.history],
                    "trained": trained,
                    "metrics": result.metrics,
                }
    if rank == 0:
        torch.save(runs, out)


def test_fsdp_lora_trains_like_ddp_lora_with_the_frozen_base_sharded_in_bf16(tmp_path: Path):
    out = tmp_path / "runs.pt"
    _spawn_and_wait(_train_all, args=(loopback_init_method(), str(out)), nprocs=2, seconds=600)
    runs = torch.load(out, weights_only=False)
    for precision, tolerance in (("fp32", FP32_TOLERANCE), ("bf16", BF16_TOLERANCE)):
        ddp, fsdp = runs[f"ddp {precision}"], runs[f"fsdp {precision}"]
        assert len(ddp["losses"]) == len(fsdp["losses"]) > 4
        worst = max(abs(a - b) for a, b in zip(ddp["losses"], fsdp["losses"], strict=True))
        assert worst < tolerance, (precision, ddp["losses"], fsdp["losses"])
        assert ddp["losses"][-1] < ddp["losses"][0], ddp["losses"]
        # Rank 0's whole model got the trained adapters (and head) back: DDP's, in fp32 to the reductions' order.
        assert fsdp["trained"].keys() == ddp["trained"].keys() and all("lora_" in k or "modules_to_save" in k
                                                                       for k in fsdp["trained"])  # fmt: skip
        if precision == "fp32":
            gap = max((fsdp["trained"][k] - v).abs().max().item() for k, v in ddp["trained"].items())
            assert gap < 1e-4, gap
    # The adapters and the head are all that trains: each rank's optimizer holds half of them, and of the weights.
    for key in ("optimizer_state_bytes", "param_bytes"):
        share = runs["fsdp fp32"]["metrics"][key] / runs["ddp fp32"]["metrics"][key]
        assert 0.45 < share < 0.56, (key, share)
    # In bf16 the frozen base is sharded in bf16: each rank's weights take about half the bytes of its fp32 shards
    # (the adapters, a few percent, stay fp32).
    half = runs["fsdp bf16"]["metrics"]["param_bytes"] / runs["fsdp fp32"]["metrics"]["param_bytes"]
    assert 0.5 <= half < 0.6, half
