"""A compiled run's warm-up before its clocks start: the step compiled and run once on a batch of each shape, the
compile cache consulted first (a blob loaded where this cache has not compiled the run's fingerprint) and updated
after (manifest entry and blob), and what the compile found logged: Dynamo and Inductor cache hits and misses, and
CUDA-graph skips. Where the run accumulates gradients, the accumulation path is warmed too (`warm_accumulation`).
What compiles after the warm-up is counted by `CompileEvents` (torch's own counters): the trainer reports the
recompiles and CUDA-graph skips of its timed steps (`timed_recompiles`, `timed_cudagraph_skips`).

The optimizer's fresh state exists before the step is warmed, so on CUDA the graphs are recorded with it alive: a
CUDA graph's replay never calls the allocator, so the recording is the only moment the allocator sees the step's
activations and gradients, and the peak it reads there must hold the state too (weights + gradients + state + the
graphs' pools). Without that, the state was first made in step 0's update, after the recording, and the trial's
peak missed it: about 8 bytes a parameter under AdamW (`../shared/gpu/H200-2026-11-26.md`). The trainer makes the
state before its CUDA peak's window opens (`Trainer.start`), so the zeroed gradients that making it allocates for a
moment are not what the peak reads: the recording is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pipelines.train.compile_cache import CompileCache, cache_counters, device_name, graph_shapes
from pipelines.train.compiled_step import compile_step, shape_of, use_cache
from pipelines.train.optim import create_fresh_state
from pipelines.train.step import Batch, TrainStep


@dataclass(frozen=True)
class CompileEvents:
    """Torch's counts, process-wide, of Dynamo graphs built (a recompile builds one) and of Inductor's CUDA-graph skips
    (a compiled graph, or a call of it, run without CUDA graphs: at compile for its ops or inputs, at a call for a
    mutated input or too many re-recordings), read now; `since` gives what happened in between."""

    graphs: int
    cudagraph_skips: int

    @staticmethod
    def now() -> CompileEvents:
        """The counters as they are."""
        from torch._dynamo.utils import counters

        return CompileEvents(int(counters["stats"]["unique_graphs"]), int(counters["inductor"]["cudagraph_skips"]))

    def since(self, before: CompileEvents) -> CompileEvents:
        """What was counted between `before` and these counts."""
        return CompileEvents(self.graphs - before.graphs, self.cudagraph_skips - before.cudagraph_skips)


@dataclass
class Warmed:
    """What compiling and warming measured: metrics for the run and notes (tags)."""

    metrics: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def state_before_recording(step: TrainStep) -> bool:
    """Make the optimizer's fresh state now, unless it exists (restored from a checkpoint); False where it cannot be
    made ahead (an optimizer whose fresh state is not zeros: it is then made in step 0, after the recording)."""
    if step.optimizer.state:
        return True
    return create_fresh_state(step.model, step.optimizer)


def compile_and_warm(
    step: TrainStep, batches: list[Batch], units: list[float], say: Callable[[str], None], micro_batches: int = 1
) -> tuple[TrainStep, Warmed]:
    """The step compiled and warmed on one batch of each shape (the caller times this), and on windows of
    `micro_batches` where the run accumulates; and what it found."""
    cache, key = CompileCache(use_cache()), step.runtime.compile_key
    warmed = Warmed()
    warmed.notes["compile.state_before_recording"] = str(state_before_recording(step)).lower()
    loaded = key is not None and cache.load_blob(key)
    compiled = compile_step(step)
    before, events, start = cache_counters(), CompileEvents.now(), time.perf_counter()
    warm(compiled, batches, units)
    if micro_batches > 1:
        warm_accumulation(compiled, batches, units)
    seconds, after, found = time.perf_counter() - start, cache_counters(), CompileEvents.now().since(events)
    warmed.metrics = {
        "compile_graphs": float(found.graphs),
        "compile_cudagraph_skips": float(found.cudagraph_skips),
        "compile_shapes": float(len(batches)),
        "compile_cache_hits": float(after["hits"] - before["hits"]),
        "compile_cache_misses": float(after["misses"] - before["misses"]),
        "compile_blob_loaded": float(loaded),
    }
    if key is not None:
        entry = {"compile_time_s": round(seconds, 2), "shapes": len(batches), "torch": torch.__version__,
                 "device": device_name(step.runtime.device), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "graphs": found.graphs,  # over the shapes compiled: one graph for all, or one per width (`one_graph`)
                 "compiled": graph_shapes(map(shape_of, batches), dynamic_width=False)}  # fmt: skip
        blob = cache.record(key, entry, {name: after[name] - before[name] for name in after})  # what the compile found
        warmed.notes["compile.fingerprint"] = key
        if blob is not None:
            warmed.notes["compile.blob"] = str(blob)
    m = warmed.metrics
    skips = f"; {found.cudagraph_skips} CUDA-graph skips (run without CUDA graphs)" if found.cudagraph_skips else ""
    say(f"compile: {len(batches)} batch shapes warmed with {int(m['compile_graphs'])} graphs in {seconds:.1f} s; "
        f"cache {int(m['compile_cache_hits'])} hits, {int(m['compile_cache_misses'])} misses"
        f"{', from a blob' if loaded else ''}; widths {step.runtime.padding}{skips}")  # fmt: skip
    return compiled, warmed


def warm(step: TrainStep, batches: list[Batch], units: list[float]) -> None:
    """Compile (and on CUDA record) the step for each batch's shape: forward and backward, twice (cudagraph trees
    record on a shape's second call), then the gradients are dropped; no weight or optimizer state changes."""
    runs = 2 if step.runtime.device.type == "cuda" else 1
    for batch, unit in zip(batches, units, strict=True):
        for _ in range(runs):
            step.backward(batch, unit)
            step.optimizer.zero_grad(set_to_none=True)


def warm_accumulation(step: TrainStep, batches: list[Batch], units: list[float]) -> None:
    """Warm each shape as an accumulation window runs it: two micro-batches into the same gradients (the step's own
    `.grad` buffers, `pipelines.train.step.stable_gradients`), twice on CUDA, so a CUDA graph the window's path needs
    beyond a lone micro-batch's is recorded here, not in a timed step; no weight or optimizer state changes."""
    runs = 2 if step.runtime.device.type == "cuda" else 1
    for batch, unit in zip(batches, units, strict=True):
        for _ in range(runs):
            step.accumulate([batch, batch], 2 * unit)
            step.optimizer.zero_grad(set_to_none=True)


def row_units(rows: list[int], units: np.ndarray | None) -> float:
    """A batch's loss units (rows when None): what its warm-up loss is divided by (any positive number would do)."""
    return float(len(rows) if units is None else units[rows].sum()) or 1.0
