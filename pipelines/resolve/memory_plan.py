"""Predicted training memory, before training: one step of the real model under FakeTensorMode.

Why not a formula: parameters, gradients and optimizer state are easy to count, but the
activations depend on the model's code (attention implementation, dropout masks, what
autograd saves, what checkpointing recomputes, the fp32 copies autocast keeps), and a
formula drifts from the code it describes. Instead the plan runs the trial's own first
window (the longest batch the sampler will produce, the same accumulation, precision,
checkpointing, optimizer and adapter) under PyTorch's `FakeTensorMode`, where tensors have
shapes, dtypes and sizes but no storage, and reads the peak with the same `MemTracker` the
engine uses to measure a real step (`pipelines.train.memory.track_step`). Nothing
is allocated, so a plan for a model that would not fit costs seconds and no memory.

What differs from the real step: the loss-scaler's bookkeeping is skipped (it reads
values, which fake tensors do not have; with scale 1.0 it allocates a few bytes), and
LoRA's adapter weights are created for real (peft cannot build them on fake tensors; they
are small), then swapped for fake ones. The optimizer state is counted exactly from its tensors, as the trial does.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

from pipelines.adapters import apply_adapter
from pipelines.data.batching import padded_length
from pipelines.data.loader import in_process, make_loader
from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.repeats import counted_repeats
from pipelines.resolve.counted_step import (
    PhasedStep,
    Point,
    StepTimeline,
    WorkerPeak,
    marking_recompute,
    track_counting_flops,
    window_kernels,
)
from pipelines.resolve.cuda_plan import cuda_graph_pool
from pipelines.resolve.eval_memory import generation_peaks, largest_eval_batch, reused, validation_peak
from pipelines.resolve.qlora_plan import EightBitAdamWPlan, as_qlora
from pipelines.resolve.target import CPU_TARGET, PlanTarget
from pipelines.runtime import ResolvedPrecision, Runtime, resolve_pad_multiple
from pipelines.tasks.base import Task
from pipelines.train.compiled_step import compiled_runtime
from pipelines.train.fast_dropout import fast_dropout
from pipelines.train.flops import KernelCounter
from pipelines.train.memory_levers import apply_memory_levers, resolve_loss
from pipelines.train.optim import build_optimizer
from pipelines.train.parallel import sharding_units
from pipelines.train.step import TrainStep, make_scaler
from pipelines.train.windows import plan_windows, training_sampler, window_units

CPU = torch.device("cpu")
# Counters the plan does not need on its fake batches (`num_positions` stays: it scales the FLOPs).
_HOST_COUNTS = ("num_rows", "num_tokens")


class PlanUnavailable(Exception):
    """No plan can be made for these params; the message names the model and the reason, in one line."""


def model_label(params: Params) -> str:
    """The model a plan is for, as the user named it."""
    if params.model.name_or_path is None:
        return f"the {params.task} model built from model.config"
    gguf = f" (gguf_file {params.model.gguf_file})" if params.model.gguf_file else ""
    return f"model {params.model.name_or_path}{gguf}"


@dataclass(frozen=True)
class MemoryPlan:
    """A training step's predicted memory (bytes) and the batch it was planned for."""

    peak: int
    parameters: int
    trainable_parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    batch_rows: int
    batch_width: int
    plan_time_s: float
    step_flops: int = 0
    model_flops: int = 0
    positions: int = 0
    eval_peak: int = 0  # validation's largest scoring batch, beside weights and optimizer state (resolve/eval_memory)
    generation_peak: int = 0  # the evaluate stage's largest generation batch, beside the weights (resolve/eval_memory)
    generation_phases: tuple[int, int] = (0, 0)  # its prefill's peak and its last step's; generation_peak is the larger
    target: str = "cpu"  # the device modelled: cpu or a GPU profile (pipelines.resolve.target)
    step_kernels: int = 0  # ops the window's forwards and backwards launch, eager (flops.KernelCounter)
    update_kernels: int = 0  # ops the optimizer update launches (clip, scaler, step, zero)
    micro_batches: int = 1  # micro-batches in the planned window
    mean_positions: float = 0.0  # positions of the epoch's average window (the planned one is the longest)
    cuda_graph_pool: int = 0  # a compiled CUDA step's graph pool, in `peak` (resolve/cuda_plan.cuda_graph_pool)
    peak_gradients: int = 0  # gradients alive at the peak: fewer than `gradients` when it comes mid-backward
    peak_before_update: int = 0  # the forwards' and backwards' highest moment (StepTimeline.before_update) ...
    state_before_update: int = 0  # ... and the optimizer state then: another optimizer's bound (search_plans)
    moments: tuple[Point, ...] = field(default=(), repr=False)  # what can be an FSDP worker's peak; none by depth

    def as_metrics(self) -> dict[str, float]:
        """MLflow names: `predicted_*`, beside the measured `peak_train_memory_bytes` and its breakdown."""
        return {
            "predicted_peak_train_memory_bytes": float(self.peak),
            "predicted_param_bytes": float(self.parameters),
            "predicted_trainable_param_bytes": float(self.trainable_parameters),
            "predicted_grad_bytes": float(self.gradients),
            "predicted_optimizer_state_bytes": float(self.optimizer_state),
            "predicted_activation_bytes": float(self.activations),
            "plan_time_s": self.plan_time_s,
            "predicted_step_flops": float(self.step_flops),
            "model_flops_per_step": float(self.model_flops),
            "predicted_eval_peak_bytes": float(self.eval_peak),
            "predicted_generation_peak_bytes": float(self.generation_peak),
            "predicted_cuda_graph_pool_bytes": float(self.cuda_graph_pool),
        }

    def model_flops_per_position(self) -> float:
        """Model FLOPs (no recompute) per (padded) position of the planned window: scales a run's FLOPs by positions."""
        return self.model_flops / max(self.positions, 1)

    def sharded(self, workers: int, gathered: int) -> MemoryPlan:
        """One FSDP worker's plan: weights, gradients and optimizer state divided by `workers`, its peak the highest
        of the step's `moments` for one worker holding `gathered` bytes of whole units (`fsdp_gathered_bytes`)."""
        worker = WorkerPeak.at(self.moments, workers, gathered)
        before_update = WorkerPeak.at(tuple(m for m in self.moments if not m[3]), workers, gathered)
        return replace(
            self,
            peak=worker.peak + self.cuda_graph_pool,
            peak_before_update=before_update.peak + self.cuda_graph_pool,
            state_before_update=-(-self.state_before_update // workers),  # rounded up: the bound stays below
            parameters=self.parameters // workers,
            trainable_parameters=self.trainable_parameters // workers,
            gradients=self.gradients // workers,
            optimizer_state=self.optimizer_state // workers,
            peak_gradients=worker.gradients,
        )


def fsdp_gathered_bytes(model: nn.Module, compute_bytes: int = 4) -> int:
    """What an FSDP worker holds unsharded at once: the root unit's weights (embeddings, head: gathered for the
    whole step) and, of the largest block, two gathered copies (the running block and the next, prefetched) and one
    gradient (the reduce-scatter input of the block before, which FSDP2 holds until the next reduce-scatter);
    measured on 2 and 4 gloo ranks (tests/pipelines/test_plan_multiprocess.py). Trainable weights are gathered in the
    compute dtype (`compute_bytes`: FSDP's MixedPrecisionPolicy) and reduced in fp32, as `sharding_plan.ModelUnits`
    counts them."""
    units = sharding_units(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}

    def gathered(params: list[nn.Parameter]) -> int:
        return sum(p.numel() * (compute_bytes if p.requires_grad else p.element_size()) for p in params)

    def gradient(params: list[nn.Parameter]) -> int:
        return sum(p.numel() * (4 if compute_bytes < 4 else p.element_size()) for p in params if p.requires_grad)

    root = gathered([p for p in model.parameters() if id(p) not in in_units])
    block = max((list(unit.parameters()) for unit in units), key=gathered, default=[])
    return root + 2 * gathered(block) + gradient(block)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    # Fake tensors have no data pointers to de-duplicate by; these tensors never share storage.
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_micro_batches(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of a window that can set its peak: the first, then the largest of the rest.

    Before the first backward no gradients exist; from the second on they do, at a fixed size, so
    a later micro-batch's peak differs only by its activations, which grow with rows x width
    (linear layers) or rows x width^2 (attention scores): the largest by each is kept. A window
    of 32 one-row micro-batches is planned in three, not 32 (a search tries many such plans).
    """
    if len(batches) <= 3:
        return batches
    first, rest = batches[0], batches[1:]
    shape = [tuple(b["input_ids"].shape) for b in rest]
    by_area = max(range(len(rest)), key=lambda i: shape[i][0] * shape[i][1])
    by_attention = max(range(len(rest)), key=lambda i: shape[i][0] * shape[i][1] ** 2)
    return [first] + [rest[i] for i in sorted({by_area, by_attention})]


def _plan_qlora(
    params: Params, task: Task, train: TokenizedSplit, build_base: Callable[[], nn.Module], pad_id: int,
    precision: ResolvedPrecision, target: PlanTarget,
) -> MemoryPlan:  # fmt: skip
    """QLoRA's plan: the same model with LoRA on the unquantized base, its quantized weights then at NF4 size."""
    as_lora = params.model_copy(update={"adapter": params.adapter.model_copy(update={"type": "lora"})})
    plan = plan_memory(as_lora, task, train, build_base, lambda m: apply_adapter(m, as_lora.adapter, task, as_lora),
                       pad_id, precision, target)  # fmt: skip
    with FakeTensorMode(allow_non_fake_inputs=True):
        base = build_base()
    # bf16 compute (fp16 with precision: fp16): 2 bytes either way; the LoRA plan stored the frozen weights so too.
    return as_qlora(plan, base, compute_bytes=2, stored_bytes=2 if precision in ("bf16", "fp16") else 4)


def _optimizer(params: Params, model: nn.Module) -> torch.optim.Optimizer:
    """The trial's optimizer (8-bit AdamW by rule: bitsandbytes needs CUDA; see pipelines.resolve.qlora_plan)."""
    lr = params.lr if params.lr != "auto" else 1e-3  # the rate does not change memory
    if params.optim == "adamw_8bit":
        return EightBitAdamWPlan([p for p in model.parameters() if p.requires_grad], lr)
    return build_optimizer(params.optim, model, lr, params.weight_decay, CPU)


def _fake_model(
    mode: FakeTensorMode, seed: int, build_base: Callable[[], nn.Module], adapt: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """The model built under `mode` (no weight allocated or read), adapted, its adapter's real weights made fake."""
    with mode:
        torch.manual_seed(seed)
        model = build_base()
    return _all_fake(adapt(model), mode)


def _evaluation_peaks(
    step: TrainStep, eval_batch: dict[str, torch.Tensor], train: TokenizedSplit, params: Params
) -> tuple[int, tuple[int, int]]:
    """Validation's largest scoring batch beside the optimizer state, and the evaluate stage's generation (its
    prefill's peak and its last step's), each made once per planner for what it reads (`eval_memory.reused`)."""
    validation = reused("validation", params, lambda: validation_peak(step.model, step.optimizer, eval_batch,
                                                                      step.runtime, step.task))  # fmt: skip

    def generation() -> tuple[int, int]:
        probe = step.task.generation_probe(train, params)
        return (0, 0) if probe is None else generation_peaks(step.model, probe, step.runtime)

    return validation, reused("generation", params, generation)


def _all_fake(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Swap the real tensors `adapt` created (LoRA weights) for fake ones: mixing both corrupts the heap at exit."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, FakeTensor):
                module._parameters[name] = nn.Parameter(mode.from_tensor(param.detach()), param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not isinstance(buffer, FakeTensor):
                module._buffers[name] = mode.from_tensor(buffer)
    return model


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _unavailable_on_failure(plan: Callable[..., MemoryPlan]) -> Callable[..., MemoryPlan]:
    """`plan`, with whatever breaks it raised as one `PlanUnavailable` line naming the model and the reason.

    A plan is advice: the trial can still train without one. A `UserError` (a bad param) passes through.
    """

    @functools.wraps(plan)
    def planned(params: Params, task: Task, *args: object, **kwargs: object) -> MemoryPlan:
        try:
            return plan(params, task, *args, **kwargs)
        except (PlanUnavailable, UserError):
            raise
        except (DynamicOutputShapeException, DataDependentOutputException) as err:
            raise PlanUnavailable(
                f"{model_label(params)}: the {task.name} training step has data-dependent shapes "
                f"({_first_line(err)}), which a plan on fake tensors cannot size"
            ) from None
        except Exception as err:  # noqa: BLE001 - see above
            raise PlanUnavailable(f"{model_label(params)}: {type(err).__name__}: {_first_line(err)}") from err

    return planned


def _first_window(
    params: Params, task: Task, train: TokenizedSplit, runtime: Runtime
) -> tuple[list[list[int]], float, list[dict[str, torch.Tensor]], int, float]:
    """The first (longest) accumulation window: its rows, loss units, the micro-batches that can set its peak
    (collated on the host, padded as the trial pads them: the runtime's pad multiple), and all its positions; and
    the mean positions of the epoch's windows (rows x padded width, from the lengths: what an average step computes)."""
    sampler = training_sampler(train, params)
    windows = plan_windows(sampler.batches(0), params.grad_accum_steps)
    window = windows[0]
    units = window_units(window, task.loss_units(train, params))
    batches = [
        {k: v for k, v in batch.items() if k not in _HOST_COUNTS}
        for batch in make_loader(train, window, in_process(params), runtime, task)
    ]

    def positions(rows: list[int]) -> int:
        width = padded_length(int(train.lengths[rows].max()), runtime.padding) if params.data.bucketing else None
        return len(rows) * (width or params.data.max_length)

    mean = sum(positions(rows) for w in windows for rows in w) / len(windows)
    return window, units, peak_micro_batches(batches), sum(int(b["num_positions"]) for b in batches), mean


def _planned_runtime(
    params: Params, train: TokenizedSplit, target: PlanTarget, precision: ResolvedPrecision, pad_id: int
) -> tuple[Runtime, bool]:
    """The runtime the fake step runs with (on the CPU, in the trial's precision, padded as on the target's device),
    and whether the trial runs compiled on CUDA (`compile: true` on a card; `compile: auto` is decided by the trial
    itself, after its plan, so a plan cannot know it: `plan_targets(compiled_auto=True)` plans it as compiled, for
    packing). A compiled trial pads its bucketed batches to a few widths (`pipelines.train.compiled_step`), and its
    peak sees the widest of them; its graphs' pool is added to the peak (`cuda_graph_pool`)."""
    runtime = Runtime(CPU, precision, False, resolve_pad_multiple(params, target.device), pad_id)
    compiled = target.card is not None and params.compile is True
    return (compiled_runtime(runtime, params, train) if compiled else runtime), compiled


@_unavailable_on_failure
def plan_memory(
    params: Params,
    task: Task,
    train: TokenizedSplit,
    build_base: Callable[[], nn.Module],
    adapt: Callable[[nn.Module], nn.Module],
    pad_id: int,
    precision: ResolvedPrecision,
    target: PlanTarget = CPU_TARGET,
) -> MemoryPlan:
    """Predict the peak of one training step of `params` on `train`'s first (longest) window, in bytes of `target`.

    The batches are padded as a trial on the target's device pads them (`data.pad_to_multiple_of` resolved there); a
    GPU `target` trains on CUDA, and its rules apply to the step (`pipelines.resolve.target`). `build_base` makes the
    model from its config under FakeTensorMode (no weight allocated or read), `adapt` applies the adapter outside
    it (peft builds its small weights for real); see `_unavailable_on_failure`. QLoRA: planned as LoRA, then
    adjusted by rule (`pipelines.resolve.qlora_plan`; bitsandbytes needs CUDA)."""
    device = target.device
    if params.adapter.type == "qlora":
        return _plan_qlora(params, task, train, build_base, pad_id, precision, target)
    start = time.perf_counter()
    runtime, compiled = _planned_runtime(params, train, target, precision, pad_id)
    window, units, batches, all_positions, mean_positions = _first_window(params, task, train, runtime)
    # The planned micro-batches stand for the whole window: FLOPs scale with its positions (read here: under
    # fake mode, reading a tensor's value is a data-dependent op).
    scale = all_positions / sum(int(b["num_positions"]) for b in batches)
    # Validation's largest scoring batch, collated on the host as the trial collates it (not under fake mode).
    eval_batch = largest_eval_batch(train, params, task, runtime)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fake_model(mode, params.seed, build_base, adapt)
    with mode:
        model.train()
        recompute = marking_recompute(target.recompute_context if target.card is not None else None)
        offload = apply_memory_levers(model, params, device, planning=True, recompute_context=recompute,
                                      precision=precision)  # as trained  # fmt: skip
        runtime = replace(runtime, loss=resolve_loss(model, params, task))
        optimizer = _optimizer(params, model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # The trial's own step, with a disabled scaler (its non-finite check reads values, which fakes do not have).
        train_step = TrainStep(model, optimizer, task, runtime, make_scaler(runtime, enabled=False),
                               params.max_grad_norm, offload)  # fmt: skip
        # The engine's CPU dropout (its attention swap needs real outputs to check, so it is not tried here); a
        # card's trial keeps torch's dropout, which the card's rules plan as CUDA's fused one.
        cpu_dropout = params.fast_dropout and params.compile is not True and target.card is None
        kernels = KernelCounter()
        workers = params.distributed.num_workers if params.distributed.strategy == "fsdp" else 1
        gathered = fsdp_gathered_bytes(model, 2 if precision in ("bf16", "fp16") else 4) if workers > 1 else 0
        timeline = StepTimeline(kernels)
        with fast_dropout(model) if cpu_dropout else nullcontext(), target.rules():
            counted = PhasedStep(train_step, batches, units, kernels, timeline)
            peak, step_flops, model_flops = track_counting_flops(counted, model, optimizer, params.grad_checkpointing,
                                                                  scale)  # fmt: skip
        state = [v for kept in optimizer.state.values() for v in kept.values() if isinstance(v, torch.Tensor)]
        state = [v for v in state if v.numel() > 1]  # as the trial counts: moments and factors, not scalar steps
        with target.rules(), counted_repeats():  # memory only: nothing here is counted
            eval_peak, generation = _evaluation_peaks(train_step, eval_batch, train, params)
    pool = cuda_graph_pool(peak.activations_peak, batches) if compiled else 0
    plan = MemoryPlan(
        peak=peak.total + pool,
        parameters=_nbytes(list(model.parameters())),
        trainable_parameters=_nbytes(trainable),
        gradients=_nbytes(trainable),
        optimizer_state=_nbytes(state),
        activations=peak.activations_peak,
        batch_rows=sum(len(rows) for rows in window),
        batch_width=max(int(b["input_ids"].shape[1]) for b in batches),
        plan_time_s=time.perf_counter() - start,
        step_flops=step_flops,
        model_flops=model_flops,
        positions=all_positions,
        eval_peak=eval_peak,
        generation_peak=max(generation),
        generation_phases=generation,
        target=target.name,
        step_kernels=window_kernels(kernels, len(window), len(batches)),
        update_kernels=kernels.count("update", step=1),
        micro_batches=len(window), mean_positions=mean_positions, cuda_graph_pool=pool, peak_gradients=peak.gradients,
        moments=timeline.moments(), **timeline.before_update(pool),
    )  # fmt: skip
    return plan if workers == 1 else plan.sharded(workers, gathered)
