"""Security rules of the package: no code execution or unpickling of user input, safe loading and saving."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT

SOURCES = sorted((REPO_ROOT / "pipelines").rglob("*.py")) + sorted((REPO_ROOT / "stages").rglob("*.py"))


def test_no_eval_exec_or_pickle_in_the_package():
    for path in SOURCES:
        text = path.read_text()
        assert not re.search(r"(?<![\w.])(eval|exec)\(", text), path
        assert "import pickle" not in text and "pickle.load" not in text, path
        assert "yaml.load(" not in text and "yaml.unsafe_load" not in text, path  # safe_load only


def test_torch_load_is_weights_only_and_models_are_saved_as_safetensors():
    loads = [(p, line) for p in SOURCES for line in p.read_text().splitlines() if "torch.load(" in line]
    assert loads and all("weights_only=True" in line for _, line in loads), loads
    saves = [line for p in SOURCES for line in p.read_text().splitlines() if "model.save_pretrained(" in line]
    assert saves and all("safe_serialization=True" in line for line in saves), saves


def test_remote_code_is_off_by_default_and_docs_bind_servers_to_loopback(default_params):
    assert default_params.model.trust_remote_code is False
    docs = "\n".join(p.read_text() for p in [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])
    for command in re.findall(r"mlflow (?:ui|server) --[^\n`]*", docs):
        # Loopback, or (the cluster section) a private address the reader fills in; never all interfaces.
        assert "--host 127.0.0.1" in command or "--host <private-ip>" in command, command
        assert "--host 0.0.0.0" not in command, command
