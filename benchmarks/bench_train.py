"""Every optimization side by side, and our engine against the Hugging Face Trainer, on AG News (CPU).

    python -m benchmarks.bench_train [--train-rows N] [--epochs E]

all-MiniLM-L6-v2 (22M params) fine-tuned as a 4-class classifier on AG News rows
(max_length 128), scored on the 1,520-row test split. Each configuration runs in its own
process (peak RSS is a per-process high-water mark) with the same rows, seed, lr and
schedule. Prints wall time, samples/s, peak RSS, our exact optimizer-state and
saved-activation bytes, and accuracy, each also as % of vanilla; then the Trainer
comparison like for like (fp32 vs fp32, bf16 vs bf16) and fastest vs fastest.
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

import numpy as np
import torch

from benchmarks.common import ag_news_params, require_assets

BASE = {
    "batch_size": 32,
    "lr": 1e-4,
    "epochs": 1,
    "warmup_ratio": 0.1,
    "max_grad_norm": 1.0,
    "weight_decay": 0.01,
    "data.pad_to_multiple_of": None,
    "log_every_n_steps": 1000,
    "checkpoint_every_n_steps": None,
    "device": "cpu",
    "fast_dropout": False,
}
FIXED = {"data.bucketing": False}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "vanilla": ("ours", FIXED),
    "bucketing": ("ours", {"data.bucketing": True}),
    "bf16": ("ours", {**FIXED, "precision": "bf16"}),
    "grad_accum (8x4)": ("ours", {**FIXED, "batch_size": 8, "grad_accum_steps": 4}),
    "checkpointing": ("ours", {**FIXED, "grad_checkpointing": True}),
    "adafactor": ("ours", {**FIXED, "optim": "adafactor"}),
    "all combined": (
        "ours",
        {
            "data.bucketing": True,
            "precision": "bf16",
            "batch_size": 8,
            "grad_accum_steps": 4,
            "grad_checkpointing": True,
            "optim": "adafactor",
            "fast_dropout": True,
        },
    ),
    "fast dropout": ("ours", {**FIXED, "fast_dropout": True}),
    "bucketing+bf16": ("ours", {"data.bucketing": True, "precision": "bf16"}),
    "bucketing+fast dropout": ("ours", {"data.bucketing": True, "fast_dropout": True}),
    "bucketing+bf16+fast dropout": ("ours", {"data.bucketing": True, "precision": "bf16", "fast_dropout": True}),
    "HF Trainer fp32": ("hf", {"data.bucketing": True}),
    "HF Trainer bf16": ("hf", {"data.bucketing": True, "precision": "bf16"}),
}
LIKE_FOR_LIKE = (
    ("bucketing", "HF Trainer fp32"),
    ("bucketing+fast dropout", "HF Trainer fp32"),
    ("bucketing+bf16", "HF Trainer bf16"),
    ("bucketing+bf16+fast dropout", "HF Trainer bf16"),
)


def prepare(model_path: Path, out: Path) -> None:
    from pipelines.data.prepare import prepare_dataset

    prepare_dataset(ag_news_params(model_path, **BASE), Path.cwd(), out)


def subset(split, rows: int):
    from pipelines.data.tokenization import TokenizedSplit

    n = min(rows, len(split))
    end = int(split.lengths[:n].sum())
    # Copies, not views of the memory-mapped files: callers may save the subset over them.
    return TokenizedSplit(np.array(split.input_ids[:end]), np.array(split.lengths[:n]), np.array(split.labels[:n]))


def run_ours(params, model, train, test, pad_id: int) -> dict[str, float]:
    from pipelines.evaluation import evaluate_model
    from pipelines.train.engine import train_model

    result = train_model(
        model,
        train,
        None,
        params,
        pad_id=pad_id,
        device=torch.device("cpu"),
        precision=params.precision,
        say=lambda _: None,
    )
    names = ["1", "2", "3", "4"]
    accuracy = evaluate_model(
        model, test, names, params, pad_id=pad_id, device=torch.device("cpu"), precision=params.precision
    ).metrics["test_accuracy"]
    m = result.metrics
    return {
        "train_time_s": m["train_time_s"],
        "samples_per_s": m["samples_per_s"],
        "accuracy": accuracy,
        "optimizer_state_mb": m["optimizer_state_bytes"] / 2**20,
        "activations_mb": m["peak_activation_bytes"] / 2**20,
    }


def run_hf(params, model, train, test, pad_id: int, tokenizer) -> dict[str, float]:
    from datasets import Dataset
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    def dataset(split):
        offsets = split.offsets
        rows = [split.input_ids[o : o + n].tolist() for o, n in zip(offsets, split.lengths, strict=True)]
        return Dataset.from_dict(
            {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows], "labels": split.labels.tolist()}
        )

    steps = -(-len(train) // params.batch_size) * params.epochs
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=params.batch_size,
            per_device_eval_batch_size=64,
            num_train_epochs=params.epochs,
            learning_rate=params.lr,
            weight_decay=params.weight_decay,
            warmup_steps=int(params.warmup_ratio * steps),
            lr_scheduler_type="linear",
            max_grad_norm=params.max_grad_norm,
            bf16=params.precision == "bf16",
            use_cpu=True,
            train_sampling_strategy="group_by_length",
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=params.seed,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=dataset(train), data_collator=DataCollatorWithPadding(tokenizer)
        )
        start = time.perf_counter()
        trainer.train()
        train_time = time.perf_counter() - start
        prediction = trainer.predict(dataset(test))
    # Score against label_ids: with group_by_length the Trainer returns rows in length-grouped order.
    accuracy = float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())
    return {"train_time_s": train_time, "samples_per_s": len(train) * params.epochs / train_time, "accuracy": accuracy}


def run_one(name: str, data_dir: Path, model_path: Path, train_rows: int, epochs: int, seed: int) -> dict[str, float]:
    import resource

    from transformers import AutoTokenizer

    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.model import build_model
    from pipelines.trial import seed_everything

    engine, overrides = CONFIGS[name]
    params = ag_news_params(model_path, **{**BASE, "epochs": epochs, "seed": seed, **overrides})
    torch.set_num_threads(2)
    seed_everything(params.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = build_model(params.model, ["1", "2", "3", "4"], len(tokenizer), 128, Path.cwd())
    train = subset(TokenizedSplit.load(data_dir / "train"), train_rows)
    test = TokenizedSplit.load(data_dir / "test")
    if engine == "ours":
        result = run_ours(params, model, train, test, tokenizer.pad_token_id)
    else:
        result = run_hf(params, model, train, test, tokenizer.pad_token_id, tokenizer)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def pct(value: float, base: float) -> str:
    return f"({100 * value / base:.0f}%)"


def run_in_subprocess(name: str, data: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One configuration in a fresh process (so peak RSS is its own); exits with its stderr on failure."""
    cmd = [sys.executable, "-m", "benchmarks.bench_train", "--only", name, "--data", data]
    cmd += ["--train-rows", str(args.train_rows), "--epochs", str(args.epochs), "--seed", str(seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    print(f"done: {name} seed {seed} {result}", file=sys.stderr, flush=True)
    return result


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median of every measure over the repeats; accuracy as its mean and standard deviation."""
    summary = {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
    accuracies = [r["accuracy"] for r in runs]
    summary["accuracy"] = float(np.mean(accuracies))
    summary["accuracy_std"] = float(np.std(accuracies, ddof=1)) if len(runs) > 1 else 0.0
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=5320)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the engine-vs-Trainer configurations this many times (seeds 42, 43, ...), interleaved",
    )
    parser.add_argument("--seed", type=int, default=42, help=argparse.SUPPRESS)
    parser.add_argument("--only", help="run one configuration in this process (used internally)")
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model_path = require_assets()
    if args.only:
        result = run_one(args.only, args.data, model_path, args.train_rows, args.epochs, args.seed)
        print("RESULT " + json.dumps(result))
        return

    compared = {name for pair in LIKE_FOR_LIKE for name in pair}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        prepare(model_path, Path(tmp))
        for name in CONFIGS:
            runs[name].append(run_in_subprocess(name, tmp, args, 42))
        # Further seeds round-robin over the compared configurations, so a slow spell of the
        # machine lands on all of them alike rather than on one.
        for seed in range(43, 42 + args.repeats):
            for name in CONFIGS:
                if name in compared:
                    runs[name].append(run_in_subprocess(name, tmp, args, seed))
    results = {name: summarize(r) for name, r in runs.items()}

    base = results["vanilla"]
    print(
        f"\nAG News, {args.train_rows} train rows x {args.epochs} epoch(s), all-MiniLM-L6-v2, CPU "
        f"({torch.get_num_threads()} threads), test accuracy on 1,520 rows. Configurations marked * ran "
        f"{args.repeats} times (seeds 42..{41 + args.repeats}): median time, mean accuracy ± std.\n"
    )
    print("| Configuration | Train time | Samples/s | Peak RSS | Optimizer state | Activations | Accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        opt = (
            f"{r['optimizer_state_mb']:.1f} MB {pct(r['optimizer_state_mb'], base['optimizer_state_mb'])}"
            if "optimizer_state_mb" in r
            else "–"
        )
        act = (
            f"{r['activations_mb']:.1f} MB {pct(r['activations_mb'], base['activations_mb'])}"
            if "activations_mb" in r
            else "–"
        )
        star = "*" if len(runs[name]) > 1 else ""
        spread = f" ± {100 * r['accuracy_std']:.2f}" if len(runs[name]) > 1 else ""
        print(
            f"| {name}{star} | {r['train_time_s']:.1f} s {pct(r['train_time_s'], base['train_time_s'])} | "
            f"{r['samples_per_s']:.1f} | {r['peak_rss_mb']:.0f} MB {pct(r['peak_rss_mb'], base['peak_rss_mb'])} | "
            f"{opt} | {act} | {100 * r['accuracy']:.2f}%{spread} |"
        )
    print("\n| Ours vs HF Trainer | Wall-time ratio (medians) | Per-seed ratios | Accuracy ours | Accuracy Trainer |")
    print("|---|---|---|---|---|")
    ours_best = min((n for n, (e, _) in CONFIGS.items() if e == "ours"), key=lambda n: results[n]["train_time_s"])
    hf_best = min((n for n, (e, _) in CONFIGS.items() if e == "hf"), key=lambda n: results[n]["train_time_s"])
    pairs = [(f"{ours} vs {hf}", ours, hf) for ours, hf in LIKE_FOR_LIKE]
    pairs.append((f"fastest vs fastest ({ours_best} vs {hf_best})", ours_best, hf_best))
    for label, ours, hf in pairs:
        ratio = results[ours]["train_time_s"] / results[hf]["train_time_s"]
        per_seed = ", ".join(
            f"{a['train_time_s'] / b['train_time_s']:.2f}" for a, b in zip(runs[ours], runs[hf], strict=False)
        )
        ours_acc, hf_acc = 100 * results[ours]["accuracy"], 100 * results[hf]["accuracy"]
        print(f"| {label} | {ratio:.2f}x | {per_seed} | {ours_acc:.2f}% | {hf_acc:.2f}% |")


if __name__ == "__main__":
    main()
