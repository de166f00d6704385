"""`python -m benchmarks.gpu_check`: the one command a lent GPU runs, rehearsed here so it works the first time: its
plan fits the device calls, a failing or overdue step is recorded and the command exits non-zero, the targets are
judged by hand-checked figures, and `--smoke` runs every step on this CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import CALL_MARGIN_S, CALL_S, STEPS, Context, Step, run_step
from benchmarks.gpu_check_report import markdown, targets
from tests.conftest import REPO_ROOT

GPU_DOC = REPO_ROOT / "docs" / "how-to" / "gpu-figures.md"


def test_the_plan_lists_every_step_and_fits_two_device_calls():
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--plan"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    budgets = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"^(\w+)\s+(\d)\s+(\d+)\s", done.stdout, re.M)}
    assert set(budgets) == {"gpu_tests", "mission", "grid", "peak", "bert", "llama"}
    calls = {call: sum(b for c, b in budgets.values() if c == call) for call in (1, 2)}
    assert all(used + CALL_MARGIN_S <= CALL_S for used in calls.values()), calls  # two 10-minute calls at most
    total = int(re.search(r"^total\s+(\d+)", done.stdout, re.M)[1])
    assert total == sum(b for _, b in budgets.values())
    for call, used in calls.items():
        assert f"device call {call}: {used + CALL_MARGIN_S} s of {CALL_S}" in done.stdout
    # The docs' two device calls are the plan's, as printed.
    docs_calls = re.findall(r"^(python -m benchmarks.gpu_check --steps [\w ]+?)\s+#", GPU_DOC.read_text(), re.M)
    printed = re.findall(r"(python -m benchmarks.gpu_check --steps [\w ]+)$", done.stdout, re.M)
    assert docs_calls == printed and len(printed) == 2, (docs_calls, printed)


@pytest.mark.slow
def test_the_gpu_extra_resolves():
    # The docs' install on a GPU machine: pip's resolver finds every package of the project, NVML and the test tools.
    command = ["pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check", "-e", ".[gpu,dev]"]
    done = subprocess.run([sys.executable, "-m", *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_failing_step_and_an_overdue_one_are_recorded_with_their_errors(tmp_path: Path):
    context = Context(tmp_path, smoke=True, data=tmp_path)
    fails = Step("fails", "exits 3", 60, 60, 1, lambda c: [([sys.executable, "-c", "print('boom'); exit(3)"], {})])
    slow = Step("slow", "sleeps", 2, 2, 1, lambda c: [([sys.executable, "-c", "import time; time.sleep(60)"], {})])
    never = [([sys.executable, "-c", "open('ran', 'w')"], {})]
    chained = Step("chained", "fails first", 60, 60, 1, lambda c: fails.commands(c) + never)
    failed, overdue, stopped = run_step(fails, context), run_step(slow, context), run_step(chained, context)
    assert failed["status"] == "failed" and "boom" in failed["error"]
    assert overdue["status"] == "timed out" and 2 <= overdue["seconds"] < 30, overdue
    assert stopped["status"] == "failed" and not (REPO_ROOT / "ran").exists()  # a step stops at its first failure


def _bench(call_s: float, **figures: float | str) -> dict:
    return {"call_s": call_s, **figures}


def test_targets_are_judged_on_a_gpu_run_and_never_on_a_smoke_run():
    peak = {"ours defaults": _bench(50, compile_resolved="on: ...", compile_time_s=25.0, predicted_compile_time_s=40.0,
                                    peak_allocated_mb=3000, static_floor_mb=1253),
            "ours eager": _bench(60, step_ms=36.0, predicted_step_ms=44.0, peak_allocated_mb=3500),
            "ours compiled": _bench(20)}  # fmt: skip
    results = {"mode": "gpu", "steps": [
        {"name": "bert", "figures": {"cold": {"vs_trainer_eager": 2.1, "vs_trainer_compiled": 0.9},
                                     "warm": {"vs_trainer_eager": 2.4, "vs_trainer_compiled": 1.2}}},
        {"name": "llama", "figures": {"ours defaults": {"mfu": 0.446, "compile_time_s": 14.0}}},
        {"name": "peak", "figures": peak},
        {"name": "grid", "figures": {"speedup": 2.6}},
    ]}  # fmt: skip
    met = {t["target"]: t["met"] for t in targets(results)}
    assert met["BERT-base whole run vs Trainer eager, cold >= 2.0x"] is True
    assert met["BERT-base whole run vs Trainer eager, warm >= 2.5x"] is False
    assert met["ahead of Trainer torch_compile, cold > 1x"] is False
    assert met["ahead of Trainer torch_compile, warm > 1x"] is True
    assert met["1.1B MFU >= 45%"] is False and met["1.1B compile <= 15 s cold"] is True
    assert met["BERT-base widths compiled cold <= 30 s"] is True
    assert met["predicted compile time within 50%"] is False  # 40 / 25 - 1 = 0.6
    assert met["predicted eager step within 25%"] is True  # 44 / 36 - 1 = 0.22
    assert met["compiled peak >= weights + gradients + state"] is True
    assert met["compiled peak / eager peak (same config) in [0.5, 1.3]"] is True  # 3000 / 3500
    assert met["compile: auto right (resolved on)"] is True  # 50 s whole run against eager's 60 s
    assert met["packed grid vs one at a time >= 2.5x"] is True
    table = markdown({**results, "targets": targets(results)})
    assert "| BERT-base whole run vs Trainer eager, warm >= 2.5x | 2.4x | **no** |" in table
    assert {t["met"] for t in targets({**results, "mode": "smoke"})} == {"smoke"}


@pytest.mark.slow
def test_smoke_runs_every_step_on_this_cpu(tmp_path: Path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)  # fmt: skip
    report = json.loads((out / "gpu_check.json").read_text())
    statuses = {s["name"]: s["status"] for s in report["steps"]}
    errors = {s["name"]: s.get("error") for s in report["steps"] if s["status"] != "passed"}
    assert done.returncode == 0 and statuses == dict.fromkeys((s.name for s in STEPS), "passed"), errors
    figures = {s["name"]: s["figures"] for s in report["steps"]}
    assert figures["gpu_tests"]["failures"] == 0 and figures["gpu_tests"]["skipped"] > 0  # no CUDA here
    mission = figures["mission"]
    assert len(mission["runs"]) == 2 and not mission["problems"]
    assert all(r["env.device"].startswith("cpu") and r["card.sharing"] == "1" for r in mission["runs"])
    assert figures["grid"]["packed"]["sharing"] == ["4"] and figures["grid"]["one at a time"]["sharing"] == ["1"]
    assert len(figures["grid"]["packed"]["runs"]) == len(figures["grid"]["one at a time"]["runs"]) == 4
    assert figures["bert"]["cold"]["vs_trainer_eager"] > 0 and figures["bert"]["warm"]["vs_trainer_eager"] > 0
    assert figures["llama"]["ours defaults"]["step_ms"] > 0
    assert {"ours defaults", "ours eager"} <= set(figures["peak"])  # `ours compiled` is skipped on a CPU
    assert {t["met"] for t in report["targets"]} == {"smoke"}
    assert "| mission | passed |" in (out / "gpu_check.md").read_text()
