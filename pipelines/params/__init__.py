"""The one strict schema for `params.yaml`, and how it is read.

Every stage loads the whole file through `load_params` before doing any work, so a typo or a bad value fails
in about a second with the key path, the bad value and what is allowed. The schema holds types, bounds and
rules; the values themselves live only in `params.yaml`, so every field is required. The package imports
only pydantic and PyYAML on purpose: it must not pay for torch or Ray before it has said no.

    fields      the field types (`auto`-or-value, byte sizes) and the strict base model
    sections    data, model, adapter, eval, distributed, tracking
    tune        the tune section and its search-space dimensions
    schema      `Params`; rules: its cross-field rules as a table
    stage_keys  which params each DVC stage reads (dvc.yaml is checked against it)
    errors, loading, overrides: reading and overriding params
"""

from pipelines.optimizer_registry import FSDP_OPTIMIZERS
from pipelines.params.errors import ParamsError, format_validation_error
from pipelines.params.fields import (
    GENERATOR_SOURCE,
    AdapterType,
    BatchSize,
    Bytes,
    DeviceName,
    LearningRate,
    LrSchedule,
    Optimizer,
    Precision,
    StrictModel,
    TaskName,
    parse_bytes,
)
from pipelines.params.loading import load_params, parse_params, ray_address, resolve_repo_root
from pipelines.params.overrides import apply_overrides, flatten_params, set_dotted
from pipelines.params.schema import Params
from pipelines.params.sections import (
    AdapterParams,
    DataParams,
    DistributedParams,
    EvalParams,
    GeneratorParams,
    LrRangeTestParams,
    ModelConfigParams,
    ModelParams,
    TrackingParams,
)
from pipelines.params.stage_keys import STAGE_PARAMS, TOKENIZE_STAGE_KEYS, tokenize_stage_key
from pipelines.params.tune import (
    ChoiceDim,
    GridDim,
    LogUniformDim,
    RandIntDim,
    ResourcesParams,
    SearchDim,
    TuneParams,
    UniformDim,
    candidate_values,
)

__all__ = [
    "FSDP_OPTIMIZERS", "GENERATOR_SOURCE", "STAGE_PARAMS", "TOKENIZE_STAGE_KEYS",
    "AdapterParams", "AdapterType", "BatchSize", "Bytes", "ChoiceDim", "DataParams", "DeviceName",
    "DistributedParams", "EvalParams", "GeneratorParams", "GridDim", "LearningRate", "LogUniformDim",
    "LrRangeTestParams", "LrSchedule", "ModelConfigParams", "ModelParams", "Optimizer", "Params", "ParamsError",
    "Precision", "RandIntDim", "ResourcesParams", "SearchDim", "StrictModel", "TaskName", "TrackingParams",
    "TuneParams", "UniformDim", "apply_overrides", "candidate_values", "flatten_params", "format_validation_error",
    "load_params", "parse_bytes", "parse_params", "ray_address", "resolve_repo_root", "set_dotted",
    "tokenize_stage_key",
]  # fmt: skip
