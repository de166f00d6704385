"""The `tune` section: how the train stage runs its Ray Tune trials, and the search-space dimensions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt

from pipelines.params.fields import StrictModel


class ChoiceDim(StrictModel):
    """Sample one of `values` at random."""

    type: Literal["choice"]
    values: list[Any] = Field(min_length=1, description="The values to choose from.")


class GridDim(StrictModel):
    """Try every one of `values` (a grid axis; multiplies the number of trials)."""

    type: Literal["grid"]
    values: list[Any] = Field(min_length=1, description="Every value is tried.")


class UniformDim(StrictModel):
    """A float drawn uniformly from [low, high]."""

    type: Literal["uniform"]
    low: float = Field(description="Lower bound.")
    high: float = Field(description="Upper bound.")


class LogUniformDim(StrictModel):
    """A float drawn uniformly in log space from [low, high] (learning rates)."""

    type: Literal["loguniform"]
    low: PositiveFloat = Field(description="Lower bound (> 0).")
    high: PositiveFloat = Field(description="Upper bound.")


class RandIntDim(StrictModel):
    """An integer drawn uniformly from [low, high)."""

    type: Literal["randint"]
    low: int = Field(description="Lower bound (included).")
    high: int = Field(description="Upper bound (excluded).")


SearchDim = Annotated[ChoiceDim | GridDim | UniformDim | LogUniformDim | RandIntDim, Field(discriminator="type")]


def candidate_values(dim: ChoiceDim | GridDim | UniformDim | LogUniformDim | RandIntDim) -> list[Any]:
    """Values a dimension can produce at its edges (validated against the schema before any trial)."""
    if isinstance(dim, ChoiceDim | GridDim):
        return list(dim.values)
    if dim.low >= dim.high:
        raise ValueError(f"low ({dim.low}) must be below high ({dim.high})")
    return [dim.low, dim.high - 1] if isinstance(dim, RandIntDim) else [dim.low, dim.high]


class ResourcesParams(StrictModel):
    """What one trial reserves on the Ray cluster."""

    cpu: PositiveFloat | None = Field(
        description="CPUs per trial (per worker with distributed.num_workers > 1); null: an even share of the cores."
    )
    gpu: NonNegativeFloat | Literal["auto"] | None = Field(
        description="GPUs per trial (fractions share a GPU). auto: where the Ray cluster has GPUs, each trial the "
        "share of one card its variant's memory plan needs (planned peak + the process's reserve; at most "
        "max_concurrent_trials to a card; a whole card when it cannot share; refused when it does not fit), else 0. "
        "null: 1 with CUDA, else 0. With distributed.num_workers > 1, per worker: a number as declared (it stands "
        "where the workers train on the CPU); auto or null: 1 with distributed.use_gpu, else 0."
    )


class TuneParams(StrictModel):
    """How the train stage runs its Ray Tune trials."""

    num_samples: PositiveInt = Field(
        description="Samples drawn from search_space per variant; without a search space, repeats of each variant "
        "with seeds seed, seed+1, ... (the report then shows mean ± sd and marks differences beyond the noise)."
    )
    variants: dict[str, dict[str, Any]] = Field(
        description="Named override sets by dotted key, run as a grid, e.g. {vanilla: {}, bf16: {precision: bf16}}.",
    )
    search_space: dict[str, SearchDim] = Field(
        description="Dotted key -> {type: choice|grid|uniform|loguniform|randint, ...}; combined with every variant."
    )
    max_concurrent_trials: PositiveInt = Field(description="Trials running at the same time.")
    metric: str = Field(
        description="Trial metric that picks the best trial (and that ASHA compares); auto: the task's own "
        "(classification: val_accuracy, causal_lm and seq2seq: val_loss)."
    )
    mode: Literal["max", "min", "auto"] = Field(
        description="Whether the metric is maximised or minimised; auto: as the task's metric wants (with "
        "metric: auto), else max for accuracies and min for losses."
    )
    scheduler: Literal["fifo", "asha"] = Field(
        description="fifo runs every trial to the end; asha stops weak ones early."
    )
    grace_period: PositiveInt = Field(description="ASHA: epochs every trial runs before it can be stopped.")
    reduction_factor: float = Field(gt=1.0, description="ASHA: 1/reduction_factor of trials go on at each rung.")
    resources_per_trial: ResourcesParams = Field(description="CPUs and GPUs each trial reserves.")
    time_budget_s: PositiveFloat | None = Field(
        description="Stop starting and running trials after this long; null: none."
    )
    address: str | None = Field(description="Ray cluster to join (else RAY_ADDRESS, else a local one); null: local.")
