"""Whether a trained model scores no better than chance on validation, and what to try then.

A model that learned nothing still trains, saves and reports: the default classifier built from a config, on 300
generated rows for 3 epochs, ended at the commonest label's share and nothing said so (issue 71). A task that has a
chance level (`Task.chance_level`: a classifier's commonest label) is checked after training: a validation score
within the binomial noise (two standard errors) of that level gets a warning with the likely causes, and the trial's
MLflow run the tag `at_chance`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelines.noise import Z95, binomial_se

if TYPE_CHECKING:
    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.params import Params
    from pipelines.tasks.base import Task

AT_CHANCE_TAG = "at_chance"


def at_chance_note(task: Task, metrics: dict[str, float], validation: TokenizedSplit, params: Params) -> str | None:
    """The warning for a validation score at chance, naming the score, the chance level and the likely causes; None
    when the model beat chance beyond the noise, or the task has no chance level."""
    level = task.chance_level(validation)
    if level is None or level[0] not in metrics or len(validation) == 0:
        return None
    metric, chance = level
    score, rows = metrics[metric], len(validation)
    if score > chance + Z95 * binomial_se(chance, rows):
        return None
    causes = [f"too few optimizer steps for what it must learn ({params.epochs} epochs): raise `epochs` or bring "
              "more rows"]  # fmt: skip
    if params.model.name_or_path is None:
        causes.insert(0, "a model built from scratch (`model.name_or_path: null`) needs far more steps than a "
                         "pretrained one: name one in `model.name_or_path`")  # fmt: skip
    causes.append("a learning rate far off (`lr: auto` runs a range test)")
    return (f"{metric} {score:.3f} is at chance: always answering the commonest label scores {chance:.3f} on these "
            f"{rows} validation rows, so the model learned nothing usable. Likely: " + "; ".join(causes))  # fmt: skip
