"""How long a step will take, before training: the plan's FLOPs at an achievable share of the device's peak, and its
kernel launches at the host's cost per launch.

A step costs its arithmetic (the plan's executed FLOPs, `MemoryPlan.step_flops`, at a share of the device's peak
for the precision) and its launches (`MemoryPlan.step_kernels` + `update_kernels`: the ops the fake step dispatches,
each one kernel launched by Python eagerly). On a GPU the host launches ahead of the device, so the step takes the
longer of the two; on a CPU the same cores do both, so it takes their sum. Compiled, the arithmetic runs at a higher
share (fused elementwise work) and fewer launches remain: on a GPU the step's graphs replay as CUDA graphs, one
launch per forward and per backward of each micro-batch plus the optimizer's; on a CPU Inductor fuses the
elementwise ops into a share of the kernels. Compiling costs one compile of the step (cold, warm from the cache or
from a blob: `pipelines.train.compile_cache` says which) plus a warm-up per batch shape.

Where each constant comes from (re-measure with `benchmarks/bench_compile.py` on a CPU, `bench_gpu_parts` on a card):
- GPU efficiencies: a Llama-shaped 1.1B on one H100, bf16, 8 x 1024 tokens (`../shared/gpu/H100-2026-11-25.md`,
  section 2): ours eager 30.4% MFU, ours `compile: true` (the forward compiled) 40.9%.
- GPU cost per launch: BERT-base, batch 32, bf16, on the same H100 (section 1): a step of 58 ms (551 samples/s) for
  about 2 ms of arithmetic, divided by the 1,437 ops our plan counts for that step (1,024 in forward and backward,
  413 in the update as the fake step runs it: the CPU's per-parameter clipping, where CUDA runs foreach kernels; the
  constant absorbs that difference). About 40 us per op: the host's Python and dispatch per op, not the launch alone.
- The graphed step: a forward and a backward graph per micro-batch, plus the update's ops, at the same cost per
  launch. BERT-base on the H200 (static widths) ran 10.9-15.8 ms against 16.8 ms predicted.
- CPU: the peak is measured on this host (fp32 matmuls, `local_peak_flops`: 197 GFLOP/s on the 2-core AMD EPYC
  with AVX-512, avx512_bf16 and no AMX, where the rest was fitted). Eager: 0.55 of that peak and 42 us per op, fitted
  to `bench_compile`'s medians (benchmarks/RESULTS.md, "compile on CPU"; MiniLM 1,468 ms a step, the default model
  18.9 ms). Compiled with a dynamic width (one graph for every padded width: `pipelines.train.compiled_step`), the
  step ran slower than eager on the same host: 1.02-1.10x of eager's time for MiniLM and 1.44x for the default
  model, loaded from the cache (RESULTS.md, issue 52), where one graph per static width had run at 0.84x and 0.96x.
  So the compiled arithmetic is priced at 0.52 of the peak and each op at 1.3 eager launches (symbolic sizes cost
  host work per kernel): on a CPU a compiled bucketed step is predicted no faster, and `compile: auto` stays off.
- Compile time (`CompileCost`): one compile of the step, cold, warm from this cache, or from a Mega-Cache blob alone,
  plus a warm-up per batch shape. CPU, fitted to `bench_compile` (issue 52, medians of two rounds, 6 widths): cold
  4.5 s + 129 ms per forward-and-backward op (32.4 s for the default model's 214 ops, 74.6 s for MiniLM's 541),
  warm 26 ms per op (5.4 s, 15.1 s), from a blob 0.66 of cold (25.7 s, 39.7 s: on a CPU the blob carries the
  kernels' C++ source, which is compiled again). GPU: the first GPU figures are the H200's
  (`../shared/gpu/H200-2026-11-26.md`), for one graph per static width: BERT-base cold 152.7 s for 6 widths
  (25.4 s a width for its ~1,024 ops: 24.8 ms an op), warm 15.3-20.3 s (about 3 s a width). One dynamic compile is
  priced at 1.3x a static width's (the CPU's ratio, 32.4 s against 25 s), warm at 3 s, and a recording per width at
  0.5 s; a blob there is priced as a warm compile (Triton's kernels travel compiled in it). The dynamic compile, the
  recordings and the blob have not run on a GPU yet: treat these as bounds until a GPU measures them.
"""

from __future__ import annotations

import functools
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelines.resolve.memory_plan import MemoryPlan
from pipelines.resolve.target import PlanTarget, as_target
from pipelines.runtime import cpu_bf16_speed
from pipelines.train.compile_decision import CompilePrediction
from pipelines.train.compiled_step import CACHE_DIR


@dataclass(frozen=True)
class SpeedModel:
    """A device's constants (see the module docstring for each one's source)."""

    efficiency_eager: float  # achieved share of the precision's peak FLOP/s, eager
    efficiency_compiled: float
    launch_s: float  # host time per eager kernel launch
    compiled_kernel_share: float  # ops left as launches once compiled without CUDA graphs (fusion)
    overlap: bool  # host launches overlap the device's work (a GPU), else they add up (a CPU)


GPU_SPEED = SpeedModel(efficiency_eager=0.304, efficiency_compiled=0.409, launch_s=58e-3 / 1437,
                       compiled_kernel_share=1.0, overlap=True)  # fmt: skip
CPU_SPEED = SpeedModel(efficiency_eager=0.55, efficiency_compiled=0.52, launch_s=42e-6,
                       compiled_kernel_share=1.3, overlap=False)  # fmt: skip


@dataclass(frozen=True)
class CompileCost:
    """A device kind's compile constants (see the module docstring for each one's source): one cold compile of the
    step costs `fixed_s` plus `per_op_s` per forward-and-backward op of a micro-batch; a warm one (its graphs loaded
    from this cache) `warm_s` plus `warm_per_op_s` per op; one from a Mega-Cache blob alone `blob_share` of a cold
    one; every batch shape then costs `per_shape_s` to warm (on CUDA: to record its graph)."""

    fixed_s: float
    per_op_s: float
    warm_s: float
    warm_per_op_s: float
    blob_share: float
    per_shape_s: float

    def seconds(self, ops: float) -> tuple[float, float, float]:
        """One compile of a step of `ops` ops: cold, warm from the cache, from a blob."""
        cold = self.fixed_s + self.per_op_s * ops
        warm = self.warm_s + self.warm_per_op_s * ops
        return cold, warm, max(warm, self.blob_share * cold)


CPU_COMPILE = CompileCost(fixed_s=4.5, per_op_s=0.129, warm_s=0.0, warm_per_op_s=0.026, blob_share=0.66,
                          per_shape_s=0.05)  # fmt: skip
GPU_COMPILE = CompileCost(fixed_s=0.0, per_op_s=0.0248 * 1.3, warm_s=3.0, warm_per_op_s=0.0, blob_share=0.0,
                          per_shape_s=0.5)  # fmt: skip


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds, eager and compiled, the compile time of its shapes, and rows per step."""

    eager_s: float
    compiled_s: float
    rows: int

    def samples_per_s(self, compiled: bool) -> float:
        """Rows per second at the predicted step time."""
        return self.rows / (self.compiled_s if compiled else self.eager_s)


@functools.lru_cache(maxsize=1)
def local_peak_flops() -> float:
    """This host's fp32 matmul FLOP/s: the best of 6 bursts of 1024 x 1024 products (about 0.3 s, once per process),
    and of every earlier measurement on this machine, kept under `.cache/torch/` (a burst can only be slowed by
    other work, never sped up: on the shared 2-core host one process measured 75 GFLOP/s and another 197)."""
    # Its own generator: drawing from torch's global one would shift every later draw of the trial (its dropout
    # masks), so a run's result would depend on whether its step time was predicted.
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=generator), torch.randn(1024, 1024, generator=generator)
    a @ b  # warm the kernel and its threads
    best = 0.0
    for _ in range(6):
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.05:
            a @ b
            reps += 1
        best = max(best, 2 * 1024**3 * reps / (time.perf_counter() - start))
    return _best_so_far(best)


def _best_so_far(measured: float) -> float:
    """The larger of `measured` and this machine's kept best (per CPU model and thread count), kept again."""
    key = f"{platform.machine()} {platform.processor() or 'cpu'} x{torch.get_num_threads()}"
    path = Path.cwd() / CACHE_DIR / "cpu_peak_flops.json"
    try:
        kept = json.loads(path.read_text()) if path.is_file() else {}
        best = max(measured, float(kept.get(key, 0.0)))
        if best > kept.get(key, 0.0):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**kept, key: best}, indent=1) + "\n")
        return best
    except (OSError, ValueError):  # a read-only or corrupt cache: this process's measurement alone
        return measured


def peak_flops(precision: str, target: PlanTarget, tf32: bool | str = "auto") -> float:
    """The precision's peak FLOP/s on the target: a card's data sheet, or this CPU's measured fp32 peak (bf16: times
    `pipelines.runtime.cpu_bf16_speed`; see pipelines.resolve.budget)."""
    if target.card is None:
        if precision == "fp32":
            return local_peak_flops()
        return local_peak_flops() * cpu_bf16_speed()
    tf32_on = tf32 is True or (tf32 == "auto" and precision != "fp32")  # runtime.resolve_tf32's rule
    return target.card.peak_flops(precision, tf32=tf32_on)


def predict_step(
    plan: MemoryPlan, precision: str, where: PlanTarget | torch.device, tf32: bool | str = "auto"
) -> StepTime:
    """The epoch's average optimizer step of `plan` on the target, eager and compiled (see the module docstring)."""
    target = as_target(where)
    speed = CPU_SPEED if target.card is None else GPU_SPEED
    peak = peak_flops(precision, target, tf32)
    launches = plan.step_kernels + plan.update_kernels
    if speed.overlap:  # CUDA graphs: one forward and one backward graph per micro-batch, the update eager
        graphed = 2 * plan.micro_batches + plan.update_kernels
    else:
        graphed = round(plan.step_kernels * speed.compiled_kernel_share) + plan.update_kernels

    flops = _average_step_flops(plan)

    def seconds(efficiency: float, kernels: int) -> float:
        compute, host = flops / (peak * efficiency), kernels * speed.launch_s
        return max(compute, host) if speed.overlap else compute + host

    return StepTime(seconds(speed.efficiency_eager, launches), seconds(speed.efficiency_compiled, graphed),
                    plan.batch_rows)  # fmt: skip


def arithmetic_floor_s(
    plan: MemoryPlan,
    precision: str,
    where: PlanTarget | torch.device,
    tf32: bool | str = "auto",
    compiled: bool = False,
) -> float:
    """The fewest seconds `plan`'s step could take in `precision`, eager or `compiled` (as `predict_step` prices it):
    its arithmetic alone at that efficiency (launches only add to it). FLOPs do not depend on the precision or the
    micro-batch, so one plan bounds the others."""
    target = as_target(where)
    speed = CPU_SPEED if target.card is None else GPU_SPEED
    efficiency = speed.efficiency_compiled if compiled else speed.efficiency_eager
    return _average_step_flops(plan) / (peak_flops(precision, target, tf32) * efficiency)


def _average_step_flops(plan: MemoryPlan) -> float:
    """The FLOPs of the epoch's average step: the plan's window is the longest, the average one computes the
    epoch's mean positions (launches do not scale)."""
    return plan.step_flops * (plan.mean_positions / plan.positions if plan.mean_positions and plan.positions else 1)


def compile_seconds(plan: MemoryPlan, target: PlanTarget) -> tuple[float, float, float, float]:
    """Predicted seconds to compile the step once (cold, warm from the cache, from a blob) and to warm each batch
    shape, on the target."""
    cost = CPU_COMPILE if target.card is None else GPU_COMPILE
    return *cost.seconds(plan.step_kernels / max(plan.micro_batches, 1)), cost.per_shape_s


def predict_compile(
    plan: MemoryPlan | None, precision: str, where: PlanTarget | torch.device, tf32: bool | str = "auto"
) -> tuple[StepTime, CompilePrediction] | None:
    """The step time and what compiling would save and cost (for `compile: auto`), or None without a plan; whether
    the compile is cold or warm is the run's to say (`CompilePrediction.found`, from the compile cache)."""
    if plan is None or plan.step_kernels == 0:
        return None
    step = predict_step(plan, precision, where, tf32)
    cold, warm, blob, per_shape = compile_seconds(plan, as_target(where))
    return step, CompilePrediction(step.eager_s, step.compiled_s, cold, warm, blob, per_shape)
