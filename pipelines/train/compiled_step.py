"""`compile`: the whole step compiled once for every padded width, warmed before timing, its graphs counted and bounded.

What is compiled is the step's forward and loss (`TrainStep.forward_loss`); AOTAutograd compiles their backward with
them, and the optimizer's update is the fused kernel where the optimizer has one (AdamW), so every part of the step
runs compiled or fused. On CUDA the compiled graphs run as CUDA graphs (`mode="reduce-overhead"`): Inductor's
cudagraph trees record one graph per shape and manage its memory pool, which explicit capture would need a
capturable optimizer, static input buffers and hand-kept pools for; on a CPU there are no graphs to replay.

Shapes are what makes compile pay or not: with length bucketing every new batch width recompiled, and on an H100
that made a compiled 100-step run 7-8x slower than eager (`../shared/gpu`, 2026-11-25); with a few widths from the
length histogram (`pipelines.data.batching.width_set`, at most 8) each width still compiled on its own, about 25 s
each on an H200. So a compiled run pads every batch to those widths and compiles the step once with the width
dynamic (`with_dynamic_width`: dim 1 of every batch tensor marked dynamic), then warms one batch of each distinct
shape of its whole plan (every epoch's batches are known before training) before the clocks start
(`compile_time_s`): one compile, and on CUDA one recording per width. Every batch is also padded to the batch size's
rows (`padded_rows`; the padding rows' targets ignored, so loss and gradients are the real rows'): an epoch's partial
last batch compiled a second graph, its row count a new shape. Marking the rows dynamic too would also make one
graph, but it compiled slower (a tiny BERT on this CPU, cold: 33.2 s against 24.9 s padded; the steps alike,
9.8 ms), and padding costs one full step for the short batch, once an epoch (issue 60). The graphs are bounded by
the run's batch shapes (a model that specializes the width compiles one per shape, as static did), and a step that
would need more fails with the reason instead of running eager without a word (`recompile_limit`'s silent
fallback). A run with one width compiles it static.
Compiled graphs are cached under the project's `.cache/torch/` (Inductor's FX graph and AOTAutograd caches) with a
manifest and Mega-Cache blobs (`pipelines.train.compile_cache`), so a second trial, experiment or machine with the
same fingerprint loads them instead of compiling.

Whether a run compiles at all (`compile: auto`) is decided before training, by prediction, in
`pipelines.train.compile_decision`; this module is how a compiled step is built, padded, warmed and bounded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipelines.data.batching import LengthGroupedBatchSampler, PadCollator, width_set
from pipelines.data.loader import RowPadded, make_collator
from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.runtime import Runtime
from pipelines.train.compile_cache import BatchShapes, marks_width
from pipelines.train.step import Batch, LossFn, TrainStep
from pipelines.train.windows import planned_batches

if TYPE_CHECKING:
    from pipelines.tasks.base import Task

CACHE_DIR = Path(".cache") / "torch"


class CompileError(UserError):
    """A compiled step needed more graphs than its shapes: the run stops rather than run eager unannounced."""


def compiled_runtime(runtime: Runtime, params: Params, train: TokenizedSplit) -> Runtime:
    """The runtime a compiled run trains with: bucketed batches padded to a few widths (an unbucketed run already
    pads every batch to max_length)."""
    if not params.data.bucketing or len(train.lengths) == 0:
        return runtime
    return replace(runtime, widths=width_set(train.lengths, runtime.pad_multiple))


def compile_options(params: Params, runtime: Runtime) -> dict[str, object]:
    """The compile options and the step's constants a compiled graph bakes in (the fingerprint's `options`), with the
    data-parallel strategy and world size: a DDP replica's step compiles around its buckets and an FSDP step around
    its gathers, graphs a lone process's compile never made (one worker is not wrapped: its strategy is moot)."""
    workers = params.distributed.num_workers
    return {
        "mode": compile_mode(runtime.device),
        "dynamic_width": dynamic_width(runtime),
        "precision": runtime.precision,
        "tf32": runtime.tf32,
        "loss": runtime.loss.describe(),
        "task": params.task,
        "weights_dtype": params.weights_dtype,
        "grad_checkpointing": [params.grad_checkpointing, params.grad_checkpointing_every],
        "kernels": params.kernels,
        "distributed": [params.distributed.strategy if workers > 1 else "single", workers],
    }


def padded_rows(params: Params, halvings: int = 0) -> int | None:
    """The rows every batch of a compiled run is padded to (`pipelines.data.loader.pad_rows`): the batch size, halved
    as the micro-batches are after an out-of-memory, so an epoch's partial last batch compiles no graph of its own;
    None under a token budget, whose batches vary in rows by design."""
    if params.data.max_tokens_per_batch is not None or not isinstance(params.batch_size, int):
        return None
    return -(-params.batch_size // 2**halvings)


def shape_of(batch: Batch) -> BatchShapes:
    """A batch's shapes and dtypes: what a compiled graph is specialised to (under a dynamic width, all but the width:
    `pipelines.train.compile_cache.graph_shapes`)."""
    return tuple((name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in sorted(batch.items()))


def batches_by_shape(collator: PadCollator | RowPadded, batches: list[list[int]]) -> dict[BatchShapes, list[int]]:
    """One batch (its rows) for each distinct shape among `batches`, by its shapes, in the order `batches` first
    holds them, collated on the host to read their shapes.

    A batch's shapes depend only on its row count and its longest row (and a seq2seq batch's longest source and
    target), so only a batch with a new such key is collated: an epoch of 3,750 batches collates a few dozen."""
    sources = getattr(collator, "source_lengths", None)
    seen: dict[BatchShapes, list[int]] = {}
    keys: set[tuple[int, ...]] = set()
    for rows in batches:
        lengths = collator.lengths[rows]
        key = (len(rows), int(lengths.max()))
        if sources is not None:
            key += (int(sources[rows].max()), int((lengths - sources[rows]).max()))
        if key not in keys:
            keys.add(key)
            seen.setdefault(shape_of(collator(rows)), rows)
    return seen


def run_shapes(
    train: TokenizedSplit, params: Params, runtime: Runtime, task: Task, sampler: LengthGroupedBatchSampler
) -> dict[BatchShapes, list[int]]:
    """A compiled run's distinct batch shapes, each with one batch (its rows) to warm it: every epoch's batches of
    `sampler` (all planned before training), collated as the run pads them (`padded_rows`). The one rule for
    `compile_decision.resolve_compile` (the shapes it decides and keys by) and the Trainer (the shapes it warms and
    bounds its graphs by, for its rank)."""
    collator = make_collator(train, params, runtime, task, padded_rows(params))
    return batches_by_shape(collator, planned_batches(sampler, params.epochs))


def cache_dir(root: Path | None = None) -> Path:
    """The folder Inductor's caches (and the compile manifest and blobs) live in: TORCHINDUCTOR_CACHE_DIR, else the
    project's `.cache/torch`."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(((root or Path.cwd()) / CACHE_DIR).resolve())))


def use_cache(root: Path | None = None) -> Path:
    """Keep Inductor's caches under the project's `.cache/torch` (unless TORCHINDUCTOR_CACHE_DIR is set): a second
    run with the same model and shapes loads its compiled graphs. Returns the folder."""
    folder = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir(root))))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_mode(device: torch.device) -> str | None:
    """CUDA graphs on CUDA (`reduce-overhead`); Inductor's default on a CPU, where there are no graphs to replay."""
    return "reduce-overhead" if device.type == "cuda" else None


def dynamic_width(runtime: Runtime) -> bool:
    """Whether the step is compiled with a dynamic width: bucketed batches padded to more than one width."""
    return runtime.widths is not None and len(runtime.widths.widths) > 1


def with_dynamic_width(compiled: LossFn) -> LossFn:
    """`compiled` called with dim 1 (the width) of every 2-D batch tensor marked dynamic (`marks_width`): one graph for
    every width.

    `maybe_mark_dynamic`, not `mark_dynamic`: a model whose code specializes the width (transformers' causal-mask
    helpers branch on it for some models) then compiles one graph per width, as a static compile would, instead of
    failing; `compile_graphs` says how many it took.

    Static shapes compiled one graph per width, about 25 s each on an H200 and 19 s each on this CPU for the default
    model; marked dynamic, Dynamo traces once with a symbolic width and Inductor compiles once, and on CUDA the
    cudagraph trees record one graph per width that runs (a recording, not a compile)."""
    import torch._dynamo

    def run(batch: Batch) -> torch.Tensor:
        for tensor in batch.values():
            if marks_width(tuple(tensor.shape)):  # the rule the fingerprint keys by (`graph_shapes`)
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
        return compiled(batch)

    return run


def compile_step(step: TrainStep) -> TrainStep:
    """`step` with its forward and loss compiled: one graph over every padded width when there are several (a
    dynamic width), static otherwise; CUDA graphs on CUDA, recorded per width. Inductor's compile workers are the
    trial's threads, so trials sharing a node do not each start one per core.

    Dynamo's in-memory caches are cleared first: they are kept per code object, and every step compiles the same
    one (`TrainStep.forward_loss`), so a second run in one process (tests, benchmarks) would count the first run's
    graphs against its bound. What is on disk stays: a run compiled before loads its graphs from the cache."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    use_cache()
    torch._inductor.config.compile_threads = max(1, torch.get_num_threads())
    mode, dynamic = compile_mode(step.runtime.device), dynamic_width(step.runtime)
    if not dynamic:
        return step.compiled(lambda loss: torch.compile(loss, dynamic=False, mode=mode))
    return step.compiled(lambda loss: with_dynamic_width(torch.compile(loss, dynamic=None, mode=mode)))


def graphs_built() -> int:
    """Graphs dynamo has built in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextmanager
def bounded_graphs(graphs: int) -> Iterator[None]:
    """Inside the block, a compiled function that needs more than `graphs` + 1 graphs raises (dynamo's default is to
    fall back to eager silently after 8); the error names the count and what to do. `graphs` is the run's batch
    shapes: a dynamic width needs one graph (two when the row count varies too), and a model that specializes the
    width one per shape, as a static compile does."""
    import torch._dynamo

    limit = graphs + 1
    try:
        with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
            yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise CompileError(
            f"compile: the step needed more than {limit} graphs where its batch shapes need {graphs} (the first line "
            f"of torch's reason: {str(err).splitlines()[0] if str(err) else type(err).__name__}); set compile: false"
        ) from None
