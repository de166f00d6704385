"""Figures computed in several places come from one definition: bytes to MiB (`pipelines.gpu_profiles.mib`, beside
`MIB`) and a packed trial's GPU share (`pipelines.trials.card_share.gpu_fraction`). A copy drifts: the source is
searched for others, and each place that shows the figure is checked against a hand computation."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO_ROOT

SOURCES = sorted([*(REPO_ROOT / "pipelines").rglob("*.py"), *(REPO_ROOT / "stages").rglob("*.py")])
# A division by 2**20 or 1024*1024 (bytes to MiB by hand), or a constant of its own for that number.
BY_HAND_MIB = re.compile(
    r"(?<!/)/\s*\(?\s*(2\s*\*\*\s*20|1024\s*\*\s*1024)\b|^\w+\s*=\s*(2\s*\*\*\s*20|1024\s*\*\s*1024)\s*$"
)
BY_HAND_SHARE = re.compile(r"\b1(\.0)?\s*/\s*(\w+\.)?sharing\b")
PEAK_BYTES = 300_000_000  # 286.102 MiB: 300e6 / 1,048,576


def copies(pattern: re.Pattern[str], home: Path) -> list[str]:
    """`file:line: text` of every line of the project's code outside `home` that `pattern` finds."""
    found = []
    for path in SOURCES:
        if path == home:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    return found


def test_bytes_become_mib_in_one_function():
    assert copies(BY_HAND_MIB, REPO_ROOT / "pipelines/gpu_profiles.py") == []


def test_every_place_that_shows_the_peak_in_mib_gives_the_same_figure(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    from pipelines.gpu_profiles import mib
    from pipelines.tracking.status import training_figures
    from pipelines.trials.summary import headline_metrics
    from pipelines.trials.trial import shown_figures

    assert mib(PEAK_BYTES) == 286.1 and mib(2**20) == 1.0  # by hand: 300e6 / 2**20 = 286.10 MiB
    assert shown_figures({"peak_train_memory_bytes": PEAK_BYTES})["peak_train_memory_mib"] == 286.1  # a trial's
    assert headline_metrics({"peak_train_memory_bytes": PEAK_BYTES})["peak_train_memory_mib"] == 286.1  # DVC's
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("mib")).info.run_id
    client.log_metric(run_id, "peak_train_memory_bytes", PEAK_BYTES)
    assert training_figures(client, run_id)["peak_train_memory_mib"] == 286.1  # the evaluated model's
    # The report's columns say MiB and divide by MiB: 286.1, not the 300.0 of a megabyte.
    from pipelines.comparison import SPEED_MEMORY_COLUMNS, format_metric

    peak = next(c for c in SPEED_MEMORY_COLUMNS if c.metric == "peak_train_memory_bytes")
    assert format_metric(PEAK_BYTES, peak) == "286.1 MiB"


def test_a_packed_trials_gpu_share_is_computed_once():
    assert copies(BY_HAND_SHARE, REPO_ROOT / "pipelines/trials/card_share.py") == []


def test_three_trials_to_a_card_are_tagged_with_the_share_ray_gave_them(own_ray_cluster):
    """Three trials to an H200 (a 40 GiB plan each): each asks Ray for the share `card_share` assigned, and its run's
    tags say that share, as Ray reports it assigned, inside a real Ray task on a cluster with one (logical) GPU."""
    import ray

    from pipelines.trial_context import TrialContext
    from pipelines.trials.card_share import card_share
    from pipelines.trials.trial import card_tags

    mib = 2**20
    share = card_share("large", 40 * 2**30, 787 * mib, "H200", 143_771 * mib, cap=4)
    assert share.sharing == 3  # by hand: 143,771 MiB // (40,960 + 787 MiB) = 3
    context = TrialContext(params={}, root="/", variants={"large": {}}, tokenized_dir="/", staging_dir="/",
                           checkpoint_root="/", tracking_uri="", experiment_id="0", parent_run_id="", threads=1,
                           scheduler="fifo", tokenize_stats={}, card_sharing={"large": share.sharing})  # fmt: skip
    ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)  # our own
    try:
        tags = ray.get(ray.remote(num_cpus=0, num_gpus=share.gpu)(card_tags).remote(context, "large"), timeout=120)
    finally:
        ray.shutdown()
    assert tags == {"card.sharing": "3", "card.gpu_share": "0.3333", "card.ray_gpu": "0.3333"}
    assert tags["card.gpu_share"] == f"{share.gpu:.4g}"
