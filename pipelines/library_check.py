"""The torch and transformers internals this package leans on, checked once, with a clear error where they moved.

The memory measurement subclasses torch's `MemTracker` and reads its private state, the non-finite step check
reads `GradScaler._found_inf_per_device`, and the causal LM's loss passes transformers a 2-D `logits_to_keep`.
They were checked on torch 2.13 and transformers 5.23 (pyproject's ranges start there); a version where one of
them is gone gets this error at the trial's start rather than a stack trace mid-run.
"""

from __future__ import annotations

import inspect

CHECKED_ON = "torch 2.13 and transformers 5.23"


def missing_internals() -> list[str]:
    """The internals that this torch or transformers lacks (empty when all are there)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    missing = [
        f"torch MemTracker.{name}"
        for name in ("_update_peak_stats", "_track_module_params_and_buffers", "track_external", "reset_mod_stats")
        if not hasattr(MemTracker, name)
    ]
    from torch.distributed._tools import mod_tracker

    if not hasattr(mod_tracker, "register_multi_grad_hook"):  # wrapped to remove its hooks (train/memory.py)
        missing.append("torch mod_tracker.register_multi_grad_hook")
    if not hasattr(torch.amp.GradScaler, "_found_inf_per_device"):
        missing.append("torch GradScaler._found_inf_per_device")
    from transformers import LlamaForCausalLM

    if "logits_to_keep" not in inspect.signature(LlamaForCausalLM.forward).parameters:
        missing.append("transformers' logits_to_keep argument of the causal LMs' forward")
    return missing


def check_library_internals() -> None:
    """Raise a clear error naming what is missing and the versions it was checked on; nothing when all is there."""
    missing = missing_internals()
    if missing:
        import torch
        import transformers

        from pipelines.errors import UserError

        raise UserError(
            f"this torch ({torch.__version__}) or transformers ({transformers.__version__}) lacks what pipelines "
            f"relies on: {', '.join(missing)}; it was checked on {CHECKED_ON}: pip install 'torch>=2.13' "
            "'transformers>=5.23,<6'"
        )
