"""Scoring a causal LM: teacher-forced loss and token accuracy, and greedy generation's exact match.

Generation is batched and length-bucketed like training: prompts are sorted by length, cut
into batches and left-padded (a decoder continues from the last position, so padding goes
first), and every answer is bounded by `eval.max_new_tokens`. Predictions go back to the
split's row order.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipelines.data.loader import eval_batch_rows, score_batches
from pipelines.data.tokenization import TokenizedSplit
from pipelines.noise import wilson_interval
from pipelines.params import Params
from pipelines.progress import RowsProgress
from pipelines.runtime import FULL_LOSS, LossImpl, Runtime, eval_mode
from pipelines.tasks.answer_plots import answer_plots
from pipelines.tasks.base import EvaluationResult, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class GenerationTask(Task):
    """What the two generating tasks (causal LM, seq2seq) share: a loss over target tokens that also counts the
    argmax's hits (`token_loss`), the teacher-forced validation metrics, and synthetic labels for probes."""

    projects_vocabulary = True

    @staticmethod
    @abstractmethod
    def token_loss(
        model: nn.Module, batch: dict[str, torch.Tensor], loss_impl: LossImpl = FULL_LOSS
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed fp32 cross-entropy over the batch's target tokens, their count, how many the argmax got right)."""

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], loss_impl: LossImpl = FULL_LOSS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total, count, _ = self.token_loss(model, batch, loss_impl)
        return total, count

    def probe_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.clone()

    def validation_metrics(
        self, model: nn.Module, split: TokenizedSplit, params: Params, runtime: Runtime
    ) -> dict[str, float]:
        loss, accuracy = teacher_forced(model, split, params, runtime, self)
        return {"val_loss": loss, "val_token_accuracy": accuracy}


def teacher_forced(
    model: nn.Module, split: TokenizedSplit, params: Params, runtime: Runtime, task: GenerationTask
) -> tuple[float, float]:
    """(mean loss over the split's target tokens, share of them the argmax predicts), in `task`'s batches, with the
    runtime's loss projection."""
    total = torch.zeros((), device=runtime.device, dtype=torch.float64)
    count = correct = torch.zeros((), device=runtime.device, dtype=torch.long)
    scored = score_batches(model, split, params, runtime, task, lambda b: task.token_loss(model, b, runtime.loss))
    for loss, n, right in scored:
        total, count, correct = total + loss.double(), count + n, correct + right
    n_targets = max(int(count), 1)
    return float(total) / n_targets, int(correct) / n_targets


def fit_to_length(prompt: list[int], target: list[int], limit: int, bos: int | None) -> tuple[list[int], list[int]]:
    """A (prompt, target) pair cut to `limit` tokens keeping what is trained and scored: the target whole when it
    fits beside one prompt token (else cut at its end), and the prompt's end, where an instruction's question and a
    chat template's assistant header are (its first token kept when it is the BOS). Cutting the whole row at its end
    instead (TRL's default) left 26 of 40 test answers of our causal-LM tutorial empty at max_length 64."""
    if len(prompt) + len(target) <= limit:
        return prompt, target
    target = target[: max(limit - 1, 1)]
    room = limit - len(target)
    if room <= 0 or not prompt:
        return [], target[:limit]
    head = prompt[:1] if bos is not None and prompt[0] == bos and room > 1 else []
    return head + prompt[len(prompt) - (room - len(head)) :], target


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
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list[np.ndarray], params: Params, runtime: Runtime
) -> list[str]:
    """Greedy answers to `prompts` (token ids), in their order: length-bucketed, left-padded batches."""
    with eval_mode(model):
        return _greedy_answers(model, tokenizer, prompts, params, runtime)


def _greedy_answers(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list[np.ndarray], params: Params, runtime: Runtime
) -> list[str]:
    pad_id, device = tokenizer.pad_token_id, runtime.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows = eval_batch_rows(params)
    answers = [""] * len(prompts)
    progress = RowsProgress("generation", len(prompts))
    for start in range(0, len(order), rows):
        batch = order[start : start + rows]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]) :] = torch.from_numpy(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        with runtime.autocast():
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
        progress.advance(len(batch))
    return answers


def score_generation(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, params: Params, runtime: Runtime,
    task: GenerationTask,
) -> EvaluationResult:  # fmt: skip
    """Loss, perplexity and token accuracy (teacher-forced), and exact match of greedy answers with its interval."""
    model.to(runtime.device)
    start = time.perf_counter()
    loss, token_accuracy = teacher_forced(model, split, params, runtime, task)
    pairs = [_row_tokens(split, row) for row in range(len(split))]
    generated = generate_answers(model, tokenizer, [prompt for prompt, _ in pairs], params, runtime)
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
