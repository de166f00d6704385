"""Generation's time-left lines follow the batches as they are generated: the first estimate is the pace so far
times the rows left, not the whole job's time over one batch (30m44s said for a job that took 2.5 minutes)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

import pipelines.tasks.seq2seq as seq2seq
from pipelines.data.synthetic import generate_translations
from pipelines.data.tokenization import train_causal_word_tokenizer
from pipelines.params import GeneratorParams
from pipelines.progress import RowsProgress
from tests.pipelines.tasks.test_seq2seq import TASK, s2s_params
from tests.pipelines.train.helpers import cpu_runtime


def test_seq2seq_generation_estimates_from_the_batches_done_so_far(default_params, monkeypatch):
    # 80 test rows in batches of 2 x 8 = 16: five batches. A clock that moves 10 s per generated batch (the model
    # runs for real; only the time is made up, so the expected lines can be worked out by hand).
    params = s2s_params(default_params, batch_size=8, **{"eval.max_new_tokens": 4})
    table = generate_translations(GeneratorParams(num_rows=100, num_classes=4, label_noise=0.0)).iloc[:80]
    tokenizer = train_causal_word_tokenizer(TASK.tokenizer_corpus(table), 500)
    split = TASK.encode(tokenizer, table, params, Path(".")).split
    torch.manual_seed(0)
    model = TASK.build_model(params, tokenizer, Path("."), Path("."))
    now, lines = [0.0], []
    generate = model.generate

    def timed_generate(*args, **kwargs):
        now[0] += 10.0
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", timed_generate)
    monkeypatch.setattr(seq2seq, "RowsProgress", partial(RowsProgress, say=lines.append, clock=lambda: now[0]))
    answers = seq2seq.translate(model, tokenizer, split, params, cpu_runtime(pad_id=tokenizer.pad_token_id), TASK)
    assert len(answers) == 80 and now[0] == 50.0
    # By hand: a line once 30 s have passed, after the third batch: 48 rows in 30 s, 32 left at that pace is 20 s.
    # (Counted after the last batch, the first line said 16/80 rows, 50 s / 16 rows x 64 rows = 3m20s left.)
    assert lines == ["generation: 48/80 rows, about 20s left"]
