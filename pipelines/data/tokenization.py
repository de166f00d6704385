"""Tokenize splits into compact arrays, and read them back for training.

Each split is stored as three `.npy` files: every row's token ids concatenated
(int32), each row's length, and each row's label id. `np.save` writes the same bytes
for the same arrays (unlike `np.savez`, whose zip entries carry timestamps), so
DVC's cache holds across re-runs, and training reads the arrays memory-mapped with no
per-row Python objects.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from pipelines.errors import UserError
from pipelines.params import ModelParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# A decoder's word-level tokenizer: no [CLS]/[SEP] framing; [EOS] ends every response.
CAUSAL_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
TOKENIZER_DIR = "tokenizer"
LABELS_FILE = "labels.json"


def _word_counts(texts: Sequence[str]) -> tuple[Counter[str], normalizers.Normalizer, pre_tokenizers.PreTokenizer]:
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    return counts, normalizer, pre_tokenizer


def _most_frequent(counts: Counter[str], keep: int) -> list[str]:
    # Sorted by (-count, word): deterministic, unlike a trainer's hash-order tie breaks.
    return sorted(sorted(counts, key=lambda w: (-counts[w], w))[:keep])


def train_causal_word_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer for a decoder built from a config: words of `texts`, [PAD]/[UNK]/[BOS]/[EOS].

    Decoding joins words with spaces, so a generated answer and its reference decode alike.
    """
    counts, normalizer, pre_tokenizer = _word_counts(texts)
    words = _most_frequent(counts, vocab_size - len(CAUSAL_SPECIAL_TOKENS))
    vocab = {token: i for i, token in enumerate(CAUSAL_SPECIAL_TOKENS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    from transformers import PreTrainedTokenizerFast  # deferred: see train_word_tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]"
    )


def train_word_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Build a BERT-style word-level tokenizer from the `vocab_size` most frequent words of `texts`.

    Built here rather than with a `tokenizers` trainer: those break frequency ties in hash
    order, so the same corpus gives a different vocabulary from run to run, and DVC's cache
    never holds. Counting and sorting by (-count, word) is deterministic by construction.
    Used only when no pretrained model (with its own tokenizer) is named.
    """
    counts, normalizer, pre_tokenizer = _word_counts(texts)
    vocab = {
        token: i for i, token in enumerate(SPECIAL_TOKENS + _most_frequent(counts, vocab_size - len(SPECIAL_TOKENS)))
    }
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    # Deferred, like every transformers import of the data and task modules: the stages that only read a task's
    # declarations (the train stage's driver, the report) import those modules and tokenize nothing.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def load_pretrained_tokenizer(model: ModelParams, root: Path) -> PreTrainedTokenizerBase:
    """Load the named model's fast tokenizer from a local folder or the hub."""
    from transformers import AutoTokenizer

    from pipelines.model import resolve_model_name

    name = resolve_model_name(model, root)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name,
            use_fast=True,
            revision=model.revision,
            gguf_file=model.gguf_file,
            trust_remote_code=model.trust_remote_code,
        )
    except (OSError, ValueError) as err:
        raise UserError(
            f"model.name_or_path = {model.name_or_path!r}: no local model folder there, and the hub "
            f"could not provide it ({str(err).splitlines()[0]})"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # decoders often ship without one; padding is masked anyway
    return tokenizer


def join_texts(rows: Sequence[tuple[str, ...]], separator: str) -> list[str]:
    """Join several text columns into one string per row with the tokenizer's separator."""
    return [row[0] if len(row) == 1 else f" {separator} ".join(row) for row in rows]


def set_tokenizer_threads(threads: int | None) -> None:
    """Use `threads` Rust threads for batch encoding (None: all cores, the library's default).

    The fast tokenizer already encodes a batch in parallel (rayon). Measured on AG News with 2
    cores, while another job shared them: 4.8k rows/s on 1 thread, 10.3k on 2, and 0.7k through a
    2-process pool, whose start-up and pickling cost more than the work (13.8k rows/s on 2 threads
    with the machine idle: benchmarks/RESULTS.md). So parallelism is threads, not processes.
    Takes effect if set before the first batch is encoded in this process.
    """
    if threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(threads)


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int) -> list[list[int]]:
    return tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]


def encode_texts(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Return (flat int32 token ids, int32 lengths, rows truncated) for `texts`."""
    # One more token than allowed tells us whether a row was truncated.
    encoded = _encode(tokenizer, texts, max_length + 1)
    long_rows = [i for i, ids in enumerate(encoded) if len(ids) > max_length]
    if long_rows:
        # Re-encode the long rows with the real limit so special tokens ([SEP]) stay at the end.
        redone = _encode(tokenizer, [texts[i] for i in long_rows], max_length)
        for i, ids in zip(long_rows, redone, strict=True):
            encoded[i] = ids
    lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int32, count=len(encoded))
    flat = np.fromiter((t for ids in encoded for t in ids), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths, len(long_rows)


def label_names(train_labels: pd.Series) -> list[str]:
    """Sorted label names; numeric labels sort as numbers (so "10" comes after "9")."""
    names = sorted(set(train_labels))
    if all(n.lstrip("-").isdigit() for n in names):
        names.sort(key=int)
    return names


def class_key(label: str) -> str:
    """A label's key in metric names (`test_recall.<key>`): MLflow takes letters of any script, digits, `_` and `-`
    (and refuses `,`, `&`, quotes and emoji, INVALID_PARAMETER_VALUE). Each run of other characters becomes one `_`,
    a symbol (emoji) its code point (`u1f600`), ends trimmed: `Sports & Games` -> `Sports_Games`, `Économie` and
    `経済` unchanged. Stable (the text alone decides it) and documented; the label itself stays in labels.json, the
    plots, the predictions and the report. A label with nothing left gets `label_` and a hash of its text."""
    import hashlib
    import unicodedata

    parts = []
    for char in label:
        if char.isalnum() or char in "_-":
            parts.append(char)
        elif unicodedata.category(char) == "So":
            parts.append(f"_u{ord(char):x}_")
        else:
            parts.append("_")
    key = "_".join(p for p in "".join(parts).split("_") if p)
    return key or f"label_{hashlib.sha1(label.encode()).hexdigest()[:8]}"


def class_keys(names: list[str]) -> list[str]:
    """Each label's `class_key`, refusing two labels with one key (naming both), which would share metrics."""
    from pipelines.data.fingerprint import DataError

    seen: dict[str, str] = {}
    for name in names:
        key = class_key(name)
        if key in seen:
            raise DataError(
                f"labels {seen[key]!r} and {name!r} would share the metric key {key!r} (test_recall.{key}): metric "
                "names keep letters, digits, '_' and '-', and each run of other characters becomes one '_'; make the "
                "two labels differ in their letters or digits, or merge them if they are one class"
            )
        seen[key] = name
    return [class_key(name) for name in names]


@dataclass(frozen=True)
class TokenizedSplit:
    """One split as flat token ids plus per-row offsets and lengths.

    A classifier's split has a label id per row (`labels`); a language model's has, per row, the
    number of leading prompt tokens (`prompt_lengths`), which the loss skips unless told otherwise.
    """

    input_ids: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray | None = None
    prompt_lengths: np.ndarray | None = None

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)[:-1]])

    def __len__(self) -> int:
        return len(self.lengths)

    def digest(self, chars: int = 12) -> str:
        """A content hash of the split (its arrays, with dtypes and shapes): equal exactly for equal tokens."""
        sha = hashlib.sha256()
        for name in ("input_ids", "lengths", "labels", "prompt_lengths"):
            array = getattr(self, name)
            if array is None:
                continue
            array = np.ascontiguousarray(array)
            sha.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
            sha.update(memoryview(array).cast("B"))
        return sha.hexdigest()[:chars]

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "input_ids.npy", self.input_ids)
        np.save(folder / "lengths.npy", self.lengths)
        for name in ("labels", "prompt_lengths"):
            if getattr(self, name) is not None:
                np.save(folder / f"{name}.npy", getattr(self, name))

    @classmethod
    def load(cls, folder: Path) -> TokenizedSplit:
        if not (folder / "lengths.npy").is_file():
            raise UserError(f"{folder}: no tokenized split there; run the tokenize stage first (dvc repro tokenize)")
        optional = {
            name: np.load(folder / f"{name}.npy")
            for name in ("labels", "prompt_lengths")
            if (folder / f"{name}.npy").is_file()
        }
        return cls(
            input_ids=np.load(folder / "input_ids.npy", mmap_mode="r"),
            lengths=np.load(folder / "lengths.npy"),
            **optional,
        )


def load_label_names(tokenized_dir: Path) -> list[str]:
    """The label names saved beside the tokenized data, in label-id order."""
    return json.loads((tokenized_dir / LABELS_FILE).read_text(encoding="utf-8"))["names"]
