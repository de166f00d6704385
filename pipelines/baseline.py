"""The commit an experiment is compared with: what the experiment changed in params.yaml, and whether its train
time can be set beside that commit's.

`dvc exp run -S optim=adafactor` applies its changes on top of a commit, the experiment's baseline (DVC names it in
DVC_EXP_BASELINE_REV for queued runs; run in the workspace, it is HEAD), and `dvc exp show` lists that commit's
metrics above the experiment's. Those metrics were committed by whoever ran them, on their host, under their
load: on a shared 2-core host the same run took 4.8 s quiet and 6.7 s beside other work. So the evaluate stage
writes, as the first columns of `dvc exp show`, the params the experiment changed (`changed`) and, beside the
headline figures, what to know before comparing its time with the baseline's (`timing`).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipelines.trial_context import REPEAT_KEY

BASELINE_ENV = "DVC_EXP_BASELINE_REV"
CHANGED_WIDTH = 32  # the `changed` column's most characters: the headline figures after it stay on screen
# The `timing` column's most characters: with `changed` (32), a quality column (test_exact_match, 16), train_time_s
# (12) and DVC's padding (11), the README's `dvc exp show` line stays within 120 columns, so no cell is cut to `…`.
TIMING_WIDTH = 28
NO_BASELINE = "no baseline"


def baseline_rev() -> str:
    """The commit the running experiment started from: DVC's DVC_EXP_BASELINE_REV, else HEAD."""
    return os.environ.get(BASELINE_ENV) or "HEAD"


def _git(root: str | Path, *args: str) -> str | None:
    """git's output, or None where git fails (no git, no repository, no such commit or file)."""
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def baseline_commit(root: str | Path = ".") -> str | None:
    """The baseline commit's full hash; None outside git or before the first commit."""
    rev = _git(root, "rev-parse", "--verify", "--quiet", f"{baseline_rev()}^{{commit}}")
    return rev.strip() if rev else None


def committed_text(path: str | Path, root: str | Path = ".") -> str | None:
    """`path` (relative to the repository's root `root`) as the baseline commit holds it; None outside git, before
    the first commit, or where that commit lacks the file."""
    return _git(root, "show", f"{baseline_rev()}:{Path(path).as_posix()}")


def committed_json(path: str | Path, root: str | Path = ".") -> dict[str, Any] | None:
    """A JSON file as the baseline commit holds it (None as in `committed_text`, or when it is not a JSON object)."""
    text = committed_text(path, root)
    try:
        loaded = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    return loaded if isinstance(loaded, dict) else None


def flat_items(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`tree`'s leaves by dotted key, in the file's order (an empty mapping is a leaf: `tune.variants: {}`)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_items(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def shown_value(value: Any) -> str:
    """A value as `-S key=value` would set it: YAML's spelling of null and booleans, JSON for lists and maps."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return json.dumps(value, separators=(",", ":")) if isinstance(value, list | dict) else str(value)


def changed_params(current: Mapping[str, Any], committed: Mapping[str, Any] | None, width: int = CHANGED_WIDTH) -> str:
    """The params `current` changes from the baseline's, as `key=value` by dotted key, in params.yaml's order, at most
    `width` characters (then `+N` for the N not shown: every param is a column further right); '-' when none
    changed, 'no baseline' without a committed params.yaml. A key the baseline had and this run lacks shows as
    `key=(unset)`."""
    if committed is None:
        return NO_BASELINE
    now, then = flat_items(current), flat_items(committed)
    parts = [f"{k}={shown_value(v)}" for k, v in now.items() if k not in then or then[k] != v]
    parts += [f"{k}=(unset)" for k in then if k not in now]
    if not parts:
        return "-"
    for count in range(len(parts), 0, -1):
        text = " ".join(parts[:count]) + (f" +{len(parts) - count}" if count < len(parts) else "")
        if len(text) <= width:
            return text
    more = f" +{len(parts) - 1}" if len(parts) > 1 else ""
    return f"{parts[0][: width - len(more) - 1]}…{more}"


def _load_marks(figures: Mapping[str, Any], prefix: str) -> list[str]:
    """What made a time slower than alone and quiet: other trials of the project at once, threads waiting for a CPU."""
    marks = []
    shared, load = figures.get("concurrent_trials"), figures.get("host_load_per_core")
    if isinstance(shared, int | float) and shared > 1:
        marks.append(f"{prefix}shared by {shared:g}")
    if isinstance(load, int | float) and load > 1:  # above 1 per core, threads waited (pipelines.host_load)
        marks.append(f"{prefix}load {load:.2f}/core")
    return marks


def timing_note(figures: Mapping[str, Any], committed: Mapping[str, Any] | None, width: int = TIMING_WIDTH) -> str:
    """What to know before setting this train time beside the baseline commit's (`committed`: its metrics file):
    'ok' when both were timed on this host, alone and unloaded; otherwise marks, joined by ', ': 'shared by N' (N
    trials of the project trained here at once: `dvc queue start -j`, Ray concurrency, two terminals), 'load
    X/core' (threads waited for a CPU), 'baseline: other host' (or 'baseline: host unknown'), 'baseline: load
    X/core', 'baseline: shared by N'; 'no baseline' without a committed metrics file; at most `width` characters
    (`fit_marks`). `figures` holds this run's `timed_on`, `host_load_per_core` and `concurrent_trials`."""
    marks = _load_marks(figures, "")
    if committed is None:
        return fit_marks([*marks, NO_BASELINE], width)
    if committed.get("timed_on") is None:
        marks.append("baseline: host unknown")
    elif committed["timed_on"] != figures.get("timed_on"):
        marks.append("baseline: other host")
    marks += _load_marks(committed, "baseline: ")
    return fit_marks(marks, width) or "ok"


def fit_marks(marks: Sequence[str], width: int = TIMING_WIDTH) -> str:
    """The marks joined by ', ', as many as fit `width` characters, then `+N` for the N not shown (in order: this
    run's, then the baseline's); the whole list is `timing_full` (`timing_columns`)."""
    for count in range(len(marks), 0, -1):
        text = ", ".join(marks[:count]) + (f" +{len(marks) - count}" if count < len(marks) else "")
        if len(text) <= width or count == 1:
            return text
    return ""


# The keys of a trial's config that tell its repeats apart, not its configuration: the repeat's seed and index
# (`pipelines.trials.tuner.param_space`). Every other key (the variant, each sampled hyperparameter) is the config.
_REPEAT_KEYS = ("seed", REPEAT_KEY)


def without_repeat(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` (a trial's config, or its overrides) less its repeat's seed and index: what its repeats share. The one
    rule for which trials are repeats of one configuration, here and in the report's table (`pipelines.comparison`)."""
    return {key: value for key, value in config.items() if key not in _REPEAT_KEYS}


def configuration(trial: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a trial of the summary trained with, its repeat's seed and index left out; None without a config."""
    config = trial.get("config")
    return without_repeat(config) if isinstance(config, Mapping) else None


def repeat_times(summary: Mapping[str, Any], run_id: str) -> list[float]:
    """The train times of the repeats of the trial that ran as `run_id` (a train stage's trials summary,
    models/trials.json): the trials of the same configuration, differing only by seed or repeat, itself included.
    With a search space the trials of a variant differ in their sampled hyperparameters, so they are not repeats:
    only those that drew the same values are. Empty when that run is not this summary's best trial (a registered
    version evaluated in its place) or the summary has no config to compare."""
    best = summary.get("best") or {}
    same = configuration(best)
    if best.get("mlflow_run_id") != run_id or same is None:
        return []
    trials = [t for t in summary.get("trials", []) if configuration(t) == same]
    return [float(t["metrics"]["train_time_s"]) for t in trials if "train_time_s" in t.get("metrics", {})]


def timing_columns(figures: Mapping[str, Any], repeats: Sequence[float], committed: Mapping[str, Any] | None) -> dict:
    """The time's noise for `dvc exp show`: the `timing` note against the baseline's committed metrics (`committed`)
    and, over two or more repeats of one configuration (`repeat_times`), the 95% interval of their mean train time
    (`train_time_s_ci_low`, `_high`)."""
    from pipelines.noise import mean_interval

    columns: dict[str, Any] = {"timing": timing_note(figures, committed)}
    whole = timing_note(figures, committed, width=10**6)
    if whole != columns["timing"]:  # marks left out of the column at 120 columns: all of them, beside it
        columns["timing_full"] = whole
    if len(repeats) >= 2:
        columns["train_time_s_ci_low"], columns["train_time_s_ci_high"] = mean_interval(repeats)
    return columns


def changed_since_baseline(params_file: str | Path = "params.yaml", root: str | Path = ".") -> str:
    """`changed_params` of the params file against the baseline commit's."""
    import yaml

    current = yaml.safe_load(Path(root, params_file).read_text(encoding="utf-8")) or {}
    text = committed_text(params_file, root)
    return changed_params(current, None if text is None else yaml.safe_load(text) or {})
