"""bench_gpu's table: each configuration's figures as a % of its baseline, with its plan beside the measured peak."""

from __future__ import annotations

from typing import Any

import numpy as np

HF_LIKE_FOR_LIKE = "bucketing+bf16"  # the configuration the Trainer is run like for like with


def planned(r: dict[str, float]) -> str:
    """The plan's peak and its ratio to the measured one ('–' where there is none, e.g. the Trainer)."""
    plan = r.get("planned_peak_mb", float("nan"))
    if not np.isfinite(plan):
        return "–"
    return f"{plan:.0f} MB ({plan / r['peak_allocated_mb']:.2f}x)"


def markdown(report: dict[str, Any]) -> str:
    """The figures as a table, each as a % of its baseline (vanilla fp32; llama bf16 for packing)."""
    results = report["results"]
    lines = [
        f"Device: {report['device']}, torch {report['torch']}, transformers {report.get('transformers')}; "
        f"{report['train_rows']} AG News train rows for BERT, {report.get('causal_train_rows')} for the Llama, "
        "1 epoch; "
        f"device memory outside torch's allocator (CUDA context, libraries): {report.get('outside_allocator_mb')} MB.",
        "",
        "| Configuration | Samples/s | Tokens/s | Peak allocated | Planned (plan / measured) | Peak reserved "
        "| Model TFLOP/s | MFU | Test accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        base = results.get("llama bf16" if name.startswith("llama") else "vanilla fp32", r)

        def rel(key: str, r: dict[str, float] = r, base: dict[str, float] = base) -> str:
            share = 100 * r[key] / base[key] if base.get(key) else float("nan")
            return f" ({share:.0f}%)" if base is not r and np.isfinite(share) else ""

        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "–"
        tflops = f"{r['model_tflops_per_s']:.1f}" if "model_tflops_per_s" in r else "–"
        accuracy = f"{100 * r['accuracy']:.1f}%" if "accuracy" in r else "–"
        lines.append(
            f"| {name} | {r['samples_per_s']:.0f}{rel('samples_per_s')} | {r['tokens_per_s']:.0f}{rel('tokens_per_s')} "
            f"| {r['peak_allocated_mb']:.0f} MB{rel('peak_allocated_mb')} | {planned(r)} "
            f"| {r['peak_reserved_mb']:.0f} MB{rel('peak_reserved_mb')} | {tflops} | {mfu} | {accuracy} |"
        )
    for name, reason in report["skipped"].items():
        lines.append(f"| {name} | not run: {reason} | | | | | | | |")
    if "HF Trainer bf16" in results and HF_LIKE_FOR_LIKE in results:
        ours, theirs = results[HF_LIKE_FOR_LIKE], results["HF Trainer bf16"]
        lines += [
            "",
            f"Ours ({HF_LIKE_FOR_LIKE}) vs the HF Trainer (bf16, group_by_length), like for like: "
            f"{ours['samples_per_s'] / theirs['samples_per_s']:.2f}x the samples/s, "
            f"{ours['peak_allocated_mb'] / theirs['peak_allocated_mb']:.2f}x the peak allocated memory.",
        ]
    if "all combined" in results and "vanilla fp32" in results:
        combined, vanilla = results["all combined"], results["vanilla fp32"]
        lines.append(
            f"All combined vs vanilla: {vanilla['samples_per_s'] / combined['samples_per_s']:.2f}x the time per "
            f"sample, {combined['peak_allocated_mb'] / vanilla['peak_allocated_mb']:.2f}x the peak memory."
        )
    return "\n".join(lines) + "\n"
