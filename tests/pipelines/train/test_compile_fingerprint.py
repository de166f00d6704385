"""The compile fingerprint keys exactly what decides whether a compiled run finds its graphs: the attention
implementation and the data-parallel strategy are in it; under a dynamic width the widths are not (one graph serves
them all), under a static compile they are. Keys come from `resolve_compile`, as a run's do (no compile: seconds)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import BertConfig, BertForSequenceClassification

from pipelines.data.tokenization import TokenizedSplit
from pipelines.runtime import resolve_runtime
from pipelines.tasks import get_task
from pipelines.train.compile_cache import compile_parts, fingerprint
from pipelines.train.compile_decision import resolve_compile
from pipelines.train.compiled_step import compile_options
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split

CPU = torch.device("cpu")


def bert(attention: str) -> BertForSequenceClassification:
    """A tiny BERT whose config differs only by its attention implementation."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=3, attn_implementation=attention)  # fmt: skip
    return BertForSequenceClassification(config)


def resolved(params: Any, model: torch.nn.Module | None = None, train: TokenizedSplit | None = None) -> tuple[str, Any]:
    """The fingerprint a compiled run of `params` is keyed by, and the runtime it trains with."""
    train = tiny_split(rows=160, seed=3) if train is None else train
    runtime = resolve_runtime(params, CPU, 0)
    task = get_task("classification")
    _, trained_with, choice = resolve_compile(params, runtime, train, task, model or tiny_model(), None)
    assert choice.enabled and choice.key is not None
    return choice.key, trained_with


def test_eager_and_sdpa_attention_have_their_own_fingerprints(default_params):
    params = tiny_params(default_params, compile=True, batch_size=16, epochs=1)
    eager, sdpa = bert("eager"), bert("sdpa")
    assert (eager.config._attn_implementation, sdpa.config._attn_implementation) == ("eager", "sdpa")
    # Why the config alone could not tell them apart: `to_dict()` leaves the attention implementation out.
    assert eager.config.to_dict() == sdpa.config.to_dict()
    # Eager attention and SDPA compile different graphs: a key shared would predict warm and compile cold.
    assert resolved(params, eager)[0] != resolved(params, sdpa)[0]
    assert resolved(params, bert("sdpa"))[0] == resolved(params, sdpa)[0]  # the same model built again: one key


def test_the_data_parallel_strategy_and_world_size_are_in_the_fingerprint(default_params):
    def params(workers: int, strategy: str, compile: Any = True) -> Any:
        return tiny_params(default_params, compile=compile, batch_size=16, epochs=1,
                           **{"distributed.num_workers": workers, "distributed.strategy": strategy})  # fmt: skip

    # A run as it resolves: one process against DDP replicas over 2 and over 4 workers.
    keys = {resolved(params(1, "ddp"))[0], resolved(params(2, "ddp"))[0], resolved(params(4, "ddp"))[0]}
    assert len(keys) == 3
    # FSDP is not compiled yet (params refuse compile: true with it, `compile: auto` resolves off), but its key must
    # not be DDP's when it is: the options a graph is keyed by differ.
    model, shapes = tiny_model(), ["one batch shape"]

    def key(p: Any) -> str:
        return fingerprint(compile_parts(model, CPU, compile_options(p, resolve_runtime(p, CPU, 0)), shapes))

    assert key(params(2, "fsdp", "auto")) != key(params(2, "ddp", "auto"))
    # One worker is never wrapped, whatever the strategy says: the same graphs, one key.
    assert key(params(1, "fsdp", "auto")) == key(params(1, "ddp", "auto"))


def test_a_dynamic_width_keys_its_graph_not_each_width_and_a_static_compile_each_width(default_params):
    bucketed = tiny_params(default_params, compile=True, batch_size=16, epochs=1, **{"data.bucketing": True})
    short, short_run = resolved(bucketed, train=tiny_split(rows=160, seed=3, max_len=40))
    long, long_run = resolved(bucketed, train=tiny_split(rows=160, seed=5, max_len=90))
    # Two runs over other width sets, each compiled with the width dynamic: one graph serves both (measured: the
    # second run's compile found every graph in the cache), so one key, predicted warm.
    assert short_run.widths.widths != long_run.widths.widths
    assert len(short_run.widths.widths) > 1 and len(long_run.widths.widths) > 1
    assert short == long
    # The row count is a static dim of that graph: another batch size is another key.
    other_rows = tiny_params(bucketed, batch_size=8)
    assert resolved(other_rows, train=tiny_split(rows=160, seed=3, max_len=40))[0] != short
    # A static compile (unbucketed: every batch padded to max_length) has a graph per width: the widths stay keyed.
    static = tiny_params(default_params, compile=True, batch_size=16, epochs=1, **{"data.bucketing": False})
    narrow, narrow_run = resolved(tiny_params(static, **{"data.max_length": 48}))
    wide, _ = resolved(tiny_params(static, **{"data.max_length": 64}))
    assert narrow_run.widths is None
    assert narrow != wide
