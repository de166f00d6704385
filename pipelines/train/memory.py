"""Memory accounting that works without a GPU.

On CUDA the allocator's peak counters are the truth. On CPU, peak RSS is mostly the
libraries (~700 MB) and a lifetime high-water mark, so it hides what checkpointing or
Adafactor save. There the headline is the peak of the bytes torch allocates during a
training step, taken by PyTorch's own `MemTracker` (a dispatch mode that sees every
tensor, activations recomputed under checkpointing included), with the peak's breakdown
into parameters, gradients, optimizer state and activations. We also count exact bytes
of parameters, gradients and optimizer state from the tensors themselves, to check it.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by `tensors` (each counted once per storage)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):  # an FSDP shard: what this rank holds
            t = t.to_local()
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


_PROC_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def peak_rss_bytes() -> int:
    """This process's peak resident set size since the last `reset_peak_rss` (else since it started)."""
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0: `5 > /proc/self/clear_refs`); False where impossible.

    A trial that shares its process with an earlier one would otherwise inherit its high-water mark.
    """
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class MemoryAtPeak:
    """What torch had allocated at the peak of a training step, by kind (bytes)."""

    total: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    other: int
    activations_peak: int  # the activations' own high point in the step (not necessarily at the total's peak)

    def as_metrics(self) -> dict[str, float]:
        """`peak_train_memory_bytes`, its breakdown at that moment, and the activations' own peak, as metric names."""
        return {
            "peak_train_memory_bytes": float(self.total),
            "peak.param_bytes": float(self.parameters),
            "peak.grad_bytes": float(self.gradients),
            "peak.optimizer_state_bytes": float(self.optimizer_state),
            "peak.activation_bytes": float(self.activations),
            "peak.temp_bytes": float(self.temporaries),
            "peak_activation_bytes": float(self.activations_peak),
        }


_ACTIVATION = "Activation"  # MemTracker's name for the activation category (a str enum)


class _ResetPerMicroBatch:
    """MemTracker's per-module statistics must be cleared between forward passes (accumulation)."""

    def __init__(self, tracker: object) -> None:
        self.tracker = tracker

    @contextmanager
    def measure(self) -> Iterator[None]:
        yield
        self.tracker.reset_mod_stats()  # type: ignore[attr-defined]


class _NoHook:
    """Stands in for a gradient hook's handle where none can be registered (a frozen parameter)."""

    def remove(self) -> None:
        pass


def _frozen_aware_tracker() -> object:
    """torch's MemTracker, except that frozen parameters (LoRA's base) get no gradient hook, and no per-module peaks.

    MemTracker hooks every parameter's gradient, and `register_hook` raises on a tensor that
    requires none (torch 2.13). A frozen parameter has no gradient to watch, so it is marked as
    hooked with a no-op handle; its bytes are still counted as parameters.
    """
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):  # type: ignore[override]
            for param in module.parameters():
                if not param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state: object) -> None:  # type: ignore[override]
            # The whole step's peak only (the tail of torch's own method). Its per-module peaks, which
            # nothing here reads, walk every module on every op: on SmolLM2-135M with LoRA, 26,555 ops x
            # ~500 modules took 77 s of a 107 s plan, and as long again in the trial's tracked step.
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    self._peak_mem_snap[device] = deepcopy(snapshot)

    return FrozenAwareMemTracker()


def restart_peak(tracker: Any) -> int:
    """The peak total a MemTracker saw so far (over its devices), then its peak restarted from the current total: what
    it reports at the end is then the peak of what followed (a phase's own, e.g. generation's last step)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    seen = max(tracker._peak_mem.values(), default=0)
    for device, snapshot in tracker._curr_mem_snap.items():
        tracker._peak_mem[device] = snapshot[_TOTAL_KEY]
        tracker._peak_mem_snap[device] = deepcopy(snapshot)
    return int(seen)


@contextmanager
def _module_grad_hooks_removed_after() -> Iterator[None]:
    """Remove the gradient hooks MemTracker's module tracker puts on every module's inputs and outputs, on exit.

    torch's ModTracker drops the handles of its `register_multi_grad_hook` calls, and each hook's closure holds
    the graph nodes it is registered on: a reference cycle through C++ that the garbage collector cannot see. So
    the tracked step's graph, and through its AccumulateGrad nodes every parameter, outlived the trial (measured
    on an H100: each BERT-base configuration left its 418 MB of weights allocated, and the next trial's peak
    counted them). Removing the hooks breaks the cycle (`tests/pipelines/train/test_memory_release.py`).
    Real tensors only: a memory plan's fake step holds no storage, and freeing its graph early crashed a later
    plan inside FakeTensorMode's cache (a segmentation fault in `tests/pipelines/test_plan_targets.py`).
    """
    from torch.distributed._tools import mod_tracker

    register = mod_tracker.register_multi_grad_hook
    handles: list[Any] = []

    def register_and_keep(*args: Any, **kwargs: Any) -> Any:
        handles.append(register(*args, **kwargs))
        return handles[-1]

    mod_tracker.register_multi_grad_hook = register_and_keep
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()


def track_training_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, run_step: Callable[[object], None]
) -> MemoryAtPeak:
    """Run `run_step(per_micro_batch_meter)` twice, the second time under PyTorch's MemTracker; return its peak.

    The first, untracked, optimizer step creates the optimizer state, so the tracked one is the
    steady state every later step repeats (state alive while activations are). The caller restores
    the weights afterwards. Where the optimizer's fresh state can be made without a step
    (`pipelines.train.optim.create_fresh_state`), the trainer tracks its own warm-up step instead.
    """
    run_step(None)
    return track_step(model, optimizer, device, run_step)


def track_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, run_step: Callable[[object], None],
    watch: Callable[[dict[str, int]], None] | None = None,
) -> MemoryAtPeak:  # fmt: skip
    """Run `run_step(per_micro_batch_meter)` once under PyTorch's MemTracker; return its peak and breakdown.

    The optimizer state should exist already: only then is the step the steady state every later step
    repeats. Only one step is tracked because the tracker, a Python dispatch mode, slows the step it
    watches. Hand-written glue only: the counting is torch's own. `watch`, where given, sees the running
    bytes by kind after every op (the memory plan's timeline: one FSDP worker's peak, `resolve.memory_plan`).
    """
    tracker = _frozen_aware_tracker()
    tracker.track_external(model, optimizer)
    # The tracker keeps the snapshot at the total's peak only; the activations' own high point can come
    # earlier (under checkpointing and accumulation the total peaks in the optimizer step, activations
    # long freed), so it is read after every op too, from the tracker's running snapshot.
    activations_peak = 0
    update_peak = tracker._update_peak_stats

    def update_and_watch_activations(state: object) -> None:
        nonlocal activations_peak
        update_peak(state)
        for kinds in tracker._curr_mem_snap.values():
            activations_peak = max(activations_peak, sum(v for k, v in kinds.items() if k == _ACTIVATION))
            if watch is not None:
                watch({getattr(k, "value", k): int(v) for k, v in kinds.items()})

    tracker._update_peak_stats = update_and_watch_activations  # type: ignore[method-assign]
    release = _module_grad_hooks_removed_after() if active_fake_mode() is None else nullcontext()
    with release, tracker:
        run_step(_ResetPerMicroBatch(tracker))
    snapshot = tracker.get_tracker_snapshot("peak")
    kinds = snapshot.get(device) or snapshot.get(torch.device(device.type)) or next(iter(snapshot.values()), {})
    by_name = {getattr(k, "value", k): int(v) for k, v in kinds.items()}
    return MemoryAtPeak(
        total=by_name.get("Total", 0),
        parameters=by_name.get("Parameter", 0) + by_name.get("Buffer", 0),
        gradients=by_name.get("Gradient", 0),
        optimizer_state=by_name.get("Optstate", 0),
        activations=by_name.get("Activation", 0),
        temporaries=by_name.get("Temp", 0),
        other=by_name.get("Other", 0),
        activations_peak=max(activations_peak, by_name.get("Activation", 0)),
    )


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


@contextmanager
def restored_after(model: nn.Module) -> Iterator[None]:
    """Put the model's weights and buffers back as they were (a host copy: the GPU is what is being probed)."""
    saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
