"""Every user error in docs/reference/errors.md's table: named clearly, exit 1, no traceback, no output touched."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from tests.conftest import run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# (what, stage, params overrides, file or list of files to write, expected text) — the same rows as
# docs/reference/errors.md's table.
CASES = [
    ("unknown key", "tokenize", {"optimizer": "adamw"}, None, "optimizer: unknown key"),
    ("wrong type", "tokenize", {"epochs": "three"}, None, "epochs = 'three': Input should be a valid integer"),
    (
        "a number YAML reads as text",
        "tokenize",
        {"lr": "1e-4"},
        None,
        "lr = '1e-4': params.yaml is read as YAML 1.1, where 1e-4 is a string, not a number",
    ),
    ("out-of-range value", "train", {"batch_size": -4}, None, "batch_size = -4: must be an integer greater than 0"),
    (
        "not an allowed value",
        "train",
        {"optim": "adafator"},
        None,
        "optim = 'adafator': Input should be 'adamw', 'adafactor', 'adamw_8bit', 'lion' or 'sgd'",
    ),
    (
        "incompatible combination",
        "train",
        {"precision": "fp16", "device": "cpu"},
        None,
        "precision: fp16 (with loss scaling) is for GPUs; with device: cpu",
    ),
    (
        "missing data file",
        "tokenize",
        {"data.source": "data/raw.csv"},
        None,
        "data.source = 'data/raw.csv': no such local file or folder",
    ),
    (
        "misspelled local folder",
        "source",
        {"data.source": "mydata/csvv"},
        ("mydata/csv/train.csv", b"text,label\nhello world,a\nbye now,b\n"),
        "data.source = 'mydata/csvv': no such local file or folder",
    ),
    (
        "unreadable data file",
        "tokenize",
        {"data.source": "bad.csv"},
        ("bad.csv", b"text,label\n\xff\xfe,a\n"),
        "bad.csv: not valid UTF-8",
    ),
    (
        "missing column",
        "tokenize",
        {"data.source": "ok.csv", "data.label_column": "topic"},
        ("ok.csv", b"text,label\nhello world,a\nbye now,b\n" * 20),
        "missing column(s) ['topic']",
    ),
    ("empty split", "tokenize", {"data.source": "folder"}, ("folder/train.csv", b"text,label\n"), "the split is empty"),
    (
        "one class",
        "tokenize",
        {"data.source": "one.csv"},
        ("one.csv", b"text,label\n" + b"hello world,a\nbye now,a\n" * 20),
        "the train split has 1 class(es) ('a': ",
    ),
    (
        "a class the train split lacks",
        "tokenize",
        {"data.source": "zebra"},
        [
            ("zebra/train.csv", b"text,label\n" + b"hello world,a\nbye now,b\n" * 20),
            ("zebra/test.csv", b"text,label\n" + b"hello world,a\nstripes,zebra\n" * 10),
        ],
        "the test split has 'zebra', which the train split lacks (data.source 'zebra', split 'test': 10 rows: 2, 4,",
    ),
    (
        "unknown file type",
        "tokenize",
        {"data.source": "notes.txt"},
        ("notes.txt", b"text,label\nhello world,a\n"),
        "has the file type '.txt', which cannot be read; supported: .csv, .jsonl, .json, .parquet",
    ),
    (
        "unknown model path",
        "tokenize",
        {"model.name_or_path": "./models/none"},
        None,
        "model.name_or_path = './models/none': no such local folder",
    ),
    (
        "tracking store unreachable",
        "train",
        {"tracking.uri": "http://127.0.0.1:9"},
        None,
        "tracking.uri = 'http://127.0.0.1:9': the MLflow server is unreachable",
    ),
    (
        "tune metric the task does not report",
        "train",
        {"tune.metric": "val_acc"},
        None,
        "tune.metric = 'val_acc': task classification reports val_loss, val_accuracy at every epoch",
    ),
    ("CUDA-only option without CUDA", "train", {"optim": "adamw_8bit"}, None, "optim = 'adamw_8bit' needs CUDA"),
    (
        "more GPU workers than CUDA devices",
        "train",
        {"distributed.num_workers": 2, "distributed.use_gpu": True},
        None,
        "distributed.use_gpu = true with distributed.num_workers = 2 needs 2 GPUs",
    ),
    (
        "GPUs per trial that Ray lacks",
        "train",
        {"tune.resources_per_trial.gpu": 1},
        None,
        "but the Ray cluster started here (told this machine's CUDA devices, torch's count) has 0",
    ),
    (
        "workers Ray can never place",
        "train",
        # 64 CPUs per worker: more than any node of the local cluster has, on this machine or a larger one.
        {"distributed.num_workers": 2, "tune.resources_per_trial.cpu": 64},
        None,
        "each trial needs its driver (1 CPU) and 2 Ray Train workers of 64 CPUs each, a worker on one node",
    ),
]


def digests(root: Path) -> dict[str, str]:
    files = [p for d in ("data/tokenized", "metrics") for p in (root / d).rglob("*") if p.is_file()]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(files)}


@pytest.fixture(scope="module")
def tokenized_copy(tmp_path_factory):
    import shutil

    from tests.conftest import REPO_ROOT, _project_files  # noqa: PLC0415 - module-scoped copy

    dest = tmp_path_factory.mktemp("errors") / "project"
    for rel in _project_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, dest / rel)
    write_params(dest, {"data.generator.num_rows": 600})
    run([sys.executable, "-m", "stages.tokenize"], dest)
    return dest


@pytest.mark.parametrize(("what", "stage", "overrides", "file", "expected"), CASES, ids=[c[0] for c in CASES])
def test_user_error(tokenized_copy: Path, own_ray_cluster: None, what, stage, overrides, file, expected):
    # As on a user's machine with no Ray cluster set: joining one, a stage rightly leaves GPU placement to it.
    if "CUDA" in what:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    root = tokenized_copy
    original = (root / "params.yaml").read_text()
    before = digests(root)
    try:
        for name, content in [file] if isinstance(file, tuple) else file or []:  # a file, or a folder's files
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(content)
        write_params(root, overrides)
        proc = run([sys.executable, "-m", f"stages.{stage}"], root, check=False, timeout=120)
    finally:
        (root / "params.yaml").write_text(original)
    assert proc.returncode == 1, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert digests(root) == before


def test_the_errors_page_lists_every_user_error():
    from tests.conftest import REPO_ROOT

    page = (REPO_ROOT / "docs/reference/errors.md").read_text()
    for what, _, _, _, expected in CASES:
        assert f"| {what} |" in page, what
        assert expected.split(": ", 1)[-1][:30] in page, expected
