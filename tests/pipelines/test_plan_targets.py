"""Planning a CUDA run on a machine without one: GPU profiles, a card's rules on the fake step, the plan stage.

BERT-base's activations are checked against an analytic count derived here (per layer, in bytes per token x
hidden, T = batch x length tokens, h = 768, I = 4h, fp32 unless said):

- fp32 on an Ampere card (SDPA picks memory-efficient attention: dropout and a padding mask rule out flash):
  the QKV linears' input 4, Q, K, V 3 x 4, attention output 4 and its contiguous copy for the output linear 4,
  the output dropout's mask 1, LayerNorm 1's input 4, its output (the MLP's input) 4, the pre-GELU 4 x 4, GELU's
  output 4 x 4, the MLP dropout's mask 1, LayerNorm 2's input 4: 70 x T x h, plus the kernel's fp32 log-sum-exp
  per head and row (4 x T x heads). The embeddings add their LayerNorm's input 4 and dropout mask 1.
- bf16 (CUDA autocast: linears and attention in bf16, LayerNorm and residual sums in fp32): each of the three
  QKV linears casts its fp32 input 3 x 2, Q, K, V 3 x 2, attention output and copy 2 x 2, mask 1, LayerNorm 1's
  input 4, the MLP's cast input 2, pre-GELU 4 x 2, GELU output 4 x 2, mask 1, LayerNorm 2's input 4: 44 x T x h,
  plus the log-sum-exp, plus autocast's cached bf16 copy of every encoder weight (2 bytes each) for the step.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.gpu_profiles import GPU_PROFILES, gpu_profile, profile_for_device
from pipelines.params import Params, ParamsError
from pipelines.resolve.cuda_plan import CudaAttention, allocation_rounding, cuda_autocast, sdpa_backend
from pipelines.resolve.memory_plan import plan_memory
from pipelines.resolve.qlora_plan import eight_bit_state_bytes
from pipelines.resolve.target import CPU_TARGET, PlanTarget, target_named
from pipelines.tasks import get_task
from tests.conftest import REPO_ROOT, tiny_params

CARDS = ["H100-80GB", "H200", "A100-40GB", "A100-80GB", "L4", "A10G", "T4", "RTX4090"]
TOKENS, LENGTH, HIDDEN, LAYERS, HEADS = 32 * 128, 128, 768, 12, 12


def bert_base() -> BertForSequenceClassification:
    return BertForSequenceClassification(BertConfig(num_labels=4))  # BERT-base: 12 x 768, 12 heads, 30,522 words


def bert_parameter_count(config: BertConfig, labels: int = 4) -> int:
    """BERT's weights by formula: embeddings, 12 layers, pooler, classifier."""
    h, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    embeddings = (config.vocab_size + config.max_position_embeddings + config.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + (h * inner + inner) + (inner * h + h) + 2 * 2 * h
    return embeddings + layers * layer + (h * h + h) + (h * labels + labels)


def bert_params(default_params: Params, precision: str) -> Params:
    settings = {"batch_size": 32, "precision": precision, "data.bucketing": False, "fast_dropout": False,
                "data.pad_to_multiple_of": None, "optim": "adamw", "data.max_length": LENGTH}  # fmt: skip
    return tiny_params(default_params, **settings)


def full_rows(rows: int = 64, length: int = LENGTH) -> TokenizedSplit:
    return TokenizedSplit(
        np.full(rows * length, 5, dtype=np.int32), np.full(rows, length, dtype=np.int32), np.zeros(rows, np.int64)
    )


def plan_bert(default_params: Params, precision: str, target: PlanTarget):
    params = bert_params(default_params, precision)
    task = get_task("classification")
    return plan_memory(params, task, full_rows(), bert_base, lambda m: m, 0, target.precision(params), target=target)


def test_every_profile_named_in_the_issue_exists_and_an_unknown_name_is_refused_listing_them(default_params):
    assert list(GPU_PROFILES) == CARDS
    for name in CARDS:
        card = gpu_profile(name)
        assert card.memory_bytes > 10 * 2**30 and card.fp16_flops > card.fp32_flops
        assert card.budget_bytes() + card.reserve_bytes(card.budget_bytes()) <= card.memory_bytes
    with pytest.raises(ParamsError, match="target_device.*A100-40GB.*RTX4090"):
        tiny_params(default_params, target_device="A100")
    with pytest.raises(ParamsError, match="memory_budget.*GPU profile.*T4"):
        tiny_params(default_params, memory_budget="T5")
    with pytest.raises(UserError, match="known: H100-80GB"):
        target_named("V100")
    assert tiny_params(default_params, memory_budget="A100-40GB").memory_budget == "A100-40GB"
    assert tiny_params(default_params, memory_budget="8GB").memory_budget == 8 * 10**9
    assert profile_for_device("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert profile_for_device("NVIDIA L40S") is None  # not an L4


def test_bf16_on_a_card_without_it_is_refused_and_auto_picks_what_the_card_has(default_params):
    with pytest.raises(UserError, match="T4 has no bf16"):
        target_named("T4").precision(tiny_params(default_params, precision="bf16"))
    auto = tiny_params(default_params, precision="auto")
    assert target_named("T4").precision(auto) == "fp16" and target_named("A100-40GB").precision(auto) == "bf16"


def test_the_sdpa_backend_follows_the_cards_capability_dtype_and_mask():
    a100, t4 = gpu_profile("A100-40GB"), gpu_profile("T4")
    assert sdpa_backend(a100, torch.bfloat16, 64, masked=False) == "flash"
    assert sdpa_backend(a100, torch.bfloat16, 64, masked=True) == "efficient"
    assert sdpa_backend(a100, torch.float32, 64, masked=False) == "efficient"
    assert sdpa_backend(t4, torch.float16, 64, masked=False) == "efficient"  # flash needs 8.0
    assert sdpa_backend(t4, torch.bfloat16, 64, masked=False) == "math"  # no bf16 kernel before 8.0
    assert sdpa_backend(a100, torch.float16, 60, masked=False) == "math"  # not a multiple of 8


def test_cuda_autocast_runs_softmax_and_norms_in_fp32_and_caches_each_weight_cast_once():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)
    with cuda_autocast(torch.bfloat16):
        hidden = F.linear(x, weight)
        again = F.linear(x, weight)
        assert hidden.dtype == torch.bfloat16
        assert F.softmax(hidden, -1).dtype == torch.float32  # CPU autocast would keep bf16
        assert F.layer_norm(hidden, (8,)).dtype == torch.float32
        assert hidden.sum().dtype == torch.float32 and hidden.pow(2).dtype == torch.float32
        with torch.autocast("cpu", enabled=False):
            assert F.linear(x, weight).dtype == torch.float32  # a region that turns autocast off stays fp32
    assert again.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.softmax(F.linear(x, weight), -1).dtype == torch.bfloat16  # CPU's rule, for contrast


def test_fused_attention_saves_no_probabilities_and_gives_the_math_result():
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    with CudaAttention(gpu_profile("A100-40GB")):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert [tuple(t.shape) for t in saved] == [(2, 4, 16, 8)] * 4 + [(2, 4, 16)]  # q, k, v, output, log-sum-exp
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (q, k, v)))


def test_allocation_rounding_counts_every_tensor_in_512_byte_blocks():
    from torch.distributed._tools.mem_tracker import _MemRefType, _WeakRefInfo

    from pipelines.train.memory import track_training_peak  # noqa: F401 - the tracker the plan uses

    with allocation_rounding():
        assert _WeakRefInfo(3, 4, torch.device("cpu"), _MemRefType.ACT).mem_consumed == 512
    assert _WeakRefInfo(3, 4, torch.device("cpu"), _MemRefType.ACT).mem_consumed == 12


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bert_base_on_an_a100_exact_state_and_activations_within_10_percent_of_the_analytic_count(
    default_params, precision
):
    plan = plan_bert(default_params, precision, target_named("A100-40GB"))
    weights = bert_parameter_count(BertConfig())
    assert plan.parameters == 4 * weights and plan.gradients == 4 * weights
    assert plan.optimizer_state == 8 * weights  # AdamW: two fp32 moments
    assert plan.batch_rows == 32 and plan.batch_width == LENGTH and plan.target == "A100-40GB"
    lse = 4 * TOKENS * HEADS
    per_layer = (70 if precision == "fp32" else 44) * TOKENS * HIDDEN + lse
    analytic = LAYERS * per_layer + 5 * TOKENS * HIDDEN
    if precision == "bf16":
        encoder_weights = LAYERS * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * 4 * HIDDEN)
        analytic += 2 * encoder_weights  # autocast's cached casts
    assert abs(plan.activations / analytic - 1) <= 0.10, (plan.activations, analytic)
    assert plan.peak % 512 == 0


def test_a_card_plans_less_attention_memory_than_the_cpu_where_dropout_forces_the_math_kernel(default_params):
    on_cpu = plan_bert(default_params, "fp32", CPU_TARGET)
    on_card = plan_bert(default_params, "fp32", target_named("A100-40GB"))
    probabilities = LAYERS * 32 * HEADS * LENGTH * LENGTH * (4 + 1)  # fp32 probabilities and their dropout mask
    assert on_cpu.activations - on_card.activations >= probabilities
    assert on_cpu.parameters == on_card.parameters


def test_eight_bit_adamw_is_planned_by_rule_without_bitsandbytes(default_params):
    from tests.pipelines.train.helpers import tiny_model, tiny_split

    params = tiny_params(default_params, optim="adamw_8bit", batch_size=16, fast_dropout=False)
    task = get_task("classification")
    plan = plan_memory(params, task, tiny_split(rows=32), lambda: tiny_model(layers=2, hidden=64), lambda m: m, 0,
                       "fp32", target=target_named("A100-40GB"))  # fmt: skip
    expected = sum(eight_bit_state_bytes(p.numel()) for p in tiny_model(layers=2, hidden=64).parameters())
    assert plan.optimizer_state == expected
    assert eight_bit_state_bytes(4096) == 2 * 4096 + 2 * 4 * 16 and eight_bit_state_bytes(100) == 800


def test_the_budget_weighs_precisions_by_the_cards_peaks():
    from pipelines.resolve.budget import precision_speed

    h100 = target_named("H100-80GB")
    assert precision_speed("bf16", h100) == pytest.approx(989.4 / 67.0)  # tf32 auto: off for the fp32 baseline
    assert precision_speed("fp32", h100, tf32=True) == pytest.approx(494.7 / 67.0)
    assert precision_speed("fp16", target_named("T4")) == pytest.approx(65.0 / 8.1)


def test_memory_budget_naming_a_card_is_its_memory_less_the_reserve(default_params):
    from pipelines.resolve.budget import budget_bytes

    params = tiny_params(default_params, memory_budget="T4")
    assert budget_bytes(params) == gpu_profile("T4").budget_bytes()


def test_the_plan_stage_refuses_an_unknown_target_listing_the_profiles(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "stages.plan", "--target", "V100"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "V100" in done.stderr and "A100-40GB" in done.stderr and "Traceback" not in done.stderr


def test_plan_targets_gives_a_verdict_and_the_fastest_fitting_config_per_card(default_params, tmp_path):
    from pipelines.prepare import prepare_dataset
    from pipelines.resolve.plan_report import plan_targets, target_table

    variants = {"vanilla": {}}
    # fp32 as written (the default, auto, resolves per card: fp16 on a T4, bf16 on an H100).
    settings = {"data.generator.num_rows": 300, "tune.variants": variants, "batch_size": 8, "precision": "fp32"}
    params = tiny_params(default_params, **settings)
    prepare_dataset(params, tmp_path, tmp_path / "tokenized")
    targets = [target_named("T4"), target_named("H100-80GB")]
    plans = plan_targets(params, tmp_path, tmp_path / "tokenized", targets)
    assert list(plans) == ["T4", "H100-80GB"]
    for name, entries in plans.items():
        for entry in entries.values():
            assert entry.plan is not None and entry.plan.target == name and entry.fits is True
            assert entry.reserve >= 768 * 2**20 and "strategy auto" in entry.fastest
        table = target_table(name, entries)
        assert f"Target: {name}" in table and "| vanilla | fp32 |" in table and "fastest that fits the " in table
        # The verdict in plain words, then the precision it recommends: the card's native 16-bit (fp16 on a T4,
        # bf16 on an H100) though fp32 was written, since it fits too and is never slower.
        native = "fp16" if name == "T4" else "bf16"
        assert f" GiB to spare | {native} |" in table and f"train in {native}: the card's native 16-bit" in table
        assert "TF32 for fp32 matmuls, as assumed: vanilla off" in table
        assert max(len(line) for line in table.splitlines() if line.startswith("|")) <= 120
        assert "tier" not in table and "memory_budget" not in table  # no search jargon when no budget was set
    # This tiny model's step is launch-bound on both cards (predicted: its FLOPs take microseconds, its ops'
    # launches milliseconds), so 16-bit buys nothing and the params are kept as written, with the predicted time.
    for name in plans:
        assert "nothing changed" in plans[name]["vanilla"].fastest and " ms per step" in plans[name]["vanilla"].fastest
        assert plans[name]["vanilla"].step.eager_s > 0
        # Kept as written, the advice's room is the Fits cell's (both count the card's reserve at the peak).
        spare = re.search(r"yes, ([\d.,]+ GiB) to spare", target_table(name, plans[name])).group(1)
        assert (
            "as written; peak " in plans[name]["vanilla"].advice
            and f"{spare} to spare" in plans[name]["vanilla"].advice
        )


def test_the_plan_recommends_bf16_where_the_card_runs_it_and_its_step_times_follow_the_cards_peaks(
    default_params, tmp_path
):
    from dataclasses import replace

    from pipelines.gpu_profiles import GPU_PROFILES
    from pipelines.prepare import prepare_dataset
    from pipelines.resolve.plan_report import plan_targets
    from pipelines.resolve.step_time import peak_flops, predict_step

    params = tiny_params(default_params, **{"data.generator.num_rows": 300, "batch_size": 8, "precision": "fp32"})
    prepare_dataset(params, tmp_path, tmp_path / "tokenized")
    targets = [target_named(name) for name in GPU_PROFILES]
    assert len(targets) == 8
    plans = plan_targets(params, tmp_path, tmp_path / "tokenized", targets)
    for name in ("L4", "A100-40GB"):  # both run bf16 natively: fp32 as written is not what the plan recommends
        assert plans[name]["default"].recommended == "bf16", plans[name]["default"].advice
    # Over the 8 cards, the same plan's step (made compute-bound: 10 PFLOP a step) orders as the cards' peaks do,
    # in each precision and TF32 setting the card runs; a launch-bound step ties (the host's launch cost).
    plan = replace(plans["L4"]["default"].plan, step_flops=1e16)
    for precision, tf32 in (("fp32", False), ("fp32", True), ("bf16", "auto")):
        runs = [t for t in targets if precision != "bf16" or t.card.bf16_flops]
        steps = sorted((peak_flops(precision, t, tf32), predict_step(plan, precision, t, tf32).compiled_s)
                       for t in runs)  # fmt: skip
        assert all(a[1] >= b[1] for a, b in zip(steps, steps[1:], strict=False)), (precision, tf32, steps)
        assert steps[0][1] > steps[-1][1]


def test_the_plan_stage_plans_a_packed_run_on_its_packs_as_the_trial_does(default_params, tmp_path):
    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.prepare import prepare_dataset
    from pipelines.resolve.plan_report import plan_targets

    settings = {"task": "causal_lm", "data.generator.num_rows": 300, "data.max_length": 128, "batch_size": 4}
    unpacked = tiny_params(default_params, **settings)
    prepare_dataset(unpacked, tmp_path, tmp_path / "tokenized")
    longest_row = int(TokenizedSplit.load(tmp_path / "tokenized" / "train").lengths.max())
    packed = tiny_params(unpacked, **{"data.packing": True})
    plan = plan_targets(packed, tmp_path, tmp_path / "tokenized", [CPU_TARGET], fastest=False)["cpu"]["default"].plan
    assert longest_row < plan.batch_width <= 128  # packs of several rows, not the longest row


def test_qlora_is_planned_for_a_gpu_from_this_cpu(default_params):
    from pipelines.adapters import apply_adapter
    from tests.pipelines.test_memory_plan import llama_case

    lora_params, task, train, build = llama_case(default_params, {"adapter.type": "lora", "precision": "bf16"})
    qlora_params = tiny_params(lora_params, **{"adapter.type": "qlora"})
    card = target_named("T4")
    lora = plan_memory(lora_params, task, train, build, lambda m: apply_adapter(m, lora_params.adapter, task), 0,
                       "fp16", target=card)  # fmt: skip
    qlora = plan_memory(qlora_params, task, train, build, lambda m: m, 0, "fp16", target=card)
    assert qlora.target == "T4" and qlora.parameters < lora.parameters and qlora.peak < lora.peak
    assert (qlora.gradients, qlora.optimizer_state) == (lora.gradients, lora.optimizer_state)


def test_strategy_auto_offers_qlora_on_a_card_when_no_lora_plan_fits(default_params):
    from pipelines.adapters import apply_adapter
    from pipelines.resolve.budget import choose_strategy
    from tests.pipelines.test_memory_plan import llama_case

    # A LoRA run with Adafactor already: the search's earlier tiers are LoRA's (the grid kept small: every plan of
    # it is a fake step, about a second each here).
    settings = {"model.config.hidden_size": 256, "precision": "fp16", "batch_size": 2, "optim": "adafactor",
                "adapter.type": "lora"}  # fmt: skip
    params, task, train, build = llama_case(default_params, settings)
    card = target_named("T4")

    def plan(candidate: Params):
        lora = candidate.adapter.type == "lora"
        adapt = (lambda m: apply_adapter(m, candidate.adapter, task, candidate)) if lora else (lambda m: m)
        return plan_memory(candidate, task, train, build, adapt, 0, candidate.precision, target=card)

    leanest = {"batch_size": 1, "grad_accum_steps": 2, "grad_checkpointing": True}
    lora = plan(tiny_params(params, **leanest)).peak
    qlora = plan(tiny_params(params, **leanest, **{"adapter.type": "qlora"})).peak
    assert qlora < lora  # the base in 4 bits
    budgeted = tiny_params(params, strategy="auto", memory_budget=(qlora + lora) // 2)
    choice = choose_strategy(budgeted, plan, card, planning=True)
    assert choice.params.adapter.type == "qlora" and choice.plan.peak <= budgeted.memory_budget, choice.why
    assert "adapter.type: qlora" in choice.why and "tier 2 of 2" in choice.why, choice.why
    # Below even QLoRA's leanest the refusal names it as tried, and suggests what is left.
    with pytest.raises(UserError, match="or QLoRA; the leanest .*adapter.type: qlora.*What would fit: a shorter"):
        choose_strategy(tiny_params(budgeted, memory_budget=qlora // 2), plan, card, planning=True)


def test_a_cards_dropout_keeps_a_bool_mask_as_cudas_fused_kernel_does():
    # LoRA's dropout runs on an fp32 copy of each adapted layer's input: planned with the CPU's fp32 noise, a
    # Llama-shaped 1.1B's plan was 96 MiB a block above the H200's allocator (benchmarks/RESULTS.md).
    x = torch.randn(64, 64, requires_grad=True)
    with target_named("A100-40GB").rules():
        on_card = F.dropout(x, 0.1, training=True)
        assert F.dropout(x, 0.1, training=False) is x
    assert on_card.grad_fn.name() == "NativeDropoutBackward0" and on_card.grad_fn._saved_result1.dtype == torch.bool
    assert F.dropout(x, 0.1, training=True).grad_fn._saved_other.dtype == torch.float32  # the CPU's own
    on_card.sum().backward()
    assert torch.equal(x.grad != 0, on_card != 0)  # the mask's gradient: zero where dropped


def test_a_plan_for_several_workers_says_its_figures_are_each_workers(default_params, tmp_path):
    """`distributed.num_workers: 8` planned for one card printed `Target: A100-80GB` and "fastest that fits the
    A100-80GB", as if one card held the run: the figures are each worker's, on a card of its own (issue 71)."""
    from pipelines.prepare import prepare_dataset
    from pipelines.resolve.plan_report import plan_targets, target_table

    settings = {"data.generator.num_rows": 300, "tune.variants": {"vanilla": {}}, "batch_size": 8, "precision": "fp32",
                "distributed.num_workers": 2}  # fmt: skip
    params = tiny_params(default_params, **settings)
    prepare_dataset(params, tmp_path, tmp_path / "tokenized")
    plans = plan_targets(params, tmp_path, tmp_path / "tokenized", [target_named("T4")])
    table = target_table("T4", plans["T4"], params)
    assert table.startswith(
        "Target: T4, one per worker (2 DDP workers): every peak, fit and step below is one worker's"
    )
    assert "fastest that fits each worker's T4 (2 DDP workers): " in table, table
    assert "one per worker" not in target_table("T4", plans["T4"], tiny_params(default_params, **{
        **settings, "distributed.num_workers": 1}))  # fmt: skip
