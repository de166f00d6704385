"""The tasks the pipeline fine-tunes for, by the `task` param (see pipelines.tasks.base.Task)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.tasks.base import Task


def get_task(name: str) -> Task:
    """The task named by the `task` param (its module is imported on first use)."""
    if name == "classification":
        from pipelines.tasks.classification import ClassificationTask

        return ClassificationTask()
    if name == "causal_lm":
        from pipelines.tasks.causal_lm import CausalLmTask

        return CausalLmTask()
    if name == "seq2seq":
        from pipelines.tasks.seq2seq import Seq2SeqTask

        return Seq2SeqTask()
    raise ValueError(f"task = {name!r} is not known; choose classification, causal_lm or seq2seq")
