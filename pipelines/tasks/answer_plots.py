"""DVC plot rows for generated answers: the confusion matrix and per-class precision/recall that the `evaluate`
stage declares for every task, made meaningful for causal_lm and seq2seq instead of left empty.

Two cases, decided by the references alone (never by what the model generated):
- **a closed answer set** (at most `MAX_ANSWER_CLASSES` distinct references, e.g. instruction tuning on labelled
  rows): the classes are the answers; a generation outside the set is "(other answer)". Recall of an answer is
  its exact-match rate, so the per-class chart reads like a classifier's.
- **open answers** (translation, free text): the classes are reference-length buckets in words. The confusion
  is reference length vs generated length (is the model too terse or too verbose?); recall of a bucket is the
  exact-match rate of its rows, precision the exact-match rate of the rows whose generation fell in it.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_ANSWER_CLASSES = 20
OTHER_ANSWER = "(other answer)"
# Upper bounds (inclusive) of the length buckets in words; the last bucket is open-ended.
LENGTH_EDGES = (0, 4, 8, 16, 32, 64)


def _bucket_labels() -> tuple[str, ...]:
    spans = [f"{low + 1}-{high} words" for low, high in zip(LENGTH_EDGES, LENGTH_EDGES[1:], strict=False)]
    return ("0 words", *spans, f"{LENGTH_EDGES[-1] + 1}+ words")


BUCKETS = _bucket_labels()  # short to long: the order the per-class chart lists them in


def length_bucket(text: str) -> str:
    """The bucket label of a text's length in words, e.g. '5-8 words'; '0 words' for an empty answer."""
    words = len(text.split())
    return BUCKETS[sum(words > edge for edge in LENGTH_EDGES) if words else 0]


def answer_plots(references: Sequence[str], generated: Sequence[str]) -> dict[str, list[dict[str, object]]]:
    """`confusion` rows (actual, predicted) and `per_class` rows (class, precision, recall) for generations."""
    if len(references) != len(generated):
        raise ValueError(f"{len(references)} references but {len(generated)} generations")
    answers = sorted(set(references))
    if len(answers) <= MAX_ANSWER_CLASSES:
        closed = set(answers)
        actual = list(references)
        predicted = [g if g in closed else OTHER_ANSWER for g in generated]
        classes = answers
    else:
        actual = [length_bucket(r) for r in references]
        predicted = [length_bucket(g) for g in generated]
        present = set(actual)
        classes = [label for label in BUCKETS if label in present]
    exact = [g == r for g, r in zip(generated, references, strict=True)]
    confusion = [{"actual": a, "predicted": p} for a, p in zip(actual, predicted, strict=True)]
    per_class = []
    for name in classes:
        in_class = [e for a, e in zip(actual, exact, strict=True) if a == name]
        predicted_as = [e for p, e in zip(predicted, exact, strict=True) if p == name]
        per_class.append(
            {
                "class": name,
                "precision": sum(predicted_as) / len(predicted_as) if predicted_as else 0.0,
                "recall": sum(in_class) / len(in_class),
            }
        )
    return {"confusion": confusion, "per_class": per_class}
