"""Two machines of one name and kind are told apart (issue 71): a fresh clone's committed row, timed on another VM
also named `vm` with the same cores, was marked `ok` beside the user's time. The host's id goes into `timed_on`."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

from mlflow.tracking import MlflowClient

from pipelines.baseline import timing_note
from pipelines.tracking.environment import host_id
from pipelines.tracking.status import training_figures


def identity_files(tmp_path: Path, machine: str, boot: str) -> tuple[Path, Path]:
    folder = tmp_path / f"{machine}-{boot}"
    folder.mkdir()
    (folder / "machine-id").write_text(machine + "\n")
    (folder / "boot_id").write_text(boot + "\n")
    return folder / "machine-id", folder / "boot_id"


def test_the_host_id_is_a_hash_of_name_machine_and_boot(tmp_path):
    same_image = identity_files(tmp_path, "3d1219c7", "boot-a")
    expected = hashlib.sha256(f"{socket.gethostname()}|3d1219c7|boot-a".encode()).hexdigest()[:8]  # by hand
    assert host_id(same_image) == expected
    # Two VMs from one image share the machine id; their boots differ. A missing file counts as empty.
    assert host_id(identity_files(tmp_path, "3d1219c7", "boot-b")) != expected
    assert host_id(identity_files(tmp_path, "another", "boot-a")) != expected
    assert host_id((tmp_path / "absent", tmp_path / "absent-too")) == hashlib.sha256(
        f"{socket.gethostname()}||".encode()).hexdigest()[:8]  # fmt: skip
    assert host_id() == host_id()  # stable on this machine


def test_a_baseline_timed_on_a_host_of_the_same_name_is_marked_other_host(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("hosts", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment, tags={"host": "vm", "env.host_id": "aaaa1111", "env.device": "cpu (AVX512)"})
    client.log_metric(run.info.run_id, "host_cores", 2)
    client.set_terminated(run.info.run_id)
    here = training_figures(client, run.info.run_id)
    assert here["timed_on"] == "vm #aaaa1111: cpu (AVX512), 2 cores"
    assert timing_note(here, dict(here)) == "ok"
    # The other VM: same name, same kind, its own id; and the committed row from before ids were recorded.
    assert timing_note(here, {**here, "timed_on": "vm #bbbb2222: cpu (AVX512), 2 cores"}) == "baseline: other host"
    assert timing_note(here, {**here, "timed_on": "vm: cpu (AVX512), 2 cores"}) == "baseline: other host"
