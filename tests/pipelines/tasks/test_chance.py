"""A classifier that ends at chance on validation is told so, with the likely causes (issue 71); one that beat
chance beyond the binomial noise is not. The chance level is counted by hand from the split's labels."""

from __future__ import annotations

import numpy as np

from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import apply_overrides
from pipelines.tasks import get_task
from pipelines.tasks.chance import at_chance_note


def split_with_labels(labels: list[int]) -> TokenizedSplit:
    lengths = np.full(len(labels), 3, dtype=np.int32)
    return TokenizedSplit(np.ones(3 * len(labels), dtype=np.int32), lengths, np.asarray(labels, dtype=np.int64))


def test_a_score_at_the_commonest_labels_share_is_said_to_be_at_chance(default_params):
    task = get_task("classification")
    validation = split_with_labels([0] * 90 + [1] * 60 + [2] * 50)  # the commonest label: 90 of 200 rows
    assert task.chance_level(validation) == ("val_accuracy", 0.45)
    note = at_chance_note(task, {"val_accuracy": 0.46}, validation, default_params)
    assert note is not None and note.startswith("val_accuracy 0.460 is at chance: always answering the commonest "
                                                "label scores 0.450 on these 200 validation rows")  # fmt: skip
    assert "`epochs`" in note and "`lr: auto`" in note
    # The default model is built from a config: the first cause named is that, with where to name a pretrained one.
    assert default_params.model.name_or_path is None and "model.name_or_path" in note
    pretrained = apply_overrides(default_params, {"model.name_or_path": "sentence-transformers/all-MiniLM-L6-v2"})
    assert "from scratch" not in at_chance_note(task, {"val_accuracy": 0.4}, validation, pretrained)


def test_a_score_beyond_the_noise_of_chance_is_not(default_params):
    task = get_task("classification")
    validation = split_with_labels([0] * 90 + [1] * 60 + [2] * 50)
    # Two standard errors above 0.45 over 200 rows: 0.45 + 1.96 * sqrt(0.45 * 0.55 / 200) = 0.519 (by hand).
    assert at_chance_note(task, {"val_accuracy": 0.515}, validation, default_params) is not None
    assert at_chance_note(task, {"val_accuracy": 0.525}, validation, default_params) is None
    assert at_chance_note(task, {}, validation, default_params) is None  # no validation score: nothing to say


def test_a_generation_task_has_no_chance_level(default_params):
    validation = split_with_labels([0, 1])
    assert get_task("causal_lm").chance_level(validation) is None
    assert at_chance_note(get_task("causal_lm"), {"val_loss": 9.0}, validation, default_params) is None
