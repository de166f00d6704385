"""The memory levers that change how a step is computed, never what is trained, applied to a model once per trial:
activation checkpointing (all blocks, or every n-th), activation offloading, the loss's projection (full or
chunked), and fused CUDA kernels. The trainer, its warm-up probe and the memory plan all call
`apply_memory_levers`, so what is planned is what trains. Nothing is stored on the model: the offload comes back as
the context the step opens around its forward, and the loss is resolved into the runtime (`resolve_loss`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.runtime import FULL_LOSS, LossImpl
from pipelines.tasks.base import Task
from pipelines.tasks.linear_ce import chunk_rows_for, chunked_loss_unsupported, unwrapped

# `loss_impl: auto` chunks at this vocabulary size and above (Llama-3: 128,256; SmolLM2: 49,152; GPT-2: 50,257).
CHUNKED_FROM_VOCAB = 32_768
# The model families Liger-Kernel patches (liger_kernel.transformers' apply_liger_kernel_to_<family>).
LIGER_MODEL_TYPES = ("llama", "mistral", "mixtral", "gemma", "gemma2", "qwen2", "qwen3", "phi3", "granite", "olmo2")


# torch checkpoint's context_fn: the forward's and the recompute's context managers.
ContextFn = Callable[[], tuple[AbstractContextManager[object], AbstractContextManager[object]]] | None


def resolve_loss(model: nn.Module, params: Params, task: Task) -> LossImpl:
    """The loss's projection under `loss_impl` for this (adapted) model: full, or chunked with its rows per chunk."""
    if params.loss_impl == "full" or not task.projects_vocabulary:
        return FULL_LOSS
    why_not = chunked_loss_unsupported(model)
    if params.loss_impl == "chunked":
        if why_not is not None:
            raise UserError(f"loss_impl: chunked: {why_not}; use loss_impl: auto or full")
    elif why_not is not None or params.compile is True or params.distributed.strategy == "fsdp":
        return FULL_LOSS
    vocab = unwrapped(model).get_output_embeddings().out_features
    if params.loss_impl == "auto" and vocab < CHUNKED_FROM_VOCAB:
        return FULL_LOSS
    return LossImpl(chunk_rows_for(vocab))


def _enable_checkpointing(model: nn.Module, params: Params, offload: bool, recompute_context: ContextFn) -> None:
    if not params.grad_checkpointing:
        return
    kwargs: dict[str, object] = {"use_reentrant": False}
    if recompute_context is not None:
        kwargs["context_fn"] = recompute_context
    # transformers' own options: every n-th decoder block, and the blocks' inputs kept in pinned host memory.
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=kwargs,
        every_n_layers=params.grad_checkpointing_every,
        offload=offload,
    )


def _apply_kernels(model: nn.Module, params: Params, device: torch.device) -> None:
    if params.kernels == "none":
        return
    if device.type != "cuda":
        raise UserError(f"kernels: liger needs CUDA (Triton kernels); this trial trains on {device.type}")
    model_type = getattr(getattr(unwrapped(model), "config", None), "model_type", None)
    if model_type not in LIGER_MODEL_TYPES:
        raise UserError(
            f"kernels: liger supports the model types {', '.join(LIGER_MODEL_TYPES)}; this model is "
            f"{model_type!r}: use kernels: none"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError("kernels: liger needs the liger-kernel package: pip install liger-kernel (CUDA only)")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    inner = unwrapped(model)
    modeling = sys.modules[type(inner).__module__]
    before = dict(vars(modeling))
    # Liger's norm and SwiGLU kernels on this model's modules. Not its fused linear cross-entropy: that replaces the
    # model's forward, which then ignores our 2-D `logits_to_keep` (on an H100: logits for every row at every kept
    # position); `loss_impl: chunked` is the loss's lever, holding one chunk of logits as Liger's loss does. Not its
    # RoPE either: Liger can only swap that in the modeling module, for every model of the process.
    _apply_liger_kernel_to_instance(model=inner, fused_linear_cross_entropy=False, cross_entropy=False, rope=False)
    # Liger also swaps the module's classes; put them back, so that models built later in this process (a memory
    # plan's fake-tensor model, the next trial's) are not given Triton kernels they did not ask for. On an H100 a
    # plan made after a Liger run crashed the CUDA context ("illegal memory access").
    for name, value in before.items():
        if vars(modeling).get(name) is not value:
            setattr(modeling, name, value)


OffloadContext = Callable[[], AbstractContextManager[object]]


# What a 16-bit run computes its matmuls in: the dtype its untrained weights are stored in.
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def store_frozen_weights(model: nn.Module, params: Params, precision: str) -> int:
    """Store the weights that are not trained (a LoRA base, any frozen part) in a 16-bit run's compute dtype, in
    place; return how many tensors were cast. Trained weights keep their fp32 master copies, as autocast wants.

    A frozen fp32 weight is only ever read, and autocast casts it to the compute dtype at every forward anyway, so
    its fp32 copy is memory for nothing: an 8B base is 30.7 GB in fp32 and 15.3 GB in bf16, as PEFT's, TRL's,
    torchtune's and Unsloth's LoRA recipes load it. An fp32 run (and a CPU run resolving `precision: auto` to fp32,
    where bf16 is emulated) keeps fp32 bases. Under FSDP too: FSDP2 asks one dtype of a unit's trained weights
    only, and shards and gathers the frozen ones in the 16 bits they are stored in (`pipelines.train.fsdp_steps`).
    """
    dtype = _COMPUTE_DTYPES.get(precision)
    if dtype is None:
        return 0
    return _store_fp32_weights(model, dtype, frozen_only=True)


def _store_fp32_weights(model: nn.Module, dtype: torch.dtype, frozen_only: bool) -> int:
    """Cast `model`'s fp32 weights (the frozen ones only, or all) to `dtype` in place; how many were cast."""
    cast = 0
    for param in model.parameters():
        if param.dtype == torch.float32 and not (frozen_only and param.requires_grad):
            param.data = param.data.to(dtype)
            cast += 1
    return cast


def store_trained_weights(model: nn.Module, params: Params, precision: str) -> int:
    """`weights_dtype: bf16`: store every fp32 weight in bf16, in place (pure 16-bit training, torchtune's default);
    return how many tensors were cast. Gradients then come out in bf16 and the optimizer keeps its state in the
    weights' dtype, so a weight costs 2 + 2 + (AdamW) 4 bytes instead of 4 + 4 + 8.

    The price is resolution: bf16 has 8 significant bits, so an update smaller than about 1/256 of a weight rounds
    away (docs/how-to/plan-memory.md). No compensated update (Kahan summation, stochastic rounding) is added: it
    would need a buffer per weight or an optimizer of our own, and the option is for runs where memory, not the
    last digits of the update, decides; fp32 (the default) keeps master copies.
    """
    if params.weights_dtype == "fp32":
        return 0
    if precision != "bf16":
        raise UserError(
            f"weights_dtype: bf16 trains weights stored in bf16, under bf16 autocast; precision: {params.precision} "
            f"resolved to {precision} here: set precision: bf16 (on a machine with bf16), or weights_dtype: fp32"
        )
    return _store_fp32_weights(model, torch.bfloat16, frozen_only=False)


def apply_memory_levers(
    model: nn.Module, params: Params, device: torch.device, *, planning: bool = False,
    recompute_context: ContextFn = None, precision: str = "fp32",
) -> OffloadContext:  # fmt: skip
    """Weights in 16 bits (frozen ones, or all with `weights_dtype`), checkpointing and kernels, as the params and
    `precision` (resolved) ask,
    on `model` in place; the activation offload's context, which the step
    (`pipelines.train.step.TrainStep.offload`) opens around every forward.

    `device` is where the trial trains. `planning`: the memory plan's fake step on the CPU, where offloading is
    modelled (`offload_context`) rather than run, and kernels are not swapped in (Triton does not trace on fake
    CPU tensors; the plan counts the model's own ops, an upper bound for Liger's fused ones).
    `recompute_context`: torch checkpoint's `context_fn` (a GPU target's plan re-enters its rules in the recompute,
    which runs in backward, outside the forward's torch-function modes).
    """
    if params.activation_offload and device.type != "cuda":
        raise UserError(
            f"activation_offload: true moves saved activations from GPU to host memory; this trial trains on "
            f"{device.type}, where they already are in host memory (set activation_offload: false)"
        )
    store_trained_weights(model, params, precision)
    store_frozen_weights(model, params, precision)
    offload = params.activation_offload
    _enable_checkpointing(model, params, offload and not planning, recompute_context)
    # Without checkpointing, offload every tensor autograd saves (torch's save_on_cpu around the forward); the
    # plan models either form by keeping saved tensors out of device memory until backward reads them.
    mode = "plan" if offload and planning else "host" if offload and not params.grad_checkpointing else None
    if not planning:
        _apply_kernels(model, params, device)
    return functools.partial(offload_context, mode)


def _off_device(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.device]:
    return tensor.to("meta"), tensor.device  # no storage: what the host holds is not device memory


def _back_on_device(packed: tuple[torch.Tensor, torch.device]) -> torch.Tensor:
    meta, device = packed
    return torch.empty_like(meta, device=device)  # the host-to-device copy backward allocates


def offload_context(mode: str | None) -> AbstractContextManager[object]:
    """Around a forward: saved tensors go to pinned host memory (`host`), are modelled off the device (`plan`), or
    stay (None); see `apply_memory_levers`."""
    if mode == "host":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if mode == "plan":
        return torch.autograd.graph.saved_tensors_hooks(_off_device, _back_on_device)
    return contextlib.nullcontext()
