"""Formats users bring, through params alone: Alpaca's prompt template over several columns, ShareGPT's turns."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pipelines.data.formats import as_messages, render_prompt
from pipelines.data.sources import DataError, load_splits
from pipelines.params import ParamsError
from pipelines.tasks import get_task
from tests.conftest import tiny_params

CAUSAL = get_task("causal_lm")
ALPACA = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def test_a_paragraph_whose_fields_are_all_empty_is_left_out():
    # Axolotl's Alpaca prompt has no Input section where the input is empty; written out by hand here.
    assert render_prompt(ALPACA, {"instruction": "Add 2 and 3.", "input": ""}) == (
        "### Instruction:\nAdd 2 and 3.\n\n### Response:\n"
    )
    assert render_prompt(ALPACA, {"instruction": "Add.", "input": "2, 3"}) == (
        "### Instruction:\nAdd.\n\n### Input:\n2, 3\n\n### Response:\n"
    )
    assert render_prompt("{instruction}\n\n{input}", {"instruction": "Hi", "input": None}) == "Hi"
    assert render_prompt("{instruction}\n\n{input}", {"instruction": "Hi", "input": float("nan")}) == "Hi"


def test_alpaca_jsonl_becomes_prompt_and_response_rows(tmp_path, default_params):
    rows = [{"instruction": f"Say {i}.", "input": "" if i % 2 else f"n={i}", "output": str(i)} for i in range(40)]
    (tmp_path / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = tiny_params(default_params, **{"task": "causal_lm", "data.source": "alpaca.jsonl",
                                            "data.prompt_template": "{instruction}\n\n{input}",
                                            "data.prompt_column": None, "data.response_column": "output"})  # fmt: skip
    splits = load_splits(params.data, params.seed, tmp_path, CAUSAL)
    table = pd.concat(splits.values())
    by_response = dict(zip(table["response"], table["prompt"], strict=True))
    assert by_response["4"] == "Say 4.\n\nn=4" and by_response["5"] == "Say 5."


def test_the_schema_points_from_a_list_of_prompt_columns_to_the_template(default_params):
    with pytest.raises(ParamsError, match=r"takes one column; .* set data.prompt_template"):
        tiny_params(default_params, **{"data.prompt_column": ["instruction", "input"]})
    with pytest.raises(ParamsError, match=r"field \{0\} must be a column's name"):
        tiny_params(default_params, **{"data.prompt_template": "{0} and {1}"})


def test_sharegpt_turns_become_chat_messages():
    turns = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
             {"from": "gpt", "value": "Hello"}]  # fmt: skip
    assert as_messages(turns, "here", 0) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]  # fmt: skip
    with pytest.raises(DataError, match=r"here, row 4: ShareGPT speaker 'robot' is not one of"):
        as_messages([{"from": "robot", "value": "x"}], "here", 3)


def test_sharegpt_jsonl_loads_as_messages(tmp_path, default_params):
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(30)]  # fmt: skip
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = tiny_params(default_params, **{"task": "causal_lm", "data.source": "chats.jsonl",
                                            "data.messages_column": "conversations"})  # fmt: skip
    splits = load_splits(params.data, params.seed, tmp_path, CAUSAL)
    first = splits["train"]["messages"].iloc[0]
    assert [m["role"] for m in first] == ["user", "assistant"] and first[1]["content"].startswith("a")


def test_drop_empty_drops_empty_responses_of_a_causal_lm(tmp_path, default_params):
    rows = [{"prompt": f"p{i}", "response": "" if i in (3, 7) else f"r{i}"} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = tiny_params(default_params, **{"task": "causal_lm", "data.source": "d.jsonl"})
    with pytest.raises(DataError, match=r"empty 'response' in 2 rows: 4, 8, counted from 1; fill such rows"):
        load_splits(params.data, params.seed, tmp_path, CAUSAL)
    params = tiny_params(params, **{"data.drop_empty": True})
    splits = load_splits(params.data, params.seed, tmp_path, CAUSAL)
    assert sum(len(t) for t in splits.values()) == 38 and splits["train"].attrs["dropped_empty_rows"] == 2
