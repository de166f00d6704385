"""Data-parallel trials: 2 Ray Train workers vs 1 process at the same global batch (CPU, or GPUs when present).

    python -m benchmarks.bench_distributed [--train-rows N] [--per-worker-batch B]
    python -m benchmarks.bench_distributed --smoke   # a few rows, one round: that it runs, not a figure

all-MiniLM-L6-v2 fine-tuned on AG News rows through the real train stage code (`run_tuning`:
a Ray Tune trial, MLflow tracking in a temporary sqlite store). Global batch 2 x B rows per
optimizer step either way: one process accumulates two micro-batches of B, or two DDP workers
(gloo on CPU, NCCL on GPUs) take one each, on the same rows. Each configuration runs in its
own process with a fresh local Ray (or on the cluster RAY_ADDRESS names, when set). Prints wall
time, global samples/s, accuracy and the throughput ratio. On a 2-core machine the two workers get
one core each, where the single process gets both: the ratio shows what DDP costs there, not what
it buys on a cluster.
`--smoke`: both configurations on 64 rows of the generated corpus (AG News not needed), batch 8.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import GENERATED_TOPICS, ag_news_params, minilm_for

CONFIGS = {
    "1 process, 2 accumulated micro-batches": {"distributed.num_workers": 1, "grad_accum_steps": 2},
    "2 DDP workers": {"distributed.num_workers": 2, "grad_accum_steps": 1},
}
# A smoke run reads the built-in generator's 4 topics instead of AG News (which a CI machine lacks): the same
# tokenizer, model and stage code, 120 rows split as the pipeline splits them.
SMOKE_DATA: dict[str, Any] = {**GENERATED_TOPICS, "data.generator.num_rows": 120}
SMOKE_ROWS, SMOKE_BATCH = 64, 8


def run_one(name: str, root: Path, train_rows: int, batch: int, smoke: bool = False) -> dict[str, float]:
    """Train one configuration through `run_tuning` in this process; its train time, throughput and accuracy."""
    from benchmarks.common import subset
    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.prepare import prepare_dataset
    from pipelines.trials.tuning import run_tuning

    params = ag_news_params(
        minilm_for(smoke),
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
            **(SMOKE_DATA if smoke else {}),
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


def kill_session(session_id: int) -> None:
    """SIGKILL what is left of a session this script started: a local Ray's daemons outlive a driver that died
    before `ray.shutdown`. Only that session's processes, never `ray stop` (which stops every Ray on the machine)."""
    import psutil

    for pid in psutil.pids():
        try:
            if pid != os.getpid() and os.getsid(pid) == session_id:
                os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already, or not ours
            continue


def run_configs(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Each configuration in a process of its own (its own session, so nothing it started outlives it)."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONFIGS:
            cmd = [sys.executable, "-m", "benchmarks.bench_distributed", "--only", name, "--root", tmp]
            cmd += ["--train-rows", str(args.train_rows), "--per-worker-batch", str(args.per_worker_batch)]
            cmd += ["--smoke"] if args.smoke else []
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)  # fmt: skip
            try:
                stdout, stderr = proc.communicate()
            finally:
                kill_session(proc.pid)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{name} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
            results[name] = json.loads(line.removeprefix("RESULT "))
            print(f"done: {name} {results[name]}", file=sys.stderr, flush=True)
    return results


def print_report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    """The table, one row per configuration, and the throughput ratio."""
    device = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "CPU"
    data = "generated corpus (smoke)" if args.smoke else "AG News"
    print(
        f"\n{data}, {args.train_rows} train rows x 1 epoch, all-MiniLM-L6-v2, {device}, global batch "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=1536)
    parser.add_argument("--per-worker-batch", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} generated rows: proves it runs")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    minilm_for(args.smoke)
    if args.smoke:
        args.train_rows, args.per_worker_batch = SMOKE_ROWS, SMOKE_BATCH
    if args.only:
        result = run_one(args.only, args.root, args.train_rows, args.per_worker_batch, args.smoke)
        print("RESULT " + json.dumps(result))
        return
    print_report(run_configs(args), args)
    if args.smoke:
        print(f"\nsmoke run ({SMOKE_ROWS} generated rows, one epoch): not a measurement, nothing to record")


if __name__ == "__main__":
    main()
