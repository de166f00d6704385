"""FSDP with the GradScaler: a non-finite gradient in one rank's shard skips the step on every rank.

Each rank unscales only its shard of the gradients. With FSDP2 the shards are DTensors, and DTensor's rule for
the unscale op (`_amp_foreach_non_finite_check_and_unscale_`) reduces the inf/NaN flag over the mesh, so the
plain GradScaler already agrees across ranks (torch 2.13); FSDP1's ShardedGradScaler is not needed. This test
holds that: should a torch release drop the reduction, ranks would step apart and it fails.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.pipelines.train.helpers import loopback_init_method, loopback_process_group, tiny_model
from tests.pipelines.train.test_ddp import _spawn_and_wait

CPU = torch.device("cpu")


def _step_with_inf_on_rank_0(rank: int, init_method: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from tests.pipelines.train.helpers import cpu_step

    torch.set_num_threads(1)
    with loopback_process_group(rank, 2, init_method):
        model = tiny_model(seed=0)
        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(5, 100, (4, 12), generator=torch.Generator().manual_seed(rank))
        before = [p.detach().to_local().clone() for p in model.parameters()]
        step = cpu_step(model, None, optimizer=optimizer)
        scaler = step.scaler
        scaler.scale(model(input_ids=ids, labels=torch.zeros(4, dtype=torch.long)).loss).backward()
        if rank == 0:  # only rank 0's shard of one gradient is non-finite
            next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("inf")
        skipped = int(step.update())
        weights = zip(model.parameters(), before, strict=True)
        unchanged = all(torch.equal(p.detach().to_local(), kept) for p, kept in weights)
        scaler.scale(model(input_ids=ids, labels=torch.zeros(4, dtype=torch.long)).loss).backward()
        control = int(step.update())  # finite everywhere: it steps
        results = {"skipped": skipped, "weights unchanged": unchanged, "finite step skipped": control}
        torch.save(results, f"{out}.{rank}")


def test_a_non_finite_gradient_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path: Path):
    out = tmp_path / "skipped"
    _spawn_and_wait(_step_with_inf_on_rank_0, (loopback_init_method(), str(out)), nprocs=2, seconds=120)
    for rank in (0, 1):  # rank 1's own shards are finite: without the reduction it would step alone
        expected = {"skipped": 1, "weights unchanged": True, "finite step skipped": 0}
        assert torch.load(f"{out}.{rank}") == expected, rank
