"""A tiny model and tokenized split for engine tests (CPU, seconds)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification

from pipelines.data.tokenization import TokenizedSplit
from pipelines.runtime import Runtime
from pipelines.train.step import TrainStep, make_scaler


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


# Collectives fail after this long instead of gloo's default 30 minutes.
PROCESS_GROUP_TIMEOUT = timedelta(seconds=60)


@contextmanager
def loopback_process_group(rank: int, world_size: int, init_method: str) -> Iterator[None]:
    """A gloo process group over loopback only, destroyed on exit.

    Gloo otherwise picks its interface from how the machine's hostname resolves; pinning `lo` keeps a
    single-machine test independent of that.

    Create DDP models in a function called inside the block, so they are freed before the group is destroyed:
    a DDP Reducer that drops the group's last reference runs the gloo destructor with the GIL held, and that
    deadlocks (2 runs in 11, measured) when gloo's worker thread still needs the GIL to free the last
    collective's work.
    """
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def loopback_init_method() -> str:
    """A TCP rendezvous on 127.0.0.1 with a free port: no store file to place or clean up."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def cpu_runtime(precision: str = "fp32", pad_id: int = 0) -> Runtime:
    """A resolved CPU runtime (the full loss projection) for tests that run the step directly."""
    return Runtime(torch.device("cpu"), precision, False, None, pad_id)  # type: ignore[arg-type]


def cpu_step(model: torch.nn.Module, task: object, precision: str = "fp32", max_grad_norm: float | None = None,
             optimizer: torch.optim.Optimizer | None = None, scaler: bool = True) -> TrainStep:  # fmt: skip
    """The trial's step object on a CPU runtime (an SGD at lr 0 when no optimizer is given: backward-only tests)."""
    runtime = cpu_runtime(precision)
    optimizer = optimizer or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    return TrainStep(model, optimizer, task, runtime, make_scaler(runtime, enabled=scaler), max_grad_norm)  # type: ignore[arg-type]
