"""The GPU check's pipeline steps, each run in its own process by `benchmarks.gpu_check` (which owns the deadline):

    python -m benchmarks.gpu_check_steps mission --out DIR [--smoke]   # dvc repro, dvc exp run, each trial's run read
    python -m benchmarks.gpu_check_steps grid --out DIR [--smoke]      # 4 variants packed on one card vs one at a time
    python -m benchmarks.gpu_check_steps data --out DIR                # tiny pre-tokenized rows for the smoke benches

Each works in a fresh copy of the project under DIR, committed in a new git repository (a copied tree has none, and
`dvc exp run` needs one), writes its figures to `DIR/<step>.json` as it goes, and exits non-zero with what failed.
On a GPU the trials train on CUDA, in the local Ray cluster the train stage starts (told the host's GPUs). `--smoke`
runs the same code on this CPU at toy sizes, in a Ray head that declares one GPU, with the plan made for an H200
(`target_device`), so `gpu: auto` packs the trials as it would on the card; the checks then read the CPU's figures
where a GPU's would be (`env.device` says cpu, the CPU's system metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT

# Folders a copy never takes: outputs, caches, carried wheels (a tree copied to the GPU host has no .git to ask).
NOT_COPIED = {".git", ".dvc/cache", ".dvc/tmp", ".cache", ".gpu_parts", ".bench_gpu", ".whl", "data", "models",
              "mlruns", "mlartifacts", "ray_results", "checkpoints", "reports", "predictions", "dvc_plots",
              "gpu_check_out", "__pycache__", ".pytest_cache", ".venv"}  # fmt: skip
BERT_BASE = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "dropout": 0.1}  # fmt: skip
DRIVER = re.compile(r"^\d+\.\d+(\.\d+)?$")
GRID = {f"lr{i}": {"lr": lr} for i, lr in enumerate((1e-5, 2e-5, 5e-5, 1e-4))}


def git_env() -> dict[str, str]:
    """This environment with a fixed git identity, no prompts, and this interpreter first on PATH (the stages'
    `python -m ...` must be the one the project is installed in)."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "gpu-check", "GIT_AUTHOR_EMAIL": "gpu-check@localhost",
           "GIT_COMMITTER_NAME": "gpu-check", "GIT_COMMITTER_EMAIL": "gpu-check@localhost",
           "GIT_TERMINAL_PROMPT": "0", "DVC_NO_ANALYTICS": "1"}  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    """Run `cmd` in `cwd`, its output passed through; its wall seconds. A failure raises with the command named."""
    start = time.perf_counter()
    print(f"$ {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, cwd=cwd, env={**git_env(), **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"gpu_check_steps: `{' '.join(cmd)}` exited {done.returncode} in {cwd}")
    return time.perf_counter() - start


def copied_files(root: Path = REPO_ROOT) -> list[Path]:
    """The project's files: git's tracked and unignored ones where `root` is a repository, else every file outside
    NOT_COPIED (the tree a device call carries has no .git)."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return [root / f for f in out.split("\0") if f and (root / f).is_file()]
    found = []
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        skipped = any("/".join(parts[: i + 1]) in NOT_COPIED for i in range(len(parts)))
        if path.is_file() and not skipped and path.name != "mlflow.db":
            found.append(path)
    return found


def project_copy(dest: Path, settings: dict[str, Any]) -> Path:
    """A fresh copy of the project in `dest` with `settings` (dotted keys) written to its params.yaml, committed in a
    new git repository (what `dvc exp run` compares against)."""
    import yaml

    from pipelines.params import set_dotted

    if shutil.which("git") is None:
        raise SystemExit("gpu_check_steps: git is not on PATH; dvc exp run needs a git repository")
    shutil.rmtree(dest, ignore_errors=True)
    for path in copied_files():
        target = dest / path.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    tree = yaml.safe_load((dest / "params.yaml").read_text())
    for key, value in settings.items():
        set_dotted(tree, key, value)
    (dest / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "gpu check"]):
        run(cmd, dest)
    return dest


@contextmanager
def ray_for(smoke: bool, cwd: Path) -> Iterator[dict[str, str]]:
    """The environment the stages run in: on a GPU none added (the train stage starts its own local cluster, told the
    host's GPUs); in smoke mode, a Ray head that declares one GPU (the trials train on the CPU), stopped after."""
    if not smoke:
        os.environ.pop("RAY_ADDRESS", None)  # this process's own environment: the stages then start their own cluster
        yield {}
        return
    port = free_port()
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=4", "--num-gpus=1", "--include-dashboard=false", "--disable-usage-stats",
         f"--dashboard-agent-listen-port={free_port()}", '--system-config={"prestart_worker_first_driver": false}'],
        cwd=cwd, env=git_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    printed = head.communicate(timeout=180)[0]
    if head.returncode != 0:
        raise SystemExit(f"gpu_check_steps: the smoke run's Ray head did not start:\n{printed[-2000:]}")
    try:
        yield {"RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        stop_session(head.pid)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_session(session: int) -> None:
    """Stop every process of the session `ray start` began (never `ray stop`: it would stop other clusters)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(session, sig)
        except ProcessLookupError:
            return
        time.sleep(3)


def trial_runs(root: Path) -> list[Any]:
    """Every trial's MLflow run in the copy's store (the stage's parent runs left out), oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune")
    if experiment is None:
        raise SystemExit(f"gpu_check_steps: no experiment 'finetune' in {root / 'mlflow.db'}")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags]


def run_problems(run: Any, on_gpu: bool) -> list[str]:
    """What a trial's run lacks of what the GPU check needs: the card's tags, its peaks, system metrics of its
    device, its card share; on a CPU (smoke), the CPU's tags and system metrics stand in for the card's."""
    tags, metrics, name = run.data.tags, run.data.metrics, run.data.tags.get("mlflow.runName", run.info.run_id)
    problems = [] if run.info.status == "FINISHED" else [f"{name}: status {run.info.status}"]
    if "card.sharing" not in tags:
        problems.append(f"{name}: no card.sharing tag")
    if not metrics.get("peak_train_memory_bytes", 0) > 0:
        problems.append(f"{name}: no peak_train_memory_bytes")
    if on_gpu:
        for key in ("env.device_memory_mib", "env.compute_capability", "env.cuda"):
            if key not in tags:
                problems.append(f"{name}: no {key} tag")
        if not DRIVER.match(tags.get("env.driver", "")):
            problems.append(f"{name}: env.driver {tags.get('env.driver')!r} is not a driver version")
        if not metrics.get("peak_reserved_bytes", 0) > 0:
            problems.append(f"{name}: no CUDA peak_reserved_bytes")
        wanted = "system/gpu_0_utilization_percentage"
    else:
        if not tags.get("env.device", "").startswith("cpu"):
            problems.append(f"{name}: env.device {tags.get('env.device')!r}, expected the CPU in smoke mode")
        wanted = "system/cpu_utilization_percentage"
    if wanted not in metrics:
        problems.append(f"{name}: no {wanted} (system metrics)")
    return problems


def run_figures(run: Any) -> dict[str, Any]:
    """The figures of a trial's run the check reports."""
    tags, metrics = run.data.tags, run.data.metrics
    keep = ("train_time_s", "samples_per_s", "peak_train_memory_bytes", "peak_reserved_bytes", "compile_time_s",
            "timed_recompiles", "timed_cudagraph_skips", "system/gpu_0_utilization_percentage")  # fmt: skip
    named = ("mlflow.runName", "variant", "env.device", "env.driver", "card.sharing", "card.memory_fraction",
             "compile.resolved")  # fmt: skip
    return {**{k: tags.get(k) for k in named}, **{k: metrics[k] for k in keep if k in metrics}}


def write(out: Path, step: str, figures: dict[str, Any]) -> None:
    """`figures` to `out/<step>.json`, whole each time (a step killed at its deadline leaves what it had)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{step}.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")


def mission(out: Path, smoke: bool) -> None:
    """`dvc repro` at the defaults, then `dvc exp run -S optim=adafactor`, in a fresh copy; every trial's run read."""
    import torch

    on_gpu = torch.cuda.is_available() and not smoke
    settings = {"data.generator.num_rows": 600, "epochs": 1, "device": "cpu", "target_device": "H200",
                "tune.resources_per_trial.cpu": 1} if smoke else {}  # fmt: skip
    root = project_copy(out / "mission", settings)
    figures: dict[str, Any] = {"settings": settings, "on_gpu": on_gpu}
    with ray_for(smoke, root) as env:
        figures["repro_s"] = run([sys.executable, "-m", "dvc", "repro"], root, env)
        write(out, "mission", figures)
        figures["exp_run_s"] = run([sys.executable, "-m", "dvc", "exp", "run", "-S", "optim=adafactor"], root, env)
    runs = trial_runs(root)
    figures["runs"] = [run_figures(r) for r in runs]
    figures["problems"] = [p for r in runs for p in run_problems(r, on_gpu)]
    if len(runs) < 2:
        figures["problems"].append(f"{len(runs)} trial runs, expected one per experiment (2)")
    write(out, "mission", figures)
    if figures["problems"]:
        raise SystemExit("gpu_check_steps mission: " + "; ".join(figures["problems"]))


def grid(out: Path, smoke: bool) -> None:
    """Four BERT-base variants (learning rates) packed onto one card by `gpu: auto`, against the same four one at a
    time (`max_concurrent_trials: 1`), each the train stage's whole command, in one copy after one tokenize."""
    import torch

    on_gpu = torch.cuda.is_available() and not smoke
    base = {"epochs": 1, "tune.variants": GRID, "compile": False, "tune.resources_per_trial.cpu": 1}
    if smoke:
        base |= {"data.generator.num_rows": 600, "device": "cpu", "target_device": "H200"}
    else:
        base |= {"model.config": BERT_BASE, "data.generator.num_rows": 6000, "precision": "bf16"}
    root = project_copy(out / "grid", base)
    figures: dict[str, Any] = {"settings": base, "on_gpu": on_gpu, "order": ["packed", "one at a time"]}
    with ray_for(smoke, root) as env:
        run([sys.executable, "-m", "stages.tokenize"], root, env)
        for label, concurrent in (("packed", 4), ("one at a time", 1)):
            import yaml

            from pipelines.params import set_dotted

            tree = yaml.safe_load((root / "params.yaml").read_text())
            set_dotted(tree, "tune.max_concurrent_trials", concurrent)
            (root / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
            before = {r.info.run_id for r in trial_runs(root)} if (root / "mlflow.db").exists() else set()
            seconds = run([sys.executable, "-m", "stages.train"], root, env)
            runs = [r for r in trial_runs(root) if r.info.run_id not in before]
            figures[label] = {"train_stage_s": seconds, "runs": [run_figures(r) for r in runs],
                              "sharing": sorted({r.data.tags.get("card.sharing") for r in runs})}  # fmt: skip
            write(out, "grid", figures)
    packed, alone = figures["packed"], figures["one at a time"]
    figures["speedup"] = alone["train_stage_s"] / packed["train_stage_s"]
    write(out, "grid", figures)
    wanted = {"packed": ["4"], "one at a time": ["1"]}
    problems = [f"{label}: card.sharing {figures[label]['sharing']}, expected {want}"
                for label, want in wanted.items() if figures[label]["sharing"] != want]  # fmt: skip
    if problems:
        raise SystemExit("gpu_check_steps grid: " + "; ".join(problems))


def smoke_data(out: Path) -> Path:
    """Tiny pre-tokenized rows in the layout `python -m benchmarks.bench_gpu prepare` writes (random ids, 4 labels):
    what the smoke run's BERT steps read where no AG News is prepared."""
    import numpy as np

    from pipelines.data.tokenization import TokenizedSplit

    rng = np.random.default_rng(0)
    for name, rows in (("train", 96), ("test", 32)):
        lengths = rng.integers(8, 48, size=rows).astype(np.int32)
        ids = rng.integers(5, 1000, size=int(lengths.sum())).astype(np.int32)
        labels = rng.integers(0, 4, size=rows).astype(np.int64)
        TokenizedSplit(ids, lengths, labels=labels).save(out / "classification" / name)
    (out / "meta.json").write_text(json.dumps({"vocab_size": 1000, "pad_id": 0, "eos_id": 2}) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("step", choices=["mission", "grid", "data"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="the same steps on this CPU at toy sizes")
    args = parser.parse_args()
    out = args.out.resolve()
    if args.step == "data":
        smoke_data(out)
    else:
        {"mission": mission, "grid": grid}[args.step](out, args.smoke)


if __name__ == "__main__":
    main()
