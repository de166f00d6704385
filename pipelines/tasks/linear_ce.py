"""Cross-entropy through the vocabulary projection, full or in chunks of target positions (`loss_impl`).

A language model's step holds `targets x vocab` logits twice over (the 16-bit output, its fp32 copy for the
log-softmax) plus their gradient: SmolLM2's 49,152-word vocabulary at 8 x 1024 targets is 1.6 GB in fp32 alone.
The chunked form projects `CHUNK_BYTES` worth of rows at a time, keeps one log-sum-exp per row, and recomputes
each chunk's logits in backward, so only one chunk of logits ever exists. Hand-written rather than taken from
cut-cross-entropy or Liger because it must also run on a CPU and on fake tensors (the memory plan traces the
trial's own loss); on CUDA `kernels: liger` uses Liger's fused kernel instead. Same loss and gradients as the
full projection (fp32: within 1e-5; tests/pipelines/test_memory_levers.py), the same autocast dtype for the matmul.

Which form runs is resolved once per trial into the runtime's `LossImpl` (`pipelines.train.memory_levers.resolve_loss`)
and passed to the task's loss as an argument, never stored on the model, so the plan, the warm-up, training and
validation agree.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from pipelines.data.packing import IGNORE
from pipelines.repeats import chunk_starts
from pipelines.runtime import FULL_LOSS, LossImpl

# fp32 logits per chunk: 85 rows of a 49,152-word vocabulary. Forward and backward each hold about two chunk-sized
# tensors: on SmolLM2's head at 1,024 targets the loss's own peak is 92% below the full projection's, its time
# 1.65x on a CPU (the recomputed projection; benchmarks/RESULTS.md, "Memory levers").
CHUNK_BYTES = 16 * 1024 * 1024
# Config fields that transform logits after the head (soft-capping, scaling): the chunked form would skip them.
_AFTER_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model under DDP, torch.compile and peft wrappers."""
    inner = getattr(model, "module", model)  # DDP
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft


def forward_takes(model: nn.Module, name: str) -> bool:
    """Whether the (unwrapped) transformers model's forward takes the argument `name`."""
    return name in inspect.signature(unwrapped(model).forward).parameters


def chunk_rows_for(vocab_size: int) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about `CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def chunked_loss_unsupported(model: nn.Module) -> str | None:
    """Why this model's loss cannot be chunked (None when it can): the head must be the last op on the logits."""
    inner = unwrapped(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    name = type(inner).__name__
    if head is None:
        return f"{name} has no output projection (get_output_embeddings() is None)"
    if type(head) is not nn.Linear:
        return f"{name}'s output projection is a {type(head).__name__}, not a plain Linear (e.g. LoRA on lm_head)"
    config = getattr(inner, "config", None)
    changed = [key for key in _AFTER_HEAD if getattr(config, key, None) not in (None, 1, 1.0)]
    if changed or hasattr(inner, "final_logits_bias"):
        return f"{name} transforms its logits after the projection ({', '.join(changed) or 'final_logits_bias'})"
    return None


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


@contextlib.contextmanager
def _hidden_states_from_head(head: nn.Module) -> Iterator[None]:
    # The model's own forward runs (DDP's hooks, attention masks, `logits_to_keep`, T5's rescaling before its
    # head) and returns what its head was given; one module-level function, so a compiled model sees no new code.
    head.forward = _identity  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropy over rows of `hidden @ weight.T + bias`, one chunk of logits at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows):  # type: ignore[override]
        dtype = _compute_dtype(hidden.device, hidden.dtype)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in chunk_starts(hidden.shape[0], chunk_rows, is_fake(hidden)):  # a plan: two, counted all
                chunk = slice(start, start + chunk_rows)
                logits = F.linear(hidden[chunk].to(dtype), w, b).float()
                lse[chunk] = torch.logsumexp(logits, dim=-1)
                t = targets[chunk]
                counted = t != IGNORE
                picked = logits.gather(1, t.clamp_min(0)[:, None]).squeeze(1)
                total += ((lse[chunk] - picked) * counted).sum()
                correct += ((logits.argmax(-1) == t) & counted).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.dtype, ctx.chunk_rows = dtype, chunk_rows
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, _grad_correct):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype, rows = ctx.dtype, ctx.chunk_rows
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in chunk_starts(hidden.shape[0], rows, is_fake(hidden)):
                chunk = slice(start, start + rows)
                h, t = hidden[chunk].to(dtype), targets[chunk]
                counted = (t != IGNORE).float()
                # d(lse - picked)/d(logits) = softmax - one_hot(target), zero on ignored rows, times the upstream grad.
                # In place: one chunk-sized tensor, not one per op.
                grad = F.linear(h, w, b).float().sub_(lse[chunk][:, None]).exp_()
                grad.scatter_add_(1, t.clamp_min(0)[:, None], -torch.ones_like(grad[:, :1]))
                grad = grad.mul_((counted * grad_total)[:, None]).to(dtype)
                if grad_hidden is not None:
                    grad_hidden[chunk] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None and dtype == torch.float32:
                    grad_weight.addmm_(grad.t(), h)  # in place: no vocab x hidden temporary per chunk
                elif grad_weight is not None:
                    grad_weight += (grad.t() @ h).float()
                if grad_bias is not None:
                    grad_bias += grad.float().sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


def projected_cross_entropy(
    model: nn.Module, forward: Callable[[], torch.Tensor], targets: torch.Tensor, loss: LossImpl = FULL_LOSS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed fp32 cross-entropy over `targets` != IGNORE, how many the argmax got right), as `loss` projects.

    `forward()` runs the model and returns its output at the target positions (`targets`' shape plus one axis):
    the logits, or, with the loss chunked, the hidden states the head would have projected.
    """
    rows = loss.chunk_rows
    flat_targets = targets.reshape(-1)
    if rows is None:
        logits = forward()
        logits = logits.float().reshape(-1, logits.shape[-1])  # fp32 log-softmax even under autocast
        total = F.cross_entropy(logits, flat_targets, ignore_index=IGNORE, reduction="sum")
        correct = ((logits.detach().argmax(-1) == flat_targets) & (flat_targets != IGNORE)).sum()
        return total, correct
    head = unwrapped(model).get_output_embeddings()
    with _hidden_states_from_head(head):
        hidden = forward()
    if hidden.shape[-1] != head.in_features:
        raise RuntimeError(
            f"loss_impl: chunked: {type(unwrapped(model)).__name__} returned {hidden.shape[-1]} features where its "
            f"head takes {head.in_features}; set loss_impl: full"
        )
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, head.weight, head.bias, flat_targets, rows)
