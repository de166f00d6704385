"""FSDP2 over gloo, two real processes, against one process on the same global batch: every reduced gradient,
tensor by tensor, and a few steps of SGD (whose update is as large as the gradient, so a summed-instead-of-averaged
reduction, pytorch/pytorch#162338, shows as a step twice too long).

Full fine-tuning and LoRA (the base frozen, only the adapters in the optimizer), each with and without activation
checkpointing and with and without `cpu_offload`; the models go through `parallelize`, the trainer's own steps, and
each rank runs the trial's `TrainStep` on its half of the window (two micro-batches, the gradient sync on the last).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipelines.adapters import apply_adapter
from pipelines.data.batching import PadCollator
from pipelines.params import load_params
from pipelines.tasks import get_task
from pipelines.train.optim import build_optimizer
from pipelines.train.parallel import ParallelConfig, apply_checkpointing, parallelize
from tests.conftest import REPO_ROOT
from tests.pipelines.train.helpers import cpu_step, loopback_init_method, loopback_process_group, tiny_model, tiny_split
from tests.pipelines.train.test_ddp import _spawn_and_wait

CPU = torch.device("cpu")
# One global window of 16 rows: rank 0 its first two micro-batches, rank 1 the other two; one process all four.
BATCHES = [list(range(0, 4)), list(range(4, 8)), list(range(8, 12)), list(range(12, 16))]
RANK_BATCHES = [BATCHES[:2], BATCHES[2:]]
GLOBAL_ROWS = 16
# (adapter, grad_checkpointing, cpu_offload) per case.
CASES = {
    f"{kind}{' checkpointed' if ckpt else ''}{' offloaded' if offload else ''}": (kind, ckpt, offload)
    for kind in ("full", "lora")
    for ckpt in (False, True)
    for offload in (False, True)
}
SGD_STEPS, SGD_LR = 4, 0.5
# fp32 throughout: only the order of the additions differs. Measured: gradients within 1.9e-6 of their largest
# entry (full; LoRA 1.2e-7), weights within 1.5e-8 and losses within 1.2e-7 after the SGD steps.
TOLERANCE = 1e-5


def build_model(kind: str, ckpt: bool) -> torch.nn.Module:
    """The tiny classifier, with LoRA adapters on query and value when `kind` is lora (their B not zero, so A
    gets a gradient too), checkpointed when asked; the same weights in every process."""
    model = tiny_model(seed=0)
    if kind == "lora":
        adapter = load_params(REPO_ROOT / "params.yaml").adapter.model_copy(
            update={"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["query", "value"]}
        )
        torch.manual_seed(1)
        model = apply_adapter(model, adapter, get_task("classification"))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1)
    return apply_checkpointing(model, _config(ckpt, offload=False))


def _config(ckpt: bool, offload: bool) -> ParallelConfig:
    return ParallelConfig(2, CPU, "fp32", grad_checkpointing=ckpt, cpu_offload=offload)


def collated(indices: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    collate = PadCollator(tiny_split(rows=GLOBAL_ROWS, seed=1), pad_id=0, fixed_length=None, pad_to_multiple_of=None)
    return [collate(rows) for rows in indices]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _one_window(model: torch.nn.Module, indices: list[list[int]], units: float) -> dict[str, torch.Tensor]:
    """The gradients (whole tensors, by name) after one window of the trial's step, before any update."""
    step = cpu_step(model, get_task("classification"), scaler=False)
    step.accumulate(collated(indices), units)
    return {name: _full(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}


def _sgd_run(model: torch.nn.Module, indices: list[list[int]], units: float) -> dict[str, object]:
    """`SGD_STEPS` steps of the project's SGD on the same window: the global loss of each, and the final weights."""
    optimizer = build_optimizer("sgd", model, SGD_LR, 0.0, CPU)
    step = cpu_step(model, get_task("classification"), optimizer=optimizer)
    losses = []
    for _ in range(SGD_STEPS):
        loss = step(collated(indices), units).loss.detach().clone()
        if dist.is_initialized():  # each rank's loss is the mean of its half: the window's is their mean
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(float(loss))
    weights = {name: _full(p.detach()).clone() for name, p in model.named_parameters() if p.requires_grad}
    local = [p.to_local() if hasattr(p, "to_local") else p for group in optimizer.param_groups for p in group["params"]]
    in_optimizer = sum(p.numel() for p in local)  # this rank's own: a shard's global numel is the whole tensor's
    return {"losses": losses, "weights": weights, "in_optimizer": in_optimizer}


def _summing(sharded: torch.nn.Module) -> torch.nn.Module:
    """The negative control: every unit's reduce-scatter divides by 1, i.e. sums the ranks' gradients."""
    from torch.distributed.fsdp import FSDPModule

    for module in sharded.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a SUM, undivided (gloo has no PREMUL_SUM)
    return sharded


def _rank(rank: int, init_method: str, out: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    with loopback_process_group(rank, 2, init_method):
        for name, (kind, ckpt, offload) in CASES.items():
            sharded = parallelize(build_model(kind, ckpt), _config(ckpt, offload))
            results[name] = _one_window(sharded, RANK_BATCHES[rank], GLOBAL_ROWS / 2)
            results[f"{name} devices"] = {p.device.type for p in sharded.parameters()}
        summed = _summing(parallelize(build_model("full", False), _config(False, False)))
        results["summed"] = _one_window(summed, RANK_BATCHES[rank], GLOBAL_ROWS / 2)
        for kind in ("full", "lora"):
            sharded = parallelize(build_model(kind, True), _config(True, offload=True))
            results[f"sgd {kind}"] = _sgd_run(sharded, RANK_BATCHES[rank], GLOBAL_ROWS / 2)
    if rank == 0:
        torch.save(results, out)


def worst_gap(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest difference of a gradient from one process's, relative to that gradient's largest entry."""
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    return max(((got[n] - e).abs().max() / e.abs().max().clamp(min=1e-12)).item() for n, e in expected.items())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("fsdp") / "results.pt"
    _spawn_and_wait(_rank, args=(loopback_init_method(), str(out)), nprocs=2, seconds=300)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", list(CASES))
def test_each_reduced_gradient_equals_one_process_on_the_same_global_batch(two_ranks, case):
    kind, ckpt, _ = CASES[case]
    expected = _one_window(build_model(kind, ckpt), BATCHES, GLOBAL_ROWS)
    if kind == "lora":  # only the adapters (and the new head peft trains) have gradients
        assert expected and all("lora_" in n or "modules_to_save" in n for n in expected), sorted(expected)
    assert worst_gap(two_ranks[case], expected) < TOLERANCE, case
    assert two_ranks[f"{case} devices"] == {"cpu"}  # a CPU run's shards stay on the host (pytorch#132471)


def test_a_reduction_that_sums_the_ranks_gradients_fails_the_comparison(two_ranks):
    """The comparison above is not blind to pytorch/pytorch#162338: summed gradients are twice one process's."""
    expected = _one_window(build_model("full", False), BATCHES, GLOBAL_ROWS)
    assert worst_gap(two_ranks["summed"], expected) == pytest.approx(1.0, abs=1e-4)  # 2g against g


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_sgd_steps_match_one_process_and_only_the_trained_weights_are_in_the_optimizer(two_ranks, kind):
    sharded = two_ranks[f"sgd {kind}"]
    model = build_model(kind, True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    single = _sgd_run(model, BATCHES, GLOBAL_ROWS)
    assert sharded["losses"] == pytest.approx(single["losses"], abs=TOLERANCE)
    assert single["losses"][-1] < single["losses"][0], single["losses"]
    gap = max((sharded["weights"][n] - w).abs().max().item() for n, w in single["weights"].items())
    assert sharded["weights"].keys() == single["weights"].keys() and gap < TOLERANCE, gap
    # Each rank's optimizer holds its half of the trained weights only (shards of uneven tensors round up).
    assert sharded["in_optimizer"] < 0.6 * trainable
    if kind == "lora":
        assert trainable < 0.2 * sum(p.numel() for p in model.parameters())
