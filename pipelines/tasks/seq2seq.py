"""Sequence-to-sequence fine-tuning of an encoder-decoder (T5): source text → target text, BLEU and chrF.

A row is stored as its source tokens then its target tokens (`prompt_lengths` holds the source
length), so splits keep one layout for every task and the length-grouped sampler buckets by
source + target. The collator splits each row again: the source, right-padded, for the
encoder; the target as labels, and shifted right behind the decoder's start token as the
decoder's input. The loss is cross-entropy over the target tokens, and a window's loss is the
mean over all of its target tokens.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipelines.data.batching import PadCollator, Padding, padded_length
from pipelines.data.loader import eval_batch_rows, score_batches
from pipelines.data.sources import check_columns, drop_or_refuse_empty
from pipelines.data.synthetic import generate_translations
from pipelines.data.tokenization import TokenizedSplit, train_causal_word_tokenizer
from pipelines.noise import wilson_interval
from pipelines.params import DataParams, ModelParams, Params
from pipelines.progress import RowsProgress
from pipelines.runtime import FULL_LOSS, LossImpl, Runtime
from pipelines.tasks.answer_plots import answer_plots
from pipelines.tasks.base import Encoded, EvaluationResult, GenerationProbe, QualityMetric
from pipelines.tasks.causal_lm import IGNORE
from pipelines.tasks.generation import GenerationTask, answer_text, teacher_forced
from pipelines.tasks.linear_ce import projected_cross_entropy

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SOURCE, TARGET = "source", "target"


class Seq2SeqCollator(PadCollator):
    """Rows (source then target tokens) → encoder input, decoder input and labels, each padded to its batch."""

    def __init__(self, split: TokenizedSplit, pad_id: int, *, decoder_start_id: int, **kwargs: Padding):
        super().__init__(split, pad_id, **kwargs)  # type: ignore[arg-type]
        assert split.prompt_lengths is not None, "a seq2seq split has source lengths"
        self.source_lengths = split.prompt_lengths
        self.decoder_start_id = decoder_start_id

    def _width(self, longest: int) -> int:
        return self.fixed_length or padded_length(longest, self.pad_to_multiple_of)

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices)
        sources = self.source_lengths[idx].astype(np.int64)
        targets = self.lengths[idx].astype(np.int64) - sources
        source_ids = np.full((len(idx), self._width(int(sources.max()))), self.pad_id, dtype=np.int64)
        labels = np.full((len(idx), self._width(max(int(targets.max()), 1))), IGNORE, dtype=np.int64)
        for row, (start, source, target) in enumerate(zip(self.offsets[idx], sources, targets, strict=True)):
            tokens = self.input_ids[start : start + source + target]
            source_ids[row, :source] = tokens[:source]
            labels[row, :target] = tokens[source:]
        decoder_input = np.full_like(labels, self.pad_id)
        decoder_input[:, 0] = self.decoder_start_id
        decoder_input[:, 1:] = np.where(labels[:, :-1] == IGNORE, self.pad_id, labels[:, :-1])
        width = source_ids.shape[1]
        return {
            "input_ids": torch.from_numpy(source_ids),
            "attention_mask": torch.from_numpy((np.arange(width)[None, :] < sources[:, None]).astype(np.int64)),
            "decoder_input_ids": torch.from_numpy(decoder_input),
            "labels": torch.from_numpy(labels),
            "row_index": torch.from_numpy(idx.astype(np.int64)),
            "num_rows": torch.tensor(len(idx)),
            "num_tokens": torch.tensor(int((sources + targets).sum())),
            # Encoder and decoder positions, as num_tokens counts source and target tokens: padding in [0, 1].
            "num_positions": torch.tensor(source_ids.size + labels.size),
        }


def target_token_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], loss_impl: LossImpl = FULL_LOSS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed fp32 cross-entropy over target tokens, their count, how many the argmax got right)."""
    decoder_input = batch.get("decoder_input_ids")
    if decoder_input is None:  # a synthetic batch (memory probes): shifted right as the model itself does
        decoder_input = getattr(model, "module", model).prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    labels = batch["labels"]

    def forward() -> torch.Tensor:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return model(**inputs, decoder_input_ids=decoder_input).logits

    # Every position with ignore_index, not the targets picked by a boolean mask: a mask's data-dependent shape
    # costs a host sync per micro-batch on CUDA and cannot be sized on fake tensors (the memory plan). Decoder
    # rows pad only past their EOS, so the fp32 copy covers few positions more than the targets.
    total, correct = projected_cross_entropy(model, forward, labels, loss_impl)
    targets = labels != IGNORE
    return total, targets.sum(), correct


def _append_eos(ids: list[int], eos: int) -> list[int]:
    return ids if ids and ids[-1] == eos else ids + [eos]


class Seq2SeqTask(GenerationTask):
    """Source → target with an encoder-decoder (T5ForConditionalGeneration from a config offline)."""

    name = "seq2seq"
    peft_task_type = "SEQ_2_SEQ_LM"
    objective = ("val_loss", "min")
    validation_metric_names = ("val_loss", "val_token_accuracy")
    quality = (
        QualityMetric("BLEU", "test_bleu"),
        QualityMetric("chrF", "test_chrf"),
        QualityMetric("Exact match", "test_exact_match", scale=100, binomial=True, interval=True),
        QualityMetric("Perplexity", "test_perplexity"),
    )
    validation_quality = (QualityMetric("Validation token accuracy", "val_token_accuracy", scale=100),)
    input_column = "source"

    def predict_texts(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, params: Params, labels: list[str] | None,
        texts: list[str],
    ) -> list[str]:  # fmt: skip
        from pipelines.tasks.generation import generate_texts

        return generate_texts(model, tokenizer, params, texts, continuation=False)

    def generate(self, data: DataParams) -> pd.DataFrame:
        return generate_translations(data.generator)

    def normalize_table(self, table: pd.DataFrame, data: DataParams, where: str) -> pd.DataFrame:
        check_columns(table, [data.source_column, data.target_column], where)
        out = pd.DataFrame(
            {SOURCE: table[data.source_column].astype(str).tolist(), TARGET: table[data.target_column].astype(str)}
        )
        out.index = table.index
        for field, column in ((SOURCE, data.source_column), (TARGET, data.target_column)):
            empty = (out[field].str.strip() == "").to_numpy()
            out = drop_or_refuse_empty(out, empty, repr(column), where, data, table.attrs)
        return out

    def tokenizer_corpus(self, train: pd.DataFrame) -> list[str]:
        return (train[SOURCE] + " " + train[TARGET]).tolist()

    def train_tokenizer(self, train: pd.DataFrame, vocab_size: int) -> PreTrainedTokenizerBase:
        return train_causal_word_tokenizer(self.tokenizer_corpus(train), vocab_size)

    def encode(
        self, tokenizer: PreTrainedTokenizerBase, table: pd.DataFrame, params: Params, meta_dir: Path
    ) -> Encoded:
        limit, eos = params.data.max_length, tokenizer.eos_token_id
        sources = tokenizer(table[SOURCE].tolist(), add_special_tokens=True)["input_ids"]
        targets = tokenizer(table[TARGET].tolist(), add_special_tokens=False)["input_ids"]
        rows, source_lengths, truncated, whole = [], [], 0, []
        for source, target in zip(sources, targets, strict=True):
            source, target = _append_eos(source, eos), _append_eos(target, eos)
            whole.append(max(len(source), len(target)))
            truncated += len(source) > limit or len(target) > limit
            # Source and target are cut to max_length each (the end-of-sequence token kept).
            source = source[: limit - 1] + [eos] if len(source) > limit else source
            target = target[: limit - 1] + [eos] if len(target) > limit else target
            rows.append(source + target)
            source_lengths.append(len(source))
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(lengths.sum()))
        split = TokenizedSplit(flat, lengths, prompt_lengths=np.asarray(source_lengths, np.int32))
        return Encoded(split, truncated, int(np.percentile(whole, 95)) if whole else 0)

    def stacked_layers(self, params: Params, root: Path) -> int | None:
        return None  # an encoder and a decoder, each its own stack: planned whole

    def build_model(
        self, params: Params, tokenizer: PreTrainedTokenizerBase, meta_dir: Path, root: Path, *, weights: bool = True,
        layers: int | None = None,
    ) -> PreTrainedModel:  # fmt: skip
        # Deferred (here and in load_model): see CausalLmTask.build_model.
        from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

        if params.model.name_or_path is None:
            cfg = params.model.config
            config = T5Config(
                vocab_size=len(tokenizer),
                d_model=cfg.hidden_size,
                d_kv=cfg.hidden_size // cfg.num_attention_heads,
                d_ff=cfg.intermediate_size,
                num_layers=cfg.num_hidden_layers,
                num_decoder_layers=cfg.num_hidden_layers,
                num_heads=cfg.num_attention_heads,
                dropout_rate=cfg.dropout,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id,  # T5's convention
            )
            return T5ForConditionalGeneration(config)
        from pipelines.model import load_pretrained

        return load_pretrained(AutoModelForSeq2SeqLM, params.model, root, weights=weights)

    def load_model(self, folder: Path, model: ModelParams) -> PreTrainedModel:
        from transformers import AutoModelForSeq2SeqLM

        return AutoModelForSeq2SeqLM.from_pretrained(str(folder), dtype=torch.float32)

    def collator(
        self,
        split: TokenizedSplit,
        pad_id: int,
        *,
        fixed_length: int | None,
        pad_to_multiple_of: Padding,
        params: Params,
    ) -> PadCollator:
        # T5 starts decoding from its pad token; the collator needs no model to know it.
        return Seq2SeqCollator(
            split, pad_id, decoder_start_id=pad_id, fixed_length=fixed_length, pad_to_multiple_of=pad_to_multiple_of
        )

    def loss_units(self, split: TokenizedSplit, params: Params) -> np.ndarray:
        assert split.prompt_lengths is not None
        return (split.lengths - split.prompt_lengths).astype(np.int64)

    token_loss = staticmethod(target_token_loss)

    def generation_probe(self, split: TokenizedSplit, params: Params) -> GenerationProbe | None:
        # Beam search runs every source num_beams times: the encoder once, then the decoder one token at a time
        # from its start token, with self-attention and cross-attention caches.
        assert split.prompt_lengths is not None
        rows = min(eval_batch_rows(params), len(split)) * params.eval.num_beams
        source = int(np.max(split.prompt_lengths))
        inputs = {"attention_mask": torch.ones(rows, source, dtype=torch.long), "use_cache": True,
                  "decoder_input_ids": torch.zeros(rows, 1, dtype=torch.long)}  # fmt: skip

        def step(out: object, cache: object) -> dict[str, object]:
            encoded = (out.encoder_last_hidden_state,)  # type: ignore[attr-defined]
            return {**inputs, "encoder_outputs": encoded, "past_key_values": cache}

        prefill = {**inputs, "input_ids": torch.zeros(rows, source, dtype=torch.long)}
        return GenerationProbe(prefill, step, new_tokens=params.eval.max_new_tokens - 1)

    def evaluate(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, meta_dir: Path,
                 params: Params, runtime: Runtime) -> EvaluationResult:  # fmt: skip
        return score_translation(model, tokenizer, split, params, runtime, self)


def translate(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, params: Params, runtime: Runtime,
    task: Seq2SeqTask,
) -> list[str]:  # fmt: skip
    """Generated targets for every row, in row order: sources sorted by length, batched, beam size eval.num_beams."""

    def generate(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             max_new_tokens=params.eval.max_new_tokens, num_beams=params.eval.num_beams,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        # Counted as each batch is generated: score_batches returns after the last batch, and counting its list
        # then put the first line at the end, one batch done in the whole time (30m44s "left" for a finished job).
        progress.advance(len(out))
        return out, batch["row_index"].tolist()

    answers = [""] * len(split)
    progress = RowsProgress("generation", len(split))
    for out, rows in score_batches(model, split, params, runtime, task, generate):
        for row, index in enumerate(rows):
            answers[index] = answer_text(tokenizer, out[row, 1:].tolist())  # after the decoder's start token
    return answers


def generation_metrics(generated: list[str], references: list[str]) -> dict[str, float]:
    """Corpus BLEU and chrF (sacrebleu's defaults: 13a tokenization), and exact match with its 95% Wilson interval."""
    import sacrebleu

    exact = np.array([g == r for g, r in zip(generated, references, strict=True)])
    low, high = wilson_interval(int(exact.sum()), len(exact))
    return {
        "test_bleu": float(sacrebleu.corpus_bleu(generated, [references]).score),
        "test_chrf": float(sacrebleu.corpus_chrf(generated, [references]).score),
        "test_exact_match": float(exact.mean()) if len(exact) else 0.0,
        "test_exact_match_ci_low": low,
        "test_exact_match_ci_high": high,
    }


def score_translation(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, params: Params, runtime: Runtime,
    task: Seq2SeqTask,
) -> EvaluationResult:  # fmt: skip
    """Loss, perplexity and token accuracy (teacher-forced); BLEU, chrF (sacrebleu) and exact match of generations."""
    model.to(runtime.device)
    start = time.perf_counter()
    loss, accuracy = teacher_forced(model, split, params, runtime, task)
    generated = translate(model, tokenizer, split, params, runtime, task)
    assert split.prompt_lengths is not None
    rows = [np.asarray(split.input_ids[o : o + n]) for o, n in zip(split.offsets, split.lengths, strict=True)]
    sources = [
        tokenizer.decode(r[:p], skip_special_tokens=True) for r, p in zip(rows, split.prompt_lengths, strict=True)
    ]
    references = [answer_text(tokenizer, r[p:]) for r, p in zip(rows, split.prompt_lengths, strict=True)]
    metrics = {
        "test_loss": loss,
        "test_perplexity": math.exp(min(loss, 700.0)),
        "test_token_accuracy": accuracy,
        **generation_metrics(generated, references),
        "test_rows": float(len(split)),
        "eval_samples_per_s": len(split) / (time.perf_counter() - start),
    }
    exact = np.array([g == r for g, r in zip(generated, references, strict=True)])
    predictions = pd.DataFrame(
        {
            "row_id": np.arange(len(split)),
            "source": sources,
            "reference": references,
            "generated": generated,
            "exact_match": exact.astype(int),
        }
    )
    return EvaluationResult(metrics, predictions, answer_plots(references, generated))
