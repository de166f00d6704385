"""`python -m stages.plan [--target CARD ...]`: every variant's predicted training memory on each target, before
any training (seconds; no GPU needed).

Targets: the `--target` names given (cpu or GPU profiles), else `target_device`, else the card `memory_budget`
names, else where a run here would train. Prints a table per target (predicted peak, the card's reserve, fits,
the fastest configuration that fits) and writes `metrics/plan.json`. Needs the tokenize stage's output.
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
    parser.add_argument("--target", action="append", default=[], help="cpu or a GPU profile (repeatable)")
    args = parser.parse_args()
    params = load_params()
    from pipelines.resolve.plan_report import plan_targets, target_table
    from pipelines.resolve.target import target_named

    targets = [target_named(name) for name in _targets(params, args.target)]
    plans = plan_targets(params, resolve_repo_root(), TOKENIZED, targets)
    print("\n\n".join(target_table(name, entries) for name, entries in plans.items()))
    atomic_write_json(METRICS, {name: {v: e.as_json() for v, e in entries.items()} for name, entries in plans.items()})
    print(f"\nwritten: {METRICS}")


if __name__ == "__main__":
    run_cli(main, arguments=True)
