"""Evaluation's memory: validation's largest scoring batch during training, and the evaluate stage's generation.

Users most often run out of memory in evaluation, not in the training step: the scoring batch is twice an optimizer
step's rows (`eval_batch_rows`), its logits are computed whole for every position, and the optimizer state is still
resident. The memory plan runs this on its fake model after the training step (`predicted_eval_peak_bytes`).
Generation (the evaluate stage: weights, no optimizer) is planned by one forward that fills the key/value cache
of its largest batch (`Task.generation_probe`: prefill, then the last step with the cache at its final length;
`predicted_generation_peak_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from pipelines.data.batching import HOST_COUNTS
from pipelines.data.loader import eval_batch_rows, in_process, make_loader
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import Runtime, eval_mode
from pipelines.tasks.base import GenerationProbe, Task
from pipelines.train.memory import restart_peak, track_step

T = TypeVar("T")
# The planner's store of evaluation peaks and the depth being traced (`shared_evaluations`), or None: no reuse.
_SHARED: ContextVar[tuple[dict[tuple[object, ...], object], object] | None] = ContextVar("evaluations", default=None)


@contextmanager
def shared_evaluations(store: dict[tuple[object, ...], object], depth: object) -> Iterator[None]:
    """Within it, `reused` keeps each evaluation peak in `store` for the fake steps at `depth` blocks that share what
    that evaluation reads (one planner: one task, training split, tokenizer and target)."""
    token = _SHARED.set((store, depth))
    try:
        yield
    finally:
        _SHARED.reset(token)


def evaluation_key(kind: str, params: Params) -> str:
    """Everything of `params` the `kind` ("validation" or "generation") evaluation reads, as JSON.

    What is left out, and why it cannot change the evaluation: the budget and the search's mode (they only judge a
    plan), `adapter.merge` (it only saves the model), the split of the effective batch into micro-batch x
    accumulation (both evaluations size their batch by `eval_batch_rows`, the product; kept when compiled, whose
    runtime pads by the micro-batch), and for generation the optimizer (generation tracks the weights beside an
    idle optimizer of its own; the trial's is not tracked). Checkpointing and activation offload stay in: they
    change the model's layers, and generation's last step measured 6 MiB apart with and without on an 8B shape."""
    update: dict[str, object] = {"memory_budget": None, "strategy": "manual",
                                 "adapter": params.adapter.model_copy(update={"merge": True})}  # fmt: skip
    if params.compile is not True and isinstance(params.batch_size, int):
        update |= {"batch_size": eval_batch_rows(params), "grad_accum_steps": 1, "effective_batch_size": None}
    if kind == "generation":
        update["optim"] = "adamw"
    return params.model_copy(update=update).model_dump_json()


def reused(kind: str, params: Params, evaluate: Callable[[], T]) -> T:
    """`evaluate()`, once per `evaluation_key` and depth inside `shared_evaluations` (a search plans many candidates
    that differ only in what the evaluation does not read); every time outside it."""
    shared = _SHARED.get()
    if shared is None:
        return evaluate()
    store, depth = shared
    key = (kind, depth, evaluation_key(kind, params))
    if key not in store:
        store[key] = evaluate()
    return store[key]  # type: ignore[return-value]


def largest_eval_batch(split: TokenizedSplit, params: Params, task: Task, runtime: Runtime) -> dict[str, torch.Tensor]:
    """The scoring batch of the split's longest rows, as validation batches them (sorted by length), on the host."""
    rows = min(eval_batch_rows(params), len(split))
    longest = sorted(np.argsort(split.lengths, kind="stable")[::-1][:rows].tolist())
    loader = make_loader(split, [longest], in_process(params), runtime, task)
    return {k: v for k, v in next(iter(loader)).items() if k not in HOST_COUNTS}


def validation_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], runtime: Runtime, task: Task
) -> int:
    """Peak bytes (MemTracker) of the task's no-grad loss on `batch` with the optimizer state alive, gradients freed
    (the plan's fake step: `runtime` on the CPU)."""
    optimizer.zero_grad(set_to_none=True)

    def forward(_meter: object) -> None:
        with torch.no_grad(), runtime.autocast():
            task.loss(model, batch, runtime.loss)

    with eval_mode(model):
        return track_step(model, optimizer, runtime.device, forward).total


def grow_cache(cache: object, positions: int) -> None:
    """Append `positions` (zero) positions to every self-attention layer of a transformers cache, in place."""
    cache = getattr(cache, "self_attention_cache", cache)  # encoder-decoder: the decoder's own cache grows
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "keys", None) is None or layer.keys.dim() != 4:
            continue
        shape = (*layer.keys.shape[:2], positions, layer.keys.shape[-1])
        layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(shape)], dim=-2)
        layer.values = torch.cat([layer.values, layer.values.new_zeros(shape)], dim=-2)


def generation_peaks(model: nn.Module, probe: GenerationProbe, runtime: Runtime) -> tuple[int, int]:
    """Peak bytes (MemTracker) of generation's prefill, and of its last step with the cache at its final length,
    beside the weights alone (the evaluate stage has no optimizer); generation's peak is the larger. Apart, because
    each grows with the model's depth at its own rate (a plan by depth extrapolates each: resolve/plan_depth)."""
    idle = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    prefill: list[int] = []

    def generate(meter: object) -> None:
        with torch.no_grad(), runtime.autocast():
            out = model(**probe.prefill)
            meter.tracker.reset_mod_stats()  # type: ignore[attr-defined]  # a second forward follows
            prefill.append(restart_peak(meter.tracker))  # type: ignore[attr-defined]
            cache = out["cache"] if "cache" in out else out.past_key_values
            grow_cache(cache, probe.new_tokens)
            model(**_cache_named(model, probe.step(out, cache)))

    with eval_mode(model):
        last_step = track_step(model, idle, runtime.device, generate).total
    return prefill[0], last_step


def _cache_named(model: nn.Module, inputs: dict[str, object]) -> dict[str, object]:
    """The probe's step inputs with the key/value cache under the name the model's forward takes: transformers 5.24
    renamed `past_key_values` to `cache` (the old name warns, once per forward); 5.23, our floor, has only the old."""
    from pipelines.tasks.linear_ce import forward_takes

    if "past_key_values" not in inputs or not forward_takes(model, "cache"):
        return inputs
    renamed = {k: v for k, v in inputs.items() if k != "past_key_values"}
    return {**renamed, "cache": inputs["past_key_values"]}
