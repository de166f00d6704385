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

The attention function is swapped only where it reproduces the stock SDPA attention: it
implements bidirectional attention under a padding mask, computed in fp32 like SDPA's math
path, and nothing else. A causal model, sliding windows, soft-capped logits or a non-SDPA
attention keep their own attention (a swap would drop the mask it does not implement: on a
decoder, future tokens would leak). Before swapping, one forward at p=0 through both must
agree (fp32: within 1e-6; bf16: the same output dtype, within bf16 rounding); else the stock
attention stays and the reason is reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.runtime import eval_mode

_LANES = 65536
ATTENTION_NAME = "sdpa_fast_dropout"
FP32_TOLERANCE = 1e-6
BF16_TOLERANCE = 2.0**-6  # a few units in bf16's last place on logits of order one
_FORCE_MATH: ContextVar[bool] = ContextVar("fast_dropout_force_math", default=False)


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

    unsupported = (
        kwargs.get("position_bias") is not None
        or kwargs.get("is_causal")
        or getattr(module, "is_causal", False)
        or kwargs.get("sliding_window")
        or kwargs.get("softcap")
    )
    if unsupported or query.device.type != "cpu" or (dropout == 0.0 and not _FORCE_MATH.get()):
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
    """softmax(q k^T * scaling + mask) dropped out, times v; returned as (batch, length, heads, head_dim).

    bf16/fp16 inputs are computed in fp32 and the output cast back, as SDPA's math path does.
    """
    out_dtype = query.dtype
    if out_dtype in (torch.bfloat16, torch.float16):
        query, key, value = query.float(), key.float(), value.float()
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
    probs = torch.softmax(scores, dim=-1)
    probs = apply_dropout(probs, dropout_p)
    return torch.matmul(probs, value).transpose(1, 2).contiguous().to(out_dtype)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # the masks SDPA takes


@dataclass(frozen=True)
class FastDropoutUse:
    """What `fast_dropout` changed: dropout layers swapped, and whether (or why not) the attention was."""

    layers: int
    attention: bool
    reason: str

    def describe(self) -> str:
        """One line for the run's tags."""
        attention = "fast attention dropout" if self.attention else f"stock attention ({self.reason})"
        return f"{self.layers} dropout layers swapped; {attention}"


def unsupported_attention(model: nn.Module) -> str | None:
    """Why the fast attention cannot stand in for this model's attention, or None when it can be tried."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return f"attention implementation {implementation!r} is not SDPA"
    if getattr(config, "is_decoder", False) or any(getattr(m, "is_causal", False) for m in model.modules()):
        return "causal attention: the fast path implements bidirectional padding masks only"
    if getattr(config, "sliding_window", None):
        return "sliding-window attention is not implemented by the fast path"
    if getattr(config, "attn_logit_softcapping", None):
        return "soft-capped attention logits are not implemented by the fast path"
    return None


def _logits(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()
    with torch.no_grad(), autocast:
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out[0]


def attention_mismatch(model: nn.Module, inputs: dict[str, torch.Tensor], bf16: bool) -> str | None:
    """Run `inputs` at p=0 through the stock and the fast attention; say how they differ, or None."""
    original = model.config._attn_implementation
    # Eval mode, p=0: the comparison is of the attention arithmetic and masks, not of random masks.
    with eval_mode(model):
        checks = [(None, FP32_TOLERANCE)] + ([(torch.bfloat16, BF16_TOLERANCE)] if bf16 else [])
        for dtype, tolerance in checks:
            stock = _logits(model, inputs, dtype)
            model.set_attn_implementation(ATTENTION_NAME)
            token = _FORCE_MATH.set(True)
            try:
                fast = _logits(model, inputs, dtype)
            finally:
                _FORCE_MATH.reset(token)
                model.set_attn_implementation(original)
            name = "bf16" if dtype is not None else "fp32"
            if fast.dtype != stock.dtype:
                return f"{name}: outputs in {fast.dtype} instead of the stock {stock.dtype}"
            worst = float((fast.float() - stock.float()).abs().max())
            if not worst <= tolerance:
                return f"{name}: outputs differ from the stock attention by {worst:.2e} (tolerance {tolerance:.0e})"
        return None


@contextmanager
def fast_dropout(
    model: nn.Module, probe_inputs: dict[str, torch.Tensor] | None = None, bf16: bool = False
) -> Iterator[FastDropoutUse]:
    """Within the block, `model`'s dropout uses the fast CPU masks; yields what was changed and why.

    Every plain `nn.Dropout` is swapped for `FastDropout` (the same operation). A Hugging Face
    model on SDPA attention also gets the attention function above, but only when
    `unsupported_attention` finds nothing against it and, on `probe_inputs` (a batch with
    padding), its outputs at p=0 match the stock attention's (`attention_mismatch`; with
    `bf16`, also under bf16 autocast). Everything is put back on exit, so a saved model's
    config still names its own attention implementation.
    """
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                fast = FastDropout(child.p, child.inplace)
                fast.train(child.training)
                setattr(parent, name, fast)
                swapped.append((parent, name, child))
    original_attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    reason = unsupported_attention(model)
    if reason is None:
        _register_attention()
        if probe_inputs is None:
            reason = "no batch to check it against the stock attention"
        else:
            reason = attention_mismatch(model, probe_inputs, bf16)
    switch_attention = reason is None
    if switch_attention:
        model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield FastDropoutUse(len(swapped), switch_attention, reason or "")
    finally:
        if switch_attention:
            model.set_attn_implementation(original_attention)
        for parent, name, child in swapped:
            child.train(getattr(parent, name).training)
            setattr(parent, name, child)
