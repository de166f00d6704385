"""Dropout with cheaper random masks on CPU, for Hugging Face models and plain `nn.Dropout`.

Why hand-written: on CPU, torch's dropout draws one Mersenne-Twister number per element
(`bernoulli_`), which profiled at 14% of a bf16 fine-tuning step of all-MiniLM-L6-v2, more
than the attention matmuls. Here each 64-bit draw gives four 16-bit lanes and an element is
dropped when its lane falls below `round(p * 65536)`: four elements per draw, then one
vectorised compare. The drop probability is p rounded to 1/65,536 (0.1 becomes 0.1000061)
and kept elements are scaled by 1/(1 - that p), so the layer stays unbiased. Masks come from
torch's default CPU generator, so seeding, checkpoint RNG restore and activation
checkpointing's recompute see the same masks. On CUDA torch's fused dropout is already fast
and is used unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

_LANES = 65536
ATTENTION_NAME = "sdpa_fast_dropout"


def drop_threshold(p: float) -> int:
    """How many of the 65,536 lane values drop an element, for drop probability p."""
    return min(_LANES, max(0, round(p * _LANES)))


def keep_mask(shape: torch.Size | tuple[int, ...], p: float) -> torch.Tensor:
    """A bool mask of `shape` (CPU) that is False with probability `drop_threshold(p) / 65536`."""
    numel = 1
    for size in shape:
        numel *= size
    words = torch.empty((numel + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    lanes = words.view(torch.int16)[:numel]  # four uniform 16-bit lanes per word, values -32768..32767
    return (lanes >= drop_threshold(p) - _LANES // 2).view(shape)


class _MaskedScale(torch.autograd.Function):
    """x * mask * scale, saving only the bool mask for backward (as torch's own dropout does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:  # type: ignore[override]
        mask = keep_mask(x.shape, p)
        scale = 1.0 / (1.0 - drop_threshold(p) / _LANES)
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return (x * mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        # Two plain multiplies: torch's native_dropout_backward kernel measured 6x slower on CPU.
        return (grad * mask).mul_(ctx.scale), None


def apply_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Drop-in for `F.dropout`: the fast mask on CPU, torch's fused kernel elsewhere."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training)
    return _MaskedScale.apply(x, p)


class FastDropout(nn.Dropout):
    """`nn.Dropout` that uses `apply_dropout`; same `p`, no parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_dropout(x, self.p, self.training)


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """A Hugging Face attention function: SDPA, except training on CPU with dropout.

    There, SDPA itself falls back to its math path (its CPU flash kernel has no dropout) and
    masks with `bernoulli_`; this is the same math path with the fast mask.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if dropout == 0.0 or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return math_attention(query, key, value, attention_mask, dropout, scaling), None


def math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout_p: float,
    scaling: float | None,
) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) dropped out, times v; returned as (batch, length, heads, head_dim)."""
    if key.shape[1] != query.shape[1]:  # grouped-query attention: repeat the key/value heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Scale q (length x head_dim) rather than the scores (length x length): fewer elements.
    scores = torch.matmul(query * scaling, key.transpose(-2, -1))
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    # torch's CPU softmax computes in fp32 for bf16/fp16 inputs and rounds once on output, which
    # is what an fp32 softmax followed by a cast gives, without the fp32 copy of the scores.
    probs = torch.softmax(scores, dim=-1)
    probs = apply_dropout(probs, dropout_p)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # the masks SDPA takes


@contextmanager
def fast_dropout(model: nn.Module) -> Iterator[int]:
    """Within the block, `model`'s dropout uses the fast CPU masks; yields how many layers changed.

    Every plain `nn.Dropout` is swapped for `FastDropout`; a Hugging Face model on SDPA
    attention also gets the attention function above. Both are put back on exit, so a saved
    model's config still names its own attention implementation.
    """
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                fast = FastDropout(child.p, child.inplace)
                fast.train(child.training)
                setattr(parent, name, fast)
                swapped.append((parent, name, child))
    config = getattr(model, "config", None)
    original_attention = getattr(config, "_attn_implementation", None)
    switch_attention = original_attention == "sdpa" and hasattr(model, "set_attn_implementation")
    if switch_attention:
        _register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield len(swapped) + (1 if switch_attention else 0)
    finally:
        if switch_attention:
            model.set_attn_implementation(original_attention)
        for parent, name, child in swapped:
            child.train(getattr(parent, name).training)
            setattr(parent, name, child)
