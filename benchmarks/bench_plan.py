"""The memory plan against the measured peak: all-MiniLM-L6-v2 on AG News across the strategy grid (CPU).

    python -m benchmarks.bench_plan [--rows N] [--json PATH]

For each strategy, `plan_memory` predicts the training peak on fake tensors (nothing allocated),
then `train_model` trains the same params on the same rows and measures it (the engine's
MemTracker probe of the first window, `peak_train_memory_bytes`). The first N rows of the
AG News train split (sorted into batches as training sorts them) are used by both; the
error is (predicted - measured) / measured. Optimizer state is compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_train import BASE, FIXED, prepare
from benchmarks.common import ag_news_params, require_assets, subset

LABELS = ["1", "2", "3", "4"]
LORA = {"adapter.type": "lora", "adapter.target_modules": ["query", "value"], "lr": 1e-3}
STRATEGIES: dict[str, dict[str, Any]] = {
    "vanilla": FIXED,
    "bucketing": {"data.bucketing": True},
    "bf16": {**FIXED, "precision": "bf16"},
    "grad_accum (8x4)": {**FIXED, "batch_size": 8, "grad_accum_steps": 4},
    "checkpointing": {**FIXED, "grad_checkpointing": True},
    "adafactor": {**FIXED, "optim": "adafactor"},
    "lora": {**FIXED, **LORA},
    "fast dropout": {**FIXED, "fast_dropout": True},
    "all combined": {
        "data.bucketing": True,
        "precision": "bf16",
        "batch_size": 8,
        "grad_accum_steps": 4,
        "grad_checkpointing": True,
        "optim": "adafactor",
    },
}


def run_one(name: str, data: Path, model_path: Path, rows: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from pipelines.adapters import apply_adapter
    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.model import build_model
    from pipelines.resolve.memory_plan import plan_memory
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model

    params = ag_news_params(model_path, **{**BASE, **STRATEGIES[name]})
    torch.set_num_threads(2)
    task = get_task("classification")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train = subset(TokenizedSplit.load(data / "train"), rows)

    def build() -> torch.nn.Module:
        return build_model(params.model, LABELS, len(tokenizer), 128, Path.cwd())

    def adapt(model: torch.nn.Module) -> torch.nn.Module:
        return apply_adapter(model, params.adapter, task, params)

    start = time.perf_counter()
    plan = plan_memory(params, task, train, build, adapt, tokenizer.pad_token_id, params.precision)
    plan_s = time.perf_counter() - start
    torch.manual_seed(params.seed)
    model = adapt(build())
    m = train_model(TrainRequest(model, train, None, params, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"),
                    precision=params.precision, say=lambda _: None, task=task)).metrics  # fmt: skip
    return {
        "predicted_peak_mb": plan.peak / 2**20,
        "measured_peak_mb": m["peak_train_memory_bytes"] / 2**20,
        "error": plan.peak / m["peak_train_memory_bytes"] - 1,
        "predicted_activations_mb": plan.activations / 2**20,
        "measured_activations_mb": m["peak_activation_bytes"] / 2**20,
        "predicted_optimizer_state": plan.optimizer_state,
        "measured_optimizer_state": int(m["optimizer_state_bytes"]),
        "batch": f"{plan.batch_rows} x {plan.batch_width}",
        "plan_s": plan_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("bench_plan_results.json"))
    args = parser.parse_args()
    model_path = require_assets()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepare(model_path, Path(tmp))
        for name in STRATEGIES:
            results[name] = run_one(name, Path(tmp), model_path, args.rows)
            print(f"done: {name} {results[name]}", file=sys.stderr, flush=True)
    print("| Strategy | Batch | Predicted peak | Measured peak | Error | Activations (pred / meas) | Optimizer state "
          "(pred / meas, bytes) | Plan time |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        same = "exact" if r["predicted_optimizer_state"] == r["measured_optimizer_state"] else "DIFFERS"
        print(
            f"| {name} | {r['batch']} | {r['predicted_peak_mb']:.1f} MB | {r['measured_peak_mb']:.1f} MB "
            f"| {100 * r['error']:+.1f}% | {r['predicted_activations_mb']:.1f} / {r['measured_activations_mb']:.1f} MB "
            f"| {r['predicted_optimizer_state']:,} / {r['measured_optimizer_state']:,} ({same}) | {r['plan_s']:.1f} s |"
        )
    record = {"command": " ".join(["python -m benchmarks.bench_plan", *sys.argv[1:]]), "results": results}
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nfigures: {args.json}")


if __name__ == "__main__":
    main()
