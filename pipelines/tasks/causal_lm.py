"""Causal-LM fine-tuning: instruction (prompt → response), chat, or plain text, on a decoder.

A row is its prompt's tokens then its response's tokens and an end-of-sequence token. The loss
is next-token cross-entropy over the *target* tokens only: the response's (and the prompt's
too with `train_on_prompt`), never padding. Their count per row is known from the lengths
alone, so a window's loss is the mean over all its target tokens, whatever its micro-batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipelines.data.batching import PadCollator, Padding
from pipelines.data.formats import as_messages, cell_text, render_prompts, template_fields
from pipelines.data.loader import eval_batch_rows
from pipelines.data.packing import IGNORE, PackedSplit, check_isolation, pack_split, packed_targets
from pipelines.data.sources import check_columns, drop_or_refuse_empty
from pipelines.data.synthetic import generate_instructions
from pipelines.data.tokenization import TokenizedSplit, train_causal_word_tokenizer
from pipelines.errors import UserError
from pipelines.params import DataParams, ModelParams, Params
from pipelines.runtime import FULL_LOSS, LossImpl, Runtime
from pipelines.tasks.base import Encoded, EvaluationResult, GenerationProbe, QualityMetric
from pipelines.tasks.generation import GenerationTask, fit_to_length, score_generation
from pipelines.tasks.linear_ce import forward_takes, projected_cross_entropy

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def source_columns(data: DataParams) -> dict[str, str]:
    """Which source columns a causal-LM row comes from: a chat, a prompt/response pair, or one text (with
    data.prompt_template, the prompt is built from the template's columns: `pipelines.data.formats`)."""
    if data.messages_column is not None:
        return {"messages": data.messages_column}
    if data.prompt_template is not None and data.response_column is not None:
        return {"response": data.response_column}
    if data.prompt_column is not None and data.response_column is not None:
        return {"prompt": data.prompt_column, "response": data.response_column}
    assert isinstance(data.text_column, str)  # the schema refuses a list for causal_lm
    return {"response": data.text_column}


def mask_labels(
    tokens: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor, train_on_prompt: bool
) -> torch.Tensor:
    """Labels from label tokens (the input ids): padding, and the prompt unless trained on, set to IGNORE."""
    target = attention_mask.bool()
    if not train_on_prompt:
        target &= torch.arange(tokens.shape[1])[None, :] >= prompt_lengths[:, None]
    return torch.where(target, tokens, IGNORE)


class CausalLmCollator(PadCollator):
    """Pads rows on the right; `labels` are the token ids with prompt (unless trained on) and padding masked."""

    def __init__(self, split: TokenizedSplit, pad_id: int, *, train_on_prompt: bool, **kwargs: Padding):
        super().__init__(split, pad_id, **kwargs)  # type: ignore[arg-type]
        assert split.prompt_lengths is not None, "a causal-LM split has prompt lengths"
        self.prompt_lengths = split.prompt_lengths
        self.train_on_prompt = train_on_prompt

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = super().__call__(indices)
        prompts = torch.from_numpy(self.prompt_lengths[np.asarray(indices)].astype(np.int64))
        batch["labels"] = mask_labels(batch["input_ids"], batch["attention_mask"], prompts, self.train_on_prompt)
        return with_targets(batch)


class PackedCausalLmCollator(PadCollator):
    """Packs padded on the right, with `position_ids` restarting per example and no 2-D attention mask.

    Without the mask, transformers isolates each example by its positions (see pipelines.data.packing);
    `num_rows` counts examples, not packs, so samples/s stays comparable with unpacked runs.
    """

    def __init__(self, split: PackedSplit, pad_id: int, *, train_on_prompt: bool, **kwargs: Padding):
        super().__init__(split, pad_id, **kwargs)  # type: ignore[arg-type]
        self.split = split
        self.train_on_prompt = train_on_prompt

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = super().__call__(indices)
        width = batch["input_ids"].shape[1]
        targets = [packed_targets(self.split, pack, width, self.train_on_prompt) for pack in indices]
        batch["position_ids"] = torch.from_numpy(np.stack([positions for positions, _ in targets]))
        batch["labels"] = torch.from_numpy(np.stack([labels for _, labels in targets]))
        starts = self.split.segment_starts
        batch["num_rows"] = torch.tensor(int((starts[np.asarray(indices) + 1] - starts[np.asarray(indices)]).sum()))
        del batch["attention_mask"]
        return with_targets(batch)


def target_counts(lengths: np.ndarray, prompt_lengths: np.ndarray, train_on_prompt: bool) -> np.ndarray:
    """Target tokens per row: positions 1..L-1 (the first token has nothing before it), after the prompt if masked."""
    first = np.ones_like(lengths) if train_on_prompt else np.maximum(prompt_lengths, 1)
    return np.maximum(lengths.astype(np.int64) - first, 0)


def next_token_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, targets), both (rows x K): the positions whose next token is a target, and that token.

    K is the most targets any row has; a row with fewer fills its last slots with other
    positions and IGNORE targets. Integer positions rather than a boolean mask: the collator computes them on the host,
    so the step has no data-dependent shape (no device sync on CUDA, and a memory plan on fake
    tensors can size it).
    """
    keep = labels[:, 1:] != IGNORE
    k = max(int(keep.sum(1).max()) if keep.numel() else 0, 1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :k]  # target positions first, in order
    order = torch.cat([order, order.new_zeros(len(order), max(k - order.shape[1], 0))], dim=1)
    valid = torch.take_along_dim(keep, order, dim=1) if keep.shape[1] else torch.zeros_like(order, dtype=torch.bool)
    targets = torch.where(valid, torch.take_along_dim(labels[:, 1:], order, dim=1), IGNORE)
    return order, targets


def with_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with `target_positions`/`target_labels` from its `labels` (see `next_token_targets`)."""
    batch["target_positions"], batch["target_labels"] = next_token_targets(batch["labels"])
    return batch


def _keeps_logits(model: nn.Module) -> bool:
    """Whether the (unwrapped) model's forward takes our 2-D `logits_to_keep` (most transformers decoders do).

    Only transformers versions with `slice_logits_to_keep` read a 2-D tensor as per-row positions; before it, the
    decoders index `hidden_states[:, positions, :]`, which broadcasts to batch x batch x positions (found on the
    GPU machine's transformers). Those models get full logits and the same loss instead."""
    from transformers import modeling_utils

    return forward_takes(model, "logits_to_keep") and hasattr(modeling_utils, "slice_logits_to_keep")


def next_token_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], loss_impl: LossImpl = FULL_LOSS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed fp32 cross-entropy over target tokens, their count, how many the argmax got right).

    The vocabulary projection runs only at positions whose next token is a target
    (`logits_to_keep` with the collator's integer positions): with the prompt masked that skips
    most of a row's (rows x length x vocab) logits, the largest tensor of a small model's step.
    Models without that argument get full logits, and the same loss. With the loss chunked
    (`loss_impl`), the projection itself runs a chunk of positions at a time (`pipelines.tasks.linear_ce`).
    """
    if "target_positions" not in batch:  # a batch not from our collators (e.g. the batch-size probe)
        batch = with_targets(dict(batch))
    positions, targets = batch["target_positions"], batch["target_labels"]
    # A packed batch has position ids and no attention mask; training never needs a key/value cache.
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    if _keeps_logits(model):
        forward = lambda: model(**inputs, use_cache=False, logits_to_keep=positions).logits  # noqa: E731
    else:
        forward = lambda: torch.take_along_dim(  # noqa: E731
            model(**inputs, use_cache=False).logits, positions[..., None], dim=1
        )
    total, correct = projected_cross_entropy(model, forward, targets, loss_impl)
    counted = targets != IGNORE
    return total, counted.sum(), correct


class CausalLmTask(GenerationTask):
    """Instruction, chat or plain-text fine-tuning of a decoder (LlamaForCausalLM from a config offline)."""

    name = "causal_lm"
    peft_task_type = "CAUSAL_LM"
    objective = ("val_loss", "min")
    validation_metric_names = ("val_loss", "val_token_accuracy")
    quality = (
        QualityMetric("Exact match", "test_exact_match", scale=100, binomial=True, interval=True),
        QualityMetric("Token accuracy", "test_token_accuracy", scale=100),
        QualityMetric("Perplexity", "test_perplexity"),
    )
    validation_quality = (QualityMetric("Validation token accuracy", "val_token_accuracy", scale=100),)
    input_column = "prompt"

    def predict_texts(
        self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, params: Params, labels: list[str] | None,
        texts: list[str],
    ) -> list[str]:  # fmt: skip
        from pipelines.tasks.generation import generate_texts

        return generate_texts(model, tokenizer, params, texts, continuation=True)

    def example_texts(self, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, count: int = 3) -> list[str]:
        assert split.prompt_lengths is not None  # what the model is given: the prompts only
        return [tokenizer.decode(split.input_ids[split.offsets[i] : split.offsets[i] + split.prompt_lengths[i]],
                                 skip_special_tokens=True) for i in range(min(count, len(split)))]  # fmt: skip

    def generate(self, data: DataParams) -> pd.DataFrame:
        return generate_instructions(data.generator)

    def normalize_table(self, table: pd.DataFrame, data: DataParams, where: str) -> pd.DataFrame:
        columns = source_columns(data)
        templated = data.prompt_template is not None and "messages" not in columns
        fields = template_fields(data.prompt_template) if templated else []
        check_columns(table, list(columns.values()) + fields, where)
        out = pd.DataFrame({field: table[column].tolist() for field, column in columns.items()}, index=table.index)
        if "messages" in out:
            out["messages"] = [as_messages(chat, where, row) for row, chat in enumerate(out["messages"])]
            return out
        if templated:
            out["prompt"] = render_prompts(data.prompt_template, table[fields].to_dict("records"))
        out["prompt"] = out["prompt"].astype(str) if "prompt" in out else ""
        out["response"] = [cell_text(value) for value in out["response"]]  # a missing answer is empty, not "None"
        empty = (out["response"].str.strip() == "").to_numpy()
        return drop_or_refuse_empty(out, empty, repr(columns["response"]), where, data, table.attrs)

    def tokenizer_corpus(self, train: pd.DataFrame) -> list[str]:
        if "messages" in train:
            raise UserError(
                "data.messages_column needs a tokenizer with a chat template: name a pretrained model "
                "(model.name_or_path), or use data.prompt_column/response_column with a model built from model.config"
            )
        return (train["prompt"] + train["response"]).tolist()

    def train_tokenizer(self, train: pd.DataFrame, vocab_size: int) -> PreTrainedTokenizerBase:
        return train_causal_word_tokenizer(self.tokenizer_corpus(train), vocab_size)

    def encode(
        self, tokenizer: PreTrainedTokenizerBase, table: pd.DataFrame, params: Params, meta_dir: Path
    ) -> Encoded:
        from pipelines.tasks.chat import render_chats

        prompts, responses = (
            render_chats(tokenizer, table["messages"].tolist())
            if "messages" in table
            else (table["prompt"].tolist(), table["response"].tolist())
        )
        # Encoded apart, as generation will see them: the prompt alone, then the model's answer.
        prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
        response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
        eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
        limit = params.data.max_length
        rows, prompt_lengths, truncated, whole = [], [], 0, []
        for prompt, response in zip(prompt_ids, response_ids, strict=True):
            target = response + ([eos] if not response or response[-1] != eos else [])
            whole.append(len(prompt) + len(target))
            truncated += whole[-1] > limit
            kept_prompt, kept_target = fit_to_length(prompt, target, limit, bos)
            rows.append(kept_prompt + kept_target)
            prompt_lengths.append(len(kept_prompt))
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(lengths.sum()))
        split = TokenizedSplit(flat, lengths, prompt_lengths=np.asarray(prompt_lengths, dtype=np.int32))
        return Encoded(split, truncated, int(np.percentile(whole, 95)) if whole else 0)

    def build_model(
        self, params: Params, tokenizer: PreTrainedTokenizerBase, meta_dir: Path, root: Path, *, weights: bool = True,
        layers: int | None = None,
    ) -> PreTrainedModel:  # fmt: skip
        # Deferred (here and in load_model): transformers' model classes cost seconds to import, and the stages that
        # only read a task's declarations (its objective, its report columns) build no model.
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        if params.model.name_or_path is None:
            cfg = params.model.config
            config = LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_hidden_layers=layers or cfg.num_hidden_layers,
                num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_attention_heads,
                max_position_embeddings=max(512, params.data.max_length + params.eval.max_new_tokens),
                attention_dropout=cfg.dropout,
                tie_word_embeddings=True,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            return LlamaForCausalLM(config)
        from pipelines.model import load_pretrained

        depth = {"num_hidden_layers": layers} if layers else {}
        return load_pretrained(AutoModelForCausalLM, params.model, root, weights=weights, **depth)

    def load_model(self, folder: Path, model: ModelParams) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)

    def collator(
        self,
        split: TokenizedSplit,
        pad_id: int,
        *,
        fixed_length: int | None,
        pad_to_multiple_of: Padding,
        params: Params,
    ) -> PadCollator:
        collator = PackedCausalLmCollator if isinstance(split, PackedSplit) else CausalLmCollator
        return collator(
            split,  # type: ignore[arg-type]
            pad_id,
            train_on_prompt=params.train_on_prompt,
            fixed_length=fixed_length,
            pad_to_multiple_of=pad_to_multiple_of,
        )

    def loss_units(self, split: TokenizedSplit, params: Params) -> np.ndarray:
        if isinstance(split, PackedSplit):  # a pack's units: its examples' target tokens
            units = target_counts(split.segment_lengths, split.segment_prompt_lengths, params.train_on_prompt)
            return np.add.reduceat(units, split.segment_starts[:-1])
        assert split.prompt_lengths is not None
        return target_counts(split.lengths, split.prompt_lengths, params.train_on_prompt)

    def training_split(self, split: TokenizedSplit, params: Params, model: nn.Module | None) -> TokenizedSplit:
        """With `data.packing`, the rows packed up to data.max_length, once the model is known to isolate them."""
        if not params.data.packing or isinstance(split, PackedSplit):
            return split
        reason = None if model is None else check_isolation(model, int(model.get_input_embeddings().num_embeddings))
        if reason is not None:
            raise UserError(f"data.packing: {reason}")
        return pack_split(split, params.data.max_length)

    token_loss = staticmethod(next_token_loss)

    def generation_probe(self, split: TokenizedSplit, params: Params) -> GenerationProbe | None:
        # Generation batches the longest prompts together (sorted by length, left-padded), then appends up to
        # max_new_tokens one at a time, keeping the last position's logits only.
        prompts = getattr(split, "segment_prompt_lengths", split.prompt_lengths)  # packs: their examples' prompts
        if prompts is None or not len(prompts):
            return None
        rows, new = min(eval_batch_rows(params), len(prompts)), params.eval.max_new_tokens
        width = max(int(np.max(prompts)), 1)  # plain language modelling: no prompt, generation from one token

        def step(_out: object, cache: object) -> dict[str, object]:
            return {"input_ids": torch.zeros(rows, 1, dtype=torch.long), "past_key_values": cache, "use_cache": True,
                    "attention_mask": torch.ones(rows, width + new, dtype=torch.long), "logits_to_keep": 1}  # fmt: skip

        prefill = {"input_ids": torch.zeros(rows, width, dtype=torch.long), "use_cache": True, "logits_to_keep": 1,
                   "attention_mask": torch.ones(rows, width, dtype=torch.long)}  # fmt: skip
        return GenerationProbe(prefill, step, new_tokens=new - 1)

    def evaluate(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, split: TokenizedSplit, meta_dir: Path,
                 params: Params, runtime: Runtime) -> EvaluationResult:  # fmt: skip
        return score_generation(model, tokenizer, split, params, runtime, self)
