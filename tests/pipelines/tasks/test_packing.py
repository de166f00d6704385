"""Packing: packed and unpacked rows give the same loss and gradients; packs are full, complete and isolated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertLMHeadModel

from pipelines.adapters import apply_adapter
from pipelines.data.packing import IGNORE, PackedSplit, best_fit_decreasing, check_isolation, pack_split, packed_targets
from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.model import set_attention
from pipelines.params import Params
from pipelines.tasks.causal_lm import CausalLmCollator
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.windows import window_units
from tests.pipelines.tasks.test_causal_lm import CPU, TASK, WordTokenizer, gradients, lm_params, lm_split
from tests.pipelines.train.helpers import cpu_step

# fp32 sums over ~100 target tokens, reduced in a different order (one long row vs several short ones).
RTOL = 1e-5


def test_best_fit_decreasing_packs_every_row_once_within_capacity():
    lengths = np.random.default_rng(0).integers(5, 60, size=500)
    packs = best_fit_decreasing(lengths, 64)
    rows = sorted(r for pack in packs for r in pack)
    assert rows == list(range(500))
    assert all(int(lengths[pack].sum()) <= 64 for pack in packs)
    # No two rows over half the capacity share a pack: that many packs at least; BFD adds few more.
    assert (lengths > 32).sum() <= len(packs) <= 1.15 * (lengths > 32).sum()
    # Short rows against the capacity: the packs are nearly full.
    short = np.random.default_rng(1).integers(5, 30, size=500)
    assert len(best_fit_decreasing(short, 256)) == np.ceil(short.sum() / 256)


@pytest.mark.parametrize(("low", "high", "capacity"), [(20, 400, 2048), (5, 60, 64), (1, 1024, 1024)])
def test_best_fit_decreasing_makes_trls_packs(low: int, high: int, capacity: int):
    """The expected packs are TRL's `pack_dataset(strategy="bfd")` over the same rows, whole (one map batch)."""
    datasets, trl_data = pytest.importorskip("datasets"), pytest.importorskip("trl.data_utils")
    lengths = np.random.default_rng(capacity).integers(low, high, size=3000)
    # Each row's tokens are its own index, so a packed row names the rows it holds.
    rows = datasets.Dataset.from_dict({"input_ids": [np.full(int(n), i) for i, n in enumerate(lengths)]})
    packed = trl_data.pack_dataset(rows, capacity, strategy="bfd", map_kwargs={"batch_size": len(rows)})
    expected = sorted(sorted(set(pack)) for pack in packed["input_ids"])
    assert sorted(best_fit_decreasing(lengths, capacity)) == expected


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_pack_targets_are_transformers_flattening_collators_then_padding(train_on_prompt: bool):
    """Each pack's positions and labels are what `DataCollatorWithFlattening` makes of its rows (labels with the
    prompt masked unless trained on), then padding that starts positions of its own and has no labels."""
    from transformers import DataCollatorWithFlattening

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 40, size=60).astype(np.int32)
    prompts = (lengths * rng.uniform(0, 0.9, size=60)).astype(np.int32)
    split = TokenizedSplit(input_ids=rng.integers(0, 1000, size=int(lengths.sum())).astype(np.int32),
                           lengths=lengths, prompt_lengths=prompts)  # fmt: skip
    packed = pack_split(split, capacity=96)
    collator = DataCollatorWithFlattening(return_tensors="np")
    for pack in range(len(packed)):
        features = []
        for row in packed.source_rows[packed.segments(pack)]:
            ids = split.input_ids[split.offsets[row] : split.offsets[row] + split.lengths[row]].astype(np.int64)
            labels = ids.copy()
            labels[: 0 if train_on_prompt else split.prompt_lengths[row]] = IGNORE
            features.append({"input_ids": ids, "labels": labels})
        flat = collator(features)
        padding = 100 - flat["input_ids"].shape[1]
        positions, labels = packed_targets(packed, pack, 100, train_on_prompt)
        assert positions.tolist() == flat["position_ids"][0].tolist() + list(range(padding))
        assert labels.tolist() == flat["labels"][0].tolist() + [IGNORE] * padding


def test_a_row_longer_than_a_pack_is_refused():
    with pytest.raises(ValueError, match="does not fit a pack of 8"):
        best_fit_decreasing(np.array([4, 9]), 8)


@pytest.mark.parametrize(("train_on_prompt", "attention"), [(False, "sdpa"), (True, "sdpa"), (False, "eager")])
def test_packed_and_unpacked_give_the_same_loss_and_gradients(
    default_params: Params, train_on_prompt: bool, attention: str
):
    settings = {"data.packing": True, "model.attn_implementation": attention}
    params = lm_params(default_params, train_on_prompt=train_on_prompt, **settings)
    split = lm_split(rows=16)
    packed = pack_split(split, capacity=48)
    assert len(packed) < len(split) and packed.examples == len(split)
    torch.manual_seed(0)
    model = set_attention(TASK.build_model(params, WordTokenizer(), Path("."), Path(".")), params.model)
    assert model.config._attn_implementation == attention
    step = cpu_step(model, TASK, scaler=False)

    def run(rows: TokenizedSplit, window: list[list[int]]) -> tuple[float, dict[str, torch.Tensor]]:
        collate = TASK.collator(rows, 0, fixed_length=None, pad_to_multiple_of=None, params=params)
        model.zero_grad(set_to_none=True)
        units = window_units(window, TASK.loss_units(rows, params))
        batches = [collate(b) for b in window]
        loss = step.accumulate(batches, units)
        assert sum(int(b["num_rows"]) for b in batches) == len(split)  # examples, not packs
        return float(loss), gradients(model)

    unpacked_loss, unpacked_grads = run(split, [list(range(len(split)))])
    packed_loss, packed_grads = run(packed, [list(range(len(packed)))])
    assert packed_loss == pytest.approx(unpacked_loss, rel=RTOL)
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=RTOL, atol=1e-6, msg=name)


def test_pack_labels_count_what_the_loss_units_say(default_params: Params):
    params = lm_params(default_params, **{"data.packing": True})
    packed = pack_split(lm_split(rows=20, seed=3), capacity=40)
    batch = TASK.collator(packed, 0, fixed_length=None, pad_to_multiple_of=None, params=params)(
        list(range(len(packed)))
    )
    assert "attention_mask" not in batch
    # Positions restart at each example: one 0 per example plus one per padded tail.
    starts = int((batch["position_ids"] == 0).sum())
    tails = int((batch["input_ids"].shape[1] > packed.lengths).sum())
    assert starts == packed.examples + tails
    targets = (batch["labels"][:, 1:] != -100).sum(dim=1).numpy()
    np.testing.assert_array_equal(targets, TASK.loss_units(packed, params))


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_packing_trains_with_fewer_rows_and_less_padding(default_params: Params, adapter: str):
    split = lm_split(rows=64, seed=1)
    results = {}
    for packing in (False, True):
        settings = {"data.packing": packing, "data.max_length": 48, "adapter.type": adapter}
        params = lm_params(default_params, epochs=1, batch_size=8, **settings)
        torch.manual_seed(0)
        model = apply_adapter(TASK.build_model(params, WordTokenizer(), Path("."), Path(".")), params.adapter, TASK)
        results[packing] = train_model(
            TrainRequest(model, split, None, params, pad_id=0, device=CPU, precision="fp32", task=TASK)
        )
    off, on = results[False].metrics, results[True].metrics
    assert on["optimizer_steps"] < off["optimizer_steps"]
    assert on["padding_fraction"] < off["padding_fraction"]
    assert np.isfinite(on["final_train_loss"])


def test_a_model_whose_mask_ignores_positions_is_refused(default_params: Params):
    # BERT as a decoder builds its causal mask without looking at position ids: examples would see each other.
    bert = BertLMHeadModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, is_decoder=True))  # fmt: skip
    assert "does not isolate packed examples" in (check_isolation(bert, 50) or "")
    llama = TASK.build_model(lm_params(default_params), WordTokenizer(), Path("."), Path("."))
    assert check_isolation(llama, 120) is None
    with pytest.raises(UserError, match="data.packing: BertLMHeadModel"):
        TASK.training_split(lm_split(), lm_params(default_params, **{"data.packing": True}), bert)


def test_unpacked_collator_is_unchanged_without_packing(default_params: Params):
    params = lm_params(default_params)
    split = lm_split()
    assert TASK.training_split(split, params, torch.nn.Linear(1, 1)) is split
    collate = TASK.collator(split, 0, fixed_length=None, pad_to_multiple_of=None, params=params)
    assert isinstance(collate, CausalLmCollator) and not isinstance(split, PackedSplit)


def test_an_attention_that_cannot_run_here_names_the_key(default_params: Params):
    params = lm_params(default_params, **{"model.attn_implementation": "flash_attention_2"})
    model = TASK.build_model(params, WordTokenizer(), Path("."), Path("."))
    if torch.cuda.is_available():
        pytest.skip("flash-attn may be installed with CUDA")
    with pytest.raises(UserError, match="model.attn_implementation = 'flash_attention_2' cannot be used here"):
        set_attention(model, params.model)
