"""Packing on and off: SmolLM2-135M-Instruct, LoRA + bf16, AG News topic instructions (CPU).

    python -m benchmarks.bench_packing [--train-rows N] [--test-rows M] [--json PATH]
    python -m benchmarks.bench_packing --smoke [--json PATH]   # a few rows, one round: that it runs, not a figure

The rows are bench_instruct's (AG News articles phrased as "Classify the topic ..." with a
one-word answer, 53-196 tokens, median 83), tokenized once at data.max_length 256 so that no
configuration truncates differently. Every configuration trains in its own process on the
same rows, seed and schedule (LoRA r=16 on q/k/v/o, bf16 autocast, one epoch) and is scored
by the same greedy generation on the same test rows:

- fixed padding: every row padded to 256 (the baseline);
- bucketing: length-grouped batches padded to their longest row;
- packing, 8 packs/step: rows packed up to 256 tokens (best-fit decreasing), 8 packs per
  batch as TRL counts them: about 2.9 examples per pack, so fewer, larger optimizer steps;
- packing, 3 packs/step: about as many examples per step as the unpacked runs' 8.

Padding is each run's own measurement (`padding_fraction`: padded share of the batch
tensors over the timed steps); tokens/s counts real tokens only; "steps" is `train_time_s`
(optimizer steps after the first), "wall" the whole `train_model` call.

`--smoke`: every configuration and table line on 12 made-up rows (bench_instruct's smoke rows, 40-71 tokens) at
max_length 128, 2 rows or packs per step (3 for "3 packs/step"), 2 test rows; writes no figures unless `--json`
says where.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_instruct import (
    LORA,
    PLAIN,
    SMOKE,
    instruction_rows,
    params_for,
    require_assets,
    save_plain_model,
    smoke_threads,
)
from benchmarks.common import REPO_ROOT
from pipelines.params import Params
from pipelines.runtime import resolve_runtime

MAX_LENGTH = 256
COMMON: dict[str, Any] = {**LORA, "precision": "bf16", "data.max_length": MAX_LENGTH}
CONFIGS: dict[str, dict[str, Any]] = {
    "fixed padding": {"data.bucketing": False},
    "bucketing": {"data.bucketing": True},
    "packing, 8 packs/step": {"data.bucketing": True, "data.packing": True},
    "packing, 3 packs/step": {"data.bucketing": True, "data.packing": True, "batch_size": 3},
}
# A smoke run: enough made-up rows (40-71 tokens) for two steps of every configuration at bench_instruct's smoke
# batch, 2 or 3 rows to a pack; max_length 128, so fixed padding pads these short rows to 128, not 256.
SMOKE_TRAIN_ROWS, SMOKE_TEST_ROWS = 12, 2
SMOKE_OVERRIDES: dict[str, Any] = {**SMOKE, "data.max_length": 128}


def bench_params(folder: Path, source: Path, smoke: bool, **overrides: Any) -> Params:
    """bench_instruct's params with LoRA, bf16 and max_length 256 (a smoke run's sizes), then `overrides`."""
    return params_for(folder, source, **{**COMMON, **(SMOKE_OVERRIDES if smoke else {}), **overrides})


def prepare(folder: Path, out: Path, train_rows: int, test_rows: int, smoke: bool) -> dict[str, Any]:
    """The rows as a train/validation/test folder, tokenized as the tokenize stage does (at max_length 256)."""
    from pipelines.prepare import prepare_dataset

    rows = instruction_rows(smoke)
    source = out / "source"
    source.mkdir(parents=True)
    rows.iloc[:train_rows].to_csv(source / "train.csv", index=False)
    rows.iloc[train_rows : train_rows + 16].to_csv(source / "validation.csv", index=False)
    rows.iloc[train_rows + 16 : train_rows + 16 + test_rows].to_csv(source / "test.csv", index=False)
    stats = prepare_dataset(bench_params(folder, source, smoke), Path.cwd(), out / "tokenized")
    if smoke:
        save_plain_model(folder, out)  # SmolLM2 read from its GGUF file once, not once per configuration
    return stats


def run_one(name: str, work: Path, folder: Path, seed: int, smoke: bool) -> dict[str, Any]:
    """One configuration trained and scored in this process; its figures."""
    from transformers import AutoTokenizer

    from pipelines.adapters import apply_adapter
    from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
    from pipelines.recipe import seed_everything
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model

    folder = work / PLAIN if smoke else folder
    params = bench_params(folder, work / "source", smoke, seed=seed, **CONFIGS[name])
    torch.set_num_threads(smoke_threads(smoke))
    seed_everything(params.seed)
    task = get_task("causal_lm")
    tokenized = work / "tokenized"
    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    model = apply_adapter(task.build_model(params, tokenizer, tokenized, REPO_ROOT), params.adapter, task)
    train = TokenizedSplit.load(tokenized / "train")
    rows = task.training_split(train, params, model)
    start = time.perf_counter()
    trained = train_model(
        TrainRequest(
            model,
            rows,
            None,
            params,
            pad_id=tokenizer.pad_token_id,
            device=torch.device("cpu"),
            precision=params.precision,
            say=lambda _: None,
            task=task,
        )
    )
    wall = time.perf_counter() - start
    m = trained.metrics
    test = TokenizedSplit.load(tokenized / "test")
    scored = task.evaluate(
        model, tokenizer, test, tokenized, params, resolve_runtime(params, torch.device("cpu"), tokenizer.pad_token_id)
    )
    return {
        "rows_per_epoch": len(rows),
        "examples": len(train),
        "optimizer_steps": m["optimizer_steps"],
        "train_time_s": m["train_time_s"],
        "wall_time_s": wall,
        "samples_per_s": m["samples_per_s"],
        "tokens_per_s": m["tokens_per_s"],
        "padding_fraction": m["padding_fraction"],
        "peak_train_memory_mb": m["peak_train_memory_bytes"] / 2**20,
        "activations_mb": m["peak_activation_bytes"] / 2**20,
        "final_train_loss": m["final_train_loss"],
        **{k: scored.metrics[k] for k in ("test_exact_match", "test_exact_match_ci_low", "test_exact_match_ci_high")},
    }


def run_in_subprocess(name: str, work: Path, seed: int, smoke: bool) -> dict[str, Any]:
    """One configuration in a process of its own (so none inherits another's memory or threads); its figures."""
    cmd = [sys.executable, "-m", "benchmarks.bench_packing", "--only", name, "--work", str(work), "--seed", str(seed)]
    cmd += ["--smoke"] if smoke else []
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    print(f"done: {name} {result}", file=sys.stderr, flush=True)
    return result


def pct(value: float, base: float) -> str:
    """`value` as % of `base`."""
    return f"{100 * value / base:.0f}%"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One line per configuration, as % of fixed padding; then packing (3 packs/step) against bucketing."""
    base = results["fixed padding"]
    print(
        "| Configuration | Rows/epoch | Optimizer steps | Padding | Tokens/s | Train time (steps) | Wall (train call) "
        "| Peak train memory | Exact match [95% CI] |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        low, high = 100 * r["test_exact_match_ci_low"], 100 * r["test_exact_match_ci_high"]
        cells = [
            f"{r['rows_per_epoch']} ({r['examples'] / r['rows_per_epoch']:.2f} examples/row)",
            f"{r['optimizer_steps']:.0f}",
            f"{100 * r['padding_fraction']:.1f}%",
            f"{r['tokens_per_s']:.0f} ({pct(r['tokens_per_s'], base['tokens_per_s'])})",
            f"{r['train_time_s']:.1f} s ({pct(r['train_time_s'], base['train_time_s'])})",
            f"{r['wall_time_s']:.1f} s ({pct(r['wall_time_s'], base['wall_time_s'])})",
            f"{r['peak_train_memory_mb']:.0f} MB ({pct(r['peak_train_memory_mb'], base['peak_train_memory_mb'])})",
            f"{100 * r['test_exact_match']:.1f} [{low:.1f}, {high:.1f}]",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    packed, bucketed = results["packing, 3 packs/step"], results["bucketing"]
    print(
        f"\npacking (3 packs/step) vs bucketing: tokens/s {packed['tokens_per_s'] / bucketed['tokens_per_s']:.2f}x, "
        f"train time {packed['train_time_s'] / bucketed['train_time_s']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=512)
    parser.add_argument("--test-rows", type=int, default=200)
    parser.add_argument("--json", type=Path, help="the figures (default: bench_packing_results.json; smoke: none)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--smoke", action="store_true", help="every configuration on a few rows: proves it runs")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # One configuration's run (--only) reads the rows its parent prepared; a smoke run makes its rows up.
    folder = require_assets(ag_news=not (args.smoke or args.only))
    if args.only:
        print("RESULT " + json.dumps(run_one(args.only, args.work, folder, args.seed, args.smoke)))
        return
    if args.smoke:
        args.train_rows, args.test_rows = SMOKE_TRAIN_ROWS, SMOKE_TEST_ROWS
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stats = prepare(folder, Path(tmp), args.train_rows, args.test_rows, args.smoke)
        for name in CONFIGS:
            results[name] = run_in_subprocess(name, Path(tmp), args.seed, args.smoke)
    print_table(results)
    out = args.json or (None if args.smoke else Path(__file__).with_name("bench_packing_results.json"))
    if out is not None:
        record = {"command": " ".join(["python -m benchmarks.bench_packing", *sys.argv[1:]]),
                  "machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}", "tokenize": stats,
                  "results": results}  # fmt: skip
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nfigures: {out}")
    if args.smoke:
        print(f"\nsmoke run: {SMOKE_TRAIN_ROWS} made-up rows, {SMOKE_TEST_ROWS} test rows, one seed, one epoch; "
              "not a measurement, nothing to record")  # fmt: skip


if __name__ == "__main__":
    main()
