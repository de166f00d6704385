"""Padding is a fraction of the positions the model reads, in [0, 1], for every task.

Seq2seq once reported -96%: its batches counted source and target tokens against the encoder's positions only.
"""

from __future__ import annotations

import pytest

from pipelines.tasks import get_task
from tests.conftest import tiny_params
from tests.pipelines.tasks.test_causal_lm import lm_params, lm_split
from tests.pipelines.tasks.test_seq2seq import s2s_params, s2s_split
from tests.pipelines.train.helpers import tiny_split


def _cases(default_params):
    return {
        "classification": (tiny_params(default_params), tiny_split(rows=24)),
        "causal_lm": (lm_params(default_params), lm_split(rows=24)),
        "seq2seq": (s2s_params(default_params), s2s_split(rows=24)),
    }


@pytest.mark.parametrize("task_name", ["classification", "causal_lm", "seq2seq"])
@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
def test_every_tasks_batches_hold_no_more_tokens_than_positions(default_params, task_name, pad_to_multiple_of):
    params, split = _cases(default_params)[task_name]
    collate = get_task(task_name).collator(split, 0, fixed_length=None, pad_to_multiple_of=pad_to_multiple_of,
                                           params=params)  # fmt: skip
    for start in range(0, 24, 8):
        batch = collate(list(range(start, start + 8)))
        tokens, positions = int(batch["num_tokens"]), int(batch["num_positions"])
        assert 0 < tokens <= positions, (tokens, positions)
        read = sum(batch[k].numel() for k in ("input_ids", "decoder_input_ids") if k in batch)
        assert positions == read  # every position the model reads, the decoder's included
        if pad_to_multiple_of:
            assert tokens < positions  # rows of unequal length padded to 16: some padding
