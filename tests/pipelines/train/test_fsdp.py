"""FSDP2 over gloo, two real processes: the same loss curve and final weights as DDP, in 1/N of the state."""

from __future__ import annotations

from pathlib import Path

import torch

from pipelines.params import load_params
from pipelines.train.parallel import sharding_units
from tests.conftest import REPO_ROOT, tiny_params
from tests.pipelines.train.helpers import loopback_init_method, loopback_process_group, tiny_model, tiny_split
from tests.pipelines.train.test_ddp import _spawn_and_wait

CPU = torch.device("cpu")
# Per logged loss, FSDP against DDP. fp32: only the order of the reductions differs. bf16: FSDP casts the
# all-gathered weights to bf16 (its MixedPrecisionPolicy) where DDP's autocast casts them per matmul.
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 0.03
PLAN_TOLERANCE = 0.15  # the memory plan's bar (tests/pipelines/test_memory_plan.py)


def fsdp_params(**overrides):
    base = load_params(REPO_ROOT / "params.yaml")
    return tiny_params(
        base,
        **{"epochs": 3, "batch_size": 8, "grad_accum_steps": 2, "lr": 3e-3, "log_every_n_steps": 1,
           "warmup_ratio": 0.0, "distributed.num_workers": 2, "fast_dropout": False, **overrides},
    )  # fmt: skip


def _train_both(rank: int, init_method: str, out: str) -> None:
    from pipelines.train.engine import TrainRequest, train_model

    torch.set_num_threads(1)
    runs = {}
    with loopback_process_group(rank, 2, init_method):
        for name, overrides in {
            "ddp fp32": {"distributed.strategy": "ddp"},
            "fsdp fp32": {"distributed.strategy": "fsdp"},
            "ddp bf16": {"distributed.strategy": "ddp", "precision": "bf16", "grad_checkpointing": True},
            "fsdp bf16": {"distributed.strategy": "fsdp", "precision": "bf16", "grad_checkpointing": True},
        }.items():
            params = fsdp_params(**overrides)
            torch.manual_seed(0)
            model = tiny_model(seed=0)
            result = train_model(TrainRequest(
                model, tiny_split(rows=256, seed=3), tiny_split(rows=32, seed=4), params, pad_id=0, device=CPU,
                precision=params.precision, say=lambda _: None,
            ))  # fmt: skip
            runs[name] = {
                "losses": [h["loss"] for h in result.history],
                "weights": {k: v.clone() for k, v in model.state_dict().items()},
                "metrics": result.metrics,
            }
    if rank == 0:
        torch.save(runs, out)


def test_fsdp_trains_like_ddp_and_holds_half_the_state_per_worker(tmp_path: Path):
    out = tmp_path / "runs.pt"
    _spawn_and_wait(_train_both, args=(loopback_init_method(), str(out)), nprocs=2, seconds=600)
    runs = torch.load(out, weights_only=False)
    for precision, tolerance in (("fp32", FP32_TOLERANCE), ("bf16", BF16_TOLERANCE)):
        ddp, fsdp = runs[f"ddp {precision}"], runs[f"fsdp {precision}"]
        assert len(ddp["losses"]) == len(fsdp["losses"]) > 4
        worst = max(abs(a - b) for a, b in zip(ddp["losses"], fsdp["losses"], strict=True))
        assert worst < tolerance, (precision, ddp["losses"], fsdp["losses"])
        assert ddp["losses"][-1] < ddp["losses"][0], ddp["losses"]
        # Rank 0's model came back whole with the trained weights (it evaluates and saves them).
        assert fsdp["weights"].keys() == ddp["weights"].keys()
        if precision == "fp32":
            gap = max((fsdp["weights"][k] - v).abs().max().item() for k, v in ddp["weights"].items())
            assert gap < 1e-4, gap
        if precision == "fp32":  # the plan of one FSDP worker against rank 0's measured peak
            from pipelines.resolve.memory_plan import plan_memory
            from pipelines.tasks import get_task

            params = fsdp_params(**{"distributed.strategy": "fsdp"})
            build = lambda: tiny_model(seed=0)  # noqa: E731
            plan = plan_memory(
                params, get_task("classification"), tiny_split(rows=256, seed=3), build, lambda m: m, 0, "fp32"
            )
            measured = fsdp["metrics"]["peak_train_memory_bytes"]
            assert abs(plan.peak - measured) <= PLAN_TOLERANCE * measured, (plan.peak, measured)
        # Each worker holds half of the weights, gradients and optimizer state (shards of uneven tensors round up).
        for key in ("param_bytes", "optimizer_state_bytes"):
            share = fsdp["metrics"][key] / ddp["metrics"][key]
            assert 0.45 < share < 0.56, (key, share)


def test_the_blocks_fsdp_shards_are_transformers_own_no_split_modules():
    model = tiny_model(layers=3)
    units = sharding_units(model)
    assert [type(u).__name__ for u in units].count("BertLayer") == 3
    assert model not in units


def test_the_fsdp_memory_plan_divides_the_state_by_the_workers():
    from pipelines.resolve.memory_plan import plan_memory
    from pipelines.tasks import get_task

    def plan(strategy: str):
        params = fsdp_params(**{"distributed.strategy": strategy})
        split = tiny_split(rows=256, seed=3)
        return plan_memory(
            params, get_task("classification"), split, lambda: tiny_model(seed=0), lambda m: m, 0, "fp32"
        )

    ddp, fsdp = plan("ddp"), plan("fsdp")
    assert fsdp.parameters == ddp.parameters // 2 and fsdp.optimizer_state == ddp.optimizer_state // 2
    assert fsdp.gradients == ddp.gradients // 2 and fsdp.activations == ddp.activations
    assert fsdp.peak < ddp.peak
