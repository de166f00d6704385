"""How long a step will take, before training: the plan's FLOPs at an achievable share of the device's peak, and its
kernel launches at the host's cost per launch.

A step costs its arithmetic (the plan's executed FLOPs, `MemoryPlan.step_flops`, at a share of the device's peak
for the precision) and its launches (`MemoryPlan.step_kernels` + `update_kernels`: the ops the fake step dispatches,
each one kernel launched by Python eagerly). On a GPU the host launches ahead of the device, so the step takes the
longer of the two; on a CPU the same cores do both, so it takes their sum. Compiled, the arithmetic runs at a higher
share (fused elementwise work) and fewer launches remain: on a GPU the step's graphs replay as CUDA graphs, one
launch per forward and per backward of each micro-batch plus the optimizer's; on a CPU Inductor fuses the
elementwise ops into a share of the kernels. Compiling costs a fixed time per batch shape plus a time per op traced.

Where each constant comes from (re-measure with `benchmarks/bench_compile.py` on a CPU, `bench_gpu_parts` on a card):
- GPU efficiencies: a Llama-shaped 1.1B on one H100, bf16, 8 x 1024 tokens (`../shared/gpu/H100-2026-11-25.md`,
  section 2): ours eager 30.4% MFU, ours `compile: true` (the forward compiled) 40.9%.
- GPU cost per launch: BERT-base, batch 32, bf16, on the same H100 (section 1): a step of 58 ms (551 samples/s) for
  about 2 ms of arithmetic, divided by the 1,437 ops our plan counts for that step (1,024 in forward and backward,
  413 in the update as the fake step runs it: the CPU's per-parameter clipping, where CUDA runs foreach kernels; the
  constant absorbs that difference). About 40 us per op: the host's Python and dispatch per op, not the launch alone.
- The graphed step: not measured yet (no GPU has run the whole-step compile): a forward and a backward graph per
  micro-batch, plus the update's ops, at the same cost per launch. Until a GPU measures it, treat it as a bound.
- CPU: the peak is measured on this host (fp32 matmuls, `local_peak_flops`: 197 GFLOP/s on the 2-core AMD EPYC
  with AVX-512, avx512_bf16 and no AMX, where the rest was fitted). Fitted there to `bench_compile`'s medians of
  two rounds (benchmarks/RESULTS.md, "compile on CPU"): eager, 0.55 of that peak and 42 us per op (MiniLM 1,468 ms
  a step, the default model 18.9 ms); compiled and loaded from the cache, MiniLM's steps took 0.84x of eager's time
  (p50 step 0.91x) and the default model's 0.96x, so the compiled arithmetic runs at 0.61 of the peak and 95% of
  the ops remain. Another CPU's peak is its own; its per-op cost is assumed alike.
- Compile time per shape: 9.2 s plus 74 ms per forward-and-backward op, fitted to the same runs uncached (25 s a
  shape for the default model's 214 ops, 49 s for MiniLM's 538); assumed the same on a GPU host until measured
  there. From the cache, a shape took 3-7 s.
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
from pipelines.runtime import EMULATED_BF16_SLOWDOWN, cpu_has_fast_bf16
from pipelines.train.compiled_step import CACHE_DIR, CompilePrediction


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
CPU_SPEED = SpeedModel(efficiency_eager=0.55, efficiency_compiled=0.61, launch_s=42e-6,
                       compiled_kernel_share=0.95, overlap=False)  # fmt: skip
COMPILE_S_PER_SHAPE, COMPILE_S_PER_OP = 9.2, 0.074  # CPU, uncached: see the module docstring


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
    """The precision's peak FLOP/s on the target: a card's data sheet, or this CPU's measured fp32 peak (bf16: 2x
    where it is native, 1/17 where it is emulated; see pipelines.resolve.budget)."""
    if target.card is None:
        if precision == "fp32":
            return local_peak_flops()
        return local_peak_flops() * (2.0 if cpu_has_fast_bf16() else 1.0 / EMULATED_BF16_SLOWDOWN)
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


def compile_seconds(plan: MemoryPlan, shapes: int) -> float:
    """Predicted time to compile the step for `shapes` batch shapes (uncached)."""
    per_micro_batch = plan.step_kernels / max(plan.micro_batches, 1)
    return shapes * (COMPILE_S_PER_SHAPE + COMPILE_S_PER_OP * per_micro_batch)


def predict_compile(
    plan: MemoryPlan | None, precision: str, where: PlanTarget | torch.device, tf32: bool | str = "auto"
) -> tuple[StepTime, CompilePrediction] | None:
    """The step time and what compiling would save and cost (for `compile: auto`), or None without a plan; the
    compile cost is per shape (multiplied by the run's shapes where they are known: `CompilePrediction` takes one)."""
    if plan is None or plan.step_kernels == 0:
        return None
    step = predict_step(plan, precision, where, tf32)
    return step, CompilePrediction(step.eager_s, step.compiled_s, compile_seconds(plan, 1))
