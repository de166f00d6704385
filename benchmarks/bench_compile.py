"""`compile` on and off, side by side on this CPU: compile time and steps time apart, cold cache and warm, and the
plan's predicted step time beside the measured one.

    python -m benchmarks.bench_compile [--rows N] [--rounds R] [--json PATH]
    python -m benchmarks.bench_compile --smoke [--json PATH]   # a few rows, one round: that it runs, not a figure

Two models, each trained for one epoch of the same rows with length bucketing (our default):
- "default": the repository's default pipeline (params.yaml: the generated corpus, the small BERT built from
  model.config);
- "minilm": all-MiniLM-L6-v2 on AG News (max_length 128), skipped with the reason when either is missing.

Per round, per model, four runs, each in a fresh process (so nothing compiled stays in memory): eager; compiled
with an empty Inductor cache ("cold": every graph compiled); compiled again on the cache the cold run filled
("cached": what a second trial or experiment pays); compiled in a fresh, empty cache folder holding only the
Mega-Cache blob the cold run saved ("blob": what another machine or Ray worker pays). Rounds alternate the seed.
Reported per run: `compile_time_s` (the shapes warmed before timing), `train_time_s` (the timed steps), the median
step, samples/s, the number of batch shapes and graphs, the final loss, the compile cache's hits and misses
(Inductor's FX graphs, AOTAutograd's); and the plan's predicted eager and compiled step and compile time in the case
the compile cache predicted (cold or warm: `pipelines.resolve.step_time`, `pipelines.train.compile_cache`). Medians
over rounds, and the ratio compiled/eager of the steps time.
`--smoke`: the four runs of one round on 64 rows of the default model cut to one layer (MiniLM only when `--models`
names it, then on generated rows: its cold compile takes minutes here); no JSON unless `--json` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    AG_NEWS,
    GENERATED_TOPICS,
    REPO_ROOT,
    TRAINING_BASE,
    ag_news_overrides,
    minilm_path,
    subset,
)
from pipelines.params import apply_overrides, load_params
from pipelines.train.compile_cache import BLOBS

BASE = {**TRAINING_BASE, "device": "cpu", "data.bucketing": True, "precision": "fp32", "fast_dropout": False}
RUNS = ("eager", "cold", "cached", "blob")
SMOKE_ROWS = 64  # two batches of 32: one timed step after the first
# A smoke run's model is the smallest the default's code paths allow (a compile's time grows with the graph), and
# MiniLM reads the generator's 4 topics instead of AG News (which a CI machine lacks).
SMOKE_DEFAULT: dict[str, Any] = {"model.config.num_hidden_layers": 1}
SMOKE_MINILM: dict[str, Any] = GENERATED_TOPICS


def params_for(model: str, rows: int, seed: int, smoke: bool = False) -> Any:
    """The params of one model's runs (its data, `rows` training rows; a smoke run's smaller model or data)."""
    params = load_params(REPO_ROOT / "params.yaml")
    extra: dict[str, Any] = {**BASE, "seed": seed}
    if model == "minilm":
        path = minilm_path()
        extra.update(ag_news_overrides(path))  # type: ignore[arg-type]
    if model != "minilm" or smoke:
        extra.update({"data.generator.num_rows": max(rows * 2, 100)})
    if smoke:
        extra.update(SMOKE_MINILM if model == "minilm" else SMOKE_DEFAULT)
    return apply_overrides(params, extra)


def one_run(model_name: str, run: str, rows: int, seed: int, data_dir: Path, smoke: bool) -> dict[str, float | str]:
    """Train once in this process (compile per `run`) and return what was measured and predicted."""
    from transformers import AutoTokenizer

    from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
    from pipelines.prepare import prepare_dataset
    from pipelines.resolve.preflight import trial_planner
    from pipelines.resolve.step_time import predict_compile
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model

    params = params_for(model_name, rows, seed, smoke)
    if not (data_dir / "train").exists():
        prepare_dataset(params, REPO_ROOT, data_dir)
    tokenizer = AutoTokenizer.from_pretrained(data_dir / TOKENIZER_DIR)
    train = subset(TokenizedSplit.load(data_dir / "train"), rows)
    task = get_task(params.task)
    plan = trial_planner(task, train, tokenizer, data_dir, REPO_ROOT, torch.device("cpu"))(params)
    predicted = predict_compile(plan, "fp32", torch.device("cpu"))
    torch.manual_seed(seed)
    model = task.build_model(params, tokenizer, data_dir, REPO_ROOT)
    params = apply_overrides(params, {"compile": run != "eager"})
    result = train_model(
        TrainRequest(
            model,
            train,
            None,
            params,
            pad_id=int(tokenizer.pad_token_id),
            device=torch.device("cpu"),
            precision="fp32",
            task=task,
            say=lambda _: None,
            compile_prediction=None if predicted is None else predicted[1],
        )
    )
    m = result.metrics
    out: dict[str, float | str] = {
        "compile_time_s": m["compile_time_s"],
        "train_time_s": m["train_time_s"],
        "step_time_p50_ms": m["step_time_p50_ms"],
        "samples_per_s": m["samples_per_s"],
        "compile_graphs": m["compile_graphs"],
        "compile_graphs_in_loop": m["compile_graphs_in_loop"],
        "final_train_loss": m["final_train_loss"],
        "timed_steps": m["timed_steps"],
        "compile_shapes": m.get("compile_shapes", 0.0),
        "compile_cache_hits": m.get("compile_cache_hits", 0.0),
        "compile_cache_misses": m.get("compile_cache_misses", 0.0),
        "compile_blob_loaded": m.get("compile_blob_loaded", 0.0),
        "predicted_compile_time_s": m.get("predicted_compile_time_s", 0.0),
        "compile_resolved": result.notes.get("compile.resolved", ""),
        "pad_widths": result.notes.get("pad_widths.resolved", "—"),
        "plan_step_kernels": float(plan.step_kernels),
        "plan_update_kernels": float(plan.update_kernels),
        "plan_step_gflop": plan.step_flops / 1e9,
    }
    if predicted is not None:
        step, compile_cost = predicted
        out.update({
            "predicted_eager_step_ms": 1000 * step.eager_s,
            "predicted_compiled_step_ms": 1000 * step.compiled_s,
            "predicted_compile_cold_s": compile_cost.compile_s,
            "predicted_compile_warm_s": compile_cost.warm_compile_s,
            "predicted_compile_blob_s": compile_cost.blob_compile_s,
        })  # fmt: skip
    return out


def in_subprocess(
    model: str, run: str, rows: int, seed: int, data_dir: Path, cache: Path, smoke: bool
) -> dict[str, Any]:
    """`one_run` in a fresh process whose Inductor cache is `cache`; a `blob` run's is a fresh folder holding only the
    Mega-Cache blob the cold run saved in `cache` (what another machine or Ray worker receives)."""
    if run == "blob":
        fresh = cache.with_name(cache.name + "-blob")
        (fresh / BLOBS).mkdir(parents=True, exist_ok=True)
        for blob in (cache / BLOBS).glob("*.bin"):
            shutil.copyfile(blob, fresh / BLOBS / blob.name)
        cache = fresh
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "benchmarks.bench_compile", "--one", model, run, str(rows), str(seed)]
    command += [str(data_dir), *(["--smoke"] if smoke else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model} {run} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """Medians over rounds, one row per model and run."""
    lines = [
        "| model | run | compile s (predicted) | cache hits / misses | steps s | steps vs eager | step p50 ms "
        "| predicted step ms | samples/s | shapes (graphs) | widths | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(float(r[key]) for r in runs)

    for model, by_run in results.items():
        eager_steps = med(by_run["eager"], "train_time_s")
        for run, runs in by_run.items():
            key = "predicted_eager_step_ms" if run == "eager" else "predicted_compiled_step_ms"
            predicted = f"{med(runs, key):,.1f}" if key in runs[0] else "—"
            spread = ", ".join(f"{float(r['train_time_s']):.1f}" for r in runs)
            compiled = run != "eager"
            compile_s = (f"{med(runs, 'compile_time_s'):.1f} ({med(runs, 'predicted_compile_time_s'):.1f})"
                         if compiled else "—")  # fmt: skip
            hits = f"{med(runs, 'compile_cache_hits'):.0f} / {med(runs, 'compile_cache_misses'):.0f}"
            hits = hits if compiled else "—"
            shapes = f"{int(med(runs, 'compile_shapes'))} ({int(med(runs, 'compile_graphs'))})" if compiled else "—"
            lines.append(
                f"| {model} | {run} | {compile_s} | {hits} | {med(runs, 'train_time_s'):.1f} ({spread}) "
                f"| {med(runs, 'train_time_s') / eager_steps:.2f}x | {med(runs, 'step_time_p50_ms'):.1f} | {predicted} "
                f"| {med(runs, 'samples_per_s'):.1f} | {shapes} | {runs[0]['pad_widths']} "
                f"| {med(runs, 'final_train_loss'):.4f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048, help="training rows per model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--models", nargs="+", choices=["default", "minilm"], help="default: both (a smoke run: default)"
    )
    parser.add_argument("--json", type=Path, help="where every run's figures go (default: bench_compile_results.json)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} rows, one round: proves it runs")
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, run, rows, seed, data_dir = args.one
        print(json.dumps(one_run(model, run, int(rows), int(seed), Path(data_dir), args.smoke)))
        return
    if args.smoke:
        args.rows, args.rounds = SMOKE_ROWS, 1
    models = list(args.models or (["default"] if args.smoke else ["default", "minilm"]))
    # A smoke run's MiniLM reads generated rows: only the model must be installed.
    if "minilm" in models and (minilm_path() is None or not (args.smoke or (AG_NEWS / "test.csv").is_file())):
        print("minilm skipped: all-MiniLM-L6-v2 or AG News missing (see benchmarks/common.py)")
        models.remove("minilm")
    results = measure(models, args)
    # A smoke run writes only where --json says: its figures must not replace the recorded ones.
    out = args.json or (None if args.smoke else Path(__file__).with_name("bench_compile_results.json"))
    if out is not None:
        out.write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.smoke:
        print(f"\nsmoke run ({SMOKE_ROWS} rows, one round): not a measurement, nothing to record")


def measure(models: list[str], args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every model's four runs per round, each in a fresh process, the seed alternating by round."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {m: {r: [] for r in RUNS} for m in models}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            seed = 42 + round_
            for model in models:
                data_dir, cache = Path(tmp) / f"data-{model}", Path(tmp) / f"cache-{model}-{round_}"
                for run in RUNS:  # cold fills this round's empty cache, cached reads it
                    result = in_subprocess(model, run, args.rows, seed, data_dir, cache, args.smoke)
                    results[model][run].append(result)
                    print(model, run, round_, json.dumps(result), flush=True)
    return results


if __name__ == "__main__":
    main()
