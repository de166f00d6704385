"""`compile`: the whole step compiled once per padded batch shape, warmed before timing, its graphs counted and bounded.

What is compiled is the step's forward and loss (`TrainStep.forward_loss`); AOTAutograd compiles their backward with
them, and the optimizer's update is the fused kernel where the optimizer has one (AdamW), so every part of the step
runs compiled or fused. On CUDA the compiled graphs run as CUDA graphs (`mode="reduce-overhead"`): Inductor's
cudagraph trees record one graph per static shape and manage its memory pool, which explicit capture would need a
capturable optimizer, static input buffers and hand-kept pools for; on a CPU there are no graphs to replay.

Shapes are what makes compile pay or not: with length bucketing every new batch width recompiles, and on an H100
that made a compiled 100-step run 7-8x slower than eager, on our side and the Trainer's (`../shared/gpu`,
2026-11-25). So a compiled run pads every batch to a few widths from the training split's length histogram
(`pipelines.data.batching.width_set`, at most 8), lists the distinct batch shapes of its whole plan (every epoch's
batches are known before training), compiles and warms one batch of each before the clocks start
(`compile_time_s`), and bounds the graphs at that count: a step that would need one more fails with the reason
instead of running eager without a word (`recompile_limit`'s silent fallback). Compiled graphs are cached under
the project's `.cache/torch/` (Inductor's FX graph and AOTAutograd caches), so a second trial or experiment with
the same model and shapes loads them instead of compiling.

`compile: auto` is decided by prediction (`decide_compile`): on when the steps of the run times the predicted saving
per step exceed the predicted compile time, off otherwise, with the reason as the tag `compile.resolved`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipelines.data.batching import MAX_WIDTHS, PadCollator, width_set
from pipelines.data.loader import make_collator
from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.runtime import Runtime
from pipelines.train.step import Batch, TrainStep
from pipelines.train.windows import training_sampler

if TYPE_CHECKING:
    from pipelines.tasks.base import Task

# Distinct batch shapes a compiled run accepts: the widths, times a few row counts (a partial last batch per
# epoch, a packed split's last row). More than this (a token budget's varying rows) compiles too often to pay.
MAX_SHAPES = 2 * MAX_WIDTHS + 2
CACHE_DIR = Path(".cache") / "torch"


class CompileError(UserError):
    """A compiled step needed more graphs than its shapes: the run stops rather than run eager unannounced."""


@dataclass(frozen=True)
class CompilePrediction:
    """What the plan predicts of compiling this run: a step's seconds eager and compiled, and the compile time of
    one batch shape (`pipelines.resolve.step_time`)."""

    eager_step_s: float
    compiled_step_s: float
    compile_s_per_shape: float

    def repaid(self, steps: int, shapes: int) -> tuple[bool, str]:
        """Whether `steps` steps repay compiling `shapes` shapes, and the arithmetic that says so."""
        saving = steps * (self.eager_step_s - self.compiled_step_s)
        cost = shapes * self.compile_s_per_shape
        if saving <= 0:
            return False, (
                f"a compiled step is predicted no faster here ({1000 * self.compiled_step_s:,.1f} ms against "
                f"{1000 * self.eager_step_s:,.1f} ms eager)"
            )
        verdict = saving > cost
        return verdict, (
            f"{steps} steps x {1000 * (self.eager_step_s - self.compiled_step_s):,.1f} ms predicted saving per step "
            f"= {saving:,.1f} s {'>' if verdict else '<='} {cost:,.1f} s predicted to compile {shapes} batch shapes"
        )


@dataclass(frozen=True)
class CompileChoice:
    """`compile` resolved: on or off, and why (the tag `compile.resolved`)."""

    enabled: bool
    reason: str

    def tag(self) -> str:
        """`on: <why>` or `off: <why>`."""
        return f"{'on' if self.enabled else 'off'}: {self.reason}"


def blocker(params: Params, runtime: Runtime) -> str | None:
    """Why this run cannot be compiled (so `compile: auto` is off), or None."""
    if params.kernels == "liger":
        return "kernels: liger (Inductor cannot compile Liger's RMSNorm backward: the loss sticks, measured on an H100)"
    if runtime.loss.chunk_rows is not None:
        return "loss_impl resolved chunked (its head call outside the model's forward would retrace)"
    if params.distributed.strategy == "fsdp" and params.distributed.num_workers > 1:
        return "distributed.strategy: fsdp (sharded steps are not compiled yet)"
    if params.activation_offload:
        return "activation_offload (its saved-tensor hooks run outside a compiled graph)"
    return None


def decide_compile(
    params: Params, runtime: Runtime, steps: int, shapes: int | Callable[[], int], prediction: CompilePrediction | None
) -> CompileChoice:
    """`compile` resolved for a run of `steps` optimizer steps over `shapes` distinct batch shapes (counted only
    when the decision needs them: a callable is called at most once)."""
    if params.compile is not True and params.compile != "auto":
        return CompileChoice(False, "compile: false")
    count = (lambda: shapes) if isinstance(shapes, int) else shapes
    if params.compile is True:
        return CompileChoice(True, f"compile: true ({count()} batch shapes)")
    why_not = blocker(params, runtime)
    if why_not is not None:
        return CompileChoice(False, why_not)
    if prediction is not None and prediction.eager_step_s <= prediction.compiled_step_s:
        return CompileChoice(False, prediction.repaid(steps, 0)[1])
    shapes_in_run = count()
    if shapes_in_run > MAX_SHAPES:
        return CompileChoice(False, f"{shapes_in_run} batch shapes, over the {MAX_SHAPES} a compiled run warms")
    if prediction is None:
        return CompileChoice(False, "no memory plan to predict its saving from")
    verdict, arithmetic = prediction.repaid(steps, shapes_in_run)
    return CompileChoice(verdict, arithmetic)


def compiled_runtime(runtime: Runtime, params: Params, train: TokenizedSplit) -> Runtime:
    """The runtime a compiled run trains with: bucketed batches padded to a few widths (an unbucketed run already
    pads every batch to max_length)."""
    if not params.data.bucketing or len(train.lengths) == 0:
        return runtime
    return replace(runtime, widths=width_set(train.lengths, runtime.pad_multiple))


def resolve_compile(
    params: Params, runtime: Runtime, train: TokenizedSplit, task: Task, prediction: CompilePrediction | None
) -> tuple[Params, Runtime, CompileChoice]:
    """`compile` decided for this run (`decide_compile`), and the params and runtime it trains with: `compile` a bool,
    and a compiled run's batches padded to its widths."""
    widened = compiled_runtime(runtime, params, train)
    sampler = training_sampler(train, params)
    planned = [sampler.batches(epoch) for epoch in range(params.epochs)]
    steps = sum(math.ceil(len(batches) / params.grad_accum_steps) for batches in planned)

    def shapes() -> int:
        collator = make_collator(train, params, widened, task)
        return len(batches_by_shape(collator, [rows for batches in planned for rows in batches]))

    choice = decide_compile(params, runtime, steps, shapes, prediction)
    return params.model_copy(update={"compile": choice.enabled}), widened if choice.enabled else runtime, choice


def shape_of(batch: Batch) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """A batch's shapes: what a compiled graph is specialised to."""
    return tuple((name, tuple(tensor.shape)) for name, tensor in sorted(batch.items()))


def batches_by_shape(collator: PadCollator, batches: list[list[int]]) -> list[list[int]]:
    """One batch (its rows) for each distinct shape among `batches`, collated on the host to read their shapes.

    A batch's shapes depend only on its row count and its longest row (and a seq2seq batch's longest source and
    target), so only a batch with a new such key is collated: an epoch of 3,750 batches collates a few dozen."""
    sources = getattr(collator, "source_lengths", None)
    seen: dict[tuple[tuple[str, tuple[int, ...]], ...], list[int]] = {}
    keys: set[tuple[int, ...]] = set()
    for rows in batches:
        lengths = collator.lengths[rows]
        key = (len(rows), int(lengths.max()))
        if sources is not None:
            key += (int(sources[rows].max()), int((lengths - sources[rows]).max()))
        if key not in keys:
            keys.add(key)
            seen.setdefault(shape_of(collator(rows)), rows)
    return list(seen.values())


def use_cache(root: Path | None = None) -> Path:
    """Keep Inductor's caches under the project's `.cache/torch` (unless TORCHINDUCTOR_CACHE_DIR is set): a second
    run with the same model and shapes loads its compiled graphs. Returns the folder."""
    folder = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(((root or Path.cwd()) / CACHE_DIR).resolve())))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_step(step: TrainStep) -> TrainStep:
    """`step` with its forward and loss compiled: static shapes (one graph per shape, never dynamic ones, which
    CUDA graphs cannot replay), CUDA graphs on CUDA.

    Dynamo's in-memory caches are cleared first: they are kept per code object, and every step compiles the same
    one (`TrainStep.forward_loss`), so a second run in one process (tests, benchmarks) would count the first run's
    graphs against its bound. What is on disk stays: a run compiled before loads its graphs from the cache."""
    import torch._dynamo

    torch._dynamo.reset()
    use_cache()
    mode = "reduce-overhead" if step.runtime.device.type == "cuda" else None
    return step.compiled(lambda loss: torch.compile(loss, dynamic=False, mode=mode))


def graphs_built() -> int:
    """Graphs dynamo has built in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextmanager
def bounded_graphs(shapes: int) -> Iterator[None]:
    """Inside the block, a compiled function that needs more than `shapes` + 1 graphs raises (dynamo's default is to
    fall back to eager silently after 8); the error names the count and what to do."""
    import torch._dynamo

    limit = shapes + 1
    try:
        with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
            yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise CompileError(
            f"compile: the step needed more than {limit} graphs for its {shapes} batch shapes (the first line of "
            f"torch's reason: {str(err).splitlines()[0] if str(err) else type(err).__name__}); set compile: false"
        ) from None


def warm(step: TrainStep, batches: list[Batch], units: list[float]) -> None:
    """Compile (and on CUDA record) the step for each batch's shape: forward and backward, twice (cudagraph trees
    record on a shape's second call), then the gradients are dropped; no weight or optimizer state changes."""
    runs = 2 if step.runtime.device.type == "cuda" else 1
    for batch, unit in zip(batches, units, strict=True):
        for _ in range(runs):
            step.backward(batch, unit)
            step.optimizer.zero_grad(set_to_none=True)


def row_units(rows: list[int], units: np.ndarray | None) -> float:
    """A batch's loss units (rows when None): what its warm-up loss is divided by (any positive number would do)."""
    return float(len(rows) if units is None else units[rows].sum()) or 1.0
