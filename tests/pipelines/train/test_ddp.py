"""DDP over gloo, two real processes: ranks with unequal rows still give the global mean gradient."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipelines.data.batching import LengthGroupedBatchSampler, PadCollator, Replica
from pipelines.tasks import get_task
from pipelines.train.windows import global_window_rows, plan_windows
from tests.pipelines.train.helpers import cpu_step, loopback_init_method, loopback_process_group, tiny_model, tiny_split

CPU = torch.device("cpu")
# Rank 0 gets 10 rows of unequal lengths, rank 1 gets 4: one global window of 14 rows.
RANK_BATCHES = [[list(range(0, 6)), list(range(6, 10))], [list(range(10, 14))]]


def _rank(rank: int, init_method: str, out: str) -> None:
    torch.set_num_threads(1)
    with loopback_process_group(rank, 2, init_method):
        grads = _ddp_gradients(rank)
    if rank == 0:
        torch.save(grads, out)


def _ddp_gradients(rank: int) -> dict[str, torch.Tensor]:
    """This rank's gradients after one DDP window (the DDP wrapper is freed on return, before the group)."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_model(seed=0))
    split = tiny_split(rows=14, seed=1)
    collate = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=None)
    window = RANK_BATCHES[rank]
    global_rows = sum(len(b) for batches in RANK_BATCHES for b in batches)
    step = cpu_step(model.module, get_task("classification"), scaler=False).through(model)
    step.accumulate([collate(b) for b in window], global_rows / 2)
    return {n: p.grad for n, p in model.module.named_parameters()}


def test_two_ranks_with_unequal_rows_give_the_mean_gradient_over_all_rows(tmp_path: Path):
    out = tmp_path / "grads.pt"
    _spawn_and_wait(_rank, args=(loopback_init_method(), str(out)), nprocs=2, seconds=180)
    ddp = torch.load(out)

    model = tiny_model(seed=0)
    split = tiny_split(rows=14, seed=1)
    collate = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=None)
    everything = [b for batches in RANK_BATCHES for b in batches]
    step = cpu_step(model, get_task("classification"), scaler=False)
    step.accumulate([collate(b) for b in everything], sum(len(b) for b in everything))
    worst = max((ddp[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    assert worst < 1e-6, worst


def _spawn_and_wait(fn, args: tuple, nprocs: int, seconds: float) -> None:
    """mp.spawn with a deadline: a stuck rank fails the test (and is killed) instead of hanging the suite."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=5):  # raises at once if a rank fails
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{nprocs} gloo ranks did not finish within {seconds:.0f} s")


def test_global_window_rows_add_every_rank_s_window():
    lengths = torch.randint(4, 40, (50,)).numpy()
    sampler = LengthGroupedBatchSampler(lengths, 8, replica=Replica(0, 2), seed=3)
    rows = global_window_rows(sampler, epoch=0, accum=2)
    plan = sampler.global_batches(0)
    per_rank = [plan_windows(plan[r::2], 2) for r in range(2)]
    assert rows == [sum(len(b) for w in (per_rank[0][s], per_rank[1][s]) for b in w) for s in range(len(rows))]
    assert sum(rows) == 50  # every row in exactly one global window
