"""`python -m stages.plan [--target CARD ...]`: every variant's predicted training memory on each target, before
any training (seconds; no GPU needed).

Targets: the `--target` names given (cpu, GPU profiles, or several GPUs of one: `8xA100-80GB`, `2x8xH100-80GB`),
else `target_device`, else the card `memory_budget` names, else where a run here would train. Prints a table per
target (predicted peak, the card's reserve, fits, the fastest configuration that fits; for several GPUs, per GPU for
each adapter, checkpointing and strategy, with host RAM, the largest batch and the step time with its collectives)
and writes `metrics/plan.json`. Needs the tokenize stage's output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.atomic import atomic_write_json
from pipelines.errors import run_cli
from pipelines.params import Params, load_params, resolve_repo_root
from pipelines.stage_help import description

TOKENIZED = Path("data/tokenized")
METRICS = Path("metrics/plan.json")


def _targets(params: Params, named: list[str]) -> list[str]:
    if named:
        return named
    if params.target_device != "auto":
        return [params.target_device]
    if isinstance(params.memory_budget, str):
        return [params.memory_budget]
    from pipelines.resolve.target import as_target
    from pipelines.runtime import resolve_device

    return [as_target(resolve_device(params)).name]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.plan", description=description(__doc__))
    parser.add_argument("--target", action="append", default=[],
                        help="cpu, a GPU profile, or GPUs of one: 8xA100-80GB, 2x8xH100-80GB (repeatable)")  # fmt: skip
    args = parser.parse_args()
    params = load_params()
    from pipelines.resolve.cluster import cluster_named
    from pipelines.resolve.cluster_report import cluster_json, cluster_table, plan_clusters
    from pipelines.resolve.plan_report import plan_targets, target_table
    from pipelines.resolve.target import target_named

    names = _targets(params, args.target)
    clusters = {name: cluster_named(name) for name in names}  # a bad name is refused here, naming the forms
    targets = [target_named(name) for name, cluster in clusters.items() if cluster is None]
    plans = plan_targets(params, resolve_repo_root(), TOKENIZED, targets) if targets else {}
    several = plan_clusters(params, resolve_repo_root(), TOKENIZED, [c for c in clusters.values() if c is not None])
    print(
        "\n\n".join(
            [target_table(name, entries, params) for name, entries in plans.items()]
            + [cluster_table(v, plan) for entries in several.values() for v, plan in entries.items()]
        )
    )
    written = {name: {v: e.as_json() for v, e in entries.items()} for name, entries in plans.items()}
    written |= {name: {v: cluster_json(plan) for v, plan in entries.items()} for name, entries in several.items()}
    atomic_write_json(METRICS, written)
    print(f"\nwritten: {METRICS}")


if __name__ == "__main__":
    run_cli(main, arguments=True)
