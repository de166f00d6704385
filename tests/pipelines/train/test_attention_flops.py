"""Model FLOPs count attention on every SDPA kernel: one BERT layer and one Llama layer against the formula.

Analytic count of one layer's training step (forward and backward, input and weights trainable), with
B rows of S positions, width H, feed-forward width FFN, and d = H / HEADS:
- linear layers: 2·B·S FLOPs per weight in the forward (a multiply and an add), twice that in the
  backward (the input's gradient and the weight's): BERT's weights are 4H² + 2H·FFN, Llama's are
  2H² + 2H·(KV_HEADS·d) + 3H·FFN (grouped-query K and V; gate, up and down);
- attention: the scores (q·kᵀ) and the weighted values: 2 · 2·B·HEADS·S²·d = 4·B·S²·H forward, again
  twice that backward. Causal attention is counted in full (no halving for the masked half), as
  torch's counter and PaLM's appendix count it.
So a layer's model FLOPs are 3 × (linear + attention forward). Biases, norms, softmax and the rotary
rotation are element-wise and not counted.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import BertConfig, LlamaConfig
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from pipelines.train.flops import flop_counter

B, S, H, FFN, HEADS, KV_HEADS = 2, 48, 64, 256, 4, 2


def _bert_layer() -> tuple[torch.nn.Module, dict]:
    config = BertConfig(hidden_size=H, num_attention_heads=HEADS, intermediate_size=FFN, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    config._attn_implementation = "sdpa"
    return BertLayer(config), {}


def _llama_layer() -> tuple[torch.nn.Module, dict]:
    config = LlamaConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         intermediate_size=FFN, num_hidden_layers=1)  # fmt: skip
    config._attn_implementation = "sdpa"
    positions = torch.arange(S).unsqueeze(0).expand(B, S)
    # The rotary table is built outside the counted step: it is the model's, not the layer's.
    cos_sin = LlamaRotaryEmbedding(config)(torch.zeros(B, S, H), positions)
    return LlamaDecoderLayer(config, layer_idx=0), {"position_embeddings": cos_sin, "position_ids": positions}


def _analytic(kind: str) -> int:
    d = H // HEADS
    weights = 4 * H * H + 2 * H * FFN if kind == "bert" else 2 * H * H + 2 * H * KV_HEADS * d + 3 * H * FFN
    forward = 2 * B * S * weights + 4 * B * S * S * H
    return 3 * forward


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
def test_attention_flops_match_the_analytic_count(kind, backend):
    layer, kwargs = _bert_layer() if kind == "bert" else _llama_layer()
    hidden = torch.randn(B, S, H, requires_grad=True)
    with sdpa_kernel(backend), flop_counter(model_work=True) as counter:
        out = layer(hidden, **kwargs)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert counter.get_total_flops() == _analytic(kind)


def test_the_hardware_count_keeps_the_flash_backwards_recompute():
    layer, _ = _bert_layer()
    hidden = torch.randn(B, S, H, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), flop_counter(model_work=False) as counter:
        out = layer(hidden)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    recompute = 2 * B * S * S * H  # the scores, once more
    assert counter.get_total_flops() == _analytic("bert") + recompute
