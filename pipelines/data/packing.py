"""Packing for causal LMs: several short examples per row, each attending only to itself.

A packed row is its examples' tokens back to back, up to `data.max_length`. Each example keeps
its own positions (0, 1, 2, ... restarting at every example) and sees none of the others:
the batch carries `position_ids` and no 2-D attention mask, and transformers' mask builder
(`masking_utils.find_packed_sequence_indices`) turns restarting positions into a block-diagonal
causal mask for SDPA and eager attention, or variable-length sequences (`cu_seqlens`) for
FlashAttention. We use that rather than a hand-built 4-D mask so that the model's own attention
path decides how to isolate examples, on every backend it supports. Not every architecture
builds its mask there, so `check_isolation` runs one tiny forward first and refuses packing
when changing one packed example moves the next one's logits.

The packs are chosen by best-fit decreasing over the rows' lengths, as TRL's
`pack_dataset(strategy="bfd")` chooses them, and each pack's positions and labels are what
transformers' `DataCollatorWithFlattening` makes of its rows: tests hold both against the
libraries. Both are hand-written here, measured (issue 71, benchmarks/RESULTS.md "Packing
beside TRL's and transformers'"): TRL packs a `datasets.Dataset` (an Arrow copy of every token)
and truncates a row over the capacity, where we pack index lists over the memory-mapped split
and refuse such a row; its packs are identical to ours and took 10-16x longer (from a Dataset
already built). The collator builds Python lists per token: 0.445 ms a 2,048-token pack against
0.035 ms here (12.6x), about 3.3 ms of host time per 8-pack batch on the training loop's thread.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipelines.data.tokenization import TokenizedSplit
from pipelines.runtime import eval_mode

IGNORE = -100  # label of a position the loss skips: torch's ignore_index


@dataclass(frozen=True, kw_only=True)
class PackedSplit(TokenizedSplit):
    """Packs as rows (`input_ids`, `lengths` per pack), and each pack's examples (segments).

    `segment_starts[p]:segment_starts[p + 1]` index pack p's segments in `segment_lengths`,
    `segment_prompt_lengths` and `source_rows` (the segment's row in the unpacked split).
    """

    segment_lengths: np.ndarray
    segment_prompt_lengths: np.ndarray
    segment_starts: np.ndarray
    source_rows: np.ndarray
    capacity: int

    def segments(self, pack: int) -> slice:
        """The slice of the segment arrays that belongs to `pack`."""
        return slice(int(self.segment_starts[pack]), int(self.segment_starts[pack + 1]))

    @property
    def examples(self) -> int:
        """Examples (unpacked rows) over all packs."""
        return len(self.segment_lengths)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Row indices grouped into packs of at most `capacity` tokens: longest row first, into the fullest pack it fits
    (among equally full packs, the one that reached that fill first: TRL's `pack_dataset(strategy="bfd")` order)."""
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"a row of {int(lengths.max())} tokens does not fit a pack of {capacity}")
    packs: list[list[int]] = []
    # Packs by free tokens: the distinct amounts sorted (at most capacity of them, so a bisect and an insert cost
    # O(capacity), not O(packs)), and per amount the packs with that much room, in the order they got it.
    room_amounts: list[int] = []
    packs_with_room: dict[int, deque[int]] = defaultdict(deque)
    for row in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[row])
        at = bisect.bisect_left(room_amounts, need)
        if at == len(room_amounts):
            room, pack = capacity, len(packs)
            packs.append([])
        else:
            room = room_amounts[at]
            pack = packs_with_room[room].popleft()
            if not packs_with_room[room]:
                del room_amounts[at]
        packs[pack].append(row)
        if room - need > 0:
            if not packs_with_room[room - need]:
                bisect.insort(room_amounts, room - need)
            packs_with_room[room - need].append(pack)
    return [sorted(pack) for pack in packs]


def pack_split(split: TokenizedSplit, capacity: int) -> PackedSplit:
    """`split`'s rows packed into rows of at most `capacity` tokens (see `best_fit_decreasing`)."""
    assert split.prompt_lengths is not None, "packing is for causal-LM splits (rows with prompt lengths)"
    packs = best_fit_decreasing(split.lengths, capacity)
    rows = np.fromiter((r for pack in packs for r in pack), dtype=np.int64, count=len(split))
    offsets = split.offsets
    ids = np.concatenate([split.input_ids[offsets[r] : offsets[r] + split.lengths[r]] for r in rows.tolist()])
    counts = np.fromiter((len(p) for p in packs), dtype=np.int64, count=len(packs))
    segment_lengths = split.lengths[rows]
    starts = np.concatenate([[0], np.cumsum(counts)])
    return PackedSplit(
        input_ids=ids.astype(np.int32),
        lengths=np.add.reduceat(segment_lengths.astype(np.int64), starts[:-1]).astype(np.int32),
        segment_lengths=segment_lengths,
        segment_prompt_lengths=split.prompt_lengths[rows],
        segment_starts=starts,
        source_rows=rows,
        capacity=capacity,
    )


def packed_targets(split: PackedSplit, pack: int, width: int, train_on_prompt: bool) -> tuple[np.ndarray, np.ndarray]:
    """(position ids, labels) of one pack padded to `width`: positions restart per example, labels mask
    each example's first token (nothing before it in its own example), its prompt unless trained on,
    and the padding (which gets positions of its own, so it forms a segment no example attends to)."""
    positions = np.empty(width, dtype=np.int64)
    labels = np.full(width, IGNORE, dtype=np.int64)
    ids = split.input_ids[split.offsets[pack] : split.offsets[pack] + split.lengths[pack]]
    at = 0
    piece = split.segments(pack)
    for length, prompt in zip(split.segment_lengths[piece], split.segment_prompt_lengths[piece], strict=True):
        length = int(length)
        positions[at : at + length] = np.arange(length)
        first = 1 if train_on_prompt else max(int(prompt), 1)
        labels[at + first : at + length] = ids[at + first : at + length]
        at += length
    positions[at:] = np.arange(width - at)
    return positions, labels


@torch.no_grad()
def check_isolation(model: nn.Module, vocab_size: int, tolerance: float = 1e-6) -> str | None:
    """Why packed examples would see each other in `model`, or None when each attends only to itself.

    Two forwards at p=0 (eval mode) of two 4-token examples packed with restarting positions,
    the first example's tokens changed between them: the second example's logits must not move.
    Both forwards have the same shapes, so an isolating model computes them with the same
    kernels and they agree exactly (`tolerance` allows for non-deterministic reductions); a
    model that lets them attend to each other moves them by about 1e-3 even at random init.
    """
    with eval_mode(model):
        device = next(model.parameters()).device
        ids = torch.randint(0, max(vocab_size, 2), (2, 8), generator=torch.Generator().manual_seed(0))
        ids[1, 4:] = ids[0, 4:]  # the same second example after two different first ones
        positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
        logits = model(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False).logits
        worst = float((logits[0, 4:].float() - logits[1, 4:].float()).abs().max())
    if worst <= tolerance:
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    return (
        f"{type(inner).__name__}'s attention does not isolate packed examples (changing one example moved the "
        f"next one's logits by {worst:.2e}): its mask is not built from restarting position ids; set data.packing: "
        "false"
    )
