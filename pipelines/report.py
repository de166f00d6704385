"""The comparison report, built from the MLflow runs of one train stage run.

MLflow is the one source of truth: every number in the table is a stored metric,
printed with `format_metric`, and percentages are against the baseline trial (the
`vanilla` variant when there is one, else the first trial).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from pipelines.tracking import child_runs  # noqa: E402

BASELINE_VARIANT = "vanilla"
MB = 1024 * 1024


@dataclass(frozen=True)
class Column:
    """A table column: its header, the MLflow metric behind it, its unit and scale."""

    header: str
    metric: str
    unit: str = ""
    scale: float = 1.0
    digits: int = 1
    relative: bool = False  # also print as % of the baseline


COLUMNS = (
    Column("Train time", "train_time_s", " s", relative=True),
    Column("Samples/s", "samples_per_s", digits=0),
    Column("Tokens/s", "tokens_per_s", digits=0),
    Column("Peak memory", "peak_memory_bytes", " MB", scale=1 / MB, relative=True),
    Column("Optimizer state", "optimizer_state_bytes", " MB", scale=1 / MB, digits=2, relative=True),
    Column("Activations", "peak_activation_bytes", " MB", scale=1 / MB, digits=2, relative=True),
    Column("Accuracy", "test_accuracy", "", scale=100, digits=2),
    Column("Macro-F1", "test_macro_f1", "", scale=100, digits=2),
)


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


def load_rows(client: MlflowClient, experiment_id: str, parent_run_id: str) -> list[TrialRow]:
    """The child runs of the parent run, baseline first, then in start order."""
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
    rows.sort(key=lambda r: r.name != BASELINE_VARIANT)  # stable: keeps start order otherwise
    return rows


def comparison_table(rows: list[TrialRow]) -> list[list[str]]:
    """Header plus one row per finished trial; relative columns also show % of the baseline (first row)."""
    finished = [r for r in rows if r.status == "FINISHED"]
    header = ["Trial"] + [c.header for c in COLUMNS]
    table = [header]
    baseline = finished[0].metrics if finished else {}
    for row in finished:
        cells = [row.name]
        for column in COLUMNS:
            value = row.metrics.get(column.metric)
            if value is None:
                cells.append("–")
                continue
            cell = format_metric(value, column)
            if column.relative and column.metric in baseline:
                cell += f" ({format_relative(value, baseline[column.metric])})"
            cells.append(cell)
        table.append(cells)
    return table


def markdown_table(table: list[list[str]]) -> str:
    """Render a header-first table as GitHub markdown."""
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
    return "\n".join(lines)


def plot_comparison(rows: list[TrialRow], path: Path) -> None:
    """Bars of train time, peak memory and accuracy per trial, side by side."""
    finished = [r for r in rows if r.status == "FINISHED"]
    names = [r.name for r in finished]
    panels = (
        ("Train time (s)", "train_time_s", 1.0),
        ("Peak memory (MB)", "peak_memory_bytes", 1 / MB),
        ("Test accuracy (%)", "test_accuracy", 100.0),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.6 * len(names) + 2.2))
    colors = plt.cm.tab10.colors
    for ax, (title, metric, scale) in zip(axes, panels, strict=True):
        values = [r.metrics.get(metric, 0.0) * scale for r in finished]
        bars = ax.barh(names, values, color=[colors[i % 10] for i in range(len(names))])
        ax.bar_label(bars, fmt="%.1f", padding=2, fontsize=8)
        ax.set_xlabel(title)
        ax.set_title(title)
        ax.invert_yaxis()
        ax.margins(x=0.2)
    axes[0].set_ylabel("Trial")
    fig.suptitle("Speed, memory and accuracy per trial")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss_curves(client: MlflowClient, rows: list[TrialRow], path: Path) -> None:
    """Training loss against optimizer step for every trial."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row in rows:
        history = sorted(client.get_metric_history(row.run_id, "train_loss"), key=lambda m: m.step)
        if history:
            ax.plot([m.step for m in history], [m.value for m in history], label=row.name, linewidth=1.4)
    ax.set_xlabel("Optimizer step")
    ax.set_ylabel("Training loss (mean per row)")
    ax.set_title("Training loss per trial")
    ax.grid(alpha=0.3)
    ax.legend(title="Trial")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _padding_section(rows: list[TrialRow]) -> list[str]:
    metrics = rows[0].metrics if rows else {}
    configured = metrics.get("tokenize.train.pad_fraction_configured")
    fixed = metrics.get("tokenize.train.pad_fraction_fixed")
    if configured is None or fixed is None:
        return []
    return [
        "## Padding (train split)",
        "",
        f"Padding fraction of the configured batching: {configured:.1%}; padded to max_length: {fixed:.1%}.",
        "",
    ]


def _environment_section(rows: list[TrialRow]) -> list[str]:
    tags: dict[str, Any] = rows[0].tags if rows else {}
    env = {k.removeprefix("env."): v for k, v in sorted(tags.items()) if k.startswith("env.")}
    return ["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()] + [""]


def build_report(client: MlflowClient, experiment_id: str, parent_run_id: str, out_dir: Path) -> str:
    """Write report.md and its PNGs into `out_dir`; return the markdown."""
    rows = load_rows(client, experiment_id, parent_run_id)
    plot_comparison(rows, out_dir / "comparison.png")
    plot_loss_curves(client, rows, out_dir / "loss_curves.png")
    failed = [r for r in rows if r.status != "FINISHED"]
    baseline = next((r.name for r in rows if r.status == "FINISHED"), "none")
    lines = [
        "# Fine-tuning report",
        "",
        f"MLflow parent run `{parent_run_id}`, experiment `{experiment_id}`. "
        f"Percentages are relative to the baseline trial `{baseline}`.",
        "",
        markdown_table(comparison_table(rows)),
        "",
        "![Speed, memory and accuracy](comparison.png)",
        "",
        "![Training loss](loss_curves.png)",
        "",
        *_padding_section(rows),
        *_environment_section(rows),
    ]
    if failed:
        lines += ["## Failed trials", ""] + [
            f"- {r.name} ({r.status}): {r.tags.get('error', '')[:300]}" for r in failed
        ]
    markdown = "\n".join(lines) + "\n"
    (out_dir / "report.md").write_text(markdown, encoding="utf-8")
    return markdown
