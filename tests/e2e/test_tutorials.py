"""The tutorials' commands run as written, on their own data, and give the result the tutorial states."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import git_env
from tests.e2e.test_readme import OWN_DATA_BLOCKS, SMOLLM2_BLOCK, command_blocks
from tests.pipelines.test_gguf_model import smollm2_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_the_causal_lm_tutorials_smollm2_block_as_written_answers_half_its_questions(project_copy: Path):
    smollm2_folder()  # skips with the reason when the wheel is not installed (.ci/run installs it)
    (block,) = [b for _, b in command_blocks() if SMOLLM2_BLOCK in b]
    script = "\n".join(line for line in block.splitlines() if not line.startswith("pip install"))  # installed
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=project_copy, env=git_env(),
                          capture_output=True, text=True, timeout=1100)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    evaluate = json.loads((project_copy / "metrics/evaluate.json").read_text())
    # The tutorial says this bound: on 120 rows, the exact-match interval starts above 25% (a model that learned
    # nothing scores 0%).
    assert evaluate["test_rows"] == 120 and evaluate["test_exact_match_ci_low"] > 0.25, evaluate
    tokenize = json.loads((project_copy / "metrics/tokenize.json").read_text())
    assert tokenize["train"]["truncated_fraction"] <= 0.05  # data.max_length 96 keeps the rows whole


@pytest.mark.parametrize("marker", OWN_DATA_BLOCKS)
def test_the_own_data_blocks_fine_tune_alpaca_and_sharegpt_rows_through_params_alone(project_copy: Path, marker):
    if "sharegpt" in marker:
        smollm2_folder()  # the ShareGPT block needs a chat template: SmolLM2's (skips, saying so, without its wheel)
    (block,) = [b for _, b in command_blocks() if marker in b]
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=project_copy, env=git_env(),
                          capture_output=True, text=True, timeout=1100)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    evaluate = json.loads((project_copy / "metrics/evaluate.json").read_text())
    assert evaluate["test_rows"] > 0 and "test_exact_match" in evaluate
    predictions = (project_copy / "predictions/test.csv").read_text()
    if "alpaca" in marker:  # the template's sections, the Input one only where a row has input
        import yaml

        params = yaml.safe_load((project_copy / "params.yaml").read_text())
        assert params["data"]["prompt_template"].startswith("### Instruction:\n{instruction}\n\n### Input:")
        assert evaluate["test_rows"] == 80  # 20% of 400 rows
    assert predictions.count("\n") >= evaluate["test_rows"]
