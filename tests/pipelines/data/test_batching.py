"""Properties of the length-grouped sampler and the padding collator."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from pipelines.data.batching import LengthGroupedBatchSampler, PadCollator, Replica, mega_batch_rows, padding_fraction
from pipelines.data.tokenization import TokenizedSplit

lengths_strategy = st.lists(st.integers(1, 300), min_size=1, max_size=400).map(np.array)


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, batch_size=st.integers(1, 40), bucketing=st.booleans(), seed=st.integers(0, 10_000))
def test_every_row_exactly_once_per_epoch(lengths, batch_size, bucketing, seed):
    sampler = LengthGroupedBatchSampler(lengths, batch_size, bucketing=bucketing, seed=seed)
    for epoch in range(2):
        rows = flat(sampler.batches(epoch))
        assert sorted(rows) == list(range(len(lengths)))
        assert all(len(b) <= batch_size for b in sampler.batches(epoch))


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_strategy, batch_size=st.integers(1, 16), replicas=st.integers(1, 4), bucketing=st.booleans())
def test_ranks_are_disjoint_complete_and_equal_in_steps(lengths, batch_size, replicas, bucketing):
    shards = [
        LengthGroupedBatchSampler(
            lengths, batch_size, bucketing=bucketing, seed=3, replica=Replica(r, replicas)
        ).batches(1)
        for r in range(replicas)
    ]
    rows = [i for shard in shards for i in flat(shard)]
    assert sorted(rows) == list(range(len(lengths)))  # complete and disjoint
    if len(lengths) >= replicas:
        assert len({len(shard) for shard in shards}) == 1  # same number of steps on every rank


def test_deterministic_for_a_seed_and_different_across_epochs():
    lengths = np.random.default_rng(0).integers(1, 128, size=1000)
    a = LengthGroupedBatchSampler(lengths, 16, seed=7)
    b = LengthGroupedBatchSampler(lengths, 16, seed=7)
    assert a.batches(0) == b.batches(0)
    assert a.batches(0) != a.batches(1)
    assert LengthGroupedBatchSampler(lengths, 16, seed=8).batches(0) != a.batches(0)


def test_longest_batch_comes_first_and_bucketing_cuts_padding():
    lengths = np.random.default_rng(1).integers(5, 128, size=2000)
    bucketed = LengthGroupedBatchSampler(lengths, 32, bucketing=True, seed=0).batches(0)
    assert lengths[bucketed[0]].max() == lengths.max()
    fixed = LengthGroupedBatchSampler(lengths, 32, bucketing=False, seed=0).batches(0)
    bucketed_pad = padding_fraction(lengths, bucketed, lambda longest: longest)
    fixed_pad = padding_fraction(lengths, fixed, lambda _: 128)
    assert bucketed_pad < 0.08 < 0.4 < fixed_pad  # 4 mega-batches of 480 rows: ~6% padding


def test_mega_batches_hold_up_to_50_batches_and_an_epoch_has_at_least_4():
    assert mega_batch_rows(100_000, 32) == 50 * 32
    assert mega_batch_rows(1536, 32) == 384  # 4 mega-batches of 12 batches (the Trainer's rule)
    assert mega_batch_rows(50, 32) == 32  # tiny splits: one batch each


def test_same_batches_through_dataloader_workers():
    lengths = np.random.default_rng(2).integers(1, 40, size=300)
    ids = np.arange(int(lengths.sum()), dtype=np.int32) % 97 + 5
    split = TokenizedSplit(ids, lengths.astype(np.int32), np.arange(300) % 3)
    sampler = LengthGroupedBatchSampler(lengths, 8, seed=5)
    collator = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=None)

    def rows(workers: int) -> list[list[int]]:
        loader = DataLoader(collator, batch_sampler=sampler.batches(0), collate_fn=collator, num_workers=workers)
        return [b["row_index"].tolist() for b in loader]

    assert rows(0) == rows(2) == sampler.batches(0)


def test_collator_pads_dynamically_to_a_multiple_and_masks():
    lengths = np.array([3, 5, 1], dtype=np.int32)
    ids = np.arange(1, 10, dtype=np.int32)
    split = TokenizedSplit(ids, lengths, np.array([0, 1, 2]))
    batch = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=8)([1, 2])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][0, :5].tolist() == [4, 5, 6, 7, 8]
    assert batch["attention_mask"].sum(1).tolist() == [5, 1]
    assert batch["labels"].tolist() == [1, 2] and int(batch["num_tokens"]) == 6
    fixed = PadCollator(split, pad_id=0, fixed_length=16, pad_to_multiple_of=8)([0])
    assert fixed["input_ids"].shape == (1, 16) and fixed["input_ids"].dtype == torch.int64


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(300, 2000), seed=st.integers(0, 100))
def test_token_budget_batches_cover_every_row_within_budget(lengths, budget, seed):
    sampler = LengthGroupedBatchSampler(lengths, 16, bucketing=True, seed=seed, max_tokens=budget)
    batches = sampler.batches(0)
    assert sorted(flat(batches)) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) * int(lengths[batch].max()) <= budget or len(batch) == 1


def test_token_budget_puts_short_rows_in_bigger_batches():
    lengths = np.concatenate([np.full(500, 10), np.full(500, 100)])
    batches = LengthGroupedBatchSampler(lengths, 16, seed=0, max_tokens=1000).batches(0)
    short = [len(b) for b in batches if lengths[b].max() == 10]
    long = [len(b) for b in batches if lengths[b].min() == 100]
    assert max(short) == 100 and max(long) == 10
