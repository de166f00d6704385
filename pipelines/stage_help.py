"""`python -m stages.<name> --help`: what a stage does, the params it reads and the outputs it writes, answered from
its docstring, `STAGE_PARAMS` and dvc.yaml before anything runs: no Ray, no MLflow, no file read but dvc.yaml, none
written. Any other argument is refused with the allowed ones (a stage takes none: DVC runs it with params.yaml)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from pipelines.params.stage_keys import STAGE_PARAMS, WHOLE_FILE

DVC_FILE = Path("dvc.yaml")


def description(doc: str | None) -> str:
    """A module docstring's first paragraph as one whole sentence (the line breaks joined)."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in first.splitlines())


def stage_outputs(stage: str, dvc_file: Path = DVC_FILE) -> list[str]:
    """What dvc.yaml says the stage writes: its outs, metrics and plots (empty when dvc.yaml is not here)."""
    import yaml

    try:
        declared: dict[str, Any] = yaml.safe_load(dvc_file.read_text())["stages"][stage]
    except (OSError, KeyError, TypeError):
        return []
    paths = []
    for kind in ("outs", "metrics", "plots"):
        for entry in declared.get(kind, []):
            paths.append(next(iter(entry)) if isinstance(entry, dict) else str(entry))
    return paths


def stage_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The stage's argument parser: no argument but -h/--help, whose text names the params and outputs."""
    stage = module.rsplit(".", 1)[-1]
    read = STAGE_PARAMS.get(stage, ())
    params = "the whole params.yaml" if read == (WHOLE_FILE,) else ", ".join(read) or "none"
    outputs = ", ".join(stage_outputs(stage)) or "see dvc.yaml"
    paragraphs = (
        f"Params read (from params.yaml; change one with `dvc exp run -S key=value`): {params}.",
        f"Outputs written: {outputs}.",
        "Run it through DVC: `dvc repro` runs every stage that is out of date.",
    )
    epilog = "\n\n".join(textwrap.fill(paragraph, width=100) for paragraph in paragraphs)
    return argparse.ArgumentParser(
        prog=f"python -m {module}", description=textwrap.fill(description(doc), width=100), epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip


def parse_stage_arguments(module: str, doc: str | None, argv: list[str]) -> None:
    """Answer --help and exit 0, refuse any other argument and exit 2; return when there is none."""
    stage_parser(module, doc).parse_args(argv)
