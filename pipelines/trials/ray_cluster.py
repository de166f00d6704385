"""Start or join the Ray cluster the trials run on (ours, or the one at an address); how the trials get the driver's
tracking credentials; Tune's console output."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipelines.params import Params

# The trials' processes (not the driver, which draws their progress bars with tqdm): no per-file or
# per-tensor progress bars from the libraries they call (transformers' GGUF de-quantization and weight
# loading, the hub's downloads). tqdm reads TQDM_* once, at import, so they are set when a worker starts.
# Ray Train's workers turn `print` into a log record, and print it too where a library has wrapped sys.stdout
# (colorama does): every line of a distributed trial came out twice. Off, a print is printed once.
# Ray Train's watcher of node preemption only hands a notice to the training function, which our loop does not read
# (a preempted node's trial resumes from its checkpoint on the next run), and its start logged a core_worker error on
# every distributed trial: off.
WORKER_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
              "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}  # fmt: skip


# How the driver's user reaches a team's MLflow server (docs/how-to/team-server.md): trials on a cluster that
# was started without them (another terminal's `ray start`) need them too. Never in Ray's runtime environment:
# Ray's runtime-env agent logs it whole (runtime_env_agent.log), and the job table and dashboard show it. They travel
# through Ray's object store instead (`seal_credentials`), which no log, job table or dashboard records (only a full
# store spills objects to disk, under the node's temp dir).
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                        "MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_CLIENT_CERT_PATH")  # fmt: skip


# Read by Ray Train in its controller, a process of the cluster's: the driver's user sets it where the trials run.
DRIVER_SETTINGS = ("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",)


def worker_env() -> dict[str, str]:
    """The trials' environment: WORKER_ENV, MLflow's telemetry off unless the driver's user set it
    (`pipelines.tracking` says why), and the driver's DRIVER_SETTINGS. No credentials: those reach the trials by
    `seal_credentials`."""
    settings = {key: os.environ[key] for key in DRIVER_SETTINGS if os.environ.get(key)}
    return {**WORKER_ENV, "MLFLOW_DISABLE_TELEMETRY": os.environ.get("MLFLOW_DISABLE_TELEMETRY", "true"), **settings}


@dataclass(frozen=True)
class SealedCredentials:
    """This process's tracking credentials, as a reference into Ray's object store: what a trial is handed.

    Only the reference travels in what Ray records (a trainable's parameters, a Ray Train worker's config, which
    Ray Train shows on its dashboard as text): the values stay in the object store until `use_tracking_credentials`
    fetches them in the trial's own process. Ray resolves a bare ObjectRef passed to `tune.with_parameters` before
    the trial sees it; held in this object, it stays a reference, which a distributed trial hands to its workers.
    """

    ref: Any  # ray.ObjectRef to {variable: value}


def seal_credentials() -> SealedCredentials | None:
    """Put this process's tracking credentials (TRACKING_CREDENTIALS that are set) in Ray's object store; None when
    there are none. Ray must be initialized; this process owns the object, so it must outlive the trials."""
    import ray

    values = {key: os.environ[key] for key in TRACKING_CREDENTIALS if os.environ.get(key)}
    return SealedCredentials(ray.put(values)) if values else None


def use_tracking_credentials(sealed: SealedCredentials | None) -> None:
    """Set the driver's tracking credentials in this process's environment, before its first MLflow call.

    A trial (reuse_actors=False) and a Ray Train worker each have a process of their own, so they go no further. The
    driver's values win over the same variables set where the cluster was started, as Ray's runtime environment
    did; nothing else in the environment changes, and nothing is removed.
    """
    if sealed is None:
        return
    import ray

    os.environ.update(ray.get(sealed.ref))


def init_ray(num_cpus: int, address: str | None, num_gpus: int | None = None) -> None:
    """Join the cluster at `address`, else start a local one sized to this machine (`num_gpus`: its GPUs, see
    `local_ray_gpus`; None leaves them to Ray's own detection), dashboard off."""
    import ray

    if ray.is_initialized():
        return
    plain_output_off_a_terminal()
    if address:
        use_cluster_token()
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": worker_env()})
    else:
        # "local": always a new cluster of our own. Without it ray.init joins whatever cluster
        # /tmp/ray/ray_current_cluster names: another user's `ray start`, or one killed without cleanup.
        with quiet_token_notice():
            start_local_ray(num_cpus, {"env_vars": worker_env()}, num_gpus)


def stop_ray() -> None:
    """Leave Ray: stop the local cluster this process started, or disconnect from the one it joined.

    Ray stops a cluster's processes one by one, giving each a second to end on SIGTERM. Its autoscaler monitor took
    all of that second (1.0 of ray.shutdown's 1.4 s here): its SIGTERM handler reports its end to the GCS, which is
    already stopped. A local cluster of ours never scales, so its monitor is killed first, with nothing to report.
    Through Ray's private node handle: where a later Ray lacks it, the shutdown is only a second slower."""
    import ray

    if not ray.is_initialized():
        return
    node = getattr(ray._private.worker, "_global_node", None)  # noqa: SLF001 - see the docstring
    if node is not None and node.is_head() and "monitor" in getattr(node, "all_processes", {}):
        node.kill_monitor(check_alive=False)
    ray.shutdown()


def state_api_answers() -> bool:
    """Whether the cluster's State API answers (its dashboard runs): Ray Train's placement group cleaner needs it
    (`pipelines.trials.distributed.torch_trainer`). 0.2 s where it does not."""
    from ray.util.state import list_nodes

    try:
        list_nodes(limit=1, timeout=2)
    except Exception:  # noqa: BLE001 - any failure means no usable State API; Ray raises several kinds
        return False
    return True


def plain_output_off_a_terminal() -> None:
    """No ANSI colour codes in what Ray prints of its workers' lines where it lands in what is not a terminal (a log
    file, a CI job's log, captured output). Ray colours the `(pid=...)` prefix unless RAY_COLOR_PREFIX=0 (its switch,
    read by the driver as it prints each line: ray/_private/worker.py, `print_worker_logs`; a value the user set is
    kept), and its deduplication's `[repeated 3x across cluster]` always: colorama, with which Ray colours, strips the
    codes from a stream that is not a terminal once `colorama.init` wraps it (a terminal's is left as it is)."""
    if sys.stdout.isatty() and sys.stderr.isatty():
        return
    import colorama

    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    colorama.init()


def local_ray_gpus(params: Params) -> int:
    """The GPUs a local Ray head is told this machine has: torch's CUDA devices where the trials train on CUDA (the
    device `pipelines.runtime.resolve_device` picks), else 0.

    Ray counts GPUs its own way (CUDA_VISIBLE_DEVICES, else NVML), and where that finds none, as in a container
    without NVML, `gpu: auto` fell back to a whole GPU per trial that Ray never had, and Tune waited forever.
    """
    import torch

    from pipelines.runtime import resolve_device

    if not torch.cuda.is_available():
        return 0  # device: cuda without CUDA: its trial fails with resolve_device's message, not the driver
    return torch.cuda.device_count() if resolve_device(params).type == "cuda" else 0


def start_local_ray(num_cpus: int, runtime_env: dict[str, object], num_gpus: int | None = None) -> None:
    """A new local Ray cluster of our own, sized to `num_cpus` and `num_gpus` (None: Ray's detection), dashboard
    off."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        runtime_env=runtime_env,
        # Ray prestarts one idle worker per CPU for the first driver's tasks; trials are actors and start their
        # own, so those sat idle: 80 MB RSS and ~0.6 CPU-s each per train stage, measured on 2 cores.
        _system_config={"prestart_worker_first_driver": False},
    )


# Ray 2.5x logs this on every local start where a token exists (~/.ray/auth_token), token auth staying on: a
# notice about our own private cluster that a user cannot act on, printed on every train stage.
TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


@contextlib.contextmanager
def quiet_token_notice() -> Iterator[None]:
    """Drop Ray's token-auth notice while a local cluster starts (RAY_LOG_TOKEN_NOTICE=1 keeps it)."""
    import logging

    def drop(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_NOTICE)

    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if os.environ.get("RAY_LOG_TOKEN_NOTICE") == "1":
        yield
        return
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def use_cluster_token() -> None:
    """Authenticate to a cluster started by `ray start` with its token, when this machine has one.

    Ray 2.5x+ clusters require a token by default, and `ray start` writes it to ~/.ray/auth_token
    (or a user sets RAY_AUTH_TOKEN), but a driver joining by address sends it only in token mode:
    without this, `RAY_ADDRESS=... dvc repro` fails with "Authentication token is missing or
    incorrect". Ray's own switch (the one a new local cluster uses): it keeps an explicit RAY_AUTH_MODE,
    and also refreshes Ray's config, which was read when ray was imported.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def progress_bar(wanted: bool) -> Any:
    """The progress bar class a trial draws with: Ray's (drawn on the driver's terminal), or None for none."""
    from ray.experimental.tqdm_ray import tqdm

    return tqdm if wanted else None


def tune_verbosity(params: Params) -> int:
    """Ray Tune's console output: its trial-status table only for a sweep of several trials.

    A single trial has its own progress (a bar on a terminal, a line per epoch); Tune's table,
    reprinted every 30 s ("Trial status: 1 RUNNING"), would only bury it.
    """
    sweep = len(params.tune.variants) > 1 or params.tune.num_samples > 1 or bool(params.tune.search_space)
    return 1 if sweep else 0


@contextlib.contextmanager
def tune_console(verbosity: int) -> Iterator[None]:
    """Ray Tune's console output at `verbosity`; at 0, nothing at all.

    Tune's newer output engine prints its "Configuration for experiment" box and the results path even
    at verbosity 0; its legacy engine honours 0 (checked on Ray 2.60), so a single trial selects it.
    """
    if verbosity > 0:
        yield
        return
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before
