"""Every benchmark in `benchmarks/` runs, so none rots: each command has a `--smoke` run (a few rows, one round,
every side and table line of the full run) that this file runs, or that a test of its own runs and checks further.
A new benchmark without one fails `test_every_benchmark_is_smoke_run_somewhere`."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, git_env

BENCHMARKS = REPO_ROOT / "benchmarks"

# Commands whose smoke run is a test of its own, which checks its figures too (module -> that test file).
SMOKE_TESTED_ELSEWHERE = {
    "bench_cpu_bf16": "tests/pipelines/test_bench_cpu_bf16.py",
    "bench_fixed_cost": "tests/pipelines/test_bench_fixed_cost.py",
    "bench_gpu": "tests/pipelines/test_bench_gpu.py",
    "bench_gpu_parts": "tests/pipelines/test_bench_gpu.py",
    "bench_gpu_frozen_base": "tests/pipelines/test_bench_gpu.py",
    "gpu_check": "tests/pipelines/test_gpu_check.py",
}
# Commands that are not benchmarks but parts of one (module -> what runs it).
RUN_BY_ANOTHER = {
    "plain_train": "bench_fixed_cost's plain side (its smoke run runs it)",
    "gpu_check_steps": "gpu_check, one subprocess per step (its smoke run runs every step)",
    "gpu_runner": "the device tool's wrapper of gpu_check (tests/pipelines/test_gpu_runner.py)",
}
# Smoke-run here, one subprocess each.
SMOKE_HERE = [
    "bench_cluster_plan",
    "bench_compile",
    "bench_distributed",
    "bench_instruct",
    "bench_lr",
    "bench_memory_levers",
    "bench_packing",
    "bench_packing_peers",
    "bench_plan",
    "bench_plan_depth",
    "bench_seq2seq",
    "bench_team_server",
    "bench_tokenize",
    "bench_train",
    "plan_cards",
]


def commands() -> set[str]:
    """The modules of `benchmarks/` that run as a command (they have an `if __name__ == "__main__":` block)."""
    found = set()
    for path in BENCHMARKS.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                found.add(path.stem)
    return found


def test_every_benchmark_is_smoke_run_somewhere():
    assert commands() == set(SMOKE_HERE) | set(SMOKE_TESTED_ELSEWHERE) | set(RUN_BY_ANOTHER)
    for module, test_file in SMOKE_TESTED_ELSEWHERE.items():
        text = (REPO_ROOT / test_file).read_text()
        assert "--smoke" in text and module.split("_")[0] in text, f"{test_file} does not smoke-run {module}"


def test_every_benchmark_is_listed_with_its_question_in_the_folders_readme():
    readme = (BENCHMARKS / "README.md").read_text()
    for module in sorted(commands() - set(RUN_BY_ANOTHER)):
        assert f"`{module}`" in readme, f"benchmarks/README.md does not list {module}"


def tracked_files_state() -> dict[str, float]:
    """Each file under benchmarks/ and docs/, and the params, with its modification time: a smoke run (run from the
    repository's root, as the commands are documented) must write none of them."""
    files = [p for folder in ("benchmarks", "docs") for p in (REPO_ROOT / folder).rglob("*")]
    files += [REPO_ROOT / "params.yaml", REPO_ROOT / "dvc.yaml", REPO_ROOT / "README.md"]
    return {str(p): p.stat().st_mtime for p in files if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("module", SMOKE_HERE)
def test_smoke_run(module: str):
    before = tracked_files_state()
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke"], cwd=REPO_ROOT, env=git_env(),
                          capture_output=True, text=True, timeout=560)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # A smoke run's figures are not measurements: it says so, so nobody copies them into RESULTS.md.
    assert "smoke run" in done.stdout.lower(), done.stdout[-2000:]
    assert tracked_files_state() == before, "a smoke run wrote into the repository"
