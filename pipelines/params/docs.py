"""The params reference (docs/reference/params.md), generated from the schema and params.yaml.

`python -m pipelines.params.docs` rewrites the section between the markers; a test
fails when the page and the schema drift apart.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from pipelines.params import Params, flatten_params, load_params

BEGIN = "<!-- params-reference:begin -->"
END = "<!-- params-reference:end -->"
PAGE = "docs/reference/params.md"


def _annotated_bounds(metadata: Any) -> str:
    parts = []
    for meta in metadata:
        for name, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if getattr(meta, name, None) is not None:
                parts.append(f"{symbol} {getattr(meta, name)}")
    return f" ({', '.join(parts)})" if parts else ""


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        base, *metadata = get_args(annotation)
        return _type_name(base) + _annotated_bounds(metadata)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(annotation))
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: Any) -> str:
    return _annotated_bounds(field.metadata)


def _rows(model: type[BaseModel], prefix: str, defaults: dict[str, Any]) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _rows(annotation, f"{key}.", defaults)
            continue
        type_text = _type_name(annotation).replace("PositiveInt", "int").replace("NonNegativeInt", "int")
        default = defaults.get(key)
        rows.append(f"| `{key}` | {type_text}{_bounds(field)} | `{default}` | {field.description} |")
    return rows


def reference_markdown(params: Params) -> str:
    """The reference table: every key, its type and bounds, its value in params.yaml, its meaning."""
    lines = ["| Key | Type | Default (params.yaml) | Meaning |", "|---|---|---|---|"]
    return "\n".join(lines + _rows(Params, "", flatten_params(params)))


def render_page(page: str, params: Params) -> str:
    """`page` with the section between the markers replaced by the current reference."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{reference_markdown(params)}\n{END}{tail}"


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else PAGE)
    path.write_text(render_page(path.read_text(encoding="utf-8"), load_params()), encoding="utf-8")
