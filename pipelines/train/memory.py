"""Memory accounting that works without a GPU.

On CUDA the allocator's peak counters are the truth. On CPU, peak RSS alone hides the
effect of checkpointing or Adafactor under the process's baseline, so we also count
exact bytes: parameters, gradients, optimizer state, and the activations autograd
saves for backward (through saved-tensor hooks).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by `tensors` (each counted once per storage)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters."""
    return tensor_bytes(model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients currently held (zero after `zero_grad(set_to_none=True)`)."""
    return tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (moments, factors), excluding scalar steps."""
    return tensor_bytes(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.numel() > 1
    )


def peak_rss_bytes() -> int:
    """This process's peak resident set size."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class SavedActivationMeter:
    """Counts the bytes autograd saves for backward during one forward pass; keeps the peak."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._current = 0
        self._seen: set[int] = set()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Parameters are saved by reference, not copied: they are counted as parameters.
        if not isinstance(tensor, nn.Parameter):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self._current += storage.nbytes()
        return tensor

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Count saved tensors inside the block (wrap one forward pass)."""
        self._current, self._seen = 0, set()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield
        self.peak_bytes = max(self.peak_bytes, self._current)
        self._seen = set()
