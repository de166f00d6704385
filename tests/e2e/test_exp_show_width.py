"""The README's `dvc exp show` line reads whole at 120 columns with 5 experiments and every cell at its widest
(issue 71): `changed` at CHANGED_WIDTH, `timing` at TIMING_WIDTH, the causal LM's `test_exact_match` header and
`train_time_s` in the thousands. Real DVC in a git repo, with a stage that writes those cells (seconds, not a
training); `tests/e2e/test_experiment_names.py` reads a real experiment's row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipelines.baseline import CHANGED_WIDTH, TIMING_WIDTH
from tests.conftest import run
from tests.e2e.test_experiment_names import readme_exp_show

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WRITE = f"""
import json, pathlib, yaml
k = yaml.safe_load(open("params.yaml"))["k"]
figures = {{"changed": ("optim=adafactor lr=0.0003 k=" + str(k) + " +2").ljust({CHANGED_WIDTH}, "x"),
            "test_exact_match": 0.033333 * (k + 1), "train_time_s": 1234.5678 + k,
            "timing": ("shared by 2, load 1.31/core").ljust({TIMING_WIDTH}, "!"), "other": 1,
            "timing_full": "every mark, " * 8}}  # a column the README's line must not keep
pathlib.Path("metrics").mkdir(exist_ok=True)
pathlib.Path("metrics/evaluate.json").write_text(json.dumps(figures))
"""


def test_five_experiments_with_the_widest_cells_read_whole_at_120_columns(tmp_path: Path):
    root = tmp_path / "project"
    root.mkdir()
    (root / "write.py").write_text(WRITE)
    (root / "params.yaml").write_text("k: 0\n")
    stage = {"cmd": f"{sys.executable} write.py", "deps": ["write.py"], "params": ["k"],
             "metrics": [{"metrics/evaluate.json": {"cache": False}}]}  # fmt: skip
    (root / "dvc.yaml").write_text(json.dumps({"stages": {"evaluate": stage}}))
    for command in (["git", "init", "-q", "-b", "main"], ["dvc", "init", "-q"], ["dvc", "repro", "-q"],
                    ["git", "add", "-A"], ["git", "commit", "-qm", "baseline"]):  # fmt: skip
        run(command, root)
    for k in range(1, 6):
        run(["dvc", "exp", "run", "-q", "-S", f"k={k}"], root)
    shown = run(["bash", "-c", readme_exp_show()], root, env={"COLUMNS": "120"}).stdout
    lines = [line.rstrip() for line in shown.splitlines() if line.strip()]
    assert "…" not in shown and max(len(line) for line in lines) <= 120, shown
    rows = [line for line in lines if "optim=adafactor" in line]
    assert len(rows) == 6, shown  # the baseline and its five experiments
    for k, row in enumerate(sorted(rows, key=lambda line: line.split("k=")[1][:1])):  # every cell whole
        cells = row.split()
        assert len(" ".join(cells[:4])) == CHANGED_WIDTH and cells[3] == "+2" and f"k={k}" in row, row
        assert row.endswith("load 1.31/core!") and len(" ".join(cells[-5:])) == TIMING_WIDTH, row
        assert float(cells[4]) == pytest.approx(0.033333 * (k + 1), rel=1e-4) and float(cells[5]) > 1234, row
