"""Our packing beside the libraries that do the same (issue 71): are the packs and each pack's targets what TRL's
`pack_dataset(strategy="bfd")` and transformers' `DataCollatorWithFlattening` make, and what do they cost?

    python -m benchmarks.bench_packing_peers [--rounds 3]
    python -m benchmarks.bench_packing_peers --smoke      # a few thousand rows, one round: that it runs, not a figure

Packs: `pipelines.data.packing.best_fit_decreasing` against TRL's `pack_dataset` on the same generated lengths, the
whole set in one map batch (TRL's default batch of 1,000 rows packs each thousand apart, and leaves a part-filled
pack per batch). TRL's side is timed from a `datasets.Dataset` already built (its Arrow copy of every token, which
our split never makes, is not counted). Targets: every pack's position ids and labels, ours (`packed_targets`,
NumPy) against the collator's on the same rows (labels with the prompt masked), which the pipeline would then pad.
Each round times every side once, in the same order; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from pipelines.data.packing import IGNORE, PackedSplit, best_fit_decreasing, pack_split, packed_targets
from pipelines.data.tokenization import TokenizedSplit

# (name, rows, shortest, longest, capacity): short rows against a small capacity, and instruction-like rows.
SHAPES = [("5-60 tokens, capacity 64", 100_000, 5, 60, 64), ("20-400 tokens, capacity 2,048", 50_000, 20, 400, 2048)]
SMOKE_SHAPES = [("5-60 tokens, capacity 64", 3_000, 5, 60, 64), ("20-400 tokens, capacity 2,048", 2_000, 20, 400, 2048)]


def timed(work: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def packs_side_by_side(lengths: np.ndarray, capacity: int, rounds: int) -> dict[str, float]:
    """Ours and TRL's packs of the same rows: counts, whether they are the same packs, median seconds."""
    from datasets import Dataset, disable_progress_bars
    from trl.data_utils import pack_dataset

    disable_progress_bars()
    whole = {"batch_size": len(lengths)}  # one map batch: TRL packs each batch apart
    # Each row's tokens are its own index, so a packed row names the rows it holds.
    rows = Dataset.from_dict({"input_ids": [np.full(int(n), i) for i, n in enumerate(lengths)]})
    ours_s, trl_s = [], []
    for _ in range(rounds):
        seconds, ours = timed(lambda: best_fit_decreasing(lengths, capacity))
        ours_s.append(seconds)
        seconds, theirs = timed(lambda: pack_dataset(rows, capacity, strategy="bfd", map_kwargs=whole))
        trl_s.append(seconds)
    trl_packs = sorted(sorted(set(pack)) for pack in theirs["input_ids"])
    return {"ours_packs": len(ours), "trl_packs": len(trl_packs), "same_packs": sorted(ours) == trl_packs,
            "fill": float(lengths.sum() / (len(ours) * capacity)),
            "ours_s": statistics.median(ours_s), "trl_s": statistics.median(trl_s)}  # fmt: skip


def collator_targets(split: TokenizedSplit, packed: PackedSplit, pack: int, width: int) -> tuple[np.ndarray, ...]:
    """`DataCollatorWithFlattening`'s position ids and labels for one pack's rows, padded to `width` as ours are."""
    from transformers import DataCollatorWithFlattening

    features = []
    for row in packed.source_rows[packed.segments(pack)].tolist():
        ids = split.input_ids[split.offsets[row] : split.offsets[row] + split.lengths[row]].astype(np.int64)
        labels = ids.copy()
        labels[: split.prompt_lengths[row]] = IGNORE
        features.append({"input_ids": ids, "labels": labels})
    flat = DataCollatorWithFlattening(return_tensors="np")(features)
    padding = width - flat["input_ids"].shape[1]
    return (np.concatenate([flat["position_ids"][0], np.arange(padding)]),
            np.concatenate([flat["labels"][0], np.full(padding, IGNORE)]))  # fmt: skip


def targets_side_by_side(lengths: np.ndarray, capacity: int, rounds: int) -> dict[str, float]:
    """Ours and the collator's targets for every pack: whether they are equal, median milliseconds a pack."""
    rng = np.random.default_rng(1)
    prompts = (lengths * rng.uniform(0.2, 0.8, size=len(lengths))).astype(np.int32)
    ids = rng.integers(0, 49_152, size=int(lengths.sum())).astype(np.int32)
    split = TokenizedSplit(input_ids=ids, lengths=lengths.astype(np.int32), prompt_lengths=prompts)
    packed = pack_split(split, capacity)
    every = range(len(packed))
    ours_s, theirs_s = [], []
    for _ in range(rounds):
        seconds, ours = timed(lambda: [packed_targets(packed, p, capacity, False) for p in every])
        ours_s.append(seconds)
        seconds, theirs = timed(lambda: [collator_targets(split, packed, p, capacity) for p in every])
        theirs_s.append(seconds)
    equal = all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(ours, theirs, strict=True))
    return {"packs": len(packed), "same_targets": equal,
            "ours_ms_per_pack": statistics.median(ours_s) / len(packed) * 1e3,
            "collator_ms_per_pack": statistics.median(theirs_s) / len(packed) * 1e3}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    print("| rows | packs ours / TRL | same packs | fill | ours (ms) | TRL (ms) | TRL / ours |")
    print("|---|---|---|---|---|---|---|")
    for name, count, low, high, capacity in SMOKE_SHAPES if args.smoke else SHAPES:
        lengths = np.random.default_rng(0).integers(low, high, size=count)
        r = packs_side_by_side(lengths, capacity, rounds)
        ours, trl = r["ours_s"] * 1e3, r["trl_s"] * 1e3
        print(f"| {count:,} rows of {name} | {r['ours_packs']:,} / {r['trl_packs']:,} | {r['same_packs']} "
              f"| {r['fill']:.4f} | {ours:.0f} | {trl:.0f} | {trl / ours:.1f}x |")  # fmt: skip
    print("\n| rows | packs | same targets | ours (ms a pack) | collator (ms a pack) | collator / ours |")
    print("|---|---|---|---|---|---|")
    name, count, low, high, capacity = (SMOKE_SHAPES if args.smoke else SHAPES)[1]
    r = targets_side_by_side(np.random.default_rng(0).integers(low, high, size=count // 10), capacity, rounds)
    ours, collator = r["ours_ms_per_pack"], r["collator_ms_per_pack"]
    print(f"| {count // 10:,} rows of {name} | {r['packs']:,} | {r['same_targets']} | {ours:.3f} | {collator:.3f} "
          f"| {collator / ours:.1f}x |")  # fmt: skip
    if args.smoke:
        print("\nsmoke run: a few thousand rows, one round; not a measurement, nothing to record")


if __name__ == "__main__":
    main()
