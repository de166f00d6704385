"""params.yaml's validation errors, as one line per problem: the key path, the bad value, what is allowed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
    return f"{loc} = {err['input']!r}: {msg}"


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: key path, bad value, what is allowed."""
    lines = [f"{source} is invalid:"]
    lines += [f"  - {_describe_error(e)}" for e in err.errors()]
    return "\n".join(lines)
