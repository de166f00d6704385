"""DVC stage `tokenize`: read the source, split, tokenize, write arrays and stats."""

from __future__ import annotations

from pathlib import Path

from pipelines.atomic import atomic_dir, atomic_write_json
from pipelines.errors import run_cli
from pipelines.params import load_params

OUT_DIR = Path("data/tokenized")
METRICS = Path("metrics/tokenize.json")


def main() -> None:
    params = load_params()
    from pipelines.prepare import prepare_dataset  # after validation: fail fast, import heavy code later

    with atomic_dir(OUT_DIR) as tmp:
        stats = prepare_dataset(params, Path.cwd(), tmp)
    atomic_write_json(METRICS, stats)


if __name__ == "__main__":
    run_cli(main)
