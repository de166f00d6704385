"""Length-grouped batches with dynamic padding, and the fixed-padding baseline.

Hand-written rather than taken from transformers' `LengthGroupedSampler` because we
need three things it does not give together: the longest batch first (an
out-of-memory shows at step one, not at hour three), sharding across data-parallel
ranks that stays disjoint and complete without padding duplicates, and a per-epoch
batch list the engine can read ahead to weight the last partial accumulation window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.data.tokenization import TokenizedSplit

MEGA_BATCH_MULT = 50


def mega_batch_rows(rows: int, batch_size: int) -> int:
    """Rows sorted together when bucketing: up to 50 batches, and at least 4 mega-batches per epoch.

    The Hugging Face Trainer's rule. With one mega-batch for the whole split (a small split),
    every batch would hold rows of one length, and length goes with the label in many datasets
    (AG News): such batches are skewed by class, and accuracy after a short run dropped by up to
    3 points against the Trainer in our benchmark. Four or more mega-batches keep batches mixed.
    """
    return batch_size * max(1, min(MEGA_BATCH_MULT, rows // (batch_size * 4)))


def _split_largest(batches: list[list[int]], count: int) -> list[list[int]]:
    """Split the `count` largest batches in two (used to make batches divisible by ranks)."""
    batches = list(batches)
    for _ in range(count):
        i = max(range(len(batches)), key=lambda j: len(batches[j]))
        if len(batches[i]) < 2:
            break
        big = batches.pop(i)
        half = len(big) // 2
        batches[i:i] = [big[:half], big[half:]]
    return batches


def _merge_smallest(batches: list[list[int]], count: int) -> list[list[int]]:
    """Merge the smallest batch into the next smallest, `count` times (when nothing is left to split)."""
    batches = list(batches)
    for _ in range(count):
        order = sorted(range(len(batches)), key=lambda j: len(batches[j]))
        small, other = order[0], order[1]
        batches[other] = batches[other] + batches[small]
        del batches[small]
    return batches


@dataclass(frozen=True)
class Replica:
    """Which data-parallel rank reads, of how many: rank `rank` (0-based) of `count`."""

    rank: int = 0
    count: int = 1


class LengthGroupedBatchSampler:
    """Yields lists of row indices; one pass over the rows per epoch, every row exactly once.

    With `bucketing`, rows are shuffled, cut into mega-batches (`mega_batch_rows`: up to 50
    batches, at least 4 per epoch), each sorted by length and cut into batches (of `batch_size` rows, or
    of up to `max_tokens` padded tokens), and the batch order is shuffled with the
    longest batch moved first. Without it, batches are a plain random
    permutation (the fixed-padding baseline). With `replica.count > 1`, each rank takes
    every `count`-th batch; the batch count is made divisible by the rank count by
    splitting the largest batches (or, when all are single rows, merging the smallest),
    so ranks run the same number of steps on disjoint rows.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        *,
        bucketing: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        replica: Replica = Replica(),
        max_tokens: int | None = None,
    ) -> None:
        num_replicas, rank = replica.count, replica.rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.bucketing = bucketing
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.max_tokens = max_tokens if bucketing else None
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order `__iter__` yields (call before each epoch)."""
        self.epoch = epoch

    def _cut(self, rows: np.ndarray) -> list[list[int]]:
        """Cut rows (sorted longest first when bucketing) into batches of rows or of a token budget."""
        if self.max_tokens is None:
            return [rows[i : i + self.batch_size].tolist() for i in range(0, len(rows), self.batch_size)]
        batches: list[list[int]] = []
        current: list[int] = []
        for row in rows.tolist():
            # Rows arrive longest first, so the batch's first row sets its padded width.
            width = int(self.lengths[current[0]]) if current else int(self.lengths[row])
            if current and (len(current) + 1) * width > self.max_tokens:
                batches.append(current)
                current = []
            current.append(row)
        if current:
            batches.append(current)
        return batches

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches for `epoch`, deterministic in (seed, epoch)."""
        rng = np.random.default_rng([self.seed, epoch])
        n = len(self.lengths)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.bucketing:
            # Unshuffled (evaluation) batches sort the whole split: no training, so no class skew to avoid.
            mega = mega_batch_rows(n, self.batch_size) if self.shuffle else max(n, 1)
            # Stable sort, longest first, so ties keep the shuffled order.
            chunks = [c[np.argsort(-self.lengths[c], kind="stable")] for c in np.split(order, range(mega, n, mega))]
            batches = [batch for chunk in chunks for batch in self._cut(chunk)] if n else []
        else:
            batches = self._cut(order)
        if self.drop_last and self.max_tokens is None and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.bucketing and self.shuffle and len(batches) > 1:
            perm = rng.permutation(len(batches))
            batches = [batches[i] for i in perm]
            # The batch with the most padded tokens goes first: an out-of-memory shows at step one.
            largest = max(range(len(batches)), key=lambda i: len(batches[i]) * int(self.lengths[batches[i]].max()))
            batches.insert(0, batches.pop(largest))
        remainder = len(batches) % self.num_replicas
        if remainder:
            if self.drop_last:
                batches = batches[: len(batches) - remainder]
            else:
                batches = _split_largest(batches, self.num_replicas - remainder)
                remainder = len(batches) % self.num_replicas
                if remainder and len(batches) - remainder >= self.num_replicas:
                    # Only single-row batches were left to split (batch_size 1): merge instead.
                    batches = _merge_smallest(batches, remainder)
        return batches

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches for `epoch`."""
        return self.global_batches(epoch)[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches(self.epoch))

    def __len__(self) -> int:
        return len(self.batches(self.epoch))


@dataclass(frozen=True)
class WidthSet:
    """A few padded widths every batch is rounded up to: the static shapes a compiled step is built for
    (`pipelines.train.compiled_step`). A row longer than the widest (a test row) is rounded to `multiple` instead."""

    widths: tuple[int, ...]
    multiple: int

    def width(self, longest: int) -> int:
        """The narrowest width that holds `longest`."""
        for width in self.widths:
            if width >= longest:
                return width
        return -(-longest // self.multiple) * self.multiple

    def describe(self) -> str:
        """The widths as a tag: `16,32,64`."""
        return ",".join(str(w) for w in self.widths)


# How a batch's width is chosen: a multiple to round up to, a set of widths, or the longest row as it is.
Padding = int | WidthSet | None

# Widths a compiled step is built for (one graph each): few enough to compile once, and warm, before timing.
MAX_WIDTHS = 8


def width_set(lengths: np.ndarray, multiple: int | None, count: int = MAX_WIDTHS) -> WidthSet:
    """Up to `count` widths from the length histogram: the lengths at equal steps of the rows' quantiles, rounded
    up to `multiple` (8 when none), so each width holds about the same share of rows; the longest row's is last."""
    step = multiple or 8
    quantiles = np.quantile(np.asarray(lengths), np.arange(1, count + 1) / count, method="higher")
    return WidthSet(tuple(sorted({-(-int(q) // step) * step for q in quantiles})), step)


def padded_length(longest: int, pad_to_multiple_of: Padding) -> int:
    """The length a batch is padded to: its longest row, rounded up to the multiple or to the width set's next."""
    if isinstance(pad_to_multiple_of, WidthSet):
        return pad_to_multiple_of.width(longest)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return longest


class PadCollator:
    """Builds a padded batch (input_ids, attention_mask, labels) from row indices.

    Used as the DataLoader's dataset *and* collate function: `__getitem__` returns the
    index itself, so workers only slice the memory-mapped arrays in `__call__`.
    """

    def __init__(self, split: TokenizedSplit, pad_id: int, *, fixed_length: int | None, pad_to_multiple_of: Padding):
        self.input_ids = split.input_ids
        self.lengths = split.lengths
        self.offsets = split.offsets
        self.labels = split.labels
        self.pad_id = pad_id
        self.fixed_length = fixed_length
        self.pad_to_multiple_of = pad_to_multiple_of

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> int:
        return index

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices)
        lengths = self.lengths[idx]
        width = self.fixed_length or padded_length(int(lengths.max()), self.pad_to_multiple_of)
        ids = np.full((len(idx), width), self.pad_id, dtype=np.int64)
        for row, (start, length) in enumerate(zip(self.offsets[idx], lengths, strict=True)):
            ids[row, :length] = self.input_ids[start : start + length]
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        batch = {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask),
            "row_index": torch.from_numpy(idx.astype(np.int64)),
            "num_rows": torch.tensor(len(idx)),  # examples (a packed row holds several)
            "num_tokens": torch.tensor(int(lengths.sum())),
            "num_positions": torch.tensor(ids.size),  # tokens plus padding, over every input the model reads
        }
        if self.labels is not None:  # a classifier's label per row (a language model's labels are its tokens)
            batch["labels"] = torch.from_numpy(self.labels[idx].astype(np.int64))
        return batch


# Host-side counters of a batch (what it holds, for the clocks and padding figures), not model inputs.
HOST_COUNTS = ("row_index", "num_rows", "num_tokens", "num_positions")


def padding_fraction(lengths: np.ndarray, batches: list[list[int]], width_of: Callable[[int], int]) -> float:
    """Share of padded positions over all batches, given each batch's padded width."""
    real = padded = 0
    for batch in batches:
        lens = lengths[batch]
        real += int(lens.sum())
        padded += width_of(int(lens.max())) * len(batch)
    return 1.0 - real / padded if padded else 0.0
