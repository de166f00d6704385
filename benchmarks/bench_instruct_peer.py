"""bench_instruct's peer side: the same fine-tune through TRL's SFTTrainer, and the `--peers` table (ours vs TRL,
per seed). Run by `python -m benchmarks.bench_instruct`; not a command of its own."""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

from pipelines.params import Params

OURS = "ours LoRA"  # the --peers configuration every TRL one is compared with


def trl_missing() -> str | None:
    """Why TRL's side cannot run here (TRL not installed), or None when it can."""
    if importlib.util.find_spec("trl") is None:
        return "TRL not installed (pip install -e '.[bench]')"
    return None


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


def sft_config(params: Params, out: str, steps: int, defaults: bool) -> Any:
    """TRL's arguments set to ours (`params`); `defaults`: gradient checkpointing left at TRL's default (on)."""
    from trl import SFTConfig

    return SFTConfig(
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


def train_trl(params: Params, model: Any, tokenizer: Any, source: Path, defaults: bool = False) -> dict[str, Any]:
    """The same fine-tune through TRL's SFTTrainer: prompt-completion rows, completion-only loss, same LoRA.

    `defaults`: gradient checkpointing left at TRL's default (on) instead of set to ours (params)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTTrainer

    train = pd.read_csv(source / "train.csv", keep_default_na=False)
    steps = -(-len(train) // params.batch_size) * params.epochs
    with tempfile.TemporaryDirectory() as out:
        args = sft_config(params, out, steps, defaults)
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


def peer_precision() -> str:
    """bf16 where the CPU has it natively (AVX-512 BF16 or AMX) and it was measured faster than fp32 on its kind of
    host (`pipelines.runtime.cpu_has_fast_bf16`), else fp32: emulated bf16 is slow for everyone."""
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
    ours = runs[OURS]
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
        if name == OURS:
            continue
        steps = [ours[s]["train_time_s"] / by_seed[s]["train_time_s"] for s in seeds]
        wall = [ours[s]["wall_time_s"] / by_seed[s]["wall_time_s"] for s in seeds]
        sd = statistics.stdev if len(seeds) > 1 else (lambda values: 0.0)
        print(f"\nours vs {name}: steps {statistics.mean(steps):.2f}x ± {sd(steps):.2f}, "
              f"wall {statistics.mean(wall):.2f}x ± {sd(wall):.2f} (mean ± sd over {len(seeds)} seeds)")  # fmt: skip
        print(f"  {name}'s effective config: {by_seed[seeds[0]]['trl_effective_config']}")
