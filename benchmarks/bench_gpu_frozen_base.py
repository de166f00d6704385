"""Issue 46 on a GPU: LoRA on a Llama-shaped 1.1B with its frozen base stored in bf16 (now) against the fp32 base
(before), side by side, round-robin: the allocator's peak against the plan's, tokens/s and the loss.

    python -m benchmarks.bench_gpu_frozen_base [--rounds 2] [--json P]     # on the GPU machine
    python -m benchmarks.bench_gpu_frozen_base --smoke                     # any machine: tiny model, CPU

The model and rows are `bench_gpu_parts --part llama`'s (2048 x 16 layers, GQA 32/8, 32,000 words, random
weights; 8 x 1024 random tokens a step, 21 steps); LoRA r 16 on the default target modules, bf16 autocast, AdamW.
"fp32 base" turns `store_frozen_weights` off for the plan and the trial alike (the engine as it was before issue
46); everything else is the trial's own code path (`benchmarks.bench_gpu.run_ours`: planned, then trained).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_gpu import DATA, params_for, run_ours
from benchmarks.bench_gpu_parts import Bench
from pipelines.train import memory_levers

BASES = ("fp32 base", "bf16 base")


@contextmanager
def frozen_weights_kept_in_fp32(on: bool) -> Iterator[None]:
    """While `on`, the frozen base stays fp32 in the plan and in the trial (the behaviour before issue 46)."""
    original = memory_levers.store_frozen_weights
    if on:
        memory_levers.store_frozen_weights = lambda model, params, precision: 0
    try:
        yield
    finally:
        memory_levers.store_frozen_weights = original


def run_base(bench: Bench, base: str) -> dict[str, Any]:
    """One trial of LoRA on the 1.1B, its base as `base` says; the trial's own figures."""
    overrides = {**bench.base, "adapter.type": "lora", "adapter.r": 16, "lr": 1e-4, "compile": False}
    params = params_for(overrides, bench.device, bench.smoke)
    with frozen_weights_kept_in_fp32(base == "fp32 base"):
        return run_ours(params, bench.make, bench.train, None, bench.meta, bench.device, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU (checks the script runs)")
    args = parser.parse_args()
    bench = Bench("llama", DATA, args.smoke)
    runs: dict[str, list[dict[str, Any]]] = {base: [] for base in BASES}
    for _ in range(args.rounds):
        for base in BASES:  # round-robin: each round runs both, in the same order
            runs[base].append(run_base(bench, base))
    device = torch.cuda.get_device_name() if bench.device.type == "cuda" else "cpu"
    keys = ("peak_allocated_mb", "planned_peak_mb", "tokens_per_s", "final_train_loss")
    table = {base: {k: statistics.median(r[k] for r in rs) for k in keys} for base, rs in runs.items()}
    print(f"bench_gpu_frozen_base on {device}, {args.rounds} rounds (medians)")
    print("| base | peak allocated MiB | planned MiB | plan/measured | tokens/s | final loss |")
    print("|---|---|---|---|---|---|")
    for base, t in table.items():
        ratio = t["planned_peak_mb"] / t["peak_allocated_mb"]
        print(f"| {base} | {t['peak_allocated_mb']:,.1f} | {t['planned_peak_mb']:,.1f} | {ratio:.3f} | "
              f"{t['tokens_per_s']:,.0f} | {t['final_train_loss']:.4f} |")  # fmt: skip
    fp32, bf16 = table["fp32 base"], table["bf16 base"]
    print(f"bf16 base / fp32 base: peak {bf16['peak_allocated_mb'] / fp32['peak_allocated_mb']:.2f}x, "
          f"tokens/s {bf16['tokens_per_s'] / fp32['tokens_per_s']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": device, "rounds": runs, "medians": table}, indent=1))


if __name__ == "__main__":
    main()
