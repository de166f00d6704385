"""`compile: auto` decided by prediction: on when the steps of the run times the predicted saving per step exceed the
predicted compile time, cold or warm as the compile cache holds the run's fingerprint, off otherwise, with the reason
and the case as the tag `compile.resolved`.

The prediction comes from the plan (`pipelines.resolve.step_time.predict_compile`); what makes compiling impossible
(`blocker`) or too costly (more batch shapes than a compiled run warms, `MAX_SHAPES`) decides before it. The run's
batch shapes are collated only when the decision needs them (`RunShapes`), and give, with the model, the fingerprint
the compile cache is asked about (`pipelines.train.compile_cache`). How a compiled step is then built, padded, warmed
and bounded is `pipelines.train.compiled_step`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import nn

from pipelines.data.batching import MAX_WIDTHS
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import Runtime
from pipelines.train.compile_cache import BatchShapes, CompileCache, compile_parts, fingerprint, graph_shapes
from pipelines.train.compiled_step import cache_dir, compile_options, compiled_runtime, dynamic_width, run_shapes
from pipelines.train.windows import optimizer_steps, training_sampler

if TYPE_CHECKING:
    from pipelines.tasks.base import Task

# Distinct batch shapes a compiled run accepts: the widths, times a few row counts (where rows are not padded to one
# count, `compiled_step.padded_rows`). More than this (a token budget's varying rows) compiles too often to pay.
MAX_SHAPES = 2 * MAX_WIDTHS + 2


@dataclass(frozen=True)
class CompilePrediction:
    """What the plan predicts of compiling this run (`pipelines.resolve.step_time`): a step's seconds eager and
    compiled; one compile of the step cold (nothing cached), warm (its graphs loaded from the cache) and from a
    Mega-Cache blob alone; and the seconds each batch shape then costs to warm (on CUDA: record its graph). `found`
    says which case holds: where the compile cache has the run's fingerprint ('cache' or 'blob',
    `pipelines.train.compile_cache`), else None (cold)."""

    eager_step_s: float
    compiled_step_s: float
    compile_s: float
    warm_compile_s: float
    blob_compile_s: float
    shape_s: float
    found: str | None = None

    def compile_cost(self, shapes: int) -> float:
        """Predicted seconds to compile and warm `shapes` batch shapes, in the case `found` says."""
        once = {None: self.compile_s, "cache": self.warm_compile_s, "blob": self.blob_compile_s}[self.found]
        return once + shapes * self.shape_s

    def case(self) -> str:
        """`cold`, or `warm (from the cache)` / `warm (from a blob)`."""
        return "cold" if self.found is None else f"warm (from the {self.found})"

    def repaid(self, steps: int, shapes: int) -> tuple[bool, str]:
        """Whether `steps` steps repay compiling `shapes` shapes, and the arithmetic that says so."""
        saving = steps * (self.eager_step_s - self.compiled_step_s)
        if saving <= 0:
            return False, (
                f"a compiled step is predicted no faster here ({1000 * self.compiled_step_s:,.1f} ms against "
                f"{1000 * self.eager_step_s:,.1f} ms eager)"
            )
        cost = self.compile_cost(shapes)
        verdict = saving > cost
        return verdict, (
            f"{steps} steps x {1000 * (self.eager_step_s - self.compiled_step_s):,.1f} ms predicted saving per step "
            f"= {saving:,.1f} s {'>' if verdict else '<='} {cost:,.1f} s predicted to compile {self.case()} and "
            f"warm {shapes} batch shapes"
        )


@dataclass(frozen=True)
class CompileChoice:
    """`compile` resolved: on or off, and why (the tag `compile.resolved`); when on, the seconds predicted to compile
    (None without a plan) and the run's compile fingerprint (`pipelines.train.compile_cache`)."""

    enabled: bool
    reason: str
    predicted_s: float | None = None
    key: str | None = None

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


@dataclass
class RunShapes:
    """The run's distinct batch shapes, collated at most once and only when a decision needs them, and the
    fingerprint they give with the model (`pipelines.train.compile_cache`)."""

    collect: Callable[[], list[BatchShapes]]
    keyed: Callable[[list[BatchShapes]], str]
    _shapes: list[BatchShapes] | None = None

    @property
    def shapes(self) -> list[BatchShapes]:
        """The shapes, collated on first use."""
        if self._shapes is None:
            self._shapes = self.collect()
        return self._shapes

    def count(self) -> int:
        """How many distinct batch shapes the run has."""
        return len(self.shapes)

    def key(self) -> str:
        """The run's compile fingerprint."""
        return self.keyed(self.shapes)


def decide_compile(
    params: Params,
    runtime: Runtime,
    steps: int,
    shapes: int | RunShapes,
    prediction: CompilePrediction | None,
    cache: CompileCache | None = None,
) -> CompileChoice:
    """`compile` resolved for a run of `steps` optimizer steps over `shapes` distinct batch shapes (collated only when
    the decision needs them); `cache` says whether their fingerprint is compiled already (warm) or not (cold)."""
    if params.compile is not True and params.compile != "auto":
        return CompileChoice(False, "compile: false")
    count = (lambda: shapes) if isinstance(shapes, int) else shapes.count

    def looked_up(prediction: CompilePrediction) -> CompilePrediction:  # cold or warm: is the fingerprint cached?
        if cache is None or isinstance(shapes, int):
            return prediction
        # With the run's shapes: a model that compiled a graph per width is warm only for the widths it compiled.
        return replace(prediction, found=cache.holds(shapes.key(), shapes.shapes))

    key = None if isinstance(shapes, int) else shapes.key
    if params.compile is True:
        prediction = None if prediction is None else looked_up(prediction)
        predicted = None if prediction is None else prediction.compile_cost(count())
        case = "" if prediction is None else f", {prediction.case()}"
        return CompileChoice(True, f"compile: true ({count()} batch shapes{case})", predicted, key() if key else None)
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
    prediction = looked_up(prediction)
    verdict, arithmetic = prediction.repaid(steps, shapes_in_run)
    return CompileChoice(verdict, arithmetic, prediction.compile_cost(shapes_in_run), key() if key else None)


def resolve_compile(
    params: Params,
    runtime: Runtime,
    train: TokenizedSplit,
    task: Task,
    model: nn.Module,
    prediction: CompilePrediction | None,
) -> tuple[Params, Runtime, CompileChoice]:
    """`compile` decided for this run (`decide_compile`, against the project's compile cache), and the params and
    runtime it trains with: `compile` a bool, and a compiled run's batches padded to its widths, keyed by its
    fingerprint."""
    widened = compiled_runtime(runtime, params, train)
    sampler = training_sampler(train, params)  # one process's plan (a DDP rank's Trainer plans its share: `plan_run`)
    steps = optimizer_steps(sampler, params)  # the rule the Trainer counts its schedule's steps by

    def collect() -> list[BatchShapes]:  # the shapes the Trainer warms, by the same rule (`run_shapes`)
        return list(run_shapes(train, params, widened, task, sampler))

    def keyed(shapes: list[BatchShapes]) -> str:  # as the graphs specialise: under a dynamic width, not each width
        graphs = graph_shapes(shapes, dynamic_width(widened))
        return fingerprint(compile_parts(model, runtime.device, compile_options(params, widened), graphs))

    choice = decide_compile(params, runtime, steps, RunShapes(collect, keyed), prediction, CompileCache(cache_dir()))
    trained_with = replace(widened, compile_key=choice.key) if choice.enabled else runtime
    return params.model_copy(update={"compile": choice.enabled}), trained_with, choice
