"""The comparison table: one row per variant, relative to the baseline, with the noise shown.

MLflow is the one source of truth: every number is a stored metric, printed with
`format_metric`. A variant repeated over seeds (`tune.num_samples` > 1) is one row of
mean ± sd. With a search space a variant's trials differ in their sampled hyperparameters, so each configuration
is a row of its own, its repeats only the trials that drew the same values (`pipelines.baseline.configuration`'s
rule). Differences to the baseline are marked `*` where they exceed the noise
(`pipelines.noise`) and say "within noise" where they do not; memory figures are exact byte
counts, so their noise is zero; a single run's time has no noise estimate, which the legend says.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient  # the client is passed in: pipelines.tracking opens it

from pipelines.baseline import without_repeat
from pipelines.concurrency import METRIC as CONCURRENT
from pipelines.concurrency import concurrency_note
from pipelines.gpu_profiles import MIB
from pipelines.host_load import is_under_load
from pipelines.noise import binomial_se, exceeds_noise, mean_sd, repeats_se
from pipelines.task_registry import TASKS
from pipelines.tracking.runs import child_runs
from pipelines.trial_context import QUALITY_TAG

BASELINE_VARIANT = "vanilla"

# How a column's noise is known: seeds' spread only ("repeats"), exact counts ("exact"), or a binomial proportion.
Noise = Literal["repeats", "exact", "binomial", "none"]


@dataclass(frozen=True)
class Column:
    """A table column: its header, the MLflow metric behind it, its unit, scale, and how its noise is known."""

    header: str
    metric: str
    unit: str = ""
    scale: float = 1.0
    digits: int = 1
    relative: bool = False  # also print as % of the baseline
    noise: Noise = "none"
    interval: bool = False  # the metric has `<metric>_ci_low` / `_ci_high` (a 95% interval)
    versus: str | None = None  # also print the error in % against this metric of the same run (prediction)
    timed: bool = False  # measured by a clock: marked when the host was under load (pipelines.host_load)

    @property
    def axis_label(self) -> str:
        """How a chart names a test metric: "Test accuracy (%)" for a share, "Test bleu" on its own scale."""
        return f"Test {self.header.lower()}" + (" (%)" if self.scale == 100 else "")


# Time and memory: the same for every task.
SPEED_MEMORY_COLUMNS = (
    Column("Train time", "train_time_s", " s", relative=True, noise="repeats", timed=True),
    Column("Wall time", "wall_time_s", " s", timed=True),
    Column("Samples/s", "samples_per_s", digits=0, timed=True),
    Column("Tokens/s", "tokens_per_s", digits=0, timed=True),
    Column("Padding", "padding_fraction", "%", scale=100),  # of the batches' positions (bucketing, packing)
    Column("Peak train memory", "peak_train_memory_bytes", " MiB", scale=1 / MIB, relative=True, noise="exact"),
    Column("Optimizer state", "optimizer_state_bytes", " MiB", scale=1 / MIB, digits=2, relative=True, noise="exact"),
    Column("Activations", "peak_activation_bytes", " MiB", scale=1 / MIB, digits=2, relative=True, noise="exact"),
    Column("Peak RSS", "peak_rss_bytes", " MiB", scale=1 / MIB, digits=0),
)


def quality_columns(task: str, rows: list[TrialRow] | None = None) -> tuple[Column, ...]:
    """The task's quality columns (`Task.quality`); the first is its headline (the Δ column's).

    As the trials' runs recorded them (`QUALITY_TAG`), so the report stage imports no task code, nor torch (1.5 s
    of its 8 s here); from the task itself for runs without the tag.
    """
    recorded = next((r.tags[QUALITY_TAG] for r in rows or [] if QUALITY_TAG in r.tags), None)
    if recorded is not None:
        declared = json.loads(recorded)
    else:
        from pipelines.tasks import get_task

        declared = [asdict(q) for q in get_task(task).quality]
    return tuple(
        Column(
            q["header"],
            q["metric"],
            "%" if q["scale"] == 100 else "",  # a share shown in percent says so: 0.5% exact match, not 0.50
            scale=q["scale"],
            digits=q["digits"],
            noise="binomial" if q["binomial"] else "none",
            interval=q["interval"],
        )  # fmt: skip
        for q in declared
    )


# Shown when a trial froze parameters (LoRA): gradients and optimizer state exist for the trainable ones only.
TRAINABLE_COLUMN = Column(
    "Trainable param memory", "trainable_param_bytes", " MiB", scale=1 / MIB, digits=2, relative=True, noise="exact"
)
# Shown when trials were planned (pipelines.resolve.memory_plan): the prediction and its error against the measured
# peak.
PLAN_COLUMN = Column(
    "Predicted peak", "predicted_peak_train_memory_bytes", " MiB", scale=1 / MIB, versus="peak_train_memory_bytes"
)


def __getattr__(name: str) -> object:
    """`COLUMNS`: the classifier's columns (the default task's), built on first use: the classification task's
    module imports torch, which the report stage does without."""
    if name == "COLUMNS":
        return SPEED_MEMORY_COLUMNS + quality_columns("classification")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DELTA_HEADER = "Δ accuracy vs baseline"


def task_of_rows(rows: list[TrialRow]) -> str:
    """The task the trials ran (their `task` tag; runs from before tasks existed are classifiers)."""
    return next((r.tags["task"] for r in rows if r.tags.get("task") in TASKS), "classification")


def columns_for(task: str, rows: list[TrialRow] | None = None) -> tuple[Column, ...]:
    """The report's columns for `task`: time and memory (trainable parameters when a trial froze some), quality."""
    frozen = any(r.metrics.get("frozen_param_bytes", 0.0) > 0 for r in rows or [])
    planned = all(PLAN_COLUMN.metric in r.metrics for r in rows or [] if r.status == "FINISHED") and bool(rows)
    extra = ((TRAINABLE_COLUMN,) if frozen else ()) + ((PLAN_COLUMN,) if planned else ())
    return SPEED_MEMORY_COLUMNS + extra + quality_columns(task, rows)


def delta_header(task: str, rows: list[TrialRow] | None = None) -> str:
    """Header of the column that gives the headline quality's difference to the baseline."""
    header = quality_columns(task, rows)[0].header
    return f"Δ {header if header.isupper() else header.lower()} vs baseline"


def format_metric(value: float, column: Column) -> str:
    """The one rounding rule of the report: scale, then round to the column's digits."""
    return f"{value * column.scale:,.{column.digits}f}{column.unit}"


def format_relative(value: float, baseline: float) -> str:
    """`value` as a whole percentage of `baseline`."""
    return f"{round(100 * value / baseline)}%" if baseline else "n/a"


@dataclass
class TrialRow:
    """One trial's name and metrics as stored in MLflow."""

    name: str
    run_id: str
    status: str
    metrics: dict[str, float]
    tags: dict[str, str]


@dataclass
class VariantGroup:
    """One configuration's finished runs (several when it was repeated over seeds): a variant, with a search space
    one of its sampled configurations (`name` then says which)."""

    name: str
    rows: list[TrialRow]

    def values(self, metric: str) -> list[float]:
        return [r.metrics[metric] for r in self.rows if metric in r.metrics]

    def mean(self, metric: str) -> float | None:
        values = self.values(metric)
        return mean_sd(values)[0] if values else None


def load_rows(client: MlflowClient, experiment_id: str, parent_run_id: str) -> list[TrialRow]:
    """The child runs of the parent run: the baseline first, then as `tune.variants` declares them.

    Concurrent trials start and finish in any order, so start order alone would shuffle the table;
    the `variant_order` tag (set by each trial) fixes it, and start order breaks ties (repeats).
    """
    rows = [
        TrialRow(
            name=run.data.tags.get("variant", run.info.run_name),
            run_id=run.info.run_id,
            status=run.info.status,
            metrics=dict(run.data.metrics),
            tags=dict(run.data.tags),
        )
        for run in child_runs(client, experiment_id, parent_run_id)
    ]
    rows.sort(key=lambda r: (r.name != BASELINE_VARIANT, int(r.tags.get("variant_order", 0))))  # stable
    return rows


def with_last_commit(client: MlflowClient, rows: list[TrialRow], run_id: str | None, commit: str) -> list[TrialRow]:
    """A one-variant run (a `dvc exp run` changing one knob) compared with the best trial of the commit it started
    from, put first as the baseline, when the store has that run finished; else the rows as they are."""
    variants = {r.name for r in rows if r.status == "FINISHED"}  # a search space's configurations are one variant
    if run_id is None or len(variants) != 1 or run_id in {r.run_id for r in rows}:
        return rows
    try:
        run = client.get_run(run_id)
    except Exception:  # noqa: BLE001 - MlflowException (not imported here): a store without that run, no baseline
        return rows
    if run.info.status != "FINISHED":
        return rows
    name = f"last commit {commit[:7]}: {run.data.tags.get('variant', run.info.run_name)}"
    return [TrialRow(name, run_id, "FINISHED", dict(run.data.metrics), dict(run.data.tags)), *rows]


# The tag each trial sets to what it trained with beyond the base params (pipelines.trials.trial.trial_params): its
# variant's overrides and its sampled values, its seed among them.
OVERRIDES_TAG = "overrides"


def configuration_of(row: TrialRow) -> dict[str, Any]:
    """What a trial trained with beyond its variant's name: its overrides, its repeat's seed left out (the rule of
    `pipelines.baseline.configuration`); empty for a run without the tag (a variant's overrides alone)."""
    try:
        overrides = json.loads(row.tags.get(OVERRIDES_TAG, "{}"))
    except json.JSONDecodeError:
        return {}
    return without_repeat(overrides) if isinstance(overrides, dict) else {}


def group_rows(rows: list[TrialRow]) -> list[VariantGroup]:
    """Finished runs grouped by configuration, in first-seen order (the baseline first): a group is the repeats of
    one configuration, trials of one variant that trained with the same values and differ only by seed. With a search
    space a variant's trials differ in their sampled hyperparameters, so they are not repeats: each configuration is
    a group, named by its variant and the values that tell it from the variant's others (`vanilla · lr=0.001`)."""
    grouped: dict[tuple[str, str], list[TrialRow]] = {}
    for row in (r for r in rows if r.status == "FINISHED"):
        grouped.setdefault((row.name, json.dumps(configuration_of(row), sort_keys=True)), []).append(row)
    configs = {key: json.loads(key[1]) for key in grouped}
    groups = []
    for (name, config), members in grouped.items():
        mine, others = configs[(name, config)], [c for (n, _), c in configs.items() if n == name]
        told = [k for k in sorted({k for c in others for k in c}) if any(c.get(k) != mine.get(k) for c in others)]
        shown = [f"{k}={mine.get(k):.3g}" if isinstance(mine.get(k), float) else f"{k}={mine.get(k)}" for k in told]
        groups.append(VariantGroup(" · ".join([name, *shown]), members))  # shown as the trials' run names show them
    return groups


def difference_se(column: Column, group: VariantGroup, baseline: VariantGroup) -> tuple[float, float | None] | None:
    """(standard error, degrees of freedom or None for the normal) of (group - baseline) for `column`; None when
    the noise is unknown."""
    a, b = group.values(column.metric), baseline.values(column.metric)
    from_repeats = repeats_se(a, b)
    if from_repeats is not None:
        return from_repeats
    if column.noise == "exact" and not on_cuda(group) and not on_cuda(baseline):
        return 0.0, None  # MemTracker's byte counts; a CUDA allocator's peak varies between runs
    if column.noise == "binomial" and len(a) == 1 and len(b) == 1:
        rows = split_rows(column.metric)
        n_a, n_b = group.rows[0].metrics.get(rows, 0.0), baseline.rows[0].metrics.get(rows, 0.0)
        return (binomial_se(a[0], n_a) ** 2 + binomial_se(b[0], n_b) ** 2) ** 0.5, None
    return None


def split_rows(metric: str) -> str:
    """The metric counting the rows `metric` was measured on: `val_rows` for a validation figure, else `test_rows`."""
    return "val_rows" if metric.startswith("val_") else "test_rows"


def on_cuda(group: VariantGroup) -> bool:
    """Whether a group's trials trained on CUDA (their memory peaks are the allocator's, not exact counts)."""
    return any(r.tags.get("device.resolved", "").startswith("cuda") for r in group.rows)


def noise_mark(column: Column, group: VariantGroup, baseline: VariantGroup) -> str:
    """'*' when the difference to the baseline exceeds the noise, ', within noise' when not, '' when unknown."""
    noise = difference_se(column, group, baseline)
    mine, theirs = group.mean(column.metric), baseline.mean(column.metric)
    if noise is None or mine is None or theirs is None:
        return ""
    return "*" if exceeds_noise(mine - theirs, *noise) else ", within noise"


UNDER_LOAD = " †"


def _shared_card(row: TrialRow) -> bool:
    return row.metrics.get("card_sharing", 1.0) > 1  # packed onto a card with other trials (gpu: auto)


def _beside_others(row: TrialRow) -> bool:
    return row.metrics.get(CONCURRENT, 1.0) > 1  # other trials of this project trained on the host at the same time


def _loaded(row: TrialRow) -> bool:
    loaded = is_under_load(row.metrics.get("host_load_mean"), row.metrics.get("host_cores"))
    return loaded or _shared_card(row) or _beside_others(row)


def under_load(group: VariantGroup) -> bool:
    """Whether any of a group's trials ran with more runnable threads than usable cores, or on a card shared with
    other trials (its times are slowed)."""
    return any(_loaded(r) for r in group.rows)


def load_note(rows: list[TrialRow]) -> str | None:
    """Name the trials whose times were taken under load or on a shared card, so no one compares them as quiet."""
    loaded = [r for g in group_rows(rows) if under_load(g) for r in g.rows if _loaded(r)]
    if not loaded:
        return None

    def why(row: TrialRow) -> str:
        parts = [f"card shared by {row.metrics['card_sharing']:.0f} trials"] if _shared_card(row) else []
        if _beside_others(row):
            parts.append(concurrency_note(row.metrics[CONCURRENT]))
        if is_under_load(row.metrics.get("host_load_mean"), row.metrics.get("host_cores")):
            parts.insert(0, f"load {row.metrics['host_load_mean']:.1f} on {row.metrics['host_cores']:.0f} cores")
        return f"{row.name}: {', '.join(parts)}"

    return (
        f"†: timed under load ({', '.join(why(r) for r in loaded)}): the host had more runnable threads than cores, "
        "or the trial shared its card or cores with other trials, so these times are slower than the same run alone "
        "on a quiet host; compare them only with times taken under a like load."
    )


def _value_cell(column: Column, group: VariantGroup) -> str:
    values = group.values(column.metric)
    if len(values) > 1:
        mean, sd = mean_sd(values)
        mark = UNDER_LOAD if column.timed and under_load(group) else ""
        return f"{format_metric(mean, column)}{mark} ± {sd * column.scale:,.{column.digits}f} (n={len(values)})"
    cell = format_metric(values[0], column) + (UNDER_LOAD if column.timed and under_load(group) else "")
    metrics = group.rows[0].metrics
    low, high = metrics.get(f"{column.metric}_ci_low"), metrics.get(f"{column.metric}_ci_high")
    if column.interval and low is not None and high is not None:
        cell += f" [{low * column.scale:.{column.digits - 1}f}, {high * column.scale:.{column.digits - 1}f}]"
    measured = metrics.get(column.versus) if column.versus else None
    if measured:
        cell += f" ({100 * (values[0] / measured - 1):+.1f}% vs measured)"
    return cell


def comparison_table(rows: list[TrialRow]) -> list[list[str]]:
    """Header plus one row per variant; relative columns also show % of the baseline (first group)."""
    groups = group_rows(rows)
    task = task_of_rows(rows)
    columns = columns_for(task, rows)
    header = ["Trial"] + [c.header for c in columns] + [delta_header(task, rows)]
    table = [header]
    baseline = groups[0] if groups else None
    for group in groups:
        cells = [group.name]
        for column in columns:
            if not group.values(column.metric):
                cells.append("–")
                continue
            cell = _value_cell(column, group)
            base = baseline.mean(column.metric) if baseline else None
            if column.relative and base is not None:
                mark = noise_mark(column, group, baseline) if group is not baseline else ""  # type: ignore[arg-type]
                cell += f" ({format_relative(group.mean(column.metric) or 0.0, base)}{mark})"
            cells.append(cell)
        cells.append(_delta_cell(group, baseline, quality_columns(task, rows)[0]))
        table.append(cells)
    return table


def _delta_cell(group: VariantGroup, baseline: VariantGroup | None, accuracy: Column) -> str:
    mine = group.mean(accuracy.metric)
    theirs = baseline.mean(accuracy.metric) if baseline else None
    if baseline is None or group is baseline or mine is None or theirs is None:
        return "–"
    return f"{100 * (mine - theirs):+.2f}{noise_mark(accuracy, group, baseline)}"


LEGEND = (
    "Train time is the optimizer steps only, after the first (warm-up) step, timed alike for every trial; "
    "wall time is the whole trial (setup, warm-up, validation, checkpoints, test evaluation, saving). "
    "Peak train memory is what training allocates: on CUDA the allocator's peak over the training steps, on CPU "
    "the peak of torch's allocations in a training step (PyTorch's MemTracker; activations recomputed under "
    "checkpointing included); Activations are their own high point in that step. Peak RSS (the whole process, "
    "libraries included) is secondary. "
    "Accuracy and exact match carry 95% Wilson intervals over the test rows, macro-F1 a bootstrap one. "
    "Repeated variants show mean ± sd over seeds. `*`: the difference to the baseline exceeds the noise "
    "(Welch's t at 95% from the seeds' spreads when repeated; for one run each, 1.96 binomial standard errors of "
    "accuracy over the test rows; any difference in exact byte counts, never in a CUDA allocator's peak); "
    "'within noise': it does not."
)


def unknown_noise_note(rows: list[TrialRow]) -> str | None:
    """Say so when time differences carry no noise estimate (variants not repeated)."""
    groups = group_rows(rows)
    if len(groups) > 1 and any(len(g.rows) < 2 for g in groups):
        return (
            "Train time: one run per configuration, so its noise is unknown and differences are not marked; "
            "set tune.num_samples to 2 or more to repeat each variant over seeds."
        )
    return None
