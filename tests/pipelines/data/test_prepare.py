"""The tokenize stage's work: compact, deterministic arrays and honest padding stats."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from pipelines.data.tokenization import TokenizedSplit, load_label_names
from pipelines.prepare import prepare_dataset
from tests.conftest import tiny_params


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_outputs_are_byte_identical_across_runs(tmp_path, default_params):
    params = tiny_params(default_params, **{"data.generator.num_rows": 600})
    stats_a = prepare_dataset(params, tmp_path, tmp_path / "a")
    stats_b = prepare_dataset(params, tmp_path, tmp_path / "b")
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert stats_a == stats_b


def test_arrays_round_trip_and_stats_are_fractions(tmp_path, default_params):
    params = tiny_params(default_params, **{"data.generator.num_rows": 600, "data.max_length": 32})
    stats = prepare_dataset(params, tmp_path, tmp_path / "out")
    train = TokenizedSplit.load(tmp_path / "out" / "train")
    assert train.input_ids.dtype == np.int32 and len(train.input_ids) == int(train.lengths.sum())
    assert train.lengths.max() <= 32
    assert load_label_names(tmp_path / "out") == sorted(load_label_names(tmp_path / "out"))
    for split in ("train", "validation", "test"):
        s = stats[split]
        assert 0 <= s["pad_fraction_configured"] < s["pad_fraction_fixed"] < 1
        assert 0 < s["truncated_fraction"] < 1  # max_length 32 cuts the long rows
    assert stats["train"]["rows"] + stats["validation"]["rows"] + stats["test"]["rows"] == 600
