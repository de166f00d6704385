"""Field types shared by every params section: the strict base model and the `auto`-or-value types.

Imports only pydantic: the schema must say no before anything heavy is imported.
"""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, PlainValidator
from pydantic_core import PydanticCustomError

from pipelines.gpu_profiles import CLUSTER_FORMS, GPU_PROFILES, parse_cluster
from pipelines.optimizer_registry import OPTIMIZERS
from pipelines.task_registry import TASKS

# The registered optimizers (pipelines.optimizer_registry), as the task names come from the task registry.
Optimizer = Literal[tuple(OPTIMIZERS)]  # type: ignore[valid-type]
Precision = Literal["fp32", "fp16", "bf16", "auto"]
WeightsDtype = Literal["fp32", "bf16"]
LrSchedule = Literal["constant", "linear", "cosine", "onecycle", "cyclic", "reduce_on_plateau"]
DeviceName = Literal["auto", "cpu", "cuda"]
# The registered tasks (pipelines.task_registry): a new task is allowed here by its registry line alone.
TaskName = Literal[tuple(TASKS)]  # type: ignore[valid-type]
AdapterType = Literal["none", "lora", "qlora"]

GENERATOR_SOURCE = "generator"


def _batch_size(value: Any) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise PydanticCustomError("batch_size", "must be an integer greater than 0, or 'auto'")


BatchSize = Annotated[int | Literal["auto"], PlainValidator(_batch_size, json_schema_input_type=int | str)]

_BYTE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_bytes(value: Any) -> int | None:
    """Bytes from an integer or a string like "8GB" (10^9), "8GiB" (2^30) or "512 MB"; None stays None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    if isinstance(value, str):
        text = value.strip().upper()
        number = text.rstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        unit, number = text[len(number) :], number.strip()
        try:
            amount = float(number)
        except ValueError:
            amount = -1.0
        if amount > 0 and unit in _BYTE_UNITS:
            return int(amount * _BYTE_UNITS[unit])
    raise PydanticCustomError(
        "bytes",
        "must be null, a positive number of bytes, or a size with a unit: B, KB, MB, GB, TB (powers of 1000) "
        "or KiB, MiB, GiB, TiB (powers of 1024), e.g. '8GB' or '512MiB'",
    )


Bytes = Annotated[int | None, PlainValidator(parse_bytes, json_schema_input_type=int | str | None)]


def _budget(value: Any) -> int | str | None:
    if isinstance(value, str) and value in GPU_PROFILES:
        return value
    try:
        return parse_bytes(value)
    except PydanticCustomError:
        raise PydanticCustomError(
            "memory_budget",
            "must be null, a positive number of bytes, a size with a unit (B, KB, MB, GB, TB: powers of 1000; "
            "KiB, MiB, GiB, TiB: powers of 1024; e.g. '8GB'), or a GPU profile: {cards}",
            {"cards": ", ".join(GPU_PROFILES)},
        ) from None


# Bytes, or a GPU profile's name (the card's memory less its reserve: pipelines.gpu_profiles).
MemoryBudget = Annotated[int | str | None, PlainValidator(_budget, json_schema_input_type=int | str | None)]


def _target_device(value: Any) -> str:
    if value in ("auto", "cpu") or value in GPU_PROFILES or (isinstance(value, str) and parse_cluster(value)):
        return value
    raise PydanticCustomError(
        "target_device",
        "must be auto, cpu, a GPU profile ({cards}), or several GPUs of one: {forms}",
        {"cards": ", ".join(GPU_PROFILES), "forms": CLUSTER_FORMS},
    )


TargetDevice = Annotated[str, PlainValidator(_target_device, json_schema_input_type=str)]


def _lr(value: Any) -> float | str:
    if value == "auto" or (isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1):
        return value if value == "auto" else float(value)
    raise PydanticCustomError("lr", "must be a number greater than 0 and less than 1, or 'auto' (an LR range test)")


LearningRate = Annotated[float | Literal["auto"], PlainValidator(_lr, json_schema_input_type=float | str)]


class StrictModel(BaseModel):
    """Base for every params section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def template_fields(template: str) -> list[str]:
    """The column names a prompt template reads, in order of first use; a ValueError for a field that is not a plain
    name (`{0}`, `{a.b}`, `{a!r}`, `{a:>9}`) or a template with none."""
    fields: list[str] = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(
                f"data.prompt_template: field {{{name}}} must be a column's name in braces, such as "
                "{instruction} (no index, attribute, conversion or format spec); write {{ for a brace"
            )
        if name not in fields:
            fields.append(name)
    if not fields:
        raise ValueError(f"data.prompt_template {template!r} names no column; name each in braces: {{instruction}}")
    return fields
