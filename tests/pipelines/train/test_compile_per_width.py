"""A model whose code specializes the width compiles a graph per width even with the width marked dynamic, and its
fingerprint (which keys the width as '*', as one dynamic graph serves every width) cannot tell it from one that does
not. Its manifest entry says so: a run with a width none of its compiles had is predicted cold, and is cold; the
widths it compiled stay warm. A model with one dynamic graph stays warm over new widths. Real compiles on the CPU of
two toy classifiers (an embedding and a head), each run a bucketed epoch of 8 batches in a cache folder of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from pipelines.data.tokenization import TokenizedSplit
from pipelines.train.compile_cache import CompileCache, graph_shapes, one_graph
from pipelines.train.compile_decision import CompilePrediction
from pipelines.train.engine import TrainRequest, TrainResult, train_model
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_split

# Any prediction: the test reads which case (cold, warm) the run assumed, not the seconds.
PREDICTION = CompilePrediction(eager_step_s=0.05, compiled_step_s=0.03, compile_s=30.0, warm_compile_s=5.0,
                               blob_compile_s=20.0, shape_s=0.05)  # fmt: skip
NARROW, WIDE = tiny_split(rows=64, seed=3, max_len=30), tiny_split(rows=64, seed=5, max_len=60)


class Pooled(nn.Module):
    """Token embeddings summed over the width into 3 classes: one graph serves every width."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(120, 16), nn.Linear(16, 3)

    def weigh(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SequenceClassifierOutput:
        hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return SequenceClassifierOutput(logits=self.head(self.weigh(hidden).sum(1)))


class PositionWeighted(Pooled):
    """Each position weighed from a table its code builds with the width as a Python number, as transformers' mask
    helpers read it for some models: Dynamo specializes the width, so each width is a graph of its own."""

    def weigh(self, hidden: torch.Tensor) -> torch.Tensor:
        table = [1.0 / (1 + i) for i in range(hidden.shape[1])]
        return hidden * torch.tensor(table, dtype=hidden.dtype)[:, None]


def compiled_run(default_params: Any, model: nn.Module, train: TokenizedSplit, cache: Path) -> TrainResult:
    """One bucketed epoch of `train` (8 batches of 8 rows), compiled, in the Inductor cache folder `cache`."""
    params = tiny_params(default_params, epochs=1, batch_size=8, log_every_n_steps=1, warmup_ratio=0.0,
                         compile=True, precision="fp32", **{"data.bucketing": True})  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        request = TrainRequest(model, train, None, params, pad_id=0, device=torch.device("cpu"), precision="fp32",
                               compile_prediction=PREDICTION, say=lambda _: None)  # fmt: skip
        return train_model(request)


def widths(run: TrainResult) -> set[str]:
    return set(run.notes["pad_widths.resolved"].split(","))


@pytest.fixture(scope="module")
def runs(default_params, tmp_path_factory) -> dict[str, Any]:
    """Each model over the narrow widths, then over wider ones, in a cache of its own; the per-width model then over
    the narrow widths again."""
    out: dict[str, Any] = {}
    for name, model in (("dynamic", Pooled), ("per_width", PositionWeighted)):
        cache = tmp_path_factory.mktemp(name)
        out[name] = {"cache": cache, "narrow": compiled_run(default_params, model(), NARROW, cache)}
        out[name]["wide"] = compiled_run(default_params, model(), WIDE, cache)
    out["per_width"]["again"] = compiled_run(default_params, PositionWeighted(), NARROW, out["per_width"]["cache"])
    return out


def test_the_runs_widths_differ_and_the_fingerprint_cannot_tell_the_models_apart_by_them(runs):
    for name in ("dynamic", "per_width"):
        narrow, wide = runs[name]["narrow"], runs[name]["wide"]
        assert len(widths(narrow)) > 1 and widths(wide) - widths(narrow), (widths(narrow), widths(wide))
        # Both compiled with the width dynamic: the width is '*' in the key, one key for both width sets.
        assert narrow.notes["compile.fingerprint"] == wide.notes["compile.fingerprint"]
        assert narrow.notes["compile.resolved"].endswith(", cold)")
    # What the compiles built, by torch's own count: one graph for every shape, against one graph per shape.
    dynamic, per_width = runs["dynamic"]["narrow"].metrics, runs["per_width"]["narrow"].metrics
    assert dynamic["compile_graphs"] == 1 and dynamic["compile_shapes"] > 1
    assert per_width["compile_graphs"] == per_width["compile_shapes"] > 1


def test_a_model_with_one_dynamic_graph_is_warm_over_new_widths(runs):
    wide = runs["dynamic"]["wide"]
    assert wide.notes["compile.resolved"].endswith(", warm (from the cache))")
    assert wide.metrics["compile_cache_hits"] > 0 and wide.metrics["compile_cache_misses"] == 0


def test_a_model_with_a_graph_per_width_is_predicted_cold_for_a_width_it_never_compiled(runs):
    wide = runs["per_width"]["wide"]
    assert wide.notes["compile.resolved"].endswith(", cold)")
    assert wide.metrics["compile_cache_misses"] > 0  # and cold it was: Inductor compiled the new widths anew
    # The widths it compiled stay warm: the narrow run again is predicted warm and finds every graph cached.
    again = runs["per_width"]["again"]
    assert again.notes["compile.resolved"].endswith(", warm (from the cache))")
    assert again.metrics["compile_cache_hits"] > 0 and again.metrics["compile_cache_misses"] == 0
    # The manifest entry holds what both compiles compiled: the narrow run's shapes and the wide run's new ones.
    entry = CompileCache(runs["per_width"]["cache"]).manifest()[wide.notes["compile.fingerprint"]]
    assert entry["one_graph"] is False
    assert len(entry["compiled"]) > max(runs["per_width"]["narrow"].metrics["compile_shapes"], 1)


def test_a_new_width_is_warm_only_where_one_graph_was_seen_serving_several(tmp_path):
    """The rule by hand, on manifest entries as a compile writes them: the shapes compiled and the graphs built."""

    def batch(width: int) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        return (("input_ids", (8, width), "torch.int64"), ("labels", (8,), "torch.int64"))

    def entry(widths: list[int], graphs: int) -> dict[str, Any]:
        return {"graphs": graphs, "compiled": graph_shapes([batch(w) for w in widths], dynamic_width=False)}

    cache = CompileCache(tmp_path)
    run = [batch(16), batch(48)]  # 16 compiled before, 48 never
    for key, compiled, graphs, expected in [
        ("one-graph", [16, 24, 32], 1, "cache"),  # one graph served 3 widths: it serves 48 too
        ("per-width", [16, 24, 32], 3, None),  # a graph per width: 48 is a compile of its own
        ("one-shape", [16], 1, None),  # one shape cannot tell one graph from a graph per width
        ("both-compiled", [16, 48], 2, "cache"),
    ]:
        cache.add_entry(key, {**entry(compiled, graphs), "one_graph": one_graph(entry(compiled, graphs))})
        assert cache.holds(key, run) == expected, key
        assert cache.holds(key) == "cache"  # asked without the run's shapes: the entry alone
    # A second compile of the per-width key over 48 adds its shape: now both are warm.
    cache.add_entry("per-width", {**entry([48], 1), "one_graph": False})
    assert cache.holds("per-width", run) == "cache"
    # Two compiles of one width each cannot show one graph serving both: a third width stays cold.
    assert cache.holds("per-width", [batch(64)]) is None
