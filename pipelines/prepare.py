"""The tokenize stage's work: read, split, tokenize, store, and measure padding."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.data.batching import LengthGroupedBatchSampler, padded_length, padding_fraction
from pipelines.data.sources import DROPPED, SPLITS, load_splits
from pipelines.data.tokenization import TOKENIZER_DIR, load_pretrained_tokenizer, set_tokenizer_threads
from pipelines.params import DataParams, Params


def length_stats(
    lengths: np.ndarray,
    data: DataParams,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    pad_multiple: int | None = None,
) -> dict[str, float]:
    """Length percentiles and the padding fraction of the configured batching vs fixed padding (0..1).

    `shuffle`: batched as training batches them (True), or as evaluation does (False, in order).
    `pad_multiple`: the resolved `data.pad_to_multiple_of` (see resolve_pad_multiple).
    """
    sampler = LengthGroupedBatchSampler(
        lengths, batch_size, bucketing=data.bucketing, shuffle=shuffle, seed=seed, max_tokens=data.max_tokens_per_batch
    )
    batches = sampler.batches(0)
    if data.bucketing:
        configured = padding_fraction(lengths, batches, lambda longest: padded_length(longest, pad_multiple))
    else:
        configured = padding_fraction(lengths, batches, lambda _: data.max_length)
    fixed = padding_fraction(lengths, batches, lambda _: data.max_length)
    return {
        "length_p50": round(float(np.percentile(lengths, 50)), 3),
        "length_p90": round(float(np.percentile(lengths, 90)), 3),
        "length_p99": round(float(np.percentile(lengths, 99)), 3),
        "length_max": int(lengths.max()),
        "pad_fraction_configured": round(configured, 6),
        "pad_fraction_fixed": round(fixed, 6),
    }


def prepare_dataset(params: Params, root: Path, out_dir: Path) -> dict[str, Any]:
    """Write tokenized splits, the tokenizer and the task's metadata into `out_dir`; return the stats."""
    from pipelines.runtime import resolve_device, resolve_pad_multiple
    from pipelines.tasks import get_task

    task = get_task(params.task)
    data = params.data
    # The padding the train stage will use on this machine (auto: 8 on CUDA, none on CPU).
    pad_multiple = resolve_pad_multiple(params, resolve_device(params))
    set_tokenizer_threads(data.num_proc)
    splits = load_splits(data, params.seed, root, task)
    if params.model.name_or_path is None:
        tokenizer = task.train_tokenizer(splits["train"], params.model.config.vocab_size)
    else:
        tokenizer = load_pretrained_tokenizer(params.model, root)
    tokenizer.save_pretrained(out_dir / TOKENIZER_DIR)
    stats: dict[str, Any] = dict(task.write_metadata(splits["train"], out_dir))
    for split in SPLITS:
        table = splits[split]
        encoded = task.encode(tokenizer, table, params, out_dir)
        encoded.split.save(out_dir / split)
        lengths = encoded.split.lengths
        stats[split] = {
            "rows": len(table),
            # Rows data.drop_empty left out of this split's own source table (a drawn split: 0; see load_splits).
            "dropped_empty_rows": int(table.attrs.get(DROPPED, 0)),
            "truncated_fraction": round(encoded.truncated / len(table), 6),
            **({"max_length_keeping_95pct": encoded.length_for_95pct} if encoded.length_for_95pct else {}),
            **length_stats(lengths, data, params.batch_size, params.seed, split == "train", pad_multiple),
        }
        warn_truncation(split, encoded, len(table), data.max_length)
    return stats


# Above this share of rows cut, the tokenize stage says so (a few long outliers are normal; a quarter is not).
TRUNCATION_WARNING_SHARE = 0.05


def warn_truncation(split: str, encoded: Any, rows: int, max_length: int) -> None:
    """Print a warning when more than 5% of a split's rows were cut, with the max_length that keeps 95% whole."""
    if rows and encoded.truncated / rows > TRUNCATION_WARNING_SHARE:
        keep = encoded.length_for_95pct
        keep = f"; data.max_length {keep} would keep 95% of the rows whole" if keep else ""
        print(f"warning: {split}: {encoded.truncated} of {rows} rows ({encoded.truncated / rows:.0%}) are longer than "
              f"data.max_length {max_length} and were cut{keep}", file=sys.stderr)  # fmt: skip
