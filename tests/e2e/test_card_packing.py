"""`tune.resources_per_trial.gpu: auto` on a Ray cluster that declares a GPU (simulated on this CPU machine: the
head says `--num-gpus=1`, the trials train on the CPU): four small variants planned for an H200 are packed four to
the card, each run says so, and Ray gave each a quarter of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.conftest import QUICK, free_port, git_env, kill_session, run, write_params

VARIANTS = {f"lr{i}": {"lr": 10.0 ** -(i + 2)} for i in range(4)}


def start_gpu_head(cwd: Path) -> tuple[int, str]:
    """A Ray head declaring 1 GPU and 4 CPUs on 127.0.0.1; its session id and address."""
    port = free_port()
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=4", "--num-gpus=1", "--include-dashboard=false", "--disable-usage-stats",
         f"--dashboard-agent-listen-port={free_port()}"],
        cwd=cwd, env=git_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    printed = head.communicate(timeout=120)[0]
    assert head.returncode == 0, printed
    return head.pid, f"127.0.0.1:{port}"


def test_four_small_variants_are_packed_four_to_a_card(project_copy: Path, tmp_path: Path):
    settings = {**QUICK, "data.generator.num_rows": 600, "tune.variants": VARIANTS, "device": "cpu",
                "target_device": "H200", "tune.max_concurrent_trials": 4,
                "tune.resources_per_trial.cpu": 1}  # fmt: skip
    write_params(project_copy, settings)
    session, address = start_gpu_head(tmp_path)
    try:
        for stage in ("tokenize", "train"):
            run([sys.executable, "-m", f"stages.{stage}"], project_copy, timeout=800, env={"RAY_ADDRESS": address})
    finally:
        kill_session(session)
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune")
    children = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert {c.data.tags["variant"] for c in children} == set(VARIANTS)
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["card.sharing"] == "4" and child.data.metrics["card_sharing"] == 4
        assert child.data.tags["card.gpu_share"] == "0.25" and child.data.tags["card.ray_gpu"] == "0.25"
        # The share is enforced on CUDA only (set_per_process_memory_fraction); these trials train on the CPU.
        assert child.data.tags["card.memory_fraction"] == "none (trains on cpu)"
