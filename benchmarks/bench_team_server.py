"""What tracking to a team's server costs: the default train stage, to the team stack against the sqlite default.

    python -m benchmarks.bench_team_server [--rounds 3] [--json PATH]
    python -m benchmarks.bench_team_server --smoke [--json PATH]   # a few rows, one round: that it runs, not a figure

The team stack is the one `docs/how-to/team-server.md` sets up and `tests/e2e/team_stack.py` starts: PostgreSQL
(Debian's), moto's S3 server as the bucket, `mlflow server --app-name basic-auth` proxying the artifacts, a member
with EDIT on the experiment. One copy of the project is tokenized once; then `python -m stages.train` (its own
local Ray cluster, as `dvc repro` runs it) is timed whole, wall clock, alternately against each store, the order
swapped each round (round-robin). The default params otherwise. Prints each run, the medians and the ratio.
Needs PostgreSQL's server programs and the `dev` extra (moto).
`--smoke`: one round on 300 generated rows and one epoch, the whole stack as above.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = {"data.generator.num_rows": 300, "epochs": 1}  # a smoke run's corpus and training, in the copy's params


def project_copy(dest: Path) -> Path:
    """This project's tracked and unignored files, in a fresh git repo (as a clone would have them)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")  # fmt: skip
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=dest, check=True)
    return dest


PARTS = ("train_time_s", "setup_time_s", "log_model_time_s", "wall_time_s")  # the best trial's own clocks


def set_params(root: Path, overrides: dict[str, object]) -> None:
    """Dotted-key overrides written into the copy's params.yaml (what `dvc exp run -S` does)."""
    import yaml

    from pipelines.params import set_dotted

    tree = yaml.safe_load((root / "params.yaml").read_text())
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    (root / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))


def train_once(root: Path, uri: str, env: dict[str, str]) -> tuple[float, dict[str, float]]:
    """Wall seconds of one train stage tracking to `uri`, and its trial's own clocks (where the time went)."""
    set_params(root, {"tracking.uri": uri})
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "stages.train"], cwd=root, env={**os.environ, **env},
                          capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the train stage failed against {uri}:\n{done.stderr[-3000:]}")
    best = json.loads((root / "models/trials.json").read_text())["best"]["metrics"]
    return wall, {k: best[k] for k in PARTS if k in best}


def timed_rounds(root: Path, tmp: Path, rounds: int) -> dict[str, list[float]]:
    """The team stack started once; then each round, the train stage against each store, the order swapped."""
    from tests.e2e.team_stack import TeamStack

    stack = TeamStack(tmp)
    try:
        stack.experiment_id = stack.server.create_experiment()
        stack.server.add_user("trainer", "EDIT", stack.experiment_id)
        stores = {"sqlite": ("sqlite:///mlflow.db", {}), "team": (stack.server.url,
                                                                stack.server.credentials("trainer"))}  # fmt: skip
        walls: dict[str, list[float]] = {name: [] for name in stores}
        for round_ in range(rounds):
            order = list(stores) if round_ % 2 == 0 else list(reversed(stores))
            for name in order:
                wall, parts = train_once(root, *stores[name])
                walls[name].append(wall)
                clocks = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                print(f"round {round_ + 1}: {name:6s} {wall:6.1f} s (the trial's {clocks})", flush=True)
    finally:
        stack.close()
    return walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="one round on 300 generated rows: proves it runs")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.e2e.team_stack import postgres_bin

    if postgres_bin("initdb") is None or postgres_bin("pg_ctl") is None:
        # Said here, not by the stack: it skips as a test would, which a command would show as a traceback.
        raise SystemExit("PostgreSQL's server programs (initdb, pg_ctl) are not installed: apt-get install postgresql")
    os.environ.pop("RAY_ADDRESS", None)  # each stage starts its own local cluster, as a user's `dvc repro` does
    with tempfile.TemporaryDirectory() as tmp:
        root = project_copy(Path(tmp) / "project")
        if args.smoke:
            set_params(root, SMOKE)
        subprocess.run([sys.executable, "-m", "stages.tokenize"], cwd=root, check=True, capture_output=True)
        walls = timed_rounds(root, Path(tmp), 1 if args.smoke else args.rounds)
    medians = {name: statistics.median(values) for name, values in walls.items()}
    ratio = medians["team"] / medians["sqlite"]
    print(f"median wall: sqlite {medians['sqlite']:.1f} s, team server {medians['team']:.1f} s; "
          f"team / sqlite = {ratio:.3f} ({100 * (ratio - 1):+.1f}%)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"walls_s": walls, "medians_s": medians, "ratio": ratio}, indent=1) + "\n")
    if args.smoke:
        print("smoke run: 300 generated rows, one epoch, one round; not a measurement, nothing to record")


if __name__ == "__main__":
    main()
