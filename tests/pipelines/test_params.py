"""The schema: defaults validate, and every kind of bad input is named clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipelines.params import ParamsError, apply_overrides, flatten_params, load_params, parse_params
from pipelines.params.docs import BEGIN, END, PAGE, reference_markdown
from tests.conftest import REPO_ROOT, tiny_params


def raw_defaults() -> dict:
    return yaml.safe_load((REPO_ROOT / "params.yaml").read_text())


def error_of(raw: dict) -> str:
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    return str(info.value)


def test_repository_params_validate(default_params):
    assert default_params.optim == "adamw"
    assert default_params.tracking.uri == "sqlite:///mlflow.db"


def test_unknown_optimizer_names_key_value_and_allowed():
    raw = raw_defaults() | {"optim": "adafator"}
    message = error_of(raw)
    assert "optim = 'adafator'" in message
    for allowed in ("adamw", "adafactor", "adamw_8bit", "sgd"):
        assert allowed in message


def test_negative_batch_size_is_rejected():
    message = error_of(raw_defaults() | {"batch_size": -4})
    assert "batch_size = -4" in message and "greater than 0" in message


def test_unknown_key_is_an_error_not_ignored():
    raw = raw_defaults()
    raw["data"]["max_lenght"] = 32
    assert "data.max_lenght: unknown key" in error_of(raw)


def test_missing_key_is_named():
    raw = raw_defaults()
    del raw["tracking"]["experiment"]
    assert "tracking.experiment: required key is missing" in error_of(raw)


def test_wrong_type_names_key():
    raw = raw_defaults()
    raw["data"]["bucketing"] = "sometimes"
    assert "data.bucketing = 'sometimes'" in error_of(raw)


def test_cross_field_rule_names_both_keys():
    raw = raw_defaults()
    raw["model"]["config"]["hidden_size"] = 66
    raw["model"]["config"]["num_attention_heads"] = 4
    message = error_of(raw)
    assert "hidden_size (66)" in message and "num_attention_heads (4)" in message


def test_every_problem_is_reported_at_once():
    message = error_of(raw_defaults() | {"optim": "x", "lr": 5.0, "epochs": 0})
    assert "optim = 'x'" in message and "lr = 5.0" in message and "epochs = 0" in message


def test_bad_variant_is_rejected_at_load_with_its_name():
    raw = raw_defaults()
    raw["tune"]["variants"] = {"ok": {"precision": "bf16"}, "broken": {"optim": "adam"}}
    message = error_of(raw)
    assert "tune.variants.broken" in message and "optim = 'adam'" in message


def test_variant_cannot_override_tracking():
    raw = raw_defaults()
    raw["tune"]["variants"] = {"v": {"tracking.uri": "sqlite:///other.db"}}
    assert "cannot be overridden per trial" in error_of(raw)


def test_apply_overrides_by_dotted_key(default_params):
    changed = apply_overrides(default_params, {"optim": "adafactor", "data.max_length": 32})
    assert changed.optim == "adafactor" and changed.data.max_length == 32
    assert default_params.optim == "adamw"  # the original is untouched


def test_override_of_unknown_key_fails(default_params):
    with pytest.raises(ParamsError, match="data.nope: unknown key"):
        apply_overrides(default_params, {"data.nope": 1})


def test_flatten_uses_dotted_keys_and_top_level_optim(default_params):
    flat = flatten_params(default_params)
    assert flat["optim"] == "adamw"
    assert flat["data.max_length"] == default_params.data.max_length
    assert flat["model.config.hidden_size"] == default_params.model.config.hidden_size


def test_load_params_errors_name_the_file(tmp_path: Path):
    with pytest.raises(ParamsError, match="file not found"):
        load_params(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [unclosed\n")
    with pytest.raises(ParamsError, match="bad.yaml: not valid YAML"):
        load_params(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ParamsError, match="top level must be a mapping"):
        load_params(scalar)


def test_params_reference_page_matches_schema(default_params):
    page = (REPO_ROOT / PAGE).read_text(encoding="utf-8")
    section = page.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert section == reference_markdown(default_params), f"{PAGE} is stale: run `python -m pipelines.params.docs`"
    for key in flatten_params(default_params):
        assert f"| `{key}` |" in section


def test_train_stage_re_runs_when_any_training_param_changes():
    """Every top-level param is a dependency of the train stage in dvc.yaml (data: the keys training reads)."""
    import yaml

    from pipelines.params import Params

    listed = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]["train"]["params"]
    top_level = {key.split(".")[0] for key in listed}
    assert set(Params.model_fields) - {"data"} <= top_level, set(Params.model_fields) - top_level - {"data"}
    for key in ("data.bucketing", "data.pad_to_multiple_of", "data.max_length", "data.max_tokens_per_batch"):
        assert key in listed


FSDP_KNOBS = {"reshard_after_forward": True, "cpu_offload": False}  # the whole distributed section, as params.yaml


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"device": "cpu", "distributed": {"num_workers": 2, "use_gpu": True, "strategy": "ddp", **FSDP_KNOBS}},
            ("distributed.use_gpu", "device: cpu"),
        ),
        (
            {
                "batch_size": "auto",
                "effective_batch_size": 32,
                "distributed": {"num_workers": 2, "use_gpu": None, "strategy": "ddp", **FSDP_KNOBS},
            },
            ("batch_size: auto", "distributed.num_workers"),
        ),
        (
            {"distributed": {"num_workers": 0, "use_gpu": None, "strategy": "ddp", **FSDP_KNOBS}},
            ("distributed.num_workers = 0",),
        ),
    ],
)
def test_distributed_combinations_name_both_keys(changes, expected):
    message = error_of(raw_defaults() | changes)
    for part in expected:
        assert part in message, message


def test_distributed_settings_cannot_vary_per_trial():
    raw = raw_defaults()
    raw["tune"]["variants"] = {"two": {"distributed.num_workers": 2}}
    message = error_of(raw)
    assert "tune.variants.two" in message and "distributed.num_workers" in message and "shared" in message


@pytest.mark.parametrize(
    ("key", "value", "read"),
    [
        ("data.max_length", 32, "data.max_length"),
        ("data.source", "other.csv", "data.source"),
        ("model.name_or_path", "./folder", "model.name_or_path"),
        ("model.config.vocab_size", 500, "model.config.vocab_size"),
        ("data.generator.num_rows", 200, "data.generator"),
        ("seed", 7, "seed"),
        ("model", {"name_or_path": None}, "model.name_or_path"),
    ],
)
def test_variants_and_search_space_cannot_change_what_tokenize_read(key, value, read):
    raw = raw_defaults()
    raw["tune"]["variants"] = {"short": {key: value}}
    message = error_of(raw)
    assert "tune.variants.short" in message and f"key {key!r}" in message and "dvc exp run -S" in message
    assert f"changes {read!r}" in message
    raw = raw_defaults()
    raw["tune"]["search_space"] = {key: {"type": "choice", "values": [value]}}
    assert "tune.search_space" in error_of(raw) and "tokenize stage" in error_of(raw)


def test_training_only_data_keys_may_vary_per_variant():
    raw = raw_defaults()
    raw["tune"]["variants"] = {"fixed": {"data.bucketing": False, "data.pad_to_multiple_of": None}}
    parse_params(raw)  # batching is read by training: allowed


def test_tf32_and_padding_resolve_per_device(default_params):
    import torch

    from pipelines.runtime import resolve_pad_multiple, resolve_tf32

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_params.tf32 == "auto" and default_params.data.pad_to_multiple_of == "auto"
    assert resolve_tf32(default_params, "fp32", cuda) is False  # the fp32 baseline is real fp32
    assert resolve_tf32(default_params, "bf16", cuda) is True and resolve_tf32(default_params, "fp16", cuda) is True
    assert resolve_tf32(default_params, "bf16", cpu) is False
    assert resolve_tf32(tiny_params(default_params, tf32=True), "fp32", cuda) is True
    assert resolve_pad_multiple(default_params, cuda) == 8 and resolve_pad_multiple(default_params, cpu) is None
    assert resolve_pad_multiple(tiny_params(default_params, **{"data.pad_to_multiple_of": 16}), cpu) == 16


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"data.response_column": None}, ["data.prompt_column and data.response_column together", "'prompt'"]),
        ({"data.text_column": ["a", "b"]}, ["one data.text_column"]),
        ({"model.gguf_file": "x.gguf"}, ["model.gguf_file", "model.name_or_path"]),
        ({"adapter.type": "dora"}, ["adapter.type = 'dora'", "'qlora'"]),
    ],
)
def test_causal_lm_data_and_model_rules_name_their_keys(default_params, changes, expected):
    with pytest.raises(ParamsError) as err:
        tiny_params(default_params, task="causal_lm", **changes)
    for text in expected:
        assert text in str(err.value), str(err.value)


@pytest.mark.parametrize("task", ["classification", "seq2seq"])
def test_packing_is_for_causal_lm_only(default_params, task):
    with pytest.raises(ParamsError, match=f"data.packing: true packs causal-LM examples; task: {task}"):
        tiny_params(default_params, task=task, **{"data.packing": True})
    # A variant may turn it on (it is read by the train stage, not the tokenize stage).
    tiny_params(default_params, task="causal_lm", **{"tune.variants": {"packed": {"data.packing": True}}})


def test_task_and_remote_code_cannot_vary_per_trial(default_params):
    for key in ("task", "model.trust_remote_code", "model.gguf_file", "data.prompt_column"):
        with pytest.raises(ParamsError, match="which the tokenize stage reads"):
            tiny_params(default_params, **{"tune.variants": {"x": {key: None}}})


def test_auto_objective_follows_the_task(default_params):
    from pipelines.tasks import tune_objective

    assert tune_objective(default_params) == ("val_accuracy", "max")
    assert tune_objective(tiny_params(default_params, task="causal_lm")) == ("val_loss", "min")
    lm = {"task": "causal_lm", "tune.metric": "val_token_accuracy"}
    assert tune_objective(tiny_params(default_params, **lm)) == ("val_token_accuracy", "max")
    assert tune_objective(tiny_params(default_params, **{"tune.metric": "val_loss", "tune.mode": "max"})) == (
        "val_loss",
        "max",
    )


def test_a_tune_metric_the_task_does_not_report_is_refused_naming_those_it_does(default_params):
    from pipelines.errors import UserError
    from pipelines.tasks import tune_objective

    with pytest.raises(UserError, match=r"tune.metric = 'val_acc': task classification reports val_loss, "
                                         r"val_accuracy at every epoch"):  # fmt: skip
        tune_objective(tiny_params(default_params, **{"tune.metric": "val_acc"}))


def test_qlora_is_refused_without_cuda_with_a_clear_message(default_params):
    from pipelines.errors import UserError
    from pipelines.runtime import check_runtime

    with pytest.raises(ParamsError, match="adapter.type = 'qlora' needs CUDA.*use adapter.type: lora"):
        tiny_params(default_params, device="cpu", **{"adapter.type": "qlora"})
    with pytest.raises(ParamsError, match="adapter.merge: true with adapter.type: qlora"):
        tiny_params(default_params, **{"adapter.type": "qlora", "adapter.merge": True})
    auto = tiny_params(default_params, device="auto", **{"adapter.type": "qlora"})  # valid: CUDA may be there
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="needs CUDA.*found no GPU here"):
            check_runtime(auto)
