"""What a trial reserves on Ray (its CPUs and GPUs, or a distributed trial's driver and workers) and what a local Ray
is told of this machine's CPUs."""

from __future__ import annotations

from pipelines.params import Params


def trial_resources(params: Params, cpus: int) -> dict[str, float]:
    """CPUs and GPUs per trial: as declared, else an even share of the cores and one GPU when it trains on CUDA.

    A distributed trial is only its workers' driver: it reserves one CPU, and each of its
    workers reserves `worker_threads` CPUs and `worker_gpus` GPUs.
    """
    import torch

    if params.distributed.num_workers > 1:
        return {"cpu": 1, "gpu": 0}
    declared = params.tune.resources_per_trial
    cpu = declared.cpu or max(1, cpus // params.tune.max_concurrent_trials)
    trains_on_cuda = params.device != "cpu" and torch.cuda.is_available()  # device: cpu holds no GPU back
    # gpu: auto's shares are planned once Ray is up (pipelines.trials.card_share); without them, as null.
    gpu = declared.gpu if declared.gpu not in (None, "auto") else (1.0 if trains_on_cuda else 0.0)
    return {"cpu": cpu, "gpu": float(gpu)}


def worker_threads(params: Params, cpus: int) -> int:
    """torch threads (and Ray CPUs) per training process: per trial, or per worker of a distributed trial."""
    declared = params.tune.resources_per_trial.cpu
    processes = params.tune.max_concurrent_trials * params.distributed.num_workers
    return max(1, int(declared or cpus // processes))


def local_ray_cpus(params: Params, cpus: int) -> int:
    """Logical CPUs of a local Ray: the cores, plus one per concurrent distributed trial for its idle driver."""
    return cpus + (params.tune.max_concurrent_trials if params.distributed.num_workers > 1 else 0)


def workers_use_gpu(params: Params) -> bool:
    """Whether a distributed trial's workers train on GPUs: distributed.use_gpu as declared, else when this (driver)
    process sees CUDA and every worker can get a GPU (`pipelines.runtime.gpus_for_every_worker`)."""
    import torch

    from pipelines.runtime import gpus_for_every_worker

    use_gpu = params.distributed.use_gpu
    if use_gpu is None:
        return params.device != "cpu" and torch.cuda.is_available() and gpus_for_every_worker(params)
    return use_gpu


def worker_gpus(params: Params) -> float:
    """GPUs each worker of a distributed trial reserves on Ray: a number declared in tune.resources_per_trial.gpu
    (per worker, as its cpu is; it stands even where the workers train on the CPU, as a single-process trial's
    does), else one with `workers_use_gpu`, else none."""
    declared = params.tune.resources_per_trial.gpu
    if declared not in (None, "auto") and declared > 0:
        return float(declared)
    return 1.0 if workers_use_gpu(params) else 0.0
