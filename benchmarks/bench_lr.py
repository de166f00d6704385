"""`lr: auto` against a grid of fixed rates, on the default pipeline (params.yaml, generated data, CPU).

    python -m benchmarks.bench_lr [--json PATH]
    python -m benchmarks.bench_lr --smoke [--json PATH]   # a few rows, one epoch: that it runs, not a figure

Tokenizes as the tokenize stage does, then trains the default model once per rate of the grid
{1e-4, 3e-4, 1e-3, 3e-3, 1e-2} and once with `lr: auto` (the range test picks the rate, then
trains with it), all from the same initialization and batches, and scores each on the test
split with its 95% Wilson interval. `lr: auto` passes when its accuracy lies within the best
grid rate's interval. The sweep's own time is printed beside a training's.
`--smoke`: every rate and rule on 200 generated rows, one epoch, a 10-step sweep; no JSON unless `--json` names one.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

GRID = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
RULES = ("min_divided", "valley", "steepest")
# A smoke run's corpus, epochs and sweep: a few batches and a short range test (its schema's fewest steps are 5).
SMOKE: dict[str, Any] = {"data.generator.num_rows": 200, "epochs": 1, "lr_range_test.num_steps": 10}


def run_one(
    lr: float | str, tokenized: Path, root: Path, rule: str | None = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train the default model once at `lr` (a rate, or "auto" with the range test's `rule`) and score it on test
    (`extra`: further dotted overrides, a smoke run's)."""
    from transformers import AutoTokenizer

    from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
    from pipelines.params import apply_overrides, load_params
    from pipelines.resolve.lr_range import resolve_lr
    from pipelines.runtime import resolve_runtime
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model

    overrides: dict[str, Any] = {**(extra or {}), "lr": lr, "device": "cpu"}
    if rule is not None:
        overrides["lr_range_test.rule"] = rule
    params = apply_overrides(load_params(root / "params.yaml"), overrides)
    torch.set_num_threads(2)
    torch.manual_seed(params.seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    task = get_task(params.task)
    model = task.build_model(params, tokenizer, tokenized, root)
    train = TokenizedSplit.load(tokenized / "train")
    start = time.perf_counter()
    params, sweep = resolve_lr(
        params, model, train, resolve_runtime(params, torch.device("cpu"), tokenizer.pad_token_id, "fp32"), task
    )
    sweep_s = time.perf_counter() - start
    result = train_model(TrainRequest(
        model, train, TokenizedSplit.load(tokenized / "validation"), params,
        pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), precision="fp32", task=task,
    ))  # fmt: skip
    test = TokenizedSplit.load(tokenized / "test")
    metrics = task.evaluate(
        model,
        tokenizer,
        test,
        tokenized,
        params,
        resolve_runtime(params, torch.device("cpu"), tokenizer.pad_token_id, "fp32"),
    ).metrics
    return {
        "lr": params.lr,
        "auto": sweep is not None,
        "rule": params.lr_range_test.rule if sweep is not None else None,
        "sweep_s": sweep_s if sweep is not None else 0.0,
        "sweep_steps": len(sweep.lrs) if sweep is not None else 0,
        "train_time_s": result.metrics["train_time_s"],
        "accuracy": metrics["test_accuracy"],
        "low": metrics["test_accuracy_ci_low"],
        "high": metrics["test_accuracy_ci_high"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="where the rows go (default: bench_lr_results.json)")
    parser.add_argument("--smoke", action="store_true", help="200 rows, one epoch: proves it runs")
    args = parser.parse_args()
    from pipelines.params import apply_overrides, load_params
    from pipelines.prepare import prepare_dataset

    root = Path(__file__).resolve().parents[1]
    extra = SMOKE if args.smoke else {}
    params = apply_overrides(load_params(root / "params.yaml"), extra)
    with tempfile.TemporaryDirectory() as tmp:
        tokenized = Path(tmp) / "tokenized"
        prepare_dataset(params, root, tokenized)
        others = [rule for rule in RULES if rule != params.lr_range_test.rule]
        rows = [run_one(lr, tokenized, root, extra=extra) for lr in [*GRID, "auto"]]
        rows += [run_one("auto", tokenized, root, rule, extra) for rule in others]
    inside = report(rows)
    if args.smoke:
        print("\nsmoke run (200 rows, one epoch, a 10-step sweep): not a measurement, nothing to record")
    # A smoke run writes only where --json says: its rows must not replace the recorded ones.
    out = args.json or (None if args.smoke else Path(__file__).with_name("bench_lr_results.json"))
    if out is not None:
        out.write_text(json.dumps({"rows": rows, "auto_within_best_interval": inside}, indent=1) + "\n")


def report(rows: list[dict[str, Any]]) -> bool:
    """Print the table and the verdict; whether `lr: auto` (the default rule) lies within the best rate's interval."""
    best = max((r for r in rows if not r["auto"]), key=lambda r: r["accuracy"])
    auto = rows[len(GRID)]  # the default rule's
    print("| lr | Test accuracy (95% CI) | Train time | LR sweep |")
    print("|---|---|---|---|")
    for r in rows:
        name = f"auto ({r['rule']}) -> {r['lr']:.3g}" if r["auto"] else f"{r['lr']:g}"
        sweep = f"{r['sweep_s']:.1f} s ({r['sweep_steps']} steps)" if r["auto"] else ""
        print(
            f"| {name} | {100 * r['accuracy']:.1f}% ({100 * r['low']:.1f}-{100 * r['high']:.1f}) "
            f"| {r['train_time_s']:.1f} s | {sweep} |"
        )
    inside = best["low"] <= auto["accuracy"] <= best["high"]
    print(
        f"\nbest grid rate {best['lr']:g}: {100 * best['accuracy']:.1f}%; "
        f"lr: auto ({auto['rule']}, the default) chose {auto['lr']:.3g}: "
        f"{100 * auto['accuracy']:.1f}%, {'within' if inside else 'OUTSIDE'} the best one's interval; "
        f"the sweep cost {auto['sweep_s'] / auto['train_time_s']:.0%} of a training's time"
    )
    return inside


if __name__ == "__main__":
    main()
