"""Padding waste and tokenization speed on AG News with the all-MiniLM-L6-v2 tokenizer, side by side.

    python benchmarks/bench_tokenize.py

Prints, for the train split (5,320 rows) at max_length 128 and batch_size 32: the padding
fraction of fixed padding, of length bucketing (with and without rounding to a multiple
of 8, and with a token budget), and tokenization rows/s (RAYON_NUM_THREADS=1 for one thread).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from benchmarks.common import ag_news_params, require_assets
from pipelines.data.sources import load_splits
from pipelines.data.tokenization import encode_texts, join_texts
from pipelines.prepare import prepare_dataset
from pipelines.tasks import get_task

CONFIGS = {
    "fixed padding (vanilla)": {"data.bucketing": False, "data.pad_to_multiple_of": None},
    "bucketing": {"data.bucketing": True, "data.pad_to_multiple_of": None},
    "bucketing, multiple of 8": {"data.bucketing": True, "data.pad_to_multiple_of": 8},
    "bucketing, 4096-token budget": {
        "data.bucketing": True,
        "data.pad_to_multiple_of": None,
        "data.max_tokens_per_batch": 4096,
    },
}


def main() -> None:
    model = require_assets()
    print(f"{'batching':32} {'pad fraction':>12} {'vs fixed':>9}")
    for name, overrides in CONFIGS.items():
        params = ag_news_params(model, **overrides)
        with tempfile.TemporaryDirectory() as tmp:
            stats = prepare_dataset(params, Path.cwd(), Path(tmp))["train"]
        print(f"{name:32} {stats['pad_fraction_configured']:12.1%} {stats['pad_fraction_fixed']:9.1%}")

    params = ag_news_params(model)
    splits = load_splits(params.data, params.seed, Path.cwd(), get_task(params.task))
    texts = join_texts(splits["train"]["texts"].tolist(), "[SEP]")
    tokenizer = AutoTokenizer.from_pretrained(model)
    encode_texts(tokenizer, texts[:500], 128)  # warm-up
    start = time.perf_counter()
    encode_texts(tokenizer, texts, 128)
    threads = os.environ.get("RAYON_NUM_THREADS", "all cores")
    print(f"\ntokenization ({threads} threads): {len(texts) / (time.perf_counter() - start):,.0f} rows/s")


if __name__ == "__main__":
    main()
