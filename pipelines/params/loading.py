"""Reading params.yaml into `Params`, and where a run's repository and Ray cluster are."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipelines.params.errors import ParamsError, format_validation_error
from pipelines.params.schema import Params


def parse_params(raw: Mapping[str, Any] | None, source: str = "params.yaml") -> Params:
    """Validate a mapping (e.g. parsed YAML) into `Params`, raising `ParamsError` with readable lines."""
    try:
        return Params.model_validate(raw or {})
    except ValidationError as err:
        raise ParamsError(format_validation_error(err, source)) from None


def load_params(path: str | os.PathLike[str] = "params.yaml") -> Params:
    """Read and validate a params file; every failure is a `ParamsError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found (run from the repository root)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ParamsError(f"{path}: cannot be read: {err}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return parse_params(raw, str(path))


def resolve_repo_root(params_path: str | os.PathLike[str] = "params.yaml") -> Path:
    """The repository whose MLflow store and results the run uses.

    DVC sets `DVC_ROOT` for every stage and points it at the original repository even
    when a queued experiment runs in a temporary copy, so runs from `dvc exp run --queue`
    land in the same store as runs from the workspace.
    """
    root = os.environ.get("DVC_ROOT")
    return Path(root).resolve() if root else Path(params_path).resolve().parent


def ray_address(params: Params) -> str | None:
    """The Ray cluster to join: `tune.address`, else RAY_ADDRESS, else None (a local Ray)."""
    return params.tune.address or os.environ.get("RAY_ADDRESS") or None
