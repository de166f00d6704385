"""The plan for N GPUs and nodes (resolve/cluster, sharding_plan, cluster_plan), held against published figures.

The models are Llama-shaped configs shipped as test data (tests/pipelines/model_configs/*/config.json: the shapes of
Llama-3.1-70B, Llama-3.1-8B and Llama-2-70B, no weights): a plan builds them on fake tensors, from their config alone.
The anchors' settings are written down beside each test, from the peers' own files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.gpu_profiles import GPU_PROFILES
from pipelines.params import ParamsError
from pipelines.resolve.cluster import Cluster, cluster_named
from pipelines.resolve.cluster_plan import plan_cluster, unit_planner
from pipelines.resolve.cluster_report import cluster_table
from pipelines.resolve.sharding_plan import Strategy, share_of_gpu
from pipelines.tasks import get_task
from tests.conftest import tiny_params
from tests.pipelines.tasks.test_causal_lm import WordTokenizer

CONFIGS = Path(__file__).parent / "model_configs"
GIB = 2**30


def llama(default_params, config: str, **settings):
    """The project's params for a causal LM fine-tune of the Llama-shaped `config`, as `settings` say."""
    return tiny_params(default_params, **{"task": "causal_lm", "model.name_or_path": str(CONFIGS / config),
                                          "data.packing": False, "fast_dropout": False, **settings})  # fmt: skip


def full_rows(length: int, rows: int = 8, vocab: int = 32_000) -> TokenizedSplit:
    """`rows` rows of exactly `length` tokens (a packed dataset's rows: every one full)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(10, vocab, size=rows * length).astype(np.int32)
    return TokenizedSplit(ids, np.full(rows, length, np.int32), prompt_lengths=np.full(rows, 16, np.int32))


def planner_for(card: str, length: int = 2048):
    return unit_planner(get_task("causal_lm"), full_rows(length), WordTokenizer(), Path("."), Path("."),
                        Cluster(GPU_PROFILES[card]).per_gpu)  # fmt: skip


def test_clusters_are_named_nodes_x_gpus_x_card_and_a_bad_name_says_the_forms(default_params):
    one_node, two_nodes = cluster_named("8xA100-80GB"), cluster_named("2x8xH100-80GB")
    assert (one_node.nodes, one_node.gpus_per_node, one_node.card.name, one_node.workers) == (1, 8, "A100-80GB", 8)
    assert (two_nodes.nodes, two_nodes.gpus_per_node, two_nodes.workers, two_nodes.name) == (2, 8, 16, "2x8xH100-80GB")
    assert cluster_named("A100-80GB") is None and cluster_named("cpu") is None  # single targets: the old path
    assert tiny_params(default_params, target_device="2x8xH100-80GB").target_device == "2x8xH100-80GB"
    for bad in ("8xA100", "0xT4", "8x", "x8xL4"):
        with pytest.raises(ParamsError, match=rf"target_device = '{bad}'.*<gpus>x<card>.*<nodes>x<gpus>x<card>"):
            tiny_params(default_params, target_device=bad)
        with pytest.raises(UserError, match=rf"target_device \(or --target\) = '{bad}'.*8xA100-80GB.*2x8xH100-80GB"):
            cluster_named(bad)


def test_collectives_run_at_the_vendors_link_rates():
    # Hand: NVLink 3 is 600 GB/s both ways per A100 (300 one way); 8 x 200 Gb/s HDR per DGX A100 node is 25 GB/s a
    # GPU; NVLink 4 is 900 GB/s per H100; 8 x 400 Gb/s NDR per DGX H100 node is 50 GB/s a GPU. Times 0.8 (assumed).
    assert cluster_named("8xA100-80GB").collective_link()[1] == pytest.approx(300e9 * 0.8)
    assert cluster_named("8xH100-80GB").collective_link()[1] == pytest.approx(450e9 * 0.8)
    assert cluster_named("2x8xA100-80GB").collective_link()[1] == pytest.approx(25e9 * 0.8)
    assert cluster_named("2x8xH100-80GB").collective_link()[1] == pytest.approx(50e9 * 0.8)
    assert cluster_named("4xT4").collective_link()[1] == pytest.approx(16e9 * 0.8)  # PCIe Gen3 x16, 32 GB/s both ways


# torchtune's README ("Memory and training speed", at commit 0502cc5): Llama 3.1 70B, LoRA, 8x A100, 27.6 GiB peak
# memory per GPU, for batch size 2, no accumulation, a dataset packed to 2048, compile on. Its recipe,
# recipes/configs/llama3_1/70B_lora.yaml: lora_finetune_distributed (FSDP2, reshard after forward), LoRA rank 16,
# alpha 32, dropout 0 on q, v and output projections and the MLP; dtype bf16 (weights, adapter and AdamW state in
# bf16), fused AdamW, CEWithChunkedOutputLoss, activation checkpointing on, offloading off.
TORCHTUNE_70B_LORA = {
    "adapter.type": "lora", "adapter.r": 16, "adapter.alpha": 32, "adapter.dropout": 0.0,
    "adapter.target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "precision": "bf16", "weights_dtype": "bf16", "optim": "adamw", "batch_size": 2, "grad_accum_steps": 1,
    "data.max_length": 2048, "grad_checkpointing": True, "loss_impl": "chunked", "compile": False,
}  # fmt: skip
TORCHTUNE_GIB = 27.6

# Answer.AI's fsdp_qlora, benchmarks_03_2024.md ("Llama-2 70B", dual 3090 and dual 4090): QLoRA, CPU offload, batch
# size 2, context 2048: 14.92 GiB peak per GPU on both rigs. Its train.py defaults: FSDP full shard with
# CPUOffload(offload_params=True), precision bf16 (weights and adapter in bf16), bitsandbytes NF4 (double quantized,
# quant storage bf16), LoRA rank 64, alpha 16, dropout 0.1 on q, k, v, gate, up and down projections, AdamW,
# gradient checkpointing on (the benchmark's flag).
ANSWER_AI_70B_QLORA = {
    "adapter.type": "qlora", "adapter.r": 64, "adapter.alpha": 16, "adapter.dropout": 0.1,
    "adapter.target_modules": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
    "precision": "bf16", "weights_dtype": "bf16", "optim": "adamw", "batch_size": 2, "grad_accum_steps": 1,
    "data.max_length": 2048, "grad_checkpointing": True, "compile": False,
}  # fmt: skip
ANSWER_AI_GIB = 14.92


def anchor_peak(default_params, config: str, settings: dict, cluster: str, strategy: Strategy) -> tuple[float, float]:
    """The planned per-GPU peak in GiB: allocated (as torch's max_memory_allocated), and with the card's reserve."""
    where = cluster_named(cluster)
    plan, units = planner_for(where.card.name)(llama(default_params, config, **settings))
    share = share_of_gpu(plan, units, where, strategy, compute_s=1.0, rows=2)
    return share.peak / GIB, (share.peak + share.reserve) / GIB


def test_a_70b_lora_on_8_a100s_is_planned_within_15_percent_of_torchtunes_figure(default_params):
    peak, _ = anchor_peak(default_params, "llama-3.1-70b", TORCHTUNE_70B_LORA, "8xA100-80GB", Strategy("fsdp"))
    # Planned eager; torchtune's figure is compiled (its README: compile lowers memory), so ours may be above.
    assert peak == pytest.approx(TORCHTUNE_GIB, rel=0.15), peak


def test_a_70b_qlora_with_cpu_offload_on_2_24gb_cards_is_planned_within_15_percent_of_answer_ais(default_params):
    """Answer.AI's tables give the peak *reserved* memory (benchmarks_03_2024.md: "the reported peak reserved memory
    for both 512 and 2048 context length is roughly the same, the peak allocated memory is 8.28 GiB vs 9.16 GiB"),
    which holds the caching allocator's slack (FSDP1's recordStream delays frees, more so with CPU offload) beside
    the tensors. So the comparable figure is the allocated peak with the card's reserve (slack and context); the
    allocated peak alone is well below theirs (0.63x when written), and that gap is the allocator's."""
    allocated, reserved = anchor_peak(default_params, "llama-2-70b", ANSWER_AI_70B_QLORA, "2xRTX4090",
                                      Strategy("fsdp", cpu_offload=True))  # fmt: skip
    assert reserved == pytest.approx(ANSWER_AI_GIB, rel=0.15), reserved
    assert allocated < ANSWER_AI_GIB


def tiny_llama(default_params, **settings):
    """A 12-block Llama built from model.config (deep enough to be planned by depth), 120 words, tied head."""
    return tiny_params(default_params, **{"task": "causal_lm", "model.config.hidden_size": 32,
                                          "model.config.intermediate_size": 64, "model.config.num_attention_heads": 2,
                                          "model.config.num_hidden_layers": 12, "model.config.dropout": 0.0,
                                          "data.packing": False, "data.max_length": 64, "fast_dropout": False,
                                          "precision": "fp32", "batch_size": 2, **settings})  # fmt: skip


def tiny_planner():
    return unit_planner(get_task("causal_lm"), full_rows(64, vocab=120), WordTokenizer(), Path("."), Path("."),
                        Cluster(GPU_PROFILES["A100-80GB"]).per_gpu)  # fmt: skip


def test_units_and_collectives_of_a_small_llama_are_the_hand_counts(default_params):
    plan, units = tiny_planner()(tiny_llama(default_params))
    # Hand: a block is q, k, v, o (4 x 32 x 32) + gate, up, down (3 x 32 x 64) + 2 norms (2 x 32) = 10,304 weights;
    # the root is the tied 120 x 32 embedding and the final norm: 3,872 weights; fp32: 4 bytes each.
    assert (units.layers, units.block_params, units.root_params) == (12, 41_216, 15_488)
    assert units.weights == 12 * 10_304 + 3_872 and plan.parameters == 4 * units.weights
    four = cluster_named("4xA100-80GB")
    fsdp = share_of_gpu(plan, units, four, Strategy("fsdp"), compute_s=1.0, rows=2)
    assert fsdp.gathered == 15_488 + 2 * 41_216 + 41_216  # the root, two blocks, one block's fp32 gradient
    # Per GPU, one micro-batch, ring: 3/4 of (forward's and backward's all-gathers, the root once: 2 x 510,080 -
    # 15,488; the reduce-scatter of 510,080 gradient bytes).
    assert fsdp.collective_bytes == int(0.75 * (2 * 510_080 - 15_488 + 510_080))
    ddp = share_of_gpu(plan, units, four, Strategy("ddp"), compute_s=1.0, rows=2)
    assert ddp.collective_bytes == int(2 * 0.75 * 510_080)  # a ring all-reduce: twice 3/4 of the gradients
    assert ddp.peak == plan.peak + plan.gradients  # DDP's buckets: a copy of every gradient


def test_the_largest_batch_scales_activations_with_rows_as_the_plans_do(default_params):
    planner = tiny_planner()
    plan, units = planner(tiny_llama(default_params, batch_size=2))
    one_gpu = cluster_named("1xA100-80GB")
    share = share_of_gpu(plan, units, one_gpu, Strategy("ddp"), compute_s=1.0, rows=2)
    predicted_at_8 = share.peak + 6 * plan.activations / 2
    planned_at_8 = planner(tiny_llama(default_params, batch_size=8))[0].peak
    assert predicted_at_8 == pytest.approx(planned_at_8, rel=0.10)


def test_a_70b_lora_fits_8_a100s_and_not_one(default_params):
    settings = {**TORCHTUNE_70B_LORA, "loss_impl": "auto"}
    params = llama(default_params, "llama-3.1-70b", **settings)
    planner = planner_for("A100-80GB")
    eight = plan_cluster(params, planner, cluster_named("8xA100-80GB"))
    best = eight.recommended
    assert (best.adapter, best.strategy.name, best.checkpointing) == ("lora", "fsdp", True)
    assert best.share.fits and best.share.largest_batch >= 2 and best.share.step_s > best.share.compute_s > 0
    assert eight.overrides["distributed.num_workers"] == 8 and eight.refused is None, eight.refused
    one = plan_cluster(params, planner, cluster_named("1xA100-80GB"))
    lora = [r for r in one.rows if r.adapter == "lora"]
    # Hand: the bf16 base alone is 2 x 70.55e9 bytes = 131.4 GiB against the card's 80 GiB.
    assert all(not r.share.fits and -r.share.room > 51 * GIB for r in lora)
    assert one.recommended.adapter == "qlora"  # the next leaner tier, as the single-card search goes
    table = cluster_table("default", eight)
    assert "| LoRA | yes | FSDP | " in table and "Recommended on 8xA100-80GB: LoRA, checkpointed, FSDP" in table
