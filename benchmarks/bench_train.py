"""Every optimization side by side, and our engine against the Hugging Face Trainer, on AG News (CPU).

    python -m benchmarks.bench_train [--train-rows N] [--epochs E] [--repeats R] [--json PATH]
    python -m benchmarks.bench_train --smoke [--json PATH]   # a few rows, one round: that it runs, not a figure

all-MiniLM-L6-v2 (22M params) fine-tuned as a 4-class classifier on AG News rows
(max_length 128), scored on the 1,520-row test split. Each configuration runs in its own
process with the same rows, seed, lr and schedule, and no evaluation during training.

Time is measured alike on both sides:
- "steps": the optimizer steps after the first one, with the data loading between them. Ours is
  the engine's `train_time_s`; the Trainer's is taken by a callback from the end of its first
  optimizer step to the end of its last (`on_step_end`), the same region.
- "wall": the whole training call (ours: `train_model`, with its memory probe and warm-up step;
  the Trainer: `trainer.train()`), evaluation excluded on both sides.
Memory: our peak training memory (PyTorch's MemTracker over a training step, with its
activations and optimizer-state breakdown) and, for both, the process's peak RSS.
Prints both tables (like-for-like ratios first, fastest-vs-fastest second) and writes every
run's figures, per seed, as JSON.
`--smoke`: every configuration once on 64 rows of the generated corpus (AG News not needed), one epoch, short
rows; no JSON unless `--json` names one.
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

from benchmarks.common import GENERATED_TOPICS, TRAINING_BASE, ag_news_params, minilm_for, subset
from pipelines.noise import wilson_interval
from pipelines.runtime import resolve_runtime

BASE = {**TRAINING_BASE, "data.pad_to_multiple_of": None, "device": "cpu"}
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
# A smoke run reads the built-in generator's 4 topics instead of AG News (which a CI machine lacks), cut to 32
# tokens: the same tokenizer, model and code, every step cheap.
SMOKE_DATA: dict[str, Any] = {**GENERATED_TOPICS, "data.generator.num_rows": 120, "data.max_length": 32}
SMOKE_ROWS = 64  # two batches of 32: the timed steps (after the first) are not empty
LIKE_FOR_LIKE = (
    ("bucketing", "HF Trainer fp32"),
    ("bucketing+fast dropout", "HF Trainer fp32"),
    ("bucketing+bf16", "HF Trainer bf16"),
    ("bucketing+bf16+fast dropout", "HF Trainer bf16"),
)


def prepare(model_path: Path, out: Path, smoke: bool = False) -> None:
    """Tokenize AG News (a smoke run: the generated corpus) into `out` for every configuration."""
    from pipelines.prepare import prepare_dataset

    prepare_dataset(ag_news_params(model_path, **BASE, **(SMOKE_DATA if smoke else {})), Path.cwd(), out)


def run_ours(params, model, train, test, pad_id: int) -> dict[str, float]:
    from pipelines.tasks import get_task
    from pipelines.tasks.classification_scoring import evaluate_model
    from pipelines.train.engine import TrainRequest, train_model

    start = time.perf_counter()
    result = train_model(
        TrainRequest(
            model,
            train,
            None,
            params,
            pad_id=pad_id,
            device=torch.device("cpu"),
            precision=params.precision,
            say=lambda _: None,
        )
    )
    wall = time.perf_counter() - start
    names = ["1", "2", "3", "4"]
    accuracy = evaluate_model(
        model,
        test,
        names,
        params,
        resolve_runtime(params, torch.device("cpu"), pad_id),
        get_task("classification"),
    ).metrics["test_accuracy"]
    m = result.metrics
    return {
        "train_time_s": m["train_time_s"],
        "wall_time_s": wall,
        "samples_per_s": m["samples_per_s"],
        "accuracy": accuracy,
        "peak_train_memory_mb": m["peak_train_memory_bytes"] / 2**20,
        "optimizer_state_mb": m["optimizer_state_bytes"] / 2**20,
        "activations_mb": m["peak_activation_bytes"] / 2**20,
        "fast_dropout": result.notes.get("fast_dropout", "off"),
    }


def step_clock():
    """A TrainerCallback timing the Trainer's optimizer steps after the first (our train_time_s region)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.first_end: float | None = None
            self.last_end = 0.0
            self.steps = 0

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 - the Trainer's signature
            now = time.perf_counter()
            self.steps += 1
            if self.first_end is None:
                self.first_end = now
            self.last_end = now

        @property
        def seconds(self) -> float:
            return self.last_end - (self.first_end or self.last_end)

    return StepClock()


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
        clock = step_clock()
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=dataset(train),
            data_collator=DataCollatorWithPadding(tokenizer),
            callbacks=[clock],
        )
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        prediction = trainer.predict(dataset(test))
    # Score against label_ids: with group_by_length the Trainer returns rows in length-grouped order.
    accuracy = float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())
    # Rows of the timed steps: every step but the first (whose batch is one of batch_size rows or fewer).
    timed_rows = len(train) * params.epochs - params.batch_size
    return {
        "train_time_s": clock.seconds,
        "wall_time_s": wall,
        "samples_per_s": timed_rows / clock.seconds,
        "accuracy": accuracy,
    }


def run_one(name: str, data_dir: Path, model_path: Path, args: argparse.Namespace) -> dict[str, float]:
    """One configuration (`args.only`) trained and scored in this process, on `args.seed`."""
    from transformers import AutoTokenizer

    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.model import build_model
    from pipelines.recipe import seed_everything
    from pipelines.train.memory import peak_rss_bytes

    engine, overrides = CONFIGS[name]
    smoke = SMOKE_DATA if args.smoke else {}  # a smoke run's rows are short: so is a fixed padding's width
    params = ag_news_params(model_path, **{**BASE, "epochs": args.epochs, "seed": args.seed, **overrides, **smoke})
    torch.set_num_threads(2)
    seed_everything(params.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = build_model(params.model, ["1", "2", "3", "4"], len(tokenizer), 128, Path.cwd())
    train = subset(TokenizedSplit.load(data_dir / "train"), args.train_rows)
    test = TokenizedSplit.load(data_dir / "test")
    if engine == "ours":
        result = run_ours(params, model, train, test, tokenizer.pad_token_id)
    else:
        result = run_hf(params, model, train, test, tokenizer.pad_token_id, tokenizer)
    result["peak_rss_mb"] = peak_rss_bytes() / 2**20
    return result


def pct(value: float, base: float) -> str:
    return f"({100 * value / base:.0f}%)"


def run_in_subprocess(name: str, data: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One configuration in a fresh process (so peak RSS is its own); exits with its stderr on failure."""
    cmd = [sys.executable, "-m", "benchmarks.bench_train", "--only", name, "--data", data]
    cmd += ["--train-rows", str(args.train_rows), "--epochs", str(args.epochs), "--seed", str(seed)]
    cmd += ["--smoke"] if args.smoke else []
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    print(f"done: {name} seed {seed} {result}", file=sys.stderr, flush=True)
    return result


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median of every measure over the repeats; accuracy as its mean and standard deviation."""
    summary = {key: float(np.median([r[key] for r in runs])) for key in runs[0] if not isinstance(runs[0][key], str)}
    accuracies = [r["accuracy"] for r in runs]
    summary["accuracy"] = float(np.mean(accuracies))
    summary["accuracy_std"] = float(np.std(accuracies, ddof=1)) if len(runs) > 1 else 0.0
    return summary


def parse_args() -> argparse.Namespace:
    """The command line; a smoke run's rows, epochs and repeats in place of the given ones."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=5320)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the engine-vs-Trainer configurations this many times (seeds 42, 43, ...), interleaved",
    )
    parser.add_argument(
        "--json", type=Path, help="where every run's figures go, per seed (default: bench_train_results.json)"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        help="only these configurations, every one on every seed, round-robin (default: all; the compared ones repeat)",
    )
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} generated rows, one seed: proves it runs")
    parser.add_argument("--seed", type=int, default=42, help=argparse.SUPPRESS)
    parser.add_argument("--only", help="run one configuration in this process (used internally)")
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.train_rows, args.epochs, args.repeats = SMOKE_ROWS, 1, 1
    return args


def main() -> None:
    args = parse_args()
    model_path = minilm_for(args.smoke)
    if args.only:
        result = run_one(args.only, args.data, model_path, args)
        print("RESULT " + json.dumps(result))
        return

    selected = args.configs or list(CONFIGS)
    compared = set(selected) if args.configs else {name for pair in LIKE_FOR_LIKE for name in pair}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in selected}
    with tempfile.TemporaryDirectory() as tmp:
        prepare(model_path, Path(tmp), args.smoke)
        for name in selected:
            runs[name].append(run_in_subprocess(name, tmp, args, 42))
        # Further seeds round-robin over the compared configurations, so a slow spell of the
        # machine lands on all of them alike rather than on one.
        for seed in range(43, 42 + args.repeats):
            for name in selected:
                if name in compared:
                    runs[name].append(run_in_subprocess(name, tmp, args, seed))
    results = {name: summarize(r) for name, r in runs.items()}
    print_tables(results, runs, args)
    if args.smoke:
        print(f"\nsmoke run ({SMOKE_ROWS} generated rows, one seed): not a measurement, nothing to record")
    # A smoke run writes only where --json says: its figures must not replace the recorded ones.
    out = args.json or (None if args.smoke else Path(__file__).with_name("bench_train_results.json"))
    if out is not None:
        report = {"command": " ".join(["python -m benchmarks.bench_train", *sys.argv[1:]]),
                  "machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}",
                  "per_seed": {name: [{"seed": 42 + i, **r} for i, r in enumerate(rs)] for name, rs in runs.items()},
                  "summary": results}  # fmt: skip
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nper-seed figures: {out}")


def _mb(r: dict[str, float], base: dict[str, float], key: str, digits: int = 1) -> str:
    if key not in r:
        return "–"
    return f"{r[key]:.{digits}f} MB {pct(r[key], base[key])}"


def print_tables(results: dict[str, dict[str, float]], runs: dict[str, list], args: argparse.Namespace) -> None:
    """The configurations against vanilla, then ours against the Trainer (like for like, then fastest)."""
    base = results.get("vanilla") or next(iter(results.values()))  # % of vanilla, else of the first run
    print(
        f"\nAG News, {args.train_rows} train rows x {args.epochs} epoch(s), all-MiniLM-L6-v2, CPU "
        f"({torch.get_num_threads()} threads), test accuracy on 1,520 rows. Configurations marked * ran "
        f"{args.repeats} times (seeds 42..{41 + args.repeats}): median time, mean accuracy ± sd.\n"
    )
    print(
        "| Configuration | Train time (steps) | Wall time | Samples/s | Peak train memory | Optimizer state "
        "| Activations | Peak RSS | Accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        star = "*" if len(runs[name]) > 1 else ""
        spread = f" ± {100 * r['accuracy_std']:.2f}" if len(runs[name]) > 1 else ""
        print(
            f"| {name}{star} | {r['train_time_s']:.1f} s {pct(r['train_time_s'], base['train_time_s'])} | "
            f"{r['wall_time_s']:.1f} s | {r['samples_per_s']:.1f} | {_mb(r, base, 'peak_train_memory_mb')} | "
            f"{_mb(r, base, 'optimizer_state_mb')} | {_mb(r, base, 'activations_mb')} | "
            f"{r['peak_rss_mb']:.0f} MB | {100 * r['accuracy']:.2f}%{spread} |"
        )
    print(
        "\n| Ours vs HF Trainer | Steps-time ratio (medians) | Per-seed | Wall-time ratio (medians) | Per-seed "
        "| Accuracy ours | Accuracy Trainer |"
    )
    print("|---|---|---|---|---|---|---|")
    ran = [n for n in CONFIGS if n in results]
    ours_best = min((n for n in ran if CONFIGS[n][0] == "ours"), key=lambda n: results[n]["train_time_s"])
    hf_best = min((n for n in ran if CONFIGS[n][0] == "hf"), key=lambda n: results[n]["train_time_s"])
    pairs = [(f"{ours} vs {hf}", ours, hf) for ours, hf in LIKE_FOR_LIKE if ours in results and hf in results]
    pairs.append((f"fastest vs fastest ({ours_best} vs {hf_best})", ours_best, hf_best))
    for label, ours, hf in pairs:
        cells = []
        for key in ("train_time_s", "wall_time_s"):
            ratio = results[ours][key] / results[hf][key]
            per_seed = ", ".join(f"{a[key] / b[key]:.2f}" for a, b in zip(runs[ours], runs[hf], strict=False))
            cells += [f"{ratio:.2f}x", per_seed]
        ours_acc, hf_acc = 100 * results[ours]["accuracy"], 100 * results[hf]["accuracy"]
        print(f"| {label} | {' | '.join(cells)} | {ours_acc:.2f}% | {hf_acc:.2f}% |")
    print("\nPer-run test accuracy with its 95% Wilson interval (1,520 test rows), by seed:")
    for name, rs in runs.items():
        print(f"- {name}: " + "; ".join(f"{42 + i}: {_with_interval(r['accuracy'])}" for i, r in enumerate(rs)))


def _with_interval(accuracy: float, rows: int = 1520) -> str:
    low, high = wilson_interval(round(accuracy * rows), rows)
    return f"{100 * accuracy:.2f} [{100 * low:.1f}, {100 * high:.1f}]"


if __name__ == "__main__":
    main()
