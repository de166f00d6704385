"""A GPU's rules on the memory plan's fake step, on a machine without one (`target_device: <card>`).

Why not fake CUDA tensors: on a CPU-only torch build `FakeTensorMode` makes CUDA tensors, but `.to("cuda")`
raises and any op that takes a CUDA device guard (SDPA's math path, the flash and memory-efficient kernels)
aborts the process ("PyTorch is not linked with support for cuda devices", an uncatchable C++ terminate;
torch 2.13). So the plan stays on fake CPU tensors and applies what a card does differently, where it changes
memory:

- **CUDA autocast's casts** (`cuda_autocast`): CPU autocast keeps softmax, log-softmax, layer norm, exp, pow,
  rsqrt, sum, cumsum and the losses in 16-bit; CUDA autocast runs them in fp32 (an eager attention's
  probabilities are twice the bytes). The lists below are CUDA's (ATen's autocast_mode.cpp), applied by a
  torch-function mode inside each autocast region, with CUDA's cache of cast weights for the region.
- **The SDPA backend the card picks** (`CudaAttention`): flash (compute capability 8.0+, 16-bit, no mask,
  head size up to 256), memory-efficient (5.0+; masks and fp32; bf16 from 8.0), else math. Flash and
  memory-efficient save the query, key, value, output and one fp32 log-sum-exp per row, and no attention
  probabilities or dropout mask (dropout is regenerated from its seed); math saves the probabilities. The CPU
  picks math whenever dropout is on, so a BERT training step would be planned with S x S probabilities per head.
- **CUDA's fused dropout** (`CudaDropout`): it saves a bool mask (1 byte an element); the CPU's saves the scaled
  noise in the input's dtype (4 bytes under fp32). LoRA's dropout on an fp32 copy of each adapted layer's input
  made a Llama-shaped 1.1B's plan 96 MiB a block too high on an H200 (benchmarks/RESULTS.md).
- **The caching allocator's 512-byte rounding** (`allocation_rounding`): every block is a multiple of 512
  bytes, as `torch.cuda.max_memory_allocated` counts it (MemTracker rounds CUDA tensors only).
- **A compiled step's CUDA-graph pool** (`cuda_graph_pool`): `compile` on CUDA runs the step as Inductor's cudagraph
  trees (`mode="reduce-overhead"`, `pipelines.train.compiled_step`), which record each padded width's forward and
  backward into one private memory pool that every graph of the tree shares (torch's cudagraph_trees: a tree of
  graphs A, B and A, B' uses max(mem(A, B), mem(A, B'))). So the pool holds about the largest graph's footprint:
  the activations saved for backward at the widest padded width, plus the static copies of that batch, the
  graphs' inputs (their outputs, the loss and the gradients, the plan counts already). The pool is never handed
  back to the eager allocator, which keeps its own cache from the eager work of the trial (its memory probe,
  evaluation), so a compiled plan counts both: the conservative side, which packing trials onto a card needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipelines.data.batching import HOST_COUNTS
from pipelines.gpu_profiles import GpuProfile

_LOWER = (
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "multi_dot", "__matmul__", "__rmatmul__",
)  # fmt: skip
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp",
)  # fmt: skip
_FP32_OUTPUT = ("prod", "softmax", "log_softmax", "cumprod", "cumsum", "vector_norm", "matrix_norm", "sum")
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _callables(names: tuple[str, ...]) -> frozenset[Any]:
    """Every spelling of the ops `names`: torch.x, Tensor.x, F.x, torch.linalg.x (method and function forms)."""
    found = set()
    for name in names:
        for namespace in (torch, torch.Tensor, F, torch.linalg, torch.special):
            function = getattr(namespace, name, None)
            if function is not None:
                found.add(function)
    return frozenset(found)


LOWER_PRECISION, FP32, FP32_OUTPUT = _callables(_LOWER), _callables(_FP32), _callables(_FP32_OUTPUT)


def _map_tensors(value: Any, cast: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return cast(value)
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(item, cast) for item in value)
    return value


class CudaAutocast(TorchFunctionMode):
    """CUDA autocast's casts wherever CPU autocast is on (which marks where autocast is, in the task's regions and in
    checkpointing's recompute alike; it is switched off for the op itself, so CPU's lists do not apply on top).

    Inside a `region` (the task's forward) leaf weights are cast once and the casts kept until the region ends, as
    CUDA's cast cache does; elsewhere (a checkpointed block's recompute) each use casts anew."""

    def __init__(self) -> None:
        super().__init__()
        self.regions = 0
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextmanager
    def region(self, dtype: torch.dtype) -> Iterator[None]:
        """An autocast region to `dtype`; the weight casts it cached are dropped when the outermost one ends."""
        self.regions += 1
        try:
            with torch.autocast("cpu", dtype=dtype):
                yield
        finally:
            self.regions -= 1
            if not self.regions:
                self.cache.clear()

    def _to_lower(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("cpu")
        if not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64):
            return tensor
        cacheable = self.regions and tensor.dtype == torch.float32 and tensor.requires_grad and tensor.is_leaf
        if cacheable and id(tensor) in self.cache:
            return self.cache[id(tensor)][1]
        cast = tensor.to(dtype)
        if cacheable:
            self.cache[id(tensor)] = (tensor, cast)  # the source is kept too, so its id is not reused
        return cast

    @staticmethod
    def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() if tensor.dtype in _SIXTEEN_BIT else tensor

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if not torch.is_autocast_enabled("cpu"):  # fp32, or a region that turned autocast off (the chunked loss)
            return func(*args, **kwargs)
        if func in LOWER_PRECISION or func is F.scaled_dot_product_attention:
            args, kwargs = _map_tensors(args, self._to_lower), _map_tensors(kwargs, self._to_lower)
        elif func in FP32:
            args, kwargs = _map_tensors(args, self._to_fp32), _map_tensors(kwargs, self._to_fp32)
        elif func in FP32_OUTPUT and kwargs.get("dtype") is None:
            if any(isinstance(a, torch.Tensor) and a.dtype in _SIXTEEN_BIT for a in args[:1]):
                kwargs["dtype"] = torch.float32
        torch.set_autocast_enabled("cpu", False)
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_autocast_enabled("cpu", True)


@contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[CudaAutocast]:
    """One autocast region as CUDA runs it (see the module docstring), for code outside a plan."""
    with CudaAutocast() as mode, mode.region(dtype):
        yield mode


def plan_rules_class(card: GpuProfile) -> tuple[bool, bool]:
    """What of a card the fake step's rules read (`sdpa_backend`'s capability tests): cards alike here get the same
    plan, so a plan for several cards is made once per class (pipelines.resolve.plan_report)."""
    return card.capability >= (8, 0), card.capability >= (5, 0)


def sdpa_backend(card: GpuProfile, dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """The kernel torch's SDPA dispatch picks on `card`: flash, efficient or math (torch's sdp_utils rules)."""
    ampere = card.capability >= (8, 0)
    if ampere and dtype in _SIXTEEN_BIT and not masked and head_dim <= 256 and head_dim % 8 == 0:
        return "flash"
    alignment = 8 if dtype in _SIXTEEN_BIT else 4
    if card.capability >= (5, 0) and (dtype != torch.bfloat16 or ampere) and head_dim % alignment == 0:
        return "efficient"
    return "math"


def _repeat_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    return tensor if tensor.shape[-3] == heads else tensor.repeat_interleave(heads // tensor.shape[-3], dim=-3)


class _FusedAttention(torch.autograd.Function):
    """Flash / memory-efficient attention's memory: it saves q, k, v (grouped heads unexpanded), the output and
    an fp32 log-sum-exp per row. The values come from the CPU flash kernel (fake tensors: shapes only), so the
    FLOP counter counts its forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale):  # type: ignore[override]
        heads = q.shape[-3]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _repeat_heads(k, heads), _repeat_heads(v, heads), 0.0, causal, attn_mask=mask, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        heads, groups = q.shape[-3], k.shape[-3]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, _repeat_heads(k, heads), _repeat_heads(v, heads), out, lse, 0.0, ctx.causal,
            attn_mask=mask, scale=ctx.scale,
        )  # fmt: skip
        if groups != heads:  # the kernels sum the grouped heads' key and value gradients back
            dk = dk.unflatten(-3, (groups, heads // groups)).sum(-3)
            dv = dv.unflatten(-3, (groups, heads // groups)).sum(-3)
        return dq, dk, dv, None, None, None


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound.update(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


class CudaAttention(TorchFunctionMode):
    """`scaled_dot_product_attention` as `card` would run it: the backend it picks, and what that one saves."""

    def __init__(self, card: GpuProfile) -> None:
        super().__init__()
        self.card = card

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        a = _sdpa_arguments(args, kwargs)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if sdpa_backend(self.card, q.dtype, q.shape[-1], mask is not None) == "math":
            return torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, mask, a["dropout_p"], a["is_causal"], None, scale=a["scale"], enable_gqa=a["enable_gqa"]
            )[0]
        if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        return _FusedAttention.apply(q, k, v, mask, a["is_causal"], a["scale"])


class CudaDropout(TorchFunctionMode):
    """Training-mode `F.dropout` as CUDA runs it: `native_dropout`, whose backward keeps only a bool mask."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.dropout:
            return func(*args, **kwargs)
        names = ("input", "p", "training", "inplace")
        bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(names, args, strict=False)), **kwargs}
        if not bound["training"] or not 0.0 < bound["p"] < 1.0 or bound["inplace"]:
            return func(*args, **kwargs)
        return torch.native_dropout(bound["input"], bound["p"], True)[0]


def _rounded_to_blocks(self: Any) -> int:
    return math.ceil(self.size * self.element_size / 512) * 512


@contextmanager
def allocation_rounding() -> Iterator[None]:
    """MemTracker counts every tensor as the CUDA caching allocator does: rounded up to 512 bytes."""
    from torch.distributed._tools import mem_tracker

    original = mem_tracker._WeakRefInfo._calculate_mem_consumed
    mem_tracker._WeakRefInfo._calculate_mem_consumed = _rounded_to_blocks  # type: ignore[method-assign]
    try:
        yield
    finally:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = original  # type: ignore[method-assign]


def cuda_graph_pool(activations: int, batches: list[dict[str, torch.Tensor]]) -> int:
    """A compiled CUDA step's graph pool (see the module): `activations`, the step's activation peak at its padded
    widths, plus the largest of `batches` (its micro-batches, padded as the compiled trial pads them), its model
    inputs in 512-byte blocks (the host counts are no graph's inputs)."""
    inputs = (sum(_block_bytes(t) for k, t in batch.items() if k not in HOST_COUNTS) for batch in batches)
    return activations + max(inputs, default=0)


def _block_bytes(tensor: torch.Tensor) -> int:
    return math.ceil(tensor.numel() * tensor.element_size() / 512) * 512
