"""The Tuner the train stage runs: the trainable, the search space Ray samples, the scheduler, Tune's own settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelines.params import (
    ChoiceDim,
    GridDim,
    LogUniformDim,
    Params,
    SearchDim,
    UniformDim,
)
from pipelines.trial_context import REPEAT_KEY, TrialContext
from pipelines.trials.card_share import CardShare
from pipelines.trials.ray_cluster import SealedCredentials, seal_credentials, tune_verbosity


def run_trial(config: dict[str, Any], context: TrialContext, shares: dict[str, CardShare] | None = None,
              credentials: SealedCredentials | None = None) -> None:  # fmt: skip
    """Ray Tune's function trainable: `pipelines.trials.trial.run_trial`, imported in the trial's own process.

    Tune pickles this function by reference, so the driver never imports the engine and transformers' model code
    (seconds per train stage), which only the trials' processes run.
    """
    from pipelines.trials.trial import run_trial as train_one_configuration

    train_one_configuration(config, context, shares, credentials)


def _dimension(dim: SearchDim) -> Any:
    from ray import tune

    if isinstance(dim, GridDim):
        return tune.grid_search(dim.values)
    if isinstance(dim, ChoiceDim):
        return tune.choice(dim.values)
    if isinstance(dim, UniformDim):
        return tune.uniform(dim.low, dim.high)
    if isinstance(dim, LogUniformDim):
        return tune.loguniform(dim.low, dim.high)
    return tune.randint(dim.low, dim.high)


def trial_base_params(params: Params) -> Params:
    """The params every trial starts from: without the variants and search space, which the trial resolves.

    A trial checks its own configuration only; re-checking every other variant against its
    sampled values would fail trials whose siblings, not themselves, are incompatible.
    """
    return params.model_copy(update={"tune": params.tune.model_copy(update={"variants": {}, "search_space": {}})})


def repeat_seeds(params: Params) -> list[int]:
    """Seeds of a variant's repeats: with `tune.num_samples` > 1 and no search space, seed, seed+1, ...

    Repeats of one configuration differ only in their seed (initialisation, shuffling, dropout),
    so their spread is the noise the report sets differences against. Without repeats: [].
    """
    if params.tune.num_samples < 2 or params.tune.search_space:
        return []
    return [params.seed + i for i in range(params.tune.num_samples)]


def one_trial(params: Params) -> bool:
    """Whether the experiment is one trial: at most one variant, one sample, no search space."""
    return len(params.tune.variants) <= 1 and params.tune.num_samples == 1 and not params.tune.search_space


def tuner_num_samples(params: Params) -> int:
    """Samples Ray draws per grid point: repeats are a grid axis of seeds instead (see repeat_seeds)."""
    return 1 if repeat_seeds(params) else params.tune.num_samples


def param_space(params: Params) -> dict[str, Any]:
    """Ray's search space: the variants as a grid axis, repeats' seeds as another, then every search dimension."""
    from ray import tune

    variant = tune.grid_search(list(params.tune.variants)) if params.tune.variants else "default"
    space: dict[str, Any] = {"variant": variant}
    seeds = repeat_seeds(params)
    if seeds:
        space["seed"] = tune.grid_search(seeds)
        space[REPEAT_KEY] = tune.sample_from(lambda spec: spec.config["seed"] - seeds[0])
    return {**space, **{key: _dimension(dim) for key, dim in params.tune.search_space.items()}}


def tune_scheduler(params: Params) -> Any:
    """Tune's trial scheduler: FIFO, or ASHA stopping the weaker trials early."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if params.tune.scheduler == "fifo":
        return FIFOScheduler()
    # Trials report once per epoch, then once more after evaluating and saving; max_t is one past
    # the epochs so ASHA never stops a trial at its last epoch, before its model is saved.
    return ASHAScheduler(
        time_attr="training_iteration",
        max_t=params.epochs + 1,
        grace_period=params.tune.grace_period,
        reduction_factor=params.tune.reduction_factor,
    )


def build_tuner(
    params: Params, context: TrialContext, resources: dict[str, float] | Any, objective: tuple[str, str], root: Path,
    shares: dict[str, CardShare] | None = None,
) -> Any:  # fmt: skip
    """The Tuner of every trial: seeded sampling, its scheduler, a fresh process per trial, Tune's result files; each
    trial gets its variant's card share (`gpu: auto`), which it enforces, and the tracking credentials by reference."""
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback
    from ray.tune.search import BasicVariantGenerator

    trainable = tune.with_parameters(run_trial, context=context, shares=shares, credentials=seal_credentials())
    tuner = tune.Tuner(
        tune.with_resources(trainable, resources),
        param_space=param_space(params),
        tune_config=tune.TuneConfig(
            metric=objective[0],
            mode=objective[1],
            num_samples=tuner_num_samples(params),
            scheduler=tune_scheduler(params),
            # Seeded sampling: the same params draw the same trial configurations. The concurrency
            # limit goes to the generator itself: Tune ignores max_concurrent_trials (and warns) when
            # search_alg is a SearchGenerator such as this one.
            search_alg=BasicVariantGenerator(
                random_state=params.seed, max_concurrent=params.tune.max_concurrent_trials
            ),
            time_budget_s=params.tune.time_budget_s,
            # A fresh process per trial: a trial's peak RSS and allocator state are its own.
            reuse_actors=False,
        ),
        run_config=tune.RunConfig(
            name=f"train-{context.parent_run_id[:8]}",
            storage_path=str((root / "ray_results").resolve()),
            callbacks=[JsonLoggerCallback(), CSVLoggerCallback()],
            verbose=tune_verbosity(params),
        ),
    )
    return tuner
