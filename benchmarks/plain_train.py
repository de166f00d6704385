"""The reference for `bench_fixed_cost`: the default experiment's training as a plain PyTorch script, nothing else.

    python -m benchmarks.plain_train [--root PROJECT] [--optim adafactor]

Reads the project's `data/tokenized` arrays and params.yaml, builds the same BERT config model (transformers'
`BertForSequenceClassification`, as `pipelines.model.build_model` does), trains `epochs` epochs with transformers'
Adafactor (or AdamW) at `lr` with a linear warm-up schedule over length-bucketed batches (rows sorted by length in
chunks, then the batches shuffled: the same padding the pipeline's bucketing gives), clips gradients at
`max_grad_norm`, scores validation after each epoch and the test split at the end, and prints the figures. No
tracking, no Ray, no DVC, no checkpoints: the whole process's wall time is what training and scoring cost alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

START = time.perf_counter()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup  # noqa: E402
from transformers.optimization import Adafactor  # noqa: E402


def load_split(folder: Path) -> tuple[list[np.ndarray], np.ndarray]:
    """A tokenized split as per-row token ids and labels (the files `TokenizedSplit.save` writes)."""
    ids, lengths = np.load(folder / "input_ids.npy"), np.load(folder / "lengths.npy")
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [ids[o : o + n] for o, n in zip(offsets, lengths, strict=True)], np.load(folder / "labels.npy")


def batches(rows: list[np.ndarray], batch_size: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    """Length-bucketed batches: shuffled rows sorted by length within chunks of 50 batches, the batches shuffled
    (rng None: in length order, for scoring)."""
    order = np.arange(len(rows)) if rng is None else rng.permutation(len(rows))
    chunk = batch_size * 50
    out = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lambda i: len(rows[i]))
        out += [np.asarray(part[i : i + batch_size]) for i in range(0, len(part), batch_size)]
    if rng is not None:
        rng.shuffle(out)
    return out


def padded(rows: list[np.ndarray], index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(rows[i]) for i in index)
    ids = torch.zeros((len(index), width), dtype=torch.long)
    mask = torch.zeros((len(index), width), dtype=torch.long)
    for r, i in enumerate(index):
        ids[r, : len(rows[i])] = torch.from_numpy(rows[i].astype(np.int64))
        mask[r, : len(rows[i])] = 1
    return ids, mask


@torch.inference_mode()
def accuracy(model: torch.nn.Module, rows: list[np.ndarray], labels: np.ndarray, batch_size: int) -> float:
    model.eval()
    correct = 0
    for index in batches(rows, batch_size, None):
        ids, mask = padded(rows, index)
        correct += int((model(input_ids=ids, attention_mask=mask).logits.argmax(-1).numpy() == labels[index]).sum())
    model.train()
    return correct / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd())
    parser.add_argument("--optim", default="adafactor", choices=["adafactor", "adamw"])
    args = parser.parse_args()
    params = yaml.safe_load((args.root / "params.yaml").read_text())
    tokenized = args.root / "data" / "tokenized"
    torch.manual_seed(params["seed"])
    train, train_labels = load_split(tokenized / "train")
    names = json.loads((tokenized / "labels.json").read_text())["names"]
    cfg = params["model"]["config"]
    vocab = json.loads((tokenized / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(vocab), hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"], intermediate_size=cfg["intermediate_size"],
        hidden_dropout_prob=cfg["dropout"], attention_probs_dropout_prob=cfg["dropout"],
        max_position_embeddings=max(512, params["data"]["max_length"]), num_labels=len(names)))  # fmt: skip
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": params["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = (Adafactor(groups, lr=params["lr"], scale_parameter=False, relative_step=False, warmup_init=False)
                 if args.optim == "adafactor" else torch.optim.AdamW(groups, lr=params["lr"]))  # fmt: skip
    rng = np.random.default_rng(params["seed"])
    steps = params["epochs"] * len(batches(train, params["batch_size"], rng))
    schedule = get_linear_schedule_with_warmup(optimizer, int(params["warmup_ratio"] * steps), steps)
    validation, validation_labels = load_split(tokenized / "validation")
    train_start = time.perf_counter()
    for _ in range(params["epochs"]):
        for index in batches(train, params["batch_size"], rng):
            ids, mask = padded(train, index)
            loss = model(input_ids=ids, attention_mask=mask, labels=torch.from_numpy(train_labels[index])).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), params["max_grad_norm"])
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        val_accuracy = accuracy(model, validation, validation_labels, params["batch_size"])
    train_s = time.perf_counter() - train_start
    test, test_labels = load_split(tokenized / "test")
    print(json.dumps({"train_time_s": round(train_s, 3), "val_accuracy": round(val_accuracy, 4),
                      "test_accuracy": round(accuracy(model, test, test_labels, params["batch_size"]), 4),
                      "process_s_before_exit": round(time.perf_counter() - START, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
