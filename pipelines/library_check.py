"""The torch, transformers and Ray internals this package leans on, checked once, with a clear error where they moved.

The memory measurement subclasses torch's `MemTracker` and reads its private state, the non-finite step check
reads `GradScaler._found_inf_per_device`, the causal LM's loss passes transformers a 2-D `logits_to_keep`, and a
distributed trial trims Ray Train's default callbacks. They were checked on torch 2.13, transformers 5.23 to 5.24
and Ray 2.60 (pyproject bounds both to the versions tested; moving a
bound: docs/how-to/move-a-version-bound.md). This check is the backstop for an install that bypassed the bounds: a
version where one of them is gone gets this error from the train stage (`pipelines.runtime.check_runtime`), before
any run opens, rather than a stack trace mid-run.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

CHECKED_ON = "torch 2.13, transformers 5.23 to 5.24 and Ray 2.60"


def missing_internals() -> list[str]:
    """The internals that this torch, transformers or Ray lacks (empty when all are there)."""
    import torch

    names = ("_update_peak_stats", "_track_module_params_and_buffers", "track_external", "reset_mod_stats")
    missing = [f"torch MemTracker.{name}" for name in names if not _defines(_MEM_TRACKER, name, "MemTracker")]
    if not _defines(_MOD_TRACKER, "register_multi_grad_hook"):  # wrapped to remove its hooks (train/memory.py)
        missing.append("torch mod_tracker.register_multi_grad_hook")
    if not hasattr(torch.amp.GradScaler, "_found_inf_per_device"):
        missing.append("torch GradScaler._found_inf_per_device")
    if not _llama_forward_takes_logits_to_keep():
        missing.append("transformers' logits_to_keep argument of the causal LMs' forward")
    missing += [f"ray {owner or module.rsplit('.', 1)[1]}.{name}" for module, name, owner in _RAY_TRAIN
                if not _defines(module, name, owner)]  # fmt: skip
    if "getLogger(__file__)" not in _source(_RAY_TRAIN_CONTEXT):  # quieted by that name (trials/distributed.py)
        missing.append("ray train's report logger, named after its file")
    return missing


_MEM_TRACKER = "torch.distributed._tools.mem_tracker"
_MOD_TRACKER = "torch.distributed._tools.mod_tracker"
_LLAMA = "transformers.models.llama.modeling_llama"
# Ray Train's internals that a distributed trial uses (pipelines/trials/distributed.py): the trainer's default
# callbacks, less the placement group cleaner where no State API answers; the worker group's start failures.
_RAY_TRAIN = (("ray.train.v2.api.data_parallel_trainer", "_create_default_callbacks", "DataParallelTrainer"),
              ("ray.train.v2._internal.callbacks.placement_group_callback", "PlacementGroupCleanerCallback", None),
              ("ray.train.v2._internal.exceptions", "WorkerGroupStartupFailedError", None))  # fmt: skip
_RAY_TRAIN_CONTEXT = "ray.train.v2._internal.execution.context"


# A module already imported is asked directly; one not imported is read as source text instead. Importing torch's
# memory tools and transformers' Llama only to look costs about 3 s, and the train stage's driver, which checks
# before any run opens, uses neither (its trials do). Either way a version that moved them is named here.
def _defines(module: str, name: str, owner: str | None = None) -> bool:
    if module in sys.modules:
        loaded = sys.modules[module]
        return hasattr(getattr(loaded, owner) if owner else loaded, name)
    return re.search(rf"\b{name}\b" if owner is None else rf"def {name}\(", _source(module)) is not None


def _llama_forward_takes_logits_to_keep() -> bool:
    if _LLAMA in sys.modules:
        forward = sys.modules[_LLAMA].LlamaForCausalLM.forward
        return "logits_to_keep" in inspect.signature(forward).parameters
    found = re.search(r"class LlamaForCausalLM\b.*?def forward\((.*?)\)\s*->", _source(_LLAMA), re.S)
    return found is not None and "logits_to_keep" in found.group(1)


def _source(module: str) -> str:
    # Found from the top-level package's folder: find_spec of a submodule would import its parent packages.
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    path = Path(spec.origin).parent.joinpath(*rest).with_suffix(".py") if spec and spec.origin else None
    return path.read_text(encoding="utf-8") if path and path.is_file() else ""


def check_library_internals() -> None:
    """Raise a clear error naming what is missing and the versions it was checked on; nothing when all is there."""
    missing = missing_internals()
    if missing:
        import torch
        import transformers

        from pipelines.errors import UserError

        raise UserError(
            f"this torch ({torch.__version__}) or transformers ({transformers.__version__}) lacks what pipelines "
            f"relies on: {', '.join(missing)}; it was checked on {CHECKED_ON}: pip install "
            f"'{declared('torch')}' '{declared('transformers')}' (pyproject's bounds; moving one: "
            "docs/how-to/move-a-version-bound.md)"
        )


def declared(distribution: str) -> str:
    """This package's declared requirement on `distribution` (its bounds), as pip takes it: 'torch>=2.13,<2.14'."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        found = [r.split(";")[0].strip() for r in requires("pipelines") or [] if re.match(rf"{distribution}\b", r)]
    except PackageNotFoundError:  # run from a source tree that was never installed
        found = []
    return found[0] if found else distribution


if __name__ == "__main__":  # `python -m pipelines.library_check`: docs/how-to/move-a-version-bound.md, step 2
    import torch
    import transformers

    gone = missing_internals()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}: "
          + (f"missing {', '.join(gone)}" if gone else "every internal pipelines relies on is there"))  # fmt: skip
    sys.exit(1 if gone else 0)
