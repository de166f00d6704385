"""A hub model id that can't be fetched fails at once, in one line naming the key and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.errors import UserError
from pipelines.model import resolve_model_name
from pipelines.params import ModelParams


def hub_model(default_params, name: str = "someone/not-cached-model") -> ModelParams:
    return default_params.model.model_copy(update={"name_or_path": name})


def test_offline_mode_names_the_key_offline_mode_and_a_local_folder(default_params, monkeypatch, tmp_path: Path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    expected = r"model.name_or_path = 'someone/not-cached-model': .*offline mode is set \(HF_HUB_OFFLINE\); point"
    with pytest.raises(UserError, match=expected + " model.name_or_path at a local folder"):
        resolve_model_name(hub_model(default_params), tmp_path)


def test_an_unreachable_hub_fails_without_retrying(default_params, monkeypatch, tmp_path: Path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(UserError, match=r"the hub \(http://127.0.0.1:9\) cannot be reached"):
        resolve_model_name(hub_model(default_params), tmp_path)


def test_a_local_folder_needs_no_hub(default_params, monkeypatch, tmp_path: Path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "my-model").mkdir()
    assert resolve_model_name(hub_model(default_params, "my-model"), tmp_path) == str(tmp_path / "my-model")
