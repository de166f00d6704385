"""One Ray Tune trial: validated params + the trial's overrides → a trained, tracked, saved model.

Shaped like accelerate's `train(config, args)`: `config` is what Tune varies (the
variant name and any sampled overrides), `TrialContext` is the infrastructure (absolute
paths, the MLflow run tree), which never enters the search space. The trial itself runs
`pipelines.recipe` in this process, or on Ray Train workers (`pipelines.trials.distributed`).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ray import tune

from pipelines.baseline import NO_BASELINE
from pipelines.concurrency import METRIC, ConcurrentTrials, stopping
from pipelines.errors import UserError
from pipelines.gpu_profiles import mib
from pipelines.host_load import HostLoad
from pipelines.params import Params, apply_overrides
from pipelines.recipe import PARAMS_FILE, Trial, train_and_save
from pipelines.tracking.environment import environment_tags
from pipelines.tracking.lineage import log_datasets
from pipelines.tracking.mlflow_model import model_logger
from pipelines.tracking.runs import (
    RunLogger,
    leave_retries_to_run_logger,
    log_params,
    quiet_mlflow_info,
    start_run,
)
from pipelines.tracking.status import (
    ended_run,
    headline_metrics,
    list_first,
    open_client,
    stopped_tags,
    watch_system,
)
from pipelines.tracking.uploads import TRIAL_PREFIX, Upload, send_or_defer
from pipelines.train.checkpoint import claim_checkpoint_dir
from pipelines.train.memory import reset_peak_rss
from pipelines.trial_context import FINAL_KEY, REPEAT_KEY, TRIAL_NAME_TAG, VARIANT_ORDER_TAG, TrialContext
from pipelines.trials.card_share import CardShare, enforced_share, gpu_fraction
from pipelines.trials.ray_cluster import SealedCredentials, progress_bar, use_tracking_credentials

__all__ = ["run_trial", "trial_overrides"]


def trial_overrides(config: dict[str, Any], variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The variant's overrides, then any sampled keys (dotted) from the search space (and a repeat's seed)."""
    overrides = dict(variants.get(config.get("variant", ""), {}))
    overrides.update({k: v for k, v in config.items() if k not in ("variant", REPEAT_KEY)})
    return overrides


def trial_name(variant: str, changed: str = "") -> str:
    """A trial's name in the report and first in its run name: its variant; the default variant's is what the
    experiment changed from the baseline commit's params.yaml (`optim=adafactor`, `dvc exp show`'s `changed`), or
    `default` when nothing changed (`changed`: '-', 'no baseline' or '')."""
    if variant != "default" or changed in ("", "-", NO_BASELINE):
        return variant
    return changed


def trial_run_name(config: dict[str, Any], base_seed: int, experiment: str = "", changed: str = "") -> str:
    """What a trial varies, as its MLflow run name: its name (`trial_name`), its seed, then each searched value,
    then the DVC experiment it belongs to (`adafactor · seed 43 · lr=0.0003 · exp-1a2b3`), so the runs table and the
    compare view say what each row is, and tell two experiments' trials apart, without opening them."""
    seed = config.get("seed", base_seed)
    searched = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items()
                if k not in ("variant", "seed", REPEAT_KEY)]  # fmt: skip
    name = trial_name(str(config.get("variant", "default")), changed)
    return " · ".join([name, f"seed {seed}", *searched, *filter(None, [experiment])])


def shown_figures(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` with the peak memory also in MiB, as DVC and the report show it (MLflow's runs table shows that
    column). The figures themselves are not rounded: derived ones (rows = samples/s x seconds) must stay exact."""
    out = dict(metrics)
    if "peak_train_memory_bytes" in out:
        out["peak_train_memory_mib"] = mib(out["peak_train_memory_bytes"])
    return out


def quiet_stop_of_this_process() -> None:
    """Drop the "Exception ignored in ..." traceback of a KeyboardInterrupt or SystemExit met in a destructor or weakref
    callback: Ray stops a trial's process by raising one of them in it, and where that lands in a garbage collector's
    callback Python prints it as unraisable. Ray forwards it to the stage's stderr: a traceback about nothing the user
    can act on (seen once in CI, after a stage that failed at its end). Every other unraisable still prints."""
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt | SystemExit):
            default(unraisable)

    sys.unraisablehook = hook


def run_trial(config: dict[str, Any], context: TrialContext, shares: dict[str, CardShare] | None = None,
              credentials: SealedCredentials | None = None) -> None:  # fmt: skip
    """Ray Tune function trainable: train one configuration and report its metrics (`shares`: each variant's share
    of a card under `gpu: auto`, which a packed trial enforces; `credentials`: the driver's for the tracking server,
    from Ray's object store)."""
    quiet_stop_of_this_process()
    use_tracking_credentials(credentials)  # before the first MLflow call
    leave_retries_to_run_logger()
    quiet_mlflow_info()
    trial_start = time.perf_counter()
    # Ray starts a fresh process per trial (reuse_actors=False); the reset makes sure of it for RSS.
    rss_reset = reset_peak_rss()
    variant = config.get("variant", "default")
    trial_id = tune.get_context().get_trial_id()
    client = open_client(context.tracking_uri)
    run_id = start_run(
        client,
        context.experiment_id,
        trial_run_name(config, int(context.params.get("seed", 0)), context.experiment_name, context.changed),
        {
            "variant": variant,
            TRIAL_NAME_TAG: trial_name(variant, context.changed),
            # Trials finish (and start) in any order when they run concurrently; the report orders
            # variants as tune.variants declares them.
            VARIANT_ORDER_TAG: str(list(context.variants).index(variant) if variant in context.variants else 0),
            "trial_id": trial_id,
            **({REPEAT_KEY: str(config[REPEAT_KEY])} if REPEAT_KEY in config else {}),
        },
        context.parent_run_id,
    )
    logger = RunLogger(client, run_id, fallback_dir=context.fallback_dir)
    monitors: list[Any] = []  # the system-metrics monitor, started once the headline metrics are listed first

    def close(status: str) -> None:
        for system_metrics in monitors:
            try:
                system_metrics.finish()
            except Exception as err:  # noqa: BLE001 - system metrics are best effort; the run's own metrics are not
                print(f"system metrics could not be flushed: {err}")
        logger.close(status)

    def record_error(err: Exception) -> None:
        # Why, in the run itself, so the MLflow UI shows the failure next to its params.
        message = str(err) if isinstance(err, UserError) else traceback.format_exc(limit=5)
        logger.log_tags({"error": message[:5000]})

    def record_stop() -> None:
        # Ray ends a trial's thread with SystemExit when the scheduler (ASHA) stops it early.
        logger.log_tags(stopped_tags(context.scheduler))

    with ended_run(close, record_error, record_stop):
        params = trial_params(config, context, variant, trial_id, logger, rss_reset)
        monitors.append(watch_system(run_id, context.tracking_uri))
        host_load = HostLoad().start()  # beside the times: how busy the host was while they were taken
        together = ConcurrentTrials(str(Path(context.root).resolve())).start()  # and who else of ours trained
        with claim_checkpoint_dir(Path(context.checkpoint_root), params) as checkpoint_dir, stopping(together):
            if params.distributed.num_workers > 1:
                from pipelines.trials.distributed import run_distributed_trial

                metrics = run_distributed_trial(params, context, variant, trial_id, run_id, checkpoint_dir)
            else:
                trial = Trial(context, variant, trial_id, run_id, logger, tune.report, checkpoint_dir,
                              log_model=model_logger(logger, context.experiment_id, run_id, trial_id),
                              make_bar=progress_bar(context.progress_bars))  # fmt: skip
                with enforced_share(params, (shares or {}).get(variant), variant, logger.log_tags):
                    metrics = train_and_save(trial, params)
        metrics["wall_time_s"] = time.perf_counter() - trial_start
        metrics = shown_figures(metrics | host_load.stop() | together.stop())
        logger.log_tags({METRIC: f"{metrics[METRIC]:.0f}"})
        logger.log_dict(metrics, step=int(metrics["optimizer_steps"]))
    # Reported after the run is closed: Tune may end this thread (SystemExit) once it has the last result.
    tune.report({**metrics, "mlflow_run_id": run_id, "variant": variant, FINAL_KEY: 1})


def card_tags(context: TrialContext, variant: str) -> dict[str, str]:
    """How many trials of this variant share one card (`gpu: auto`) and Ray's GPU share, as tags."""
    sharing = context.card_sharing.get(variant)
    if sharing is None:
        return {}
    import ray

    assigned = ray.get_runtime_context().get_assigned_resources().get("GPU")  # what Ray actually gave this trial
    return {"card.sharing": str(sharing), "card.gpu_share": f"{gpu_fraction(sharing):.4g}",
            "card.ray_gpu": "none" if assigned is None else f"{assigned:.4g}"}  # fmt: skip


def trial_params(
    config: dict[str, Any], context: TrialContext, variant: str, trial_id: str, logger: RunLogger, rss_reset: bool
) -> Params:
    """The trial's params (the base with its variant's and sampled overrides), logged with its inputs to the
    logger's run."""
    client, run_id = logger.client, logger.run_id
    overrides = trial_overrides(config, context.variants)
    params = apply_overrides(Params.model_validate(context.params), overrides, source=f"variant {variant!r}")
    list_first(client, run_id, headline_metrics(params.task, context.score_test))  # what MLflow's compare view opens on
    log_params(client, run_id, params)
    logger.log_tags(
        {
            **environment_tags(cuda_allowed=params.device != "cpu"),
            **card_tags(context, variant),
            "overrides": json.dumps(overrides, sort_keys=True),
            "peak_rss": "reset at trial start" if rss_reset else "process lifetime (no /proc/self/clear_refs)",
        }
    )
    # The trial's folder keeps the same params.json: if the bucket fails, `--resume-upload` sends that one.
    send = lambda: client.log_text(run_id, json.dumps(params.model_dump(mode="json"), indent=2), PARAMS_FILE)  # noqa: E731
    upload = Upload(PARAMS_FILE, f"{TRIAL_PREFIX}{trial_id}/{PARAMS_FILE}", send)
    send_or_defer(client, run_id, upload, params.tracking.upload_retry_s, print)
    log_datasets(client, run_id, params.data, Path(context.root), Path(context.tokenized_dir))
    logger.log_dict(context.tokenize_stats)
    if variant in context.card_sharing:  # a metric too, so the runs table and the report can sort and mark by it
        logger.log_dict({"card_sharing": float(context.card_sharing[variant])})
    return params
