"""FSDP with rank 1's model built on the meta device (what a trial's ranks > 0 do, `builds_on_meta`), two gloo
processes: rank 1 never holds the whole model, yet the run trains as DDP with whole models on both ranks does."""

from __future__ import annotations

from pathlib import Path

import torch

from pipelines.adapters import apply_adapter
from pipelines.tasks import get_task
from pipelines.train.shard_loading import build_on_meta, builds_on_meta
from tests.pipelines.train.helpers import loopback_init_method, loopback_process_group, tiny_model, tiny_split
from tests.pipelines.train.test_ddp import _spawn_and_wait
from tests.pipelines.train.test_fsdp import fsdp_params
from tests.pipelines.train.test_fsdp_lora import LORA

CPU = torch.device("cpu")
RUNS = {  # name: (overrides, whether rank 1 builds on meta)
    "ddp": ({"distributed.strategy": "ddp"}, False),
    "fsdp meta": ({"distributed.strategy": "fsdp"}, True),
    "ddp lora": ({**LORA, "grad_checkpointing": True, "distributed.strategy": "ddp"}, False),
    "fsdp meta lora": ({**LORA, "grad_checkpointing": True, "distributed.strategy": "fsdp"}, True),
}


def _build(params, rank: int, meta: bool) -> torch.nn.Module:
    # Rank 1 draws other LoRA initial weights than rank 0: only the broadcast from rank 0 can make them equal.
    torch.manual_seed(rank)
    model = build_on_meta(lambda: tiny_model(seed=0)) if meta and rank else tiny_model(seed=0)
    torch.manual_seed(100 + rank)
    return apply_adapter(model, params.adapter, get_task("classification"), params)


def _train_all(rank: int, init_method: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from pipelines.train.engine import TrainRequest, train_model

    torch.set_num_threads(1)
    runs, held = {}, {}
    with loopback_process_group(rank, 2, init_method):
        for name, (overrides, meta) in RUNS.items():
            params = fsdp_params(**overrides)
            model = _build(params, rank, meta)
            handed = [p.is_meta for p in model.parameters()]
            result = train_model(TrainRequest(
                model, tiny_split(rows=256, seed=3), tiny_split(rows=32, seed=4), params, pad_id=0, device=CPU,
                precision=params.precision, say=lambda _: None,
            ))  # fmt: skip
            weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
            runs[name] = {"losses": [h["loss"] for h in result.history], "weights": weights, "notes": result.notes}
            if meta and rank == 1:  # what rank 1 was given, and what its (sharded in place) model holds now
                full = sum(p.numel() for p in model.parameters())
                local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
                held[name] = {"all_meta": all(handed), "share": local / full}
    torch.save(runs if rank == 0 else held, f"{out}.{rank}")


def test_a_rank_built_on_meta_trains_like_ddp_and_never_holds_the_whole_model(tmp_path: Path):
    out = tmp_path / "runs.pt"
    _spawn_and_wait(_train_all, args=(loopback_init_method(), str(out)), nprocs=2, seconds=600)
    runs, held = torch.load(f"{out}.0", weights_only=False), torch.load(f"{out}.1", weights_only=False)
    for whole, sharded in (("ddp", "fsdp meta"), ("ddp lora", "fsdp meta lora")):
        ddp, fsdp = runs[whole], runs[sharded]
        assert len(ddp["losses"]) == len(fsdp["losses"]) > 4
        worst = max(abs(a - b) for a, b in zip(ddp["losses"], fsdp["losses"], strict=True))
        assert worst < 1e-4, (sharded, ddp["losses"], fsdp["losses"])
        # Rank 0's whole model ends with DDP's weights (to the reductions' order): what it evaluates and saves.
        assert fsdp["weights"].keys() == ddp["weights"].keys()
        gap = max((fsdp["weights"][k] - v).abs().max().item() for k, v in ddp["weights"].items())
        assert gap < 1e-4, (sharded, gap)
        assert fsdp["notes"]["fsdp.shard_loading"].startswith("1 of 2 ranks built on the meta device")
        # Rank 1 was handed a model without storage, and holds about half of it (its rows; uneven tensors round up).
        assert held[sharded]["all_meta"] and 0.45 < held[sharded]["share"] < 0.56, held[sharded]
    assert "fsdp.shard_loading" not in runs["ddp"]["notes"]


def test_only_a_rank_above_0_of_an_fsdp_run_that_runs_its_model_first_in_the_trainer_builds_on_meta():
    fsdp = fsdp_params(**{"distributed.strategy": "fsdp"})
    assert builds_on_meta(fsdp, 1, 2, CPU)
    assert not builds_on_meta(fsdp, 0, 2, CPU)  # rank 0 evaluates, saves and broadcasts the whole model
    assert not builds_on_meta(fsdp, 1, 1, CPU)  # one worker: no FSDP
    assert not builds_on_meta(fsdp_params(**{"distributed.strategy": "ddp"}), 1, 2, CPU)
    # The CPU fast-dropout check and packing's isolation check run the model before the Trainer shards it.
    assert not builds_on_meta(fsdp_params(**{"distributed.strategy": "fsdp", "fast_dropout": True}), 1, 2, CPU)
    packed = fsdp_params(**{"distributed.strategy": "fsdp", "task": "causal_lm", "data.packing": True})
    assert not builds_on_meta(packed, 1, 2, CPU)
