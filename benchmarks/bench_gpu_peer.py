"""bench_gpu's peer: the Hugging Face Trainer on the same rows, batch, schedule and precision, timed like ours."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params


def free_device_memory() -> None:
    """Free what the last configuration left (garbage, the CUDA cache) and reset the allocator's peaks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_trainer(
    params: Params, make_model: Any, train: TokenizedSplit, test: TokenizedSplit, meta: dict[str, int],
    device: torch.device, **arguments: Any,
) -> dict[str, float]:  # fmt: skip
    """The Hugging Face Trainer on the same rows, batch, lr, schedule and precision, with `group_by_length`;
    `arguments` override its TrainingArguments (`torch_compile=True`, `train_sampling_strategy="random"`)."""
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
            report_to="none", save_strategy="no", eval_strategy="no",
            logging_strategy="no", disable_tqdm=True, seed=params.seed, dataloader_num_workers=params.num_workers,
            dataloader_pin_memory=params.pin_memory and device.type == "cuda",
            **{"train_sampling_strategy": "group_by_length", **arguments},  # `arguments` may set it (no grouping)
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
