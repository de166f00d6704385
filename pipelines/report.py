"""The comparison report, built from the MLflow runs of one train stage run.

MLflow is the one source of truth: the table (pipelines.comparison) prints stored metrics,
percentages against the baseline trial (the `vanilla` variant when there is one, else the
first trial), with the noise marked. This module renders it as markdown and HTML, with plots.
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient  # the client is passed in: pipelines.tracking opens it

from pipelines.comparison import (  # noqa: E402
    LEGEND,
    MIB,
    TrialRow,
    comparison_table,
    format_metric,
    format_relative,
    load_note,
    load_rows,
    quality_columns,
    task_of_rows,
    unknown_noise_note,
    with_last_commit,
)
from pipelines.trial_context import TRIAL_NAME_TAG  # noqa: E402

__all__ = ["build_report", "comparison_table", "format_metric", "format_relative", "load_rows"]


def markdown_table(table: list[list[str]]) -> str:
    """Render a header-first table as GitHub markdown."""

    def cells(row: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"  # a `|` in a label is no column

    lines = [cells(table[0]), "|" + "---|" * len(table[0])] + [cells(row) for row in table[1:]]
    return "\n".join(lines)


def plot_comparison(rows: list[TrialRow], path: Path) -> None:
    """Bars of train time, peak memory and the task's headline quality per trial, side by side."""
    quality = quality_columns(task_of_rows(rows), rows)[0]
    finished = [r for r in rows if r.status == "FINISHED"]
    names = [r.name for r in finished]
    panels = (
        ("Train time (s)", "train_time_s", 1.0),
        ("Peak train memory (MiB)", "peak_train_memory_bytes", 1 / MIB),
        (quality.axis_label, quality.metric, quality.scale),  # BLEU is on its own 0-100 scale, a share is not
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
    ax.set_ylabel("Training loss (mean per row, or per target token)")
    ax.set_title("Training loss per trial")
    ax.grid(alpha=0.3)
    ax.legend(title="Trial")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lr_range(client: MlflowClient, rows: list[TrialRow], path: Path) -> bool:
    """The LR range tests' smoothed loss against the rate (log axis), the chosen rate marked; False if none ran."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for row in rows:
        rates = {m.step: m.value for m in client.get_metric_history(row.run_id, "lr_range_lr")}
        losses = sorted(client.get_metric_history(row.run_id, "lr_range_loss"), key=lambda m: m.step)
        points = [(rates[m.step], m.value) for m in losses if m.step in rates]
        if not points:
            continue
        line = ax.plot(*zip(*points, strict=True), label=row.name, linewidth=1.4)[0]
        found = row.metrics.get("lr_found")
        if found is not None:
            ax.axvline(found, color=line.get_color(), linestyle="--", linewidth=1)
        drawn = True
    if drawn:
        ax.set_xscale("log")
        ax.set_xlabel("Learning rate (exponential sweep)")
        ax.set_ylabel("Smoothed training loss")
        ax.set_title("LR range test (dashed: the chosen rate)")
        ax.grid(alpha=0.3)
        ax.legend(title="Trial")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def plot_confusion(pairs: list[dict[str, str]], path: Path) -> bool:
    """The evaluate stage's confusion pairs (`plots/confusion.json`: actual, predicted) as a count heatmap, the
    figure `dvc plots show` draws from a CDN (blank offline); False when there are none."""
    import pandas as pd

    if not pairs:
        return False
    frame = pd.DataFrame(pairs).astype(str)
    kept = frame["actual"].value_counts().index[:CONFUSION_MAX_CLASSES]
    frame = frame.apply(lambda column: column.where(column.isin(kept), "other"))
    labels = [*kept, *(["other"] if (frame == "other").any().any() else [])]
    counts = pd.crosstab(frame["actual"], frame["predicted"]).reindex(index=labels, columns=labels, fill_value=0)
    size = max(4.0, 0.45 * len(labels) + 2)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(counts.to_numpy(), cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("actual")
    if len(labels) <= 15:  # counts in the cells while they stay readable
        peak = counts.to_numpy().max()
        for (i, j), value in np.ndenumerate(counts.to_numpy()):
            ax.text(
                j, i, str(value), ha="center", va="center", fontsize=8, color="white" if value > peak / 2 else "black"
            )
    fig.colorbar(image, ax=ax, label="test rows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_tradeoff(rows: list[TrialRow], path: Path) -> None:
    """Train time against accuracy, bubble size by peak memory, with the Pareto front (faster and better) marked."""
    quality = quality_columns(task_of_rows(rows), rows)[0]
    finished = [r for r in rows if r.status == "FINISHED" and quality.metric in r.metrics]
    fig, ax = plt.subplots(figsize=(7, 4.6))
    times = [r.metrics.get("train_time_s", 0.0) for r in finished]
    accuracy = [quality.scale * r.metrics[quality.metric] for r in finished]
    memory = [r.metrics.get("peak_train_memory_bytes", 0.0) / MIB for r in finished]
    largest = max(memory, default=1.0) or 1.0
    colors = plt.cm.tab10.colors
    for i, row in enumerate(finished):
        ax.scatter(
            times[i],
            accuracy[i],
            s=80 + 900 * memory[i] / largest,
            alpha=0.6,
            color=colors[i % 10],
            label=f"{row.name} ({memory[i]:,.0f} MiB)",
            edgecolors="black",
            linewidths=0.6,
        )
    front = pareto_front(times, accuracy)
    if len(front) > 1:
        ax.plot([times[i] for i in front], [accuracy[i] for i in front], "k--", linewidth=1, label="Pareto front")
    ax.set_xlabel("Train time (s)")
    ax.set_ylabel(quality.axis_label)
    ax.set_title(f"Time vs {quality.header.lower()} (bubble area: peak train memory)")
    ax.grid(alpha=0.3)
    ax.margins(0.15)
    legend = ax.legend(fontsize=8, loc="best")
    for handle in legend.legend_handles:
        if hasattr(handle, "set_sizes"):
            handle.set_sizes([50])  # legend markers of one size; the plot's bubbles carry the memory
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pareto_front(times: list[float], accuracy: list[float]) -> list[int]:
    """Indices of trials no other trial beats on both time (lower) and accuracy (higher), fastest first."""
    front = [
        i
        for i in range(len(times))
        if not any(
            times[j] <= times[i] and accuracy[j] >= accuracy[i] and (times[j], accuracy[j]) != (times[i], accuracy[i])
            for j in range(len(times))
        )
    ]
    return sorted(front, key=lambda i: times[i])


def plot_throughput(rows: list[TrialRow], path: Path) -> None:
    """Real (unpadded) tokens per second of training, per trial."""
    finished = [r for r in rows if r.status == "FINISHED"]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(finished) + 2))
    values = [r.metrics.get("tokens_per_s", 0.0) for r in finished]
    bars = ax.barh([r.name for r in finished], values, color=plt.cm.tab10.colors[2])
    ax.bar_label(bars, fmt="%.0f", padding=2, fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set_xlabel("Training throughput (real tokens/s, padding excluded)")
    ax.set_ylabel("Trial")
    ax.set_title("Throughput per trial")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FIGURES = (
    ("Speed, memory and accuracy", "comparison.png"),
    ("Time vs accuracy", "tradeoff.png"),
    ("Training loss", "loss_curves.png"),
    ("Throughput", "throughput.png"),
)
LR_RANGE_FIGURE = ("LR range test", "lr_range.png")  # only when a trial ran one (lr: auto)
CONFUSION_FIGURE = ("Confusion matrix (test split, the evaluated model)", "confusion.png")
CONFUSION_MAX_CLASSES = 30  # generation tasks' answers can be many: the most frequent, the rest as "other"


@dataclass
class ReportContent:
    """Everything the report says, rendered once as markdown and once as HTML."""

    intro: str
    table: list[list[str]]
    notes: list[str]
    padding: str | None
    environment: dict[str, str]
    not_finished: list[str]
    figures: tuple[tuple[str, str], ...] = field(default_factory=lambda: FIGURES)
    per_class: list[list[str]] = field(default_factory=list)


def per_class_table(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The best model's per-class test figures (the evaluate stage's `plots/per_class.json`): each label as written
    (quoted, so spaces show) beside its metric key in MLflow; empty for a task without metric keys per class."""
    keyed = [row for row in rows if "key" in row]
    if not keyed:
        return []
    header = ["Class (as written)", "MLflow metrics", "Precision", "Recall"]
    return [header] + [[json.dumps(str(row["class"]), ensure_ascii=False), f"test_precision.{row['key']}, "
                        f"test_recall.{row['key']}", f"{100 * row['precision']:.1f}%", f"{100 * row['recall']:.1f}%"]
                       for row in keyed]  # fmt: skip


def _padding_text(rows: list[TrialRow]) -> str | None:
    metrics = rows[0].metrics if rows else {}
    fixed = metrics.get("tokenize.train.pad_fraction_fixed")
    if fixed is None:
        return None
    # One padding figure per trial: the table's Padding column (the batches it trained on); here only the baseline.
    return (f"The Padding column is the share of padded positions in the batches each trial trained on; every row "
            f"padded to max_length would have been {fixed:.1%} padding.")  # fmt: skip


def _not_finished(row: TrialRow) -> str:
    if row.status == "KILLED":
        return f"{row.name} (KILLED): {row.tags.get('stopped', 'stopped before the end')}"
    return f"{row.name} ({row.status}): {row.tags.get('error', '')[:300]}"


def collect_content(rows: list[TrialRow], parent_run_id: str, experiment_id: str) -> ReportContent:
    """The report's text and table from the stored runs."""
    baseline = next((r.name for r in rows if r.status == "FINISHED"), "none")
    tags: dict[str, Any] = rows[0].tags if rows else {}
    return ReportContent(
        intro=f"MLflow parent run `{parent_run_id}`, experiment `{experiment_id}`. "
        f"Percentages are relative to the baseline trial `{baseline}`.",
        table=comparison_table(rows),
        notes=[LEGEND] + [note for note in (unknown_noise_note(rows), load_note(rows)) if note],
        padding=_padding_text(rows),
        environment={k.removeprefix("env."): v for k, v in sorted(tags.items()) if k.startswith("env.")},
        not_finished=[_not_finished(r) for r in rows if r.status != "FINISHED"],
    )


def render_markdown(content: ReportContent) -> str:
    """The report as GitHub markdown, images linked beside it."""
    lines = ["# Fine-tuning report", "", content.intro, "", markdown_table(content.table), ""]
    lines += [f"{note}\n" for note in content.notes]
    lines += [f"![{title}]({name})\n" for title, name in content.figures]
    if content.per_class:
        lines += ["## Per class (test split, best model)", "", markdown_table(content.per_class), ""]
    if content.padding:
        lines += ["## Padding (train split)", "", content.padding, ""]
    lines += ["## Environment", ""] + [f"- {k}: {v}" for k, v in content.environment.items()] + [""]
    if content.not_finished:
        lines += ["## Trials that did not finish", ""] + [f"- {line}" for line in content.not_finished]
    return "\n".join(lines) + "\n"


def render_html(content: ReportContent, image_dir: Path) -> str:
    """The report as one self-contained HTML page: images embedded as data URIs, no external files."""
    esc = html.escape

    def code(text: str) -> str:
        return re.sub(r"`([^`]*)`", r"<code>\1</code>", esc(text))

    def html_table(rows: list[list[str]]) -> str:
        head, *body = rows
        out = "<table><thead><tr>" + "".join(f"<th>{esc(c)}</th>" for c in head) + "</tr></thead><tbody>"
        return (
            out
            + "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in body)
            + "</tbody></table>"
        )

    table = html_table(content.table)
    figures = "".join(
        f'<figure><img alt="{esc(title)}" src="data:image/png;base64,'
        f'{base64.b64encode((image_dir / name).read_bytes()).decode()}"><figcaption>{esc(title)}</figcaption></figure>'
        for title, name in content.figures
    )
    notes = "".join(f"<p>{code(note)}</p>" for note in content.notes)
    parts = [f"<h1>Fine-tuning report</h1><p>{code(content.intro)}</p>", table, notes, figures]
    if content.per_class:
        parts.append(f"<h2>Per class (test split, best model)</h2>{html_table(content.per_class)}")
    if content.padding:
        parts.append(f"<h2>Padding (train split)</h2><p>{esc(content.padding)}</p>")
    parts.append(
        "<h2>Environment</h2><ul>"
        + "".join(f"<li>{esc(k)}: {esc(v)}</li>" for k, v in content.environment.items())
        + "</ul>"
    )
    if content.not_finished:
        parts.append(
            "<h2>Trials that did not finish</h2><ul>"
            + "".join(f"<li>{esc(x)}</li>" for x in content.not_finished)
            + "</ul>"
        )
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "th:first-child,td:first-child{text-align:left}thead{background:#f3f3f3}"
        "figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#666;font-size:.9em}"
    )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Fine-tuning report</title>'
        f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n"
    )


def build_report(
    client: MlflowClient,
    experiment_id: str,
    parent_run_id: str,
    out_dir: Path,
    last_commit: tuple[str, str] | None = None,
    evaluated: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    """Write report.md, report.html and the PNGs into `out_dir`; return the markdown. `last_commit` (the best
    trial's run id of the commit this run started from, and the commit) is the baseline of a one-variant run;
    `evaluated`: the evaluate stage's plot rows, `confusion` ((actual, predicted) pairs, drawn as a confusion
    matrix) and `per_class` (tabled with each label as written)."""
    evaluated = evaluated or {}
    # Each trial by its name (TRIAL_NAME_TAG): the default variant's says what the experiment changed, not `default`.
    rows = load_rows(client, experiment_id, parent_run_id)
    rows = [replace(r, name=r.tags.get(TRIAL_NAME_TAG, r.name)) for r in rows]
    if last_commit is not None:
        rows = with_last_commit(client, rows, *last_commit)
    plot_comparison(rows, out_dir / "comparison.png")
    plot_tradeoff(rows, out_dir / "tradeoff.png")
    plot_loss_curves(client, rows, out_dir / "loss_curves.png")
    plot_throughput(rows, out_dir / "throughput.png")
    content = replace(
        collect_content(rows, parent_run_id, experiment_id), per_class=per_class_table(evaluated.get("per_class", []))
    )
    if plot_lr_range(client, rows, out_dir / LR_RANGE_FIGURE[1]):
        content = replace(content, figures=(*content.figures, LR_RANGE_FIGURE))
    if plot_confusion(evaluated.get("confusion", []), out_dir / CONFUSION_FIGURE[1]):
        content = replace(content, figures=(*content.figures, CONFUSION_FIGURE))
    markdown = render_markdown(content)
    (out_dir / "report.md").write_text(markdown, encoding="utf-8")
    (out_dir / "report.html").write_text(render_html(content, out_dir), encoding="utf-8")
    return markdown
