"""params.yaml's validation errors, as one line per problem: the key path, the bad value, what is allowed."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from pipelines.errors import UserError


class ParamsError(UserError):
    """params.yaml (or an override) is not valid."""


def inner_problems(err: Exception) -> str:
    """The problems of a nested validation, without its "... is invalid:" header."""
    lines = str(err).splitlines()
    problems = [line.strip().removeprefix("- ") for line in lines[1:]] if len(lines) > 1 else lines
    return "; ".join(problems)


def _describe_error(err: Mapping[str, Any]) -> str:
    loc = ".".join(str(part) for part in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key (check the spelling; see docs/reference/params.md)"
    if err["type"] == "missing":
        return f"{loc}: required key is missing (params.yaml holds every key; see docs/reference/params.md)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        # Our own cross-field rules already name their keys and values.
        return f"{loc}: {msg}" if err["loc"] else msg
    text_number = _number_as_text(err["input"], err["type"])
    if text_number:
        return f"{loc} = {err['input']!r}: {text_number}"
    return f"{loc} = {err['input']!r}: {msg}"


# Errors of fields that want words, not numbers: a number written as text is not their problem.
_WORD_ERRORS = frozenset({"literal_error", "enum", "bool_parsing", "bool_type", "string_type", "target_device"})
# YAML 1.1's exponent form, as the user may have written it: the mantissa's dot and the exponent's sign optional.
_EXPONENT = re.compile(r"([-+]?)([0-9]*)(?:\.([0-9]*))?[eE]([-+]?)([0-9]+)")


def _number_as_text(value: Any, error_type: str) -> str | None:
    """Where a numeric field refused a string that reads as a number: why it is a string, and the spelling that
    works; else None.

    PyYAML reads params.yaml as YAML 1.1, whose floats need a dot in the mantissa and a sign in the exponent:
    `1e-4` and `1.0e4` are strings there (YAML 1.2 and Python read both as numbers), so `lr: 1e-4` reaches
    the schema as the string '1e-4', and the field's own rule ("must be a number") alone would leave the user
    staring at what looks like a number."""
    if not isinstance(value, str) or error_type in _WORD_ERRORS or not any(c.isdigit() for c in value):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    spelling = _yaml_number(value, number)
    if isinstance(yaml.safe_load(value), str):
        return (f"params.yaml is read as YAML 1.1, where {value} is a string, not a number (a number with an "
                f"exponent needs a dot in the mantissa and a sign in the exponent); write {spelling}")  # fmt: skip
    return f"a string, not a number (quoted?); write {spelling} without quotes"


def _yaml_number(value: str, number: float) -> str:
    """`value` spelled so that YAML 1.1 reads it as a number: as written when it already does (it was quoted),
    digits alone when it is whole (an integer field takes them too), else the user's exponent form with the dot
    and sign YAML 1.1 needs (1e-4: 1.0e-4)."""
    if isinstance(yaml.safe_load(value.strip()), int | float):
        return value.strip()
    if number.is_integer() and abs(number) < 1e15:
        return str(int(number))
    match = _EXPONENT.fullmatch(value.strip())
    if match:
        sign, whole, fraction, exponent_sign, exponent = match.groups()
        spelling = f"{sign}{whole or '0'}.{fraction or '0'}e{exponent_sign or '+'}{exponent}"
        if yaml.safe_load(spelling) == number:
            return spelling
    return repr(number)


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: key path, bad value, what is allowed."""
    lines = [f"{source} is invalid:"]
    lines += [f"  - {_describe_error(e)}" for e in err.errors()]
    return "\n".join(lines)
