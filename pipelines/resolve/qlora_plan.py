"""QLoRA's memory, planned without bitsandbytes (which needs CUDA and real weights): LoRA's plan, adjusted by rule.

The plan runs the step of the same LoRA model on fake tensors with the base unquantized, then swaps the bytes of
the weights bitsandbytes would quantize for their 4-bit NF4 size with double quantization (the QLoRA paper's
layout, transformers' `BitsAndBytesConfig(load_in_4bit, nf4, double quant)`):
- 4 bits per weight,
- one 8-bit absmax per block of 64 weights (its fp32 constants quantized: double quantization),
- one fp32 second-level constant per 256 of those blocks.
Which layers: every `nn.Linear` but those transformers keeps in full precision (`get_keys_to_not_convert`: the
output head, tied weights, the last module; and the class's `_keep_in_fp32_modules`). In the step each quantized
layer is de-quantized to the compute dtype for its matmul, one at a time: the largest such weight is added to
the peak as a temporary. Gradients and optimizer state are LoRA's, unchanged.

`optim: adamw_8bit` is planned the same way, by rule (`EightBitAdamWPlan`): bitsandbytes' AdamW8bit keeps both
moments in 8 bits (one byte each per weight) with one fp32 absmax per block of 256 weights per moment, for
tensors of at least 4,096 weights (`min_8bit_size`); smaller tensors keep fp32 moments. Its step is one fused
kernel per tensor, which allocates nothing beside the state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

NF4_BLOCK = 64  # weights per absmax
DOUBLE_QUANT_BLOCK = 256  # absmax values per fp32 second-level constant


def nf4_bytes(weights: int) -> int:
    """Bytes of `weights` weights in NF4 with double quantization."""
    blocks = -(-weights // NF4_BLOCK)
    return weights // 2 + weights % 2 + blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCK)


def quantized_linears(model: nn.Module) -> list[nn.Linear]:
    """The linear layers bitsandbytes' 4-bit loading would quantize (as transformers selects them)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    kept = set(get_keys_to_not_convert(model)) | set(getattr(model, "_keep_in_fp32_modules", None) or [])
    return [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not any(name == key or name.startswith(key + ".") or key in name.split(".") for key in kept)  # fmt: skip
    ]


def as_qlora(plan: object, base: nn.Module, compute_bytes: int, stored_bytes: int = 4) -> object:
    """`plan` (of the same model with LoRA, its frozen weights at `stored_bytes` each) with the quantized weights at
    their NF4 size and one de-quantized weight (`compute_bytes` per element: 2 for bf16/fp16) as a temporary at the
    peak."""
    layers = quantized_linears(base)
    full = sum(layer.weight.numel() * stored_bytes for layer in layers)
    packed = sum(nf4_bytes(layer.weight.numel()) for layer in layers)
    temporary = max((layer.weight.numel() * compute_bytes for layer in layers), default=0)
    saved = full - packed

    def quantized(peak: int) -> int:  # evaluation holds the same base, quantized alike (0: not planned)
        return peak - saved + temporary if peak else 0

    evaluation = {  # the evaluation peaks and the step's before its update, of the unquantized trace, where planned
        key: quantized(getattr(plan, key))
        for key in ("eval_peak", "generation_peak", "peak_before_update")
        if hasattr(plan, key)
    }
    if hasattr(plan, "moments"):  # the frozen weights are sharded (smaller), the de-quantized one is not
        evaluation["moments"] = tuple((unshardable + (0 if updating else temporary), shardable - saved, gradients,
                                       updating) for unshardable, shardable, gradients, updating in plan.moments)  # type: ignore[attr-defined]  # fmt: skip
    if hasattr(plan, "generation_phases"):
        evaluation["generation_phases"] = tuple(quantized(phase) for phase in plan.generation_phases)  # type: ignore[attr-defined]
    return replace(plan, peak=plan.peak - saved + temporary, parameters=plan.parameters - saved, **evaluation)  # type: ignore[type-var]


def qlora_from_lora(lora: object, precision: str, build_base: Callable[[], nn.Module]) -> object:
    """QLoRA's plan from its LoRA step's plan `lora` (as `memory_plan._plan_qlora` makes it, the trace given): the
    base built on fake tensors for its layers' sizes, its frozen weights stored as the LoRA plan stored them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        base = build_base()
    # bf16 compute (fp16 with precision: fp16): 2 bytes either way; the LoRA plan stored the frozen weights so too.
    return as_qlora(lora, base, compute_bytes=2, stored_bytes=2 if precision in ("bf16", "fp16") else 4)


EIGHT_BIT_BLOCK = 256  # weights per absmax of each 8-bit moment
MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep fp32 moments


class EightBitAdamWPlan(torch.optim.Optimizer):
    """AdamW8bit's state sizes and allocation-free step, for the plan (bitsandbytes needs CUDA). The update is
    a plain SGD step: only its memory matters on fake tensors."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]

    @staticmethod
    def _fresh_state(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if weight.numel() < MIN_8BIT_SIZE:
            return {"exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight)}
        blocks = -(-weight.numel() // EIGHT_BIT_BLOCK)
        moment = {"dtype": torch.uint8, "device": weight.device}
        scale = {"dtype": torch.float32, "device": weight.device}
        return {
            "state1": torch.zeros(weight.shape, **moment), "state2": torch.zeros(weight.shape, **moment),  # type: ignore[arg-type]
            "absmax1": torch.zeros(blocks, **scale), "absmax2": torch.zeros(blocks, **scale),  # type: ignore[arg-type]
        }  # fmt: skip

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        """Create the state on first use, then update each weight in place."""
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is None:
                    continue
                if not self.state[weight]:
                    self.state[weight] = self._fresh_state(weight)
                weight.add_(weight.grad, alpha=-group["lr"])


def eight_bit_state_bytes(numel: int) -> int:
    """AdamW8bit's state bytes for one tensor of `numel` weights (fp32 weights below `MIN_8BIT_SIZE`)."""
    if numel < MIN_8BIT_SIZE:
        return 8 * numel
    return 2 * numel + 2 * 4 * -(-numel // EIGHT_BIT_BLOCK)
