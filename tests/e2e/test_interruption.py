"""kill -9 in the middle of training: the next `dvc repro` resumes and ends where an uninterrupted run ends. Ctrl-C in
the middle of training: one line saying the step the next run resumes from, no traceback, the checkpoint kept and no
lock left. `dvc` ended under its train stage: the stage stops as at a Ctrl-C, instead of training on, orphaned."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import git_env, kill_session, run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SETTINGS = {"data.generator.num_rows": 3000, "epochs": 2, "checkpoint_every_n_steps": 20, "log_every_n_steps": 5}
# Interrupted at the first checkpoint (step 20): a training long after it, so that a loaded CI host cannot reach its
# end (and discard the checkpoint as finished) before the signal lands; stopped at step 20, it costs them nothing.
LONG = {**SETTINGS, "epochs": 12}


def test_kill_9_mid_train_then_repro_resumes_to_the_same_metrics(
    project_copy: Path, tmp_path: Path, own_ray_cluster: None
):
    # Each run on a Ray cluster of its own (not the test session's): the killed one dies with its stage, as on a
    # user's machine.
    write_params(project_copy, SETTINGS)
    run(["git", "commit", "-qam", "settings"], project_copy)
    reference = tmp_path / "reference"
    shutil.copytree(project_copy, reference)
    run(["dvc", "repro"], reference, timeout=600)

    checkpoints = project_copy / "checkpoints"  # one folder per training-params hash
    proc = subprocess.Popen(
        ["dvc", "repro"],
        cwd=project_copy,
        env=git_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not list(checkpoints.glob("*/checkpoint.pt")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert list(checkpoints.glob("*/checkpoint.pt")), "no checkpoint was written"
    kill_session(proc.pid)  # DVC, the stage, its Ray cluster and the trial, without any cleanup; nothing else
    proc.wait()

    resumed = run(["dvc", "repro"], project_copy, timeout=600)
    assert "resuming from" in resumed.stdout + resumed.stderr
    ours = json.loads((project_copy / "metrics/train.json").read_text())
    theirs = json.loads((reference / "metrics/train.json").read_text())
    assert abs(ours["final_train_loss"] - theirs["final_train_loss"]) < 1e-6
    assert ours["val_accuracy"] == theirs["val_accuracy"] and ours["optimizer_steps"] == theirs["optimizer_steps"]

    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert not [r for r in runs if r.info.status == "RUNNING"]
    killed = [r for r in runs if r.info.status == "KILLED"]
    assert killed and all("process died" in r.data.tags.get("closed", "") for r in killed)


# SIGTERM (`kill`, Slurm's `scancel`, a preempted node) killed the stage on the spot (ray.init's own handler: exit 15),
# its runs left RUNNING; it now stops as Ctrl-C does, with its own word and status (128 + 15).
@pytest.mark.parametrize(
    ("sent", "word", "status", "ignoring"),
    [(signal.SIGINT, "interrupted", 130, False), (signal.SIGTERM, "terminated", 143, False),
     # Started with SIGINT ignored, as bash starts a script's background job (`dvc repro &`): it trained on to its
     # end before, the signal lost.
     (signal.SIGINT, "interrupted", 130, True)],
    ids=["ctrl-c", "sigterm", "ctrl-c-started-ignoring-sigint"],
)  # fmt: skip
def test_ctrl_c_mid_train_ends_with_one_line_keeps_the_checkpoint_and_leaves_no_lock(
    project_copy: Path, own_ray_cluster: None, sent: int, word: str, status: int, ignoring: bool
):
    write_params(project_copy, LONG)
    run([sys.executable, "-m", "stages.tokenize"], project_copy)
    checkpoints = project_copy / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.train"],
        cwd=project_copy,
        env=git_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignoring else None,
    )
    try:
        deadline = time.monotonic() + 300
        while not list(checkpoints.glob("*/checkpoint.pt")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert list(checkpoints.glob("*/checkpoint.pt")), "no checkpoint was written"
        os.killpg(proc.pid, sent)  # as a terminal's Ctrl-C or `scancel`: to the whole process group, Ray's included
        _, stderr = proc.communicate(timeout=120)
    finally:
        kill_session(proc.pid)  # anything left of the stage and its Ray cluster; nothing else
    # Before: Ray Tune's graceful stop, its `Tuner.restore(...)` hint, then `KeyError: 'mlflow_run_id'`'s traceback;
    # then a bare `interrupted`.
    assert proc.returncode == status, stderr
    assert stderr.strip() == f"{word}; rerun the same command to resume from step {kept_step(checkpoints)}", stderr
    assert list(checkpoints.glob("*/checkpoint.pt")), "the checkpoint the next run resumes from is gone"
    assert not list(checkpoints.glob("*/.lock")), sorted(checkpoints.rglob("*"))

    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert runs and {r.info.status for r in runs} == {"KILLED"}, [(r.info.run_name, r.info.status) for r in runs]


def train_stage(process: psutil.Process) -> bool:
    """Whether `process` is the train stage's Python (not a shell running it)."""
    command = process.cmdline()
    return Path(command[0]).name.startswith("python") and "stages.train" in command


def kept_step(checkpoints: Path) -> int:
    """The optimizer step of the one checkpoint under `checkpoints`, read as torch saved it."""
    (path,) = checkpoints.glob("*/checkpoint.pt")
    step = json.loads(torch.load(path, map_location="cpu", weights_only=True)["state"])["step"]
    assert step > 0
    return step


# DVC runs a stage as `$SHELL -c <cmd>` (/bin/sh where SHELL is unset): bash execs the command, so the stage is dvc's
# child; dash stays between them, and outlives dvc.
@pytest.mark.parametrize("shell", ["bash", "dash"])
def test_dvc_ended_under_its_train_stage_stops_the_stage_as_at_a_ctrl_c(
    project_copy: Path, tmp_path: Path, own_ray_cluster: None, shell: str
):
    # DVC ignores SIGINT while a stage runs (it counts on Ctrl-C reaching the whole process group); `kill <dvc>`
    # (SIGTERM) ended DVC alone, and its train stage trained on, orphaned, writing into the workspace. Under dash (CI,
    # where SHELL was unset) it still did after the kernel was told to interrupt the stage when its parent ends.
    executable = shutil.which(shell)
    if executable is None:
        pytest.skip(f"{shell} is not installed")
    write_params(project_copy, LONG)
    run(["git", "commit", "-qam", "settings"], project_copy)
    checkpoints = project_copy / "checkpoints"
    log = tmp_path / "dvc.log"
    with log.open("w") as out:
        dvc = subprocess.Popen(["dvc", "repro"], cwd=project_copy, env={**git_env(), "SHELL": executable},
                               start_new_session=True, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not list(checkpoints.glob("*/checkpoint.pt")) and time.monotonic() < deadline and dvc.poll() is None:
            time.sleep(0.2)
        assert list(checkpoints.glob("*/checkpoint.pt")), log.read_text()
        (stage,) = [p for p in psutil.Process(dvc.pid).children(recursive=True) if train_stage(p)]
        assert (stage.ppid() == dvc.pid) == (shell == "bash"), (shell, stage.ppid(), dvc.pid)  # the case it says
        dvc.terminate()
        dvc.wait()
        stage.wait(timeout=300)  # a guard against a hang: before, it trained to its end
    finally:
        kill_session(dvc.pid)  # anything left of the stage and its Ray cluster; nothing else
    lines = log.read_text().strip().splitlines()
    assert list(checkpoints.glob("*/checkpoint.pt")), lines  # the one the next run resumes from
    assert lines[-1] == f"interrupted; rerun the same command to resume from step {kept_step(checkpoints)}", lines
    assert not list(checkpoints.glob("*/.lock")), sorted(checkpoints.rglob("*"))
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert runs and {r.info.status for r in runs} == {"KILLED"}, [(r.info.run_name, r.info.status) for r in runs]
