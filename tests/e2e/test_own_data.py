"""Users' own data through real DVC: an edit to a local file, folder or `dvc add`ed folder re-runs tokenize with
no `-f`; label text of any kind trains, evaluates and reports, every per-class metric in MLflow."""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
from pathlib import Path

import pandas as pd
import pytest

from pipelines.data.tokenization import class_key
from tests.conftest import run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# Commas, `&`, `/`, quotes, accents, CJK, an emoji, spaces around, a number: each its own class.
LABELS = ["Finance, Markets", "Sports & Games", "Science/Tech", 'Say "hi"', "Économie", "経済", "Fun 😀",
          "  Spaced  ", "42"]  # fmt: skip


def topic_rows(rows_per_label: int, labels: list[str]) -> pd.DataFrame:
    """Rows whose words say their label (each label its own word), so a small model learns them in a few epochs."""
    rows = []
    for i in range(rows_per_label):
        for k, label in enumerate(labels):
            rows.append({"text": f"word{k} topic{k} item{i % 7} about{k} word{k}", "label": label})
    return pd.DataFrame(rows)


def tokenize_ran(stdout: str) -> bool:
    return "Running stage 'tokenize'" in stdout


@pytest.mark.parametrize("layout", ["file", "folder", "dvc-added folder"])
def test_an_edited_data_file_re_runs_tokenize_without_force(project_copy: Path, layout: str):
    root = project_copy
    data = topic_rows(40, ["a", "b", "c"])
    if layout == "file":
        source, edited = "mydata.csv", root / "mydata.csv"
        data.to_csv(edited, index=False)
    else:
        (root / "mydata").mkdir()
        source, edited = "mydata", root / "mydata" / "train.csv"
        data.to_csv(edited, index=False)
        data.head(30).to_csv(root / "mydata" / "test.csv", index=False)
    if layout == "dvc-added folder":
        run(["dvc", "add", "mydata"], root)
    write_params(root, {"data.source": source})
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "own data"], root)
    first = run(["dvc", "exp", "run", "tokenize"], root)
    assert tokenize_ran(first.stdout)
    before = json.loads((root / "metrics/tokenize.json").read_text())
    again = run(["dvc", "exp", "run", "tokenize"], root)
    assert not tokenize_ran(again.stdout), again.stdout  # unchanged data: skipped
    longer = data.copy()
    longer.loc[0, "text"] = " ".join(["a much longer row"] * 8)  # the longest row grows: the stats must show it
    longer.to_csv(edited, index=False)
    edited_run = run(["dvc", "exp", "run", "tokenize"], root)
    assert tokenize_ran(edited_run.stdout), edited_run.stdout
    after = json.loads((root / "metrics/tokenize.json").read_text())
    assert after["train"]["length_max"] > before["train"]["length_max"] or (
        after["validation"]["length_max"] > before["validation"]["length_max"]
    )
    fingerprint = json.loads((root / "metrics/data_source.json").read_text())
    assert fingerprint["kind"] == ("file" if layout == "file" else "folder")


def test_labels_of_any_text_train_evaluate_and_report_through_dvc(project_copy: Path):
    root = project_copy
    (root / "mydata").mkdir()
    topic_rows(24, LABELS).to_csv(root / "mydata" / "train.csv", index=False)
    topic_rows(6, LABELS).to_csv(root / "mydata" / "test.csv", index=False)
    write_params(root, {"data.source": "mydata", "epochs": 4, "lr": 0.003, "data.generator.num_rows": 100})
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "labels"], root)
    done = run(["dvc", "exp", "run"], root)
    assert "unreachable" not in done.stdout + done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (root / "mlflow-fallback").exists()
    with sqlite3.connect(root / "mlflow.db") as db:
        keys = {k for (k,) in db.execute("SELECT DISTINCT key FROM metrics WHERE key LIKE 'test_recall.%'")}
    assert keys >= {f"test_recall.{class_key(label)}" for label in LABELS}, keys
    per_class = json.loads((root / "plots/per_class.json").read_text())
    assert sorted(row["class"] for row in per_class) == sorted(LABELS)  # as written, spaces and all
    report = (root / "reports/report.md").read_text(encoding="utf-8")
    for label in LABELS:
        assert json.dumps(label, ensure_ascii=False).replace("|", "\\|") in report, label
    predictions = pd.read_csv(root / "predictions/test.csv", keep_default_na=False)
    assert set(predictions["label"]) == set(LABELS)
    # `dvc exp show` tells experiments on other data apart: the `data` column, the MD5 of the source stage's record.
    digest = hashlib.md5((root / "metrics/data_source.json").read_bytes()).hexdigest()[:8]
    assert json.loads((root / "metrics/evaluate.json").read_text())["data"] == digest
    shown = pd.read_csv(io.StringIO(run(["dvc", "exp", "show", "--csv", "--no-pager"], root).stdout), dtype=str)
    assert digest in set(shown["data"]), shown.get("data")
