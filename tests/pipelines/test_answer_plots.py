"""The confusion and per-class plots of generation tasks: filled, and each figure what its name says."""

from collections import Counter

import pytest

from pipelines.tasks.answer_plots import MAX_ANSWER_CLASSES, OTHER_ANSWER, answer_plots, length_bucket


def test_closed_answer_set_reads_like_a_classifier():
    references = ["World", "World", "Sports", "Sports", "Business"]
    generated = ["World", "Sports", "Sports", "sport", "Business"]
    plots = answer_plots(references, generated)
    confusion = Counter((r["actual"], r["predicted"]) for r in plots["confusion"])
    assert confusion == {
        ("World", "World"): 1,
        ("World", "Sports"): 1,
        ("Sports", "Sports"): 1,
        ("Sports", OTHER_ANSWER): 1,  # an answer outside the set is not a new class
        ("Business", "Business"): 1,
    }
    per_class = {r["class"]: r for r in plots["per_class"]}
    assert set(per_class) == {"Business", "Sports", "World"}
    assert per_class["World"]["recall"] == 0.5 and per_class["World"]["precision"] == 1.0
    assert per_class["Sports"]["recall"] == 0.5 and per_class["Sports"]["precision"] == 0.5
    assert per_class["Business"] == {"class": "Business", "precision": 1.0, "recall": 1.0}


def test_open_answers_are_grouped_by_reference_length():
    references = [f"sentence number {i} " + "word " * (i % 40) for i in range(MAX_ANSWER_CLASSES + 5)]
    generated = [r if i % 2 == 0 else "short" for i, r in enumerate(references)]
    plots = answer_plots(references, generated)
    assert len(plots["confusion"]) == len(references)
    assert {r["predicted"] for r in plots["confusion"]} >= {"1-4 words"}  # the terse answers show up as such
    labels = [r["class"] for r in plots["per_class"]]
    assert labels == sorted(labels, key=lambda s: int(s.split("-")[0].split("+")[0]))  # short to long
    total = sum(r["recall"] * sum(length_bucket(x) == r["class"] for x in references) for r in plots["per_class"])
    exact = sum(g == r for g, r in zip(generated, references, strict=True))
    assert total == pytest.approx(exact)  # recall weighted by rows = exact match


@pytest.mark.parametrize(
    ("text", "bucket"), [("", "0 words"), ("a b c d", "1-4 words"), ("a " * 5, "5-8 words"), ("a " * 70, "65+ words")]
)
def test_length_buckets(text, bucket):
    assert length_bucket(text) == bucket


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 references but 1 generations"):
        answer_plots(["a", "b"], ["a"])
