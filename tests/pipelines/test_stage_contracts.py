"""dvc.yaml agrees with the code: each stage lists the params its code reads and the code it runs.

The contract is declared once, in `pipelines.params.stage_keys.STAGE_PARAMS`; the code a stage runs is the
import closure of its entry point. A key read but not listed leaves an old result under a new experiment's
name (`data.packing` did: `dvc exp run -S data.packing=true` skipped train); code run but not listed leaves
an old result after a fix.
"""

from __future__ import annotations

import ast

import pytest
import yaml

from pipelines.params import STAGE_PARAMS, TOKENIZE_STAGE_KEYS, Params, flatten_params, load_params
from pipelines.params.stage_keys import WHOLE_FILE, covers
from tests.conftest import REPO_ROOT
from tests.import_graph import closure, module_file, parsed

STAGES = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]


def listed_params(stage: str) -> list[str]:
    """The keys a stage lists; a whole file (`- params.yaml:`, parsed as {file: None}) as the file's name."""
    return [next(iter(key)) if isinstance(key, dict) else str(key) for key in STAGES[stage].get("params", [])]


def test_the_validate_stage_depends_on_the_whole_params_file_and_runs_first():
    # A file dependency: any change re-runs it, and no knob becomes a `dvc exp show` column (DVC makes a column of
    # each param a stage lists; listing the whole file made one of every knob).
    assert STAGE_PARAMS["validate"] == (WHOLE_FILE,) and WHOLE_FILE in STAGES["validate"]["deps"]
    assert "params" not in STAGES["validate"]
    checked = STAGES["validate"]["outs"][0]
    assert next(iter(checked)) in STAGES["tokenize"]["deps"]  # tokenize, and so every later stage, runs after it


def test_dvc_yaml_lists_the_params_each_stage_declares():
    assert set(STAGES) == set(STAGE_PARAMS)
    for stage, declared in STAGE_PARAMS.items():
        listed = () if declared == (WHOLE_FILE,) else declared  # the whole file: a dependency, as the test above
        assert sorted(listed_params(stage)) == sorted(listed), stage


def test_every_key_of_params_yaml_is_read_by_a_stage_that_lists_it():
    flat = flatten_params(load_params(REPO_ROOT / "params.yaml"))
    readers = [keys for stage, keys in STAGE_PARAMS.items() if stage != "validate"]  # it lists the file, reads none
    unread = [key for key in flat if not any(covers(k, key) for keys in readers for k in keys)]
    assert unread == []


@pytest.mark.parametrize("stage", sorted(STAGE_PARAMS))
def test_each_stage_lists_every_file_of_ours_it_runs(stage):
    deps = [str(dep).rstrip("/") for dep in STAGES[stage]["deps"]]
    ran = closure([f"stages.{stage}"])
    files = sorted(
        str(module_file(m).relative_to(REPO_ROOT)) for m in ran if module_file(m).read_text().strip()
    )  # an empty __init__.py runs nothing
    unlisted = [f for f in files if not any(f == dep or f.startswith(dep + "/") for dep in deps)]
    assert unlisted == [], f"{stage}: add these to its deps in dvc.yaml"
    # And no dep on code of ours the stage never runs (it would re-run for nothing).
    code_deps = [dep for dep in deps if dep.startswith(("pipelines", "stages"))]
    stale = [dep for dep in code_deps if not any(f == dep or f.startswith(dep + "/") for f in files)]
    assert stale == [], f"{stage}: these deps are never run"


def params_read(modules: set[str]) -> set[str]:
    """Dotted params keys read as `<something>params.<section>.<key>` in the source of `modules`."""
    fields = set(flatten_params(load_params(REPO_ROOT / "params.yaml"))) | set(Params.model_fields)
    found: set[str] = set()
    for module in modules:
        tree = parsed(module)
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if id(node) in inner:  # part of a longer chain, read whole below
                continue
            chain: list[str] = []
            while isinstance(node, ast.Attribute):
                chain.insert(0, node.attr)
                node = node.value
            root = node.id if isinstance(node, ast.Name) else ""
            if not (root.endswith("params") and chain):
                continue
            key = ".".join(chain)
            while key and key not in fields:
                key = key.rpartition(".")[0]
            if key:
                found.add(key)
    return found


# Read in code the train stage imports but never runs for training.
NOT_READ_BY_TRAIN = {"eval.model_uri": "pipelines/tracking/mlflow_model.py: the evaluate stage's model download"}


def test_the_train_stage_lists_every_param_its_code_reads():
    read = params_read(closure(["stages.train"]))
    assert {"data.packing", "optim", "eval.model_uri"} <= read  # the scan sees what it must
    flat = flatten_params(load_params(REPO_ROOT / "params.yaml"))
    leaves = {leaf for key in read for leaf in flat if covers(key, leaf)}  # a section read whole: all its keys
    missing = sorted(
        key
        for key in leaves - set(NOT_READ_BY_TRAIN)
        if not any(covers(k, key) for k in STAGE_PARAMS["train"])
        and not any(covers(k, key) for k in TOKENIZE_STAGE_KEYS)  # these reach train as data/tokenized
    )
    assert missing == [], "the train stage reads these params but dvc.yaml does not re-run it when they change"
