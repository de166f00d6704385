"""A tiny model and tokenized split for engine tests (CPU, seconds)."""

from __future__ import annotations

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification

from pipelines.data.tokenization import TokenizedSplit


def tiny_model(layers: int = 2, hidden: int = 32, dropout: float = 0.0, seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=120,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=128,
        num_labels=3,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(config)


def tiny_split(rows: int = 96, max_len: int = 40, seed: int = 0) -> TokenizedSplit:
    """Rows of unequal length whose label is readable from their tokens (so a model can learn it)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, max_len, size=rows).astype(np.int32)
    labels = rng.integers(0, 3, size=rows)
    ids = []
    for length, label in zip(lengths, labels, strict=True):
        row = rng.integers(10, 100, size=length)
        row[1 : length - 1 : 3] = 100 + label  # label-bearing tokens
        row[0], row[-1] = 2, 3
        ids.append(row)
    return TokenizedSplit(np.concatenate(ids).astype(np.int32), lengths, labels.astype(np.int64))
