"""kill -9 in the middle of a 2-worker FSDP trial (real Ray Train over gloo): the train stage run again resumes at
the sharded checkpoint's step and logs the uninterrupted run's losses, for LoRA and for a full fine-tune (issue 70).
The same in one process group, without Ray, and DDP: tests/pipelines/train/test_distributed_resume.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import git_env, kill_session, run, write_params
from tests.e2e.test_distributed import assert_ray_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RESUME_TOLERANCE = 1e-5  # per logged loss, as in the issue
FSDP = {"distributed.strategy": "fsdp", "distributed.num_workers": 2, "data.generator.num_rows": 1000, "epochs": 2,
        "checkpoint_every_n_steps": 6, "log_every_n_steps": 2}  # fmt: skip
KINDS = {"lora": {"adapter.type": "lora"}, "full": {}}


def train_stage(root: Path) -> subprocess.CompletedProcess[str]:
    return run(["python", "-m", "stages.train"], root, timeout=600)


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_fsdp_trial_killed_mid_epoch_resumes_to_the_uninterrupted_losses(
    project_copy: Path, tmp_path: Path, own_ray_cluster: None, kind: str
):
    write_params(project_copy, {**FSDP, **KINDS[kind]})
    run(["git", "commit", "-qam", "fsdp"], project_copy)
    run(["dvc", "repro", "tokenize"], project_copy)
    reference = tmp_path / "reference"
    shutil.copytree(project_copy, reference, symlinks=True)
    train_stage(reference)

    loop_files = "checkpoints/*/sharded/loop.pt"  # rank 0's, written once every rank's shards are
    proc = subprocess.Popen(["python", "-m", "stages.train"], cwd=project_copy, env=git_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 400
    while not list(project_copy.glob(loop_files)) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert list(project_copy.glob(loop_files)), "no sharded checkpoint was written"
    kill_session(proc.pid)  # the stage, its Ray cluster, the trial's driver and both Ray Train workers
    proc.wait()

    resumed = train_stage(project_copy)
    said = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "resuming from" in line]
    assert len(said) == 1 and "(2 ranks)" in said[0] and "optimizer step 6" in said[0], said  # rank 0 says it
    assert_ray_quiet(resumed.stdout + resumed.stderr)  # on a local cluster of its own
    ours = json.loads((project_copy / "plots/train_loss.json").read_text())
    theirs = json.loads((reference / "plots/train_loss.json").read_text())
    assert [p["step"] for p in ours] == [p["step"] for p in theirs] and len(ours) > 6
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs, strict=True))
    assert worst < RESUME_TOLERANCE, (worst, ours, theirs)
    metrics = [json.loads((root / "metrics/train.json").read_text()) for root in (project_copy, reference)]
    assert metrics[0]["optimizer_steps"] == metrics[1]["optimizer_steps"]
    assert not list((project_copy / "checkpoints").glob("*/sharded*")), "a finished run keeps no checkpoint"
