"""Data-parallel trials: 2 Ray Train workers vs 1 process at the same global batch (CPU, or GPUs when present).

    python -m benchmarks.bench_distributed [--train-rows N] [--per-worker-batch B]

all-MiniLM-L6-v2 fine-tuned on AG News rows through the real train stage code (`run_tuning`:
a Ray Tune trial, MLflow tracking in a temporary sqlite store). Global batch 2 x B rows per
optimizer step either way: one process accumulates two micro-batches of B, or two DDP workers
(gloo on CPU, NCCL on GPUs) take one each, on the same rows. Each configuration runs in its
own process with a fresh local Ray. Prints wall time, global samples/s, accuracy and the
throughput ratio. On a 2-core machine the two workers get one core each, where the single
process gets both: the ratio shows what DDP costs there, not what it buys on a cluster.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import ag_news_params, require_assets

CONFIGS = {
    "1 process, 2 accumulated micro-batches": {"distributed.num_workers": 1, "grad_accum_steps": 2},
    "2 DDP workers": {"distributed.num_workers": 2, "grad_accum_steps": 1},
}


def run_one(name: str, root: Path, train_rows: int, batch: int) -> dict[str, float]:
    from benchmarks.common import subset
    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.prepare import prepare_dataset
    from pipelines.trials.tuning import run_tuning

    model_path = require_assets()
    params = ag_news_params(
        model_path,
        **{
            "batch_size": batch,
            "lr": 1e-4,
            "epochs": 1,
            "log_every_n_steps": 1000,
            "checkpoint_every_n_steps": None,
            "data.pad_to_multiple_of": None,
            "tracking.uri": f"sqlite:///{root / 'mlflow.db'}",
            "tracking.experiment": "bench-distributed",
            **CONFIGS[name],
        },
    )
    tokenized = root / "data" / "tokenized"
    if not tokenized.exists():
        prepare_dataset(params, root, tokenized)
        subset(TokenizedSplit.load(tokenized / "train"), train_rows).save(tokenized / "train")
    out = root / f"models-{params.distributed.num_workers}"
    out.mkdir()
    summary = run_tuning(params, root, tokenized, out, {})
    metrics = summary["best"]["metrics"]
    return {k: metrics[k] for k in ("train_time_s", "samples_per_s", "test_accuracy", "optimizer_steps")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=1536)
    parser.add_argument("--per-worker-batch", type=int, default=16)
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    require_assets()
    if args.only:
        print("RESULT " + json.dumps(run_one(args.only, args.root, args.train_rows, args.per_worker_batch)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONFIGS:
            cmd = [sys.executable, "-m", "benchmarks.bench_distributed", "--only", name, "--root", tmp]
            cmd += ["--train-rows", str(args.train_rows), "--per-worker-batch", str(args.per_worker_batch)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            results[name] = json.loads(line.removeprefix("RESULT "))
            print(f"done: {name} {results[name]}", file=sys.stderr, flush=True)
    device = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "CPU"
    print(
        f"\nAG News, {args.train_rows} train rows x 1 epoch, all-MiniLM-L6-v2, {device}, global batch "
        f"{2 * args.per_worker_batch} rows per step\n"
    )
    print("| Configuration | Train time | Samples/s (global) | Optimizer steps | Test accuracy |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['train_time_s']:.1f} s | {r['samples_per_s']:.1f} | {r['optimizer_steps']:.0f} | "
            f"{100 * r['test_accuracy']:.2f}% |"
        )
    one, two = results.values()
    print(f"\nThroughput ratio, 2 workers / 1 process: {two['samples_per_s'] / one['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
