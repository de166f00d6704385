"""Scoring a causal LM: teacher-forced loss and token accuracy, and greedy generation's exact match.

Generation is batched and length-bucketed like training: prompts are sorted by length, cut
into batches and left-padded (a decoder continues from the last position, so padding goes
first), and every answer is bounded by `eval.max_new_tokens`. Predictions go back to the
split's row order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipelines.data.loader import eval_batch_rows, eval_batches
from pipelines.data.tokenization import TokenizedSplit
from pipelines.noise import wilson_interval
from pipelines.params import Params
from pipelines.runtime import ResolvedPrecision, autocast_context
from pipelines.tasks.answer_plots import answer_plots
from pipelines.tasks.base import EvaluationResult, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# (model, batch) -> (summed fp32 loss over target tokens, their count, how many the argmax got right)
TokenLoss = Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def teacher_forced(
    model: nn.Module,
    split: TokenizedSplit,
    params: Params,
    pad_id: int,
    device: torch.device,
    precision: ResolvedPrecision,
    task: Task,
    token_loss: TokenLoss,
) -> tuple[float, float]:
    """(mean loss over the split's target tokens, share of them the argmax predicts), in `task`'s batches."""
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = correct = torch.zeros((), device=device, dtype=torch.long)
    was_training = model.training
    model.eval()
    for batch in eval_batches(model, split, params, pad_id, device, task):
        with autocast_context(precision, device):
            loss, n, right = token_loss(model, batch)
        total, count, correct = total + loss.double(), count + n, correct + right
    model.train(was_training)
    n_targets = max(int(count), 1)
    return float(total) / n_targets, int(correct) / n_targets


def _row_tokens(split: TokenizedSplit, row: int) -> tuple[np.ndarray, np.ndarray]:
    assert split.prompt_lengths is not None
    start, length, prompt = int(split.offsets[row]), int(split.lengths[row]), int(split.prompt_lengths[row])
    ids = np.asarray(split.input_ids[start : start + length], dtype=np.int64)
    return ids[:prompt], ids[prompt:]


def answer_text(tokenizer: PreTrainedTokenizerBase, ids: list[int] | np.ndarray) -> str:
    """Text of an answer's tokens up to its first end-of-sequence token."""
    ids = list(ids)
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


@torch.inference_mode()
def generate_answers(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[np.ndarray],
    params: Params,
    device: torch.device,
    precision: ResolvedPrecision,
) -> list[str]:
    """Greedy answers to `prompts` (token ids), in their order: length-bucketed, left-padded batches."""
    was_training = model.training
    model.eval()
    pad_id = tokenizer.pad_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows = eval_batch_rows(params)
    answers = [""] * len(prompts)
    for start in range(0, len(order), rows):
        batch = order[start : start + rows]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]) :] = torch.from_numpy(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        with autocast_context(precision, device):
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=params.eval.max_new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        for row, i in enumerate(batch):
            answers[i] = answer_text(tokenizer, out[row, width:].tolist())
    model.train(was_training)
    return answers


def score_generation(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    split: TokenizedSplit,
    params: Params,
    device: torch.device,
    precision: ResolvedPrecision,
    task: Task,
    token_loss: TokenLoss,
) -> EvaluationResult:
    """Loss, perplexity and token accuracy (teacher-forced), and exact match of greedy answers with its interval."""
    model.to(device)
    start = time.perf_counter()
    pad_id = tokenizer.pad_token_id
    loss, token_accuracy = teacher_forced(model, split, params, pad_id, device, precision, task, token_loss)
    pairs = [_row_tokens(split, row) for row in range(len(split))]
    generated = generate_answers(model, tokenizer, [prompt for prompt, _ in pairs], params, device, precision)
    references = [answer_text(tokenizer, response) for _, response in pairs]
    exact = np.array([g == r for g, r in zip(generated, references, strict=True)])
    low, high = wilson_interval(int(exact.sum()), len(exact))
    metrics = {
        "test_loss": loss,
        "test_perplexity": math.exp(min(loss, 700.0)),
        "test_token_accuracy": token_accuracy,
        "test_exact_match": float(exact.mean()) if len(exact) else 0.0,
        "test_exact_match_ci_low": low,
        "test_exact_match_ci_high": high,
        "test_rows": float(len(split)),
        "eval_samples_per_s": len(split) / (time.perf_counter() - start),
    }
    predictions = pd.DataFrame(
        {
            "row_id": np.arange(len(split)),
            "prompt": [tokenizer.decode(prompt, skip_special_tokens=True) for prompt, _ in pairs],
            "reference": references,
            "generated": generated,
            "exact_match": exact.astype(int),
        }
    )
    return EvaluationResult(metrics, predictions, answer_plots(references, generated))


@torch.inference_mode()
def generate_texts(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, params: Params, texts: list[str], *, continuation: bool
) -> list[str]:
    """Greedy generations for raw texts, 32 at a time, on the CPU; `continuation`: a decoder's (prompt cut off)."""
    answers: list[str] = []
    for start in range(0, len(texts), 32):
        chunk = texts[start : start + 32]
        if continuation:
            tokenizer.padding_side = "left"  # a decoder continues the prompt's last token
        encoded = tokenizer(chunk, truncation=True, max_length=params.data.max_length, padding=True,
                            return_tensors="pt")  # fmt: skip
        out = model.generate(**encoded, max_new_tokens=params.eval.max_new_tokens, do_sample=False)
        if continuation:
            out = out[:, encoded["input_ids"].shape[1] :]
        answers += tokenizer.batch_decode(out, skip_special_tokens=True)
    return [a.strip() for a in answers]
