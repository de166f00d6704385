"""A number that YAML 1.1 reads as a string (`lr: 1e-4`) is refused naming the rule and the spelling that works, and
params.yaml's header points at the params reference that exists (issue 62)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipelines.params import ParamsError, load_params, parse_params
from tests.conftest import REPO_ROOT

RULE = (
    "params.yaml is read as YAML 1.1, where {value} is a string, not a number (a number with an exponent needs a dot "
    "in the mantissa and a sign in the exponent); write {spelling}"
)


def params_with(tmp_path: Path, line: str) -> Path:
    """The repository's params.yaml with its top-level line for `line`'s key replaced by `line`, as a user edits it."""
    key = line.split(":", 1)[0]
    text, count = re.subn(rf"^{key}:.*$", line, (REPO_ROOT / "params.yaml").read_text(), flags=re.M)
    assert count == 1, key
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ParamsError) as info:
        load_params(path)
    return str(info.value)


@pytest.mark.parametrize(
    ("line", "value", "spelling"),
    [
        ("lr: 1e-4", "1e-4", "1.0e-4"),
        ("lr: 5E-5", "5E-5", "5.0e-5"),
        ("epochs: 1e1", "1e1", "10"),  # an integer field: digits
        ("memory_budget: 8e9", "8e9", "8000000000"),  # bytes: an integer too
    ],
)
def test_a_number_yaml_reads_as_a_string_names_the_rule_and_the_spelling_that_works(tmp_path, line, value, spelling):
    path = params_with(tmp_path, line)
    key = line.split(":", 1)[0]
    assert refusal(path) == f"{path} is invalid:\n  - {key} = {value!r}: " + RULE.format(value=value, spelling=spelling)
    # The spelling it suggests is read as the number meant (YAML 1.1 reads it as a number: no refusal).
    fixed = load_params(params_with(tmp_path, f"{key}: {spelling}"))
    assert getattr(fixed, key) == float(value)


def test_a_quoted_number_is_named_as_a_string_and_a_word_field_keeps_its_own_message(tmp_path):
    path = params_with(tmp_path, "lr: '0.0003'")
    assert refusal(path).endswith("  - lr = '0.0003': a string, not a number (quoted?); write 0.0003 without quotes")
    message = refusal(params_with(tmp_path, "optim: 1e-4"))
    assert "optim = '1e-4': Input should be 'adamw'" in message and "YAML 1.1" not in message


def test_a_variant_and_a_search_space_name_the_rule_too():
    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    raw["tune"]["variants"] = yaml.safe_load("{small: {lr: 1e-4}}")
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    assert "tune.variants.small: lr = '1e-4': " + RULE.format(value="1e-4", spelling="1.0e-4") in str(info.value)
    raw["tune"]["variants"] = {}
    raw["tune"]["search_space"] = yaml.safe_load("{lr: {type: choice, values: [1.0e-3, 3e-4]}}")
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    assert "tune.search_space.lr: lr = '3e-4': " + RULE.format(value="3e-4", spelling="3.0e-4") in str(info.value)


def test_the_params_yaml_header_points_at_the_params_reference():
    header = [line for line in (REPO_ROOT / "params.yaml").read_text().splitlines() if line.startswith("#")]
    reference = next(line for line in header if line.startswith("# Reference:"))
    page = re.search(r"docs/reference/\S+\.md", reference)
    assert page, reference
    assert (REPO_ROOT / page.group()).read_text().startswith("# Reference: params")
