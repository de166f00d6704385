"""Fast CPU dropout: the right drop rate in every lane, unbiased, exact gradients, put back after use."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.fast_dropout import (
    ATTENTION_NAME,
    FastDropout,
    apply_dropout,
    drop_threshold,
    fast_dropout,
    keep_mask,
    math_attention,
)
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split

CPU = torch.device("cpu")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.02])
def test_each_lane_drops_with_probability_p(p):
    torch.manual_seed(0)
    n = 1 << 22
    dropped = (~keep_mask((n,), p)).double()
    expected = drop_threshold(p) / 65536
    assert abs(expected - p) <= 1 / 65536
    # Every fourth element shares a lane position of the 64-bit draw: each lane must be uniform.
    for lane in range(4):
        rate = dropped[lane::4].mean().item()
        sigma = math.sqrt(expected * (1 - expected) / (n // 4))
        assert abs(rate - expected) < 5 * sigma, (lane, rate, expected)
    # Neighbouring elements are independent: P(both dropped) = p^2.
    both = (dropped[0::2] * dropped[1::2]).mean().item()
    assert abs(both - expected**2) < 5 * math.sqrt(expected**2 / (n // 2))


def test_kept_values_are_scaled_so_the_mean_is_unbiased_and_the_gradient_matches():
    torch.manual_seed(1)
    x = torch.randn(256, 1024, requires_grad=True)
    out = apply_dropout(x, 0.1)
    kept = out != 0
    scale = 1 / (1 - drop_threshold(0.1) / 65536)
    torch.testing.assert_close(out[kept], x.detach()[kept] * scale)
    ones = apply_dropout(torch.ones(1 << 20), 0.1)
    assert abs(ones.mean().item() - 1.0) < 5 * math.sqrt(0.1 / 0.9 / (1 << 20))
    out.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() * scale)


def test_eval_mode_and_p_zero_return_the_input_and_cuda_style_fallbacks_match_torch():
    x = torch.randn(8, 8)
    assert apply_dropout(x, 0.1, training=False) is x
    assert apply_dropout(x, 0.0) is x
    assert torch.equal(apply_dropout(x, 1.0), F.dropout(x, 1.0))  # all dropped, as torch does


def test_same_seed_same_masks():
    torch.manual_seed(7)
    a = apply_dropout(torch.ones(1000), 0.3)
    torch.manual_seed(7)
    b = apply_dropout(torch.ones(1000), 0.3)
    assert torch.equal(a, b)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_math_attention_without_dropout_equals_sdpa(mask_kind):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 7, 8).unbind(0)
    keep = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    keep[0, :, :, 5:] = False
    mask = keep if mask_kind == "bool" else torch.zeros(2, 1, 7, 7).masked_fill(~keep, torch.finfo(torch.float32).min)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(math_attention(q, k, v, mask, 0.0, None), expected)


def test_model_is_put_back_after_the_block_even_on_error():
    model = tiny_model(dropout=0.1)
    model.eval()
    ids = torch.randint(5, 100, (3, 12))
    attention = torch.ones(3, 12, dtype=torch.long)
    attention[1, 8:] = 0
    before = model(input_ids=ids, attention_mask=attention).logits
    dropouts = sum(type(m) is nn.Dropout for m in model.modules())
    with pytest.raises(RuntimeError), fast_dropout(model, {"input_ids": ids, "attention_mask": attention}) as swapped:
        assert swapped.layers == dropouts and swapped.attention  # every nn.Dropout, plus the attention function
        assert model.config._attn_implementation == ATTENTION_NAME
        assert not any(type(m) is nn.Dropout for m in model.modules())
        # Eval: no dropout anywhere, so exactly the SDPA model's output.
        assert torch.equal(model(input_ids=ids, attention_mask=attention).logits, before)
        raise RuntimeError
    assert model.config._attn_implementation == "sdpa"
    assert sum(type(m) is nn.Dropout for m in model.modules()) == dropouts
    assert not any(isinstance(m, FastDropout) for m in model.modules())


def test_training_drops_out_in_attention_and_hidden_layers():
    model = tiny_model(dropout=0.2)
    ids = torch.randint(5, 100, (4, 16))
    attention = torch.ones(4, 16, dtype=torch.long)
    with fast_dropout(model, {"input_ids": ids[:, :12], "attention_mask": attention[:, :12]}) as use:
        assert use.attention
        model.train()
        torch.manual_seed(0)
        a = model(input_ids=ids, attention_mask=attention).logits
        torch.manual_seed(0)
        b = model(input_ids=ids, attention_mask=attention).logits
        c = model(input_ids=ids, attention_mask=attention).logits
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_training_with_fast_dropout_learns_like_torch_dropout(default_params):
    params = tiny_params(default_params, **{"epochs": 10, "batch_size": 16, "lr": 3e-3, "log_every_n_steps": 1})
    train, validation = tiny_split(rows=160, seed=3), tiny_split(rows=64, seed=4)
    accuracy = {}
    for fast in (True, False):
        model = tiny_model(dropout=0.1)
        result = train_model(
            TrainRequest(
                model,
                train,
                validation,
                tiny_params(params, fast_dropout=fast),
                pad_id=0,
                device=CPU,
                precision="fp32",
                say=lambda _: None,
            )
        )
        accuracy[fast] = result.metrics["val_accuracy"]
        assert model.config._attn_implementation == "sdpa"
        assert not any(isinstance(m, FastDropout) for m in model.modules())
    assert accuracy[True] > 0.9 and abs(accuracy[True] - accuracy[False]) < 0.1, accuracy


def padded_inputs(vocab: int = 100) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones(3, 12, dtype=torch.long)
    attention[1, 8:] = 0
    attention[2, 4:] = 0
    return {"input_ids": ids, "attention_mask": attention}


@pytest.mark.parametrize("bf16", [False, True])
def test_fast_attention_reproduces_sdpa_at_p0_for_bert_masks(bf16):
    from pipelines.train.fast_dropout import attention_mismatch

    model = tiny_model(dropout=0.1)
    inputs = padded_inputs()
    assert attention_mismatch(model, inputs, bf16=bf16) is None  # fp32 within 1e-6; bf16: same dtype, rounding
    with fast_dropout(model, inputs, bf16=bf16) as use:
        assert use.attention and model.config._attn_implementation == ATTENTION_NAME


def test_math_attention_computes_reduced_precision_in_fp32_like_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 7, 8, dtype=torch.bfloat16).unbind(0)
    out = math_attention(q, k, v, None, 0.0, None)
    # SDPA's math path on CPU upcasts bf16 to fp32 and rounds once at the end: so do we.
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).transpose(1, 2).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.1,
        num_labels=3,
        pad_token_id=0,
    )
    return LlamaForSequenceClassification(config)


def test_causal_decoder_keeps_its_own_attention_and_says_why():
    model = tiny_llama()
    inputs = padded_inputs()
    model.eval()
    before = model(**inputs).logits
    with fast_dropout(model, inputs) as use:
        assert not use.attention and "causal" in use.reason
        assert model.config._attn_implementation == "sdpa"
        assert torch.equal(model(**inputs).logits, before)
    assert "stock attention (causal attention" in use.describe()


def test_the_fast_attention_function_never_drops_a_causal_mask():
    from pipelines.train.fast_dropout import _FORCE_MATH, _attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 6, 8).unbind(0)
    causal_module = nn.Module()
    causal_module.is_causal = True
    token = _FORCE_MATH.set(True)  # as in the equality check: the fast path wherever it applies
    try:
        out, _ = _attention(causal_module, q, k, v, None, dropout=0.0, scaling=None)
    finally:
        _FORCE_MATH.reset(token)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, expected)  # delegated to SDPA with its causal mask, not the math path
    leaky = math_attention(q, k, v, None, 0.0, None)
    assert not torch.allclose(leaky, expected)  # what the math path alone would have done


def test_training_tags_say_whether_the_attention_was_swapped(default_params):
    params = tiny_params(default_params, **{"epochs": 1, "batch_size": 16})
    result = train_model(
        TrainRequest(
            tiny_model(dropout=0.1),
            tiny_split(rows=64, seed=3),
            None,
            params,
            pad_id=0,
            device=CPU,
            precision="fp32",
            say=lambda _: None,
        )
    )
    assert result.notes["fast_dropout"].endswith("fast attention dropout")
