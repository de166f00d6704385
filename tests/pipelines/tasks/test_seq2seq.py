"""The seq2seq task: window-normalized accumulation over target tokens, the collator's shapes, and BLEU/chrF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.data.tokenization import TokenizedSplit, train_causal_word_tokenizer
from pipelines.params import GeneratorParams, Params
from pipelines.tasks import get_task
from pipelines.tasks.causal_lm import IGNORE
from pipelines.tasks.seq2seq import Seq2SeqCollator, generation_metrics
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.windows import window_units
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import cpu_runtime, cpu_step

CPU = torch.device("cpu")
TASK = get_task("seq2seq")


def s2s_params(base: Params, **overrides: object) -> Params:
    settings = {
        "task": "seq2seq",
        "model.config.hidden_size": 32,
        "model.config.intermediate_size": 64,
        "model.config.num_attention_heads": 2,
        "model.config.num_hidden_layers": 2,
        "model.config.dropout": 0.0,
    }
    return tiny_params(base, **{**settings, **overrides})


class WordTokenizer:
    def __init__(self, size: int = 120):
        self.size, self.pad_token_id, self.eos_token_id = size, 0, 3

    def __len__(self) -> int:
        return self.size


def s2s_split(rows: int = 12, seed: int = 0) -> TokenizedSplit:
    """Rows of a source of unequal length then a target of unequal length, each ending in EOS (id 3)."""
    rng = np.random.default_rng(seed)
    sources, targets = rng.integers(3, 15, size=rows), rng.integers(2, 9, size=rows)
    ids = [
        np.concatenate([rng.integers(10, 120, size=s - 1), [3], rng.integers(10, 120, size=t - 1), [3]])
        for s, t in zip(sources, targets, strict=True)
    ]
    return TokenizedSplit(
        np.concatenate(ids).astype(np.int32),
        (sources + targets).astype(np.int32),
        prompt_lengths=sources.astype(np.int32),
    )


def test_collator_splits_rows_into_encoder_input_decoder_input_and_labels():
    split = s2s_split(rows=3, seed=2)
    batch = Seq2SeqCollator(split, 0, decoder_start_id=0, fixed_length=None, pad_to_multiple_of=None)([0, 1, 2])
    sources = split.prompt_lengths
    targets = split.lengths - sources
    assert batch["input_ids"].shape == (3, sources.max()) and batch["labels"].shape == (3, targets.max())
    assert batch["attention_mask"].sum(1).tolist() == sources.tolist()
    assert (batch["labels"] != IGNORE).sum(1).tolist() == targets.tolist()
    # The decoder reads the target shifted right behind its start token.
    for row in range(3):
        n = int(targets[row])
        assert batch["decoder_input_ids"][row, 0] == 0
        assert torch.equal(batch["decoder_input_ids"][row, 1:n], batch["labels"][row, : n - 1])
    assert int(batch["num_tokens"]) == int(split.lengths.sum())


def test_k_micro_batches_equal_one_batch_of_their_rows(default_params):
    params = s2s_params(default_params)
    split = s2s_split()
    units = TASK.loss_units(split, params)
    collate = TASK.collator(split, 0, fixed_length=None, pad_to_multiple_of=None, params=params)
    torch.manual_seed(0)
    model = TASK.build_model(params, WordTokenizer(), Path("."), Path("."))
    step = cpu_step(model, TASK, scaler=False)

    def gradients(window: list[list[int]]) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loader = iter(collate(batch) for batch in window)
        step.accumulate(list(loader), window_units(window, units))
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    one = gradients([list(range(12))])
    many = gradients([[0, 1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]])
    assert len(set(units[:5].tolist())) > 1  # unequal target lengths within and across micro-batches
    for name in one:
        torch.testing.assert_close(many[name], one[name], atol=1e-5, rtol=0, msg=name)


def test_generation_metrics_on_known_outputs():
    references = ["a b c d", "e f g", "h i j k l"]
    perfect = generation_metrics(references, references)
    assert perfect["test_bleu"] == pytest.approx(100.0) and perfect["test_chrf"] == pytest.approx(100.0)
    assert perfect["test_exact_match"] == 1.0
    partial = generation_metrics(["a b c d", "e f x", "q r s"], references)
    assert 0 < partial["test_bleu"] < 100 and 0 < partial["test_chrf"] < 100
    assert partial["test_exact_match"] == pytest.approx(1 / 3)
    assert partial["test_exact_match_ci_low"] < 1 / 3 < partial["test_exact_match_ci_high"]


def test_seq2seq_trains_on_the_generated_corpus_and_scores_its_translations(default_params):
    from pipelines.data.synthetic import generate_translations

    params = s2s_params(default_params, epochs=2, batch_size=16, **{"eval.max_new_tokens": 16})
    table = generate_translations(GeneratorParams(num_rows=400, num_classes=4, label_noise=0.0))
    tokenizer = train_causal_word_tokenizer(TASK.tokenizer_corpus(table), 2000)
    train = TASK.encode(tokenizer, table.iloc[:320], params, Path(".")).split
    test = TASK.encode(tokenizer, table.iloc[320:], params, Path(".")).split
    torch.manual_seed(0)
    model = TASK.build_model(params, tokenizer, Path("."), Path("."))
    result = train_model(
        TrainRequest(model, train, test, params, pad_id=tokenizer.pad_token_id, device=CPU, precision="fp32")
    )
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert 0.0 <= result.metrics["padding_fraction"] < 1.0  # of encoder and decoder positions (was -0.96)
    scored = TASK.evaluate(model, tokenizer, test, Path("."), params, cpu_runtime(pad_id=tokenizer.pad_token_id))
    for name in ("test_bleu", "test_chrf", "test_exact_match", "test_perplexity", "test_token_accuracy"):
        assert np.isfinite(scored.metrics[name]), name
    assert list(scored.predictions.columns) == ["row_id", "source", "reference", "generated", "exact_match"]
    assert scored.predictions["reference"].tolist()[0] == " ".join(table["target"].iloc[320].split())
