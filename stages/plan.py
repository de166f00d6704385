"""`python -m stages.plan`: predicted training memory of every variant, before any training (seconds).

Prints the plan table and writes `metrics/plan.json`. Needs the tokenize stage's output.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from pipelines.atomic import atomic_write_json
from pipelines.errors import run_cli
from pipelines.params import load_params, resolve_repo_root

TOKENIZED = Path("data/tokenized")
METRICS = Path("metrics/plan.json")


def main() -> None:
    params = load_params()
    from pipelines.memory_plan import plan_table, plan_variants

    plans = plan_variants(params, resolve_repo_root(), TOKENIZED)
    print(plan_table(plans))
    atomic_write_json(METRICS, {name: plan if isinstance(plan, str) else asdict(plan) for name, plan in plans.items()})
    print(f"\nwritten: {METRICS}")


if __name__ == "__main__":
    run_cli(main)
