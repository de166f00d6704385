"""`benchmarks/bench_cpu_bf16.py`, the measurement `precision: auto` waits for before it picks bf16 on a CPU: its smoke
run works end to end, in both precisions, for both models (MiniLM skipped with its reason where it is missing)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import minilm_path
from tests.conftest import AG_NEWS, REPO_ROOT


@pytest.mark.slow
def test_the_smoke_run_times_both_models_in_both_precisions_and_names_the_host(tmp_path: Path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_cpu_bf16", "--smoke", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    has_minilm = minilm_path() is not None and (AG_NEWS / "test.csv").is_file()
    assert set(report["runs"]) == ({"default", "minilm"} if has_minilm else {"default"})
    assert set(report["skipped"]) == (set() if has_minilm else {"minilm"})
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "flags" in cpuinfo.read_text():
        flags = next(ln.split(":", 1)[1].split() for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags"))
        assert ("avx512_bf16" in report["host"]["kernel_flags"]) == ("avx512_bf16" in flags)
        assert ("amx_bf16" in report["host"]["kernel_flags"]) == ("amx_bf16" in flags)
    for model, by_precision in report["runs"].items():
        fp32, bf16 = by_precision["fp32"], by_precision["bf16"]
        assert len(fp32) == len(bf16) == 1, model  # one seed in a smoke run
        for run in (*fp32, *bf16):
            # 64 rows at batch 32: two optimizer steps, the first untimed.
            assert (run["rows"], run["timed_steps"]) == (64, 1), (model, run)
            # Two steps from random heads on 4 balanced classes: the loss is still about ln 4.
            assert abs(run["final_train_loss"] - math.log(4)) < 0.15, (model, run)
        summary = report["summary"][model]
        assert summary["speedup"] == pytest.approx(fp32[0]["train_time_s"] / bf16[0]["train_time_s"])
        assert f"| {model} | " in proc.stdout
    assert "fp32 / bf16 (medians)" in proc.stdout and "nothing to record" in proc.stdout
