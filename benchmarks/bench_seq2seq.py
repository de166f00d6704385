"""Seq2seq strategies side by side: a T5 from a config on the generated translation corpus (CPU).

    python -m benchmarks.bench_seq2seq [--epochs E] [--json PATH]
    python -m benchmarks.bench_seq2seq --smoke [--json PATH]   # a few rows, one epoch: that it runs, not a figure

The corpus is the built-in generator's (`task: seq2seq`, 6,000 rows: a made-up language and its
translation by a fixed rule), the model a T5 of width 128, 3 encoder and 3 decoder layers, built
from the config. Every configuration runs in its own process on the same rows, seed, lr and
schedule, without validation during training; BLEU and chrF are scored on the 1,200-row test
split by greedy generation. Time is the engine's `train_time_s` (optimizer steps after the
first), memory its peak train memory (MemTracker); both as % of vanilla (fixed padding, fp32).
`--smoke`: every configuration and table line on 100 generated rows (70 train, 15 test), one epoch, one torch
thread; writes no figures unless `--json` says where.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO_ROOT
from pipelines.params import Params, apply_overrides, load_params
from pipelines.runtime import resolve_runtime

BASE: dict[str, Any] = {
    "task": "seq2seq",
    "lr": 1e-3,
    "batch_size": 32,
    "device": "cpu",
    "fast_dropout": False,
    "data.pad_to_multiple_of": None,
    "model.config.hidden_size": 128,
    "model.config.intermediate_size": 256,
    "model.config.num_attention_heads": 4,
    "model.config.num_hidden_layers": 3,
    "model.config.dropout": 0.0,
    "eval.max_new_tokens": 24,
    "log_every_n_steps": 1000,
    "checkpoint_every_n_steps": None,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "vanilla": {"data.bucketing": False},
    "bucketing": {"data.bucketing": True},
    "bf16": {"data.bucketing": False, "precision": "bf16"},
    "checkpointing": {"data.bucketing": False, "grad_checkpointing": True},
    "bucketing+bf16+checkpointing": {"data.bucketing": True, "precision": "bf16", "grad_checkpointing": True},
}
SMOKE_ROWS = 100  # the generated corpus of a smoke run: 70 train rows (3 steps), 15 test rows


def params_for(epochs: int, **overrides: Any) -> Params:
    """BASE and `epochs` over the repository's params, then `overrides`."""
    return apply_overrides(load_params(REPO_ROOT / "params.yaml"), {**BASE, "epochs": epochs, **overrides})


def run_one(name: str, data: Path, epochs: int, smoke: bool) -> dict[str, float]:
    """One configuration trained and scored in this process; its figures."""
    from transformers import AutoTokenizer

    from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
    from pipelines.recipe import seed_everything
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model

    params = params_for(epochs, **CONFIGS[name])
    # A smoke run shares its cores (a test suite's other worker): 2 threads on 2 busy cores ran 5x slower than 1.
    torch.set_num_threads(1 if smoke else 2)
    seed_everything(params.seed)
    task = get_task("seq2seq")
    tokenizer = AutoTokenizer.from_pretrained(data / TOKENIZER_DIR)
    model = task.build_model(params, tokenizer, data, REPO_ROOT)
    train = TokenizedSplit.load(data / "train")
    result = train_model(
        TrainRequest(
            model,
            train,
            None,
            params,
            pad_id=tokenizer.pad_token_id,
            device=torch.device("cpu"),
            precision=params.precision,
            say=lambda _: None,
            task=task,
        )
    )
    if params.grad_checkpointing:
        model.activation_checkpointing_disable()
    scored = task.evaluate(
        model,
        tokenizer,
        TokenizedSplit.load(data / "test"),
        data,
        params,
        resolve_runtime(params, torch.device("cpu"), tokenizer.pad_token_id),
    )
    m = result.metrics
    return {
        "train_time_s": m["train_time_s"],
        "tokens_per_s": m["tokens_per_s"],
        "peak_train_memory_mb": m["peak_train_memory_bytes"] / 2**20,
        "activations_mb": m["peak_activation_bytes"] / 2**20,
        **{k: scored.metrics[k] for k in ("test_bleu", "test_chrf", "test_exact_match", "test_token_accuracy")},
    }


def run_all(epochs: int, smoke: bool) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The corpus tokenized once, then every configuration in its own process; the tokenize stats and results."""
    from pipelines.prepare import prepare_dataset

    results: dict[str, dict[str, float]] = {}
    rows = {"data.generator.num_rows": SMOKE_ROWS} if smoke else {}
    with tempfile.TemporaryDirectory() as tmp:
        stats = prepare_dataset(params_for(epochs, **rows), REPO_ROOT, Path(tmp))
        for name in CONFIGS:
            cmd = [sys.executable, "-m", "benchmarks.bench_seq2seq", "--only", name, "--data", tmp]
            cmd += ["--epochs", str(epochs), *(["--smoke"] if smoke else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            results[name] = json.loads(line.removeprefix("RESULT "))
            print(f"done: {name} {results[name]}", file=sys.stderr, flush=True)
    return stats, results


def pct(value: float, base: float) -> str:
    """`value` as % of `base`; "–" for a base of 0 (a smoke run's vanilla can score a BLEU of 0)."""
    return f"{100 * value / base:.0f}%" if base else "–"


def print_table(stats: dict[str, Any], results: dict[str, dict[str, float]]) -> None:
    """Padding, then one line per configuration, time and memory as % of vanilla."""
    base = results["vanilla"]
    train = stats["train"]
    print(f"padding bucketed/fixed: {train['pad_fraction_configured']:.1%}/{train['pad_fraction_fixed']:.1%}\n")
    print("| Configuration | BLEU | chrF | Exact match | Train time | Tokens/s | Peak train memory | Activations |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        rel = {k: pct(r[k], base[k]) for k in ("test_bleu", "train_time_s", "peak_train_memory_mb")}
        print(
            f"| {name} | {r['test_bleu']:.2f} ({rel['test_bleu']}) | {r['test_chrf']:.1f} | "
            f"{100 * r['test_exact_match']:.1f}% | {r['train_time_s']:.1f} s ({rel['train_time_s']}) | "
            f"{r['tokens_per_s']:.0f} | {r['peak_train_memory_mb']:.1f} MB ({rel['peak_train_memory_mb']}) | "
            f"{r['activations_mb']:.1f} MB |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="the figures (default: bench_seq2seq_results.json; smoke: none)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} rows, one epoch: proves it runs")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        print("RESULT " + json.dumps(run_one(args.only, args.data, args.epochs, args.smoke)))
        return
    epochs = 1 if args.smoke else args.epochs
    stats, results = run_all(epochs, args.smoke)
    print_table(stats, results)
    out = args.json or (None if args.smoke else Path(__file__).with_name("bench_seq2seq_results.json"))
    if out is not None:
        record = {"command": " ".join(["python -m benchmarks.bench_seq2seq", *sys.argv[1:]]), "tokenize": stats,
                  "results": results}  # fmt: skip
        out.write_text(json.dumps(record, indent=2) + "\n")
    if args.smoke:
        print(f"\nsmoke run: {SMOKE_ROWS} generated rows, one epoch; not a measurement, nothing to record")


if __name__ == "__main__":
    main()
