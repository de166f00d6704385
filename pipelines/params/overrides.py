"""Dotted-key overrides (`-S data.max_length=64`, a variant, a search sample) and the flat view of params."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pipelines.params.errors import ParamsError, format_validation_error

# Any params model (schema.Params): typed by its base, so this module never imports the schema (no circle).
Params = TypeVar("Params", bound=BaseModel)


def set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    """Set `tree["a"]["b"] = value` for `dotted_key="a.b"`, creating sections as needed."""
    *parents, leaf = dotted_key.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ParamsError(f"override {dotted_key!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def apply_overrides(params: Params, overrides: Mapping[str, Any], source: str = "overrides") -> Params:
    """Return a new, re-validated `Params` with dotted-key overrides merged in."""
    tree = copy.deepcopy(params.model_dump(mode="python"))
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    try:
        return type(params).model_validate(tree)
    except ValidationError as err:
        raise ParamsError(format_validation_error(err, source)) from None


def flatten_params(params: BaseModel) -> dict[str, Any]:
    """Flatten to dotted keys (`data.max_length`); variants are logged as one JSON-ish string."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and not prefix.endswith("variants"):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        else:
            flat[prefix] = node

    walk("", params.model_dump(mode="json"))
    return flat
