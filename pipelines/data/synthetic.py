"""A deterministic synthetic topic-classification corpus, so the defaults run offline.

The words are invented (syllable strings), not taken from any public dataset. Each row
mixes words of its own topic, "confuser" words of other topics and shared filler
words, with a per-row topic strength: some rows are easy, some nearly hopeless, and a
small share of labels is noise. Lengths are spread out (log-normal) so that padding
waste, and therefore length bucketing, matters as it does on real text.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.params import GeneratorParams

TOPICS = ("orbital", "culinary", "markets", "athletics", "botany", "maritime", "music", "medicine")
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ser",
    "tun",
    "va",
    "rei",
    "dos",
    "pra",
    "nel",
    "qui",
    "zor",
    "bel",
    "fa",
    "gri",
    "hov",
    "ix",
    "jen",
    "kra",
    "lum",
    "mor",
    "nis",
    "ost",
    "pel",
    "ru",
    "sta",
    "tor",
    "ul",
    "wen",
    "yas",
)
# The corpus is fixed for given generator settings; `seed` in params shapes splits and training only.
_CORPUS_SEED = 20_240_601
_WORDS_PER_TOPIC = 40
_FILLER_WORDS = 400


def _invent_words(rng: np.random.Generator, count: int, taken: set[str]) -> list[str]:
    words: list[str] = []
    while len(words) < count:
        word = "".join(rng.choice(_SYLLABLES, size=rng.integers(2, 4)))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def _zipf_weights(n: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1)
    return weights / weights.sum()


def generate_corpus(settings: GeneratorParams, max_words: int = 200) -> pd.DataFrame:
    """Return `settings.num_rows` rows with columns `text` and `label` (topic names), up to `max_words` words."""
    rng = np.random.default_rng(_CORPUS_SEED)
    taken: set[str] = set()
    topics = TOPICS[: settings.num_classes]
    topic_words = {topic: _invent_words(rng, _WORDS_PER_TOPIC, taken) for topic in topics}
    filler = _invent_words(rng, _FILLER_WORDS, taken)
    topic_p, filler_p = _zipf_weights(_WORDS_PER_TOPIC), _zipf_weights(_FILLER_WORDS)

    texts: list[str] = []
    labels: list[str] = []
    for _ in range(settings.num_rows):
        topic = topics[rng.integers(len(topics))]
        length = int(np.clip(rng.lognormal(np.log(20), 0.6), 4, max_words))
        strength = rng.uniform(0.02, 0.3)  # share of words that carry the topic
        confusion = rng.uniform(0.0, 0.15)  # share of words borrowed from other topics
        kind = rng.random(length)
        words = rng.choice(filler, size=length, p=filler_p).tolist()
        for i in np.flatnonzero(kind < strength):
            words[i] = rng.choice(topic_words[topic], p=topic_p)
        for i in np.flatnonzero((kind >= strength) & (kind < strength + confusion)):
            other = topics[rng.integers(len(topics))]
            words[i] = rng.choice(topic_words[other], p=topic_p)
        texts.append(" ".join(words) + ".")
        labels.append(topics[rng.integers(len(topics))] if rng.random() < settings.label_noise else topic)
    return pd.DataFrame({"text": texts, "label": labels})


# Instructions of the causal-LM corpus: each has a rule a model can learn from the row's own words.
INSTRUCTIONS = (
    ("topic", "What is the topic of this text?"),
    ("first", "Which word comes first in this text?"),
    ("last", "Which word comes last in this text?"),
)
# Short texts: prompt + answer fit in the default data.max_length (64 tokens) untruncated.
_INSTRUCTION_MAX_WORDS = 24


def generate_instructions(settings: GeneratorParams) -> pd.DataFrame:
    """Instruction rows for causal-LM fine-tuning: `prompt`, `response` and `text` (the two joined).

    Each prompt is a text of the topic corpus and one of three instructions; the response is
    the topic's name, or the text's first or last word: short answers, so exact match after
    greedy generation measures whether the rule was learnt. Labels keep the corpus's label noise.
    """
    corpus = generate_corpus(settings, max_words=_INSTRUCTION_MAX_WORDS)
    rng = np.random.default_rng(_CORPUS_SEED + 1)
    kinds = rng.integers(len(INSTRUCTIONS), size=len(corpus))
    prompts, responses = [], []
    for text, label, kind in zip(corpus["text"], corpus["label"], kinds, strict=True):
        name, question = INSTRUCTIONS[kind]
        words = text.rstrip(".").split()
        answer = {"topic": label, "first": words[0], "last": words[-1]}[name]
        prompts.append(f"{text}\nQuestion: {question}\nAnswer:")
        responses.append(f" {answer}")
    return pd.DataFrame(
        {
            "prompt": prompts,
            "response": responses,
            "text": [p + r for p, r in zip(prompts, responses, strict=True)],
            "instruction": [INSTRUCTIONS[k][0] for k in kinds],
        }
    )


_SOURCE_WORDS = 100
_TRANSLATION_MAX_WORDS = 12


def generate_translations(settings: GeneratorParams) -> pd.DataFrame:
    """A made-up language and its "translation" by a fixed rule: `source` and `target` columns.

    Every source word has one target word (a fixed bijection between two invented vocabularies,
    Zipf-distributed), and the target swaps each pair of neighbouring words (a b c d e -> B A D C E):
    a word mapping plus a reordering, deterministic, so BLEU and exact match measure how much of the
    rule a model learnt. `num_classes` and `label_noise` are not used.
    """
    rng = np.random.default_rng(_CORPUS_SEED + 2)
    taken: set[str] = set()
    source_words = _invent_words(rng, _SOURCE_WORDS, taken)
    target_words = _invent_words(rng, _SOURCE_WORDS, taken)
    translate = dict(zip(source_words, target_words, strict=True))
    weights = _zipf_weights(_SOURCE_WORDS)
    sources, targets = [], []
    for _ in range(settings.num_rows):
        words = rng.choice(source_words, size=int(rng.integers(3, _TRANSLATION_MAX_WORDS + 1)), p=weights).tolist()
        mapped = [translate[w] for w in words]
        for i in range(0, len(mapped) - 1, 2):
            mapped[i], mapped[i + 1] = mapped[i + 1], mapped[i]
        sources.append(" ".join(words))
        targets.append(" ".join(mapped))
    return pd.DataFrame({"source": sources, "target": targets})
