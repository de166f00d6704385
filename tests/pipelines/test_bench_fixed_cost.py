"""`benchmarks/bench_fixed_cost.py`: its smoke run (one round on 300 generated rows) times the real pipeline and the
plain script side by side and splits the pipeline's time by stage, so the benchmark cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, git_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_smoke_run_times_the_pipeline_and_the_plain_script_and_splits_by_stage(tmp_path: Path):
    out = tmp_path / "fixed_cost.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_fixed_cost", "--smoke", "--json", str(out)],
                          cwd=REPO_ROOT, env=git_env(), capture_output=True, text=True, timeout=850)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    (round_,) = report["rounds"]
    # The experiment ran the stages its change reaches: source always, then train, evaluate and report; tokenize
    # was cached by the baseline's `dvc repro`.
    assert {"source", "train", "evaluate", "report"} <= set(round_["split"]) and "tokenize" not in round_["split"]
    assert abs(sum(round_["split"].values()) - round_["pipeline_s"]) < 0.5  # the parts add up to the whole
    assert 0 < round_["plain"]["train_time_s"] < round_["plain_s"] and 0 <= round_["plain"]["test_accuracy"] <= 1
    assert report["ratio"] == pytest.approx(report["pipeline_median_s"] / report["plain_median_s"])
    # The same experiment joined to a running Ray head ran the same stages, and its parts add up too.
    assert set(round_["head_split"]) == set(round_["split"])
    assert abs(sum(round_["head_split"].values()) - round_["head_s"]) < 0.5
    assert report["head_ratio"] == pytest.approx(report["head_median_s"] / report["plain_median_s"])
    assert "| **ratio** |" in done.stdout
