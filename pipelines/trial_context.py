"""What a trial and the driver that starts it share: the trial's context and the keys of its results.

Light on purpose (no torch, transformers or ray): the train stage's driver builds the context and reads the
results, and it never imports the engine (`pipelines.recipe`), which only the trial's own process needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Marks a trial's last result. Not "done": that key is Ray Tune's own and stops the trial.
FINAL_KEY = "final"
# The config key of a repeat's index (tune.num_samples > 1 without a search space); its seed is under "seed".
REPEAT_KEY = "repeat"
# The run tag holding the variant's position in tune.variants.
VARIANT_ORDER_TAG = "variant_order"
# The run tag holding a trial's name in the report: its variant, or for the default variant what the experiment's
# params.yaml changed from the baseline commit's (`optim=adafactor`), as `dvc exp show`'s `changed` column says it.
TRIAL_NAME_TAG = "trial_name"
# The run tag holding the task's quality columns (`Task.quality`, as JSON): the report reads them from the runs, so
# it imports no task code (nor torch).
QUALITY_TAG = "quality_columns"


@dataclass(frozen=True)
class TrialContext:
    """Everything a trial needs that is not a hyperparameter; all paths absolute."""

    params: dict[str, Any]
    root: str
    variants: dict[str, dict[str, Any]]
    tokenized_dir: str
    staging_dir: str
    checkpoint_root: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    threads: int
    scheduler: str
    tokenize_stats: dict[str, float]
    progress_bars: bool = False  # the driver's stdout is a terminal: draw a bar per trial
    card_sharing: dict[str, int] = field(default_factory=dict)  # variant -> trials to a card (gpu: auto), else none
    experiment_name: str = ""  # the DVC experiment's name (DVC_EXP_NAME), which each trial's run name ends with
    changed: str = ""  # what params.yaml changed from the baseline commit's (pipelines.baseline.changed_params)
    # Ray's State API answers (the cluster runs a dashboard), which Ray Train's placement group cleaner needs
    # (pipelines.trials.distributed.torch_trainer); our local cluster starts without one. Set once Ray is up.
    state_api: bool = False
    # Whether the trial scores the test split: only as the experiment's one trial (`tuner.one_trial`). Where there are
    # several, they are compared and chosen on validation (`Task.validation_quality`), and the evaluate stage scores
    # the chosen model alone: the test split scored once per experiment, no trial's test figure beside the others'.
    score_test: bool = True

    @property
    def fallback_dir(self) -> Path:
        """Where a run's metrics go when the tracking store stays unreachable (see RunLogger)."""
        return Path(self.root) / "mlflow-fallback"
