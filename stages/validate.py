"""DVC stage `validate`: check the whole params.yaml against the schema, first, whatever changed in it.

The other stages list only the params they read, so a key added by mistake (`dvc exp run -S +optimizer=adafactor`,
a typo of `optim`) changes none of them: without this stage every stage would be skipped and the experiment
recorded as a success with the typo in it. This stage depends on the whole file (as a file, so that no knob
becomes a `dvc exp show` column through it), so any change re-runs it, and a key the schema does not know fails
the experiment with the schema's message before anything else runs.

First of all, it claims the workspace for the pipeline running it (`pipelines.workspace`): a second `dvc exp run`
started while another runs here stops at this stage, and puts back the params.yaml DVC changed for it.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.atomic import atomic_write_json
from pipelines.errors import run_cli
from pipelines.params import flatten_params, load_params
from pipelines.workspace import FIRST_STAGE, claim_workspace

CHECKED = Path("metrics/params_checked.json")


def main() -> None:
    claim_workspace(FIRST_STAGE)  # before reading params.yaml: a refused run puts back what DVC changed in it
    params = load_params()  # raises ParamsError naming the key, the value and what is allowed
    atomic_write_json(CHECKED, {"keys": len(flatten_params(params))})


if __name__ == "__main__":
    run_cli(main)
