"""The figures README.md and docs/ quote from a JSON in benchmarks/ (or a config the tests ship), computed here from
that file and looked for in the page: a re-run that moves a figure, or an edit that drifts from it, fails here.
Only files are read; nothing trains. A page is compared with its line breaks and indents folded into spaces."""

from __future__ import annotations

import json
import math

from pipelines.gpu_profiles import MIB, gpu_profile
from tests.conftest import REPO_ROOT

BENCH = REPO_ROOT / "benchmarks"
GIB = 2**30


def evidence(name: str) -> dict:
    return json.loads((BENCH / name).read_text(encoding="utf-8"))


def page(path: str) -> str:
    """The page's text with every run of whitespace (line breaks, list indents) as one space."""
    return " ".join((REPO_ROOT / path).read_text(encoding="utf-8").split())


def says(path: str, *phrases: str) -> None:
    text = page(path)
    missing = [phrase for phrase in phrases if phrase not in text]
    assert not missing, f"{path} does not say {missing}"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def h100_runs() -> dict[str, dict]:
    """The configurations of the two H100 JSONs measured after the weight-leak fix, by name."""
    runs = {}
    for name in ("bench_gpu_h100_bert.json", "bench_gpu_h100_llama.json"):
        data = evidence(name)
        assert (data["device"], data["torch"], data["transformers"]) == (
            "NVIDIA H100 80GB HBM3",
            "2.11.0+cu130",
            "5.23.0",
        )
        runs.update(data["results"])
    return runs


def test_plan_memory_gives_the_h100_plans_as_the_json_holds_them():
    """plan-memory.md, "Checked on a GPU": "the 12 configurations ... were planned within 0.93-1.03x of
    torch.cuda.max_memory_allocated" on "one H100 80GB, 2026-11-24, torch 2.11.0+cu130, transformers 5.23.0"; and
    benchmarks.md's plan_cards line. From benchmarks/bench_gpu_h100_bert.json and bench_gpu_h100_llama.json: every
    run with a plan (Liger's is NaN)."""
    ratios = [
        run["planned_peak_mb"] / run["peak_allocated_mb"]
        for run in h100_runs().values()
        if not math.isnan(run.get("planned_peak_mb", math.nan))
    ]
    low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
    assert len(ratios) == 12 and (low, high) == ("0.93", "1.03"), (len(ratios), low, high)
    says(
        "docs/how-to/plan-memory.md",
        f"the {len(ratios)} configurations",
        f"within {low}-{high}x of `torch.cuda.max_memory_allocated`",
        "one H100 80GB, 2026-11-24, torch 2.11.0+cu130, transformers 5.23.0",
    )
    says(
        "docs/reference/benchmarks.md",
        f"within {low}-{high}x of the measured peak for the {len(ratios)} configurations",
    )


def test_the_reserve_figures_are_the_h100s_context_and_allocator_slack():
    """plan-memory.md's reserve: "measured on one H100 80GB ... the context took 619-787 MiB and the reserved peak
    was 4-28% above the allocated one", and search-and-schedule.md's "619-787 MiB a process on one H100 80GB" (not an
    H200). From benchmarks/bench_gpu_h100_bert_before_leak_fix.json (`outside_allocator_mb`, start and end of the
    call) and the reserved/allocated peaks of bench_gpu_h100_bert.json and bench_gpu_h100_llama.json."""
    first_call = evidence("bench_gpu_h100_bert_before_leak_fix.json")
    assert first_call["device"] == "NVIDIA H100 80GB HBM3"
    context = first_call["outside_allocator_mb"]
    span = f"{round(context['start'])}-{round(context['end'])} MiB"
    slack = [run["peak_reserved_mb"] / run["peak_allocated_mb"] - 1 for run in h100_runs().values()]
    share = f"{round(100 * min(slack))}-{round(100 * max(slack))}%"
    assert (span, share) == ("619-787 MiB", "4-28%"), (span, share)
    says(
        "docs/how-to/plan-memory.md",
        f"measured on one H100 80GB, 2026-11-24, on an earlier commit (torch 2.11.0+cu130), the context took {span}",
        f"the reserved peak was {share} above the allocated one",
    )
    says("docs/how-to/search-and-schedule.md", f"the CUDA context: {span} a process on one H100 80GB, 2026-11-24")
    assert f"{span} a process on an H200" not in page("docs/how-to/search-and-schedule.md")


def test_plan_memory_gives_bert_bases_h100_step_as_both_measurements_hold_it():
    """plan-memory.md, strategy: auto: BERT-base's bf16 step at batch 32 "took 58 ms on 2026-11-24 ... and 31.5 ms
    eager on 2026-11-26 ..., for at most 2.2 ms of arithmetic at the card's peak", and the plan's "58.0 ms, 1.8x the
    later measurement". From benchmarks/bench_gpu_h100_bert.json (bf16: batch 32 over samples/s; the model's FLOPs
    per position x 32 x 128 at the H100's bf16 peak) and bench_gpu_parts_bert_h100.json ("ours eager")."""
    first = evidence("bench_gpu_h100_bert.json")
    first_ms = 32 / first["results"]["bf16"]["samples_per_s"] * 1e3
    arithmetic_ms = first["model_flops_per_position"]["bert"] * 32 * 128 / gpu_profile("H100-80GB").bf16_flops * 1e3
    later = evidence("bench_gpu_parts_bert_h100.json")
    assert (later["device"], later["torch"]) == ("NVIDIA H100 80GB HBM3", "2.11.0+cu130")
    eager = later["summary"]["ours eager"]
    measured, predicted = eager["step_ms"]["median"], eager["predicted_step_ms"]["median"]
    says(
        "docs/how-to/plan-memory.md",
        f"took {first_ms:.0f} ms on 2026-11-24 (`benchmarks/bench_gpu_h100_bert.json`)",
        f"{measured:.1f} ms eager on 2026-11-26 (`benchmarks/bench_gpu_parts_bert_h100.json`)",
        f"at most {arithmetic_ms:.1f} ms of arithmetic",
        f"it predicted {predicted:.1f} ms, {predicted / measured:.1f}x the later measurement",
    )


def test_plan_memory_gives_the_cpu_plans_error_as_bench_plan_recorded_it():
    """plan-memory.md's opening: the plan "equals the measured peak, to a few bytes, for vanilla, bf16,
    checkpointing, accumulation, Adafactor and LoRA", and "With fast dropout it was 8.6% above". From
    benchmarks/bench_plan_results.json (predicted and measured peaks in MiB)."""
    results = evidence("bench_plan_results.json")["results"]
    for name in ("vanilla", "bf16", "checkpointing", "grad_accum (8x4)", "adafactor", "lora"):
        gap_bytes = abs(results[name]["predicted_peak_mb"] - results[name]["measured_peak_mb"]) * MIB
        assert gap_bytes < 64, (name, gap_bytes)
    says("docs/how-to/plan-memory.md", f"fast dropout it was {100 * results['fast dropout']['error']:.1f}% above")


def test_plan_memory_gives_smollm2_loras_plan_error_as_the_levers_run_recorded_it():
    """plan-memory.md: SmolLM2-135M-Instruct from GGUF with LoRA "planned 0.002-0.006% below the measured CPU peak".
    From benchmarks/bench_memory_levers.json, its LoRA configurations (planned and measured peak MiB)."""
    errors = [
        run["planned_peak_mb"] / run["peak_train_memory_mb"] - 1
        for run in evidence("bench_memory_levers.json")["LoRA"].values()
    ]
    assert all(error < 0 for error in errors), errors
    low, high = f"{-100 * max(errors):.3f}", f"{-100 * min(errors):.3f}"
    says("docs/how-to/plan-memory.md", f"planned {low}-{high}% below the measured CPU peak")


def test_plan_memory_gives_bert_bases_a100_plan_as_plan_cards_wrote_it():
    """plan-memory.md: BERT-base's fp32 step "2,418.5 MiB for an A100", and "Checked on this CPU": "109,485,316
    weights", "fp32 2,418.5 MiB planned", "bf16 1,746.7 MiB". From benchmarks/plan_cards_bert_base.json (A100-40GB,
    fp32 and bf16 plans: parameter bytes at 4 a weight, activation bytes)."""
    a100 = evidence("plan_cards_bert_base.json")["A100-40GB"]
    weights = a100["fp32"]["plan"]["parameters"] // 4
    fp32, bf16 = (a100[precision]["plan"]["activations"] / MIB for precision in ("fp32", "bf16"))
    says(
        "docs/how-to/plan-memory.md",
        f"{fp32:,.1f} MiB for an A100",
        f"({weights:,} weights)",
        f"fp32 {fp32:,.1f} MiB planned",
        f"bf16 {bf16:,.1f} MiB against",
    )


def test_the_8b_frozen_base_is_given_in_the_units_its_weights_make():
    """causal-lm.md's LoRA bullet: "an 8B base: 15.0 GiB instead of 29.9 GiB", and plan-memory.md's "plans its frozen
    base at 15,316.5 MiB instead of 30,633.0 MiB". From tests/pipelines/model_configs/llama-3.1-8b/config.json, the
    weight count tests/pipelines/test_plan_depth.py asserts (untied embeddings and head, GQA k and v, the MLP, two
    norms a block, the final norm) at 2 and 4 bytes."""
    config = json.loads((REPO_ROOT / "tests/pipelines/model_configs/llama-3.1-8b/config.json").read_text())
    h, inner = config["hidden_size"], config["intermediate_size"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * inner + 2 * h
    weights = 2 * config["vocab_size"] * h + config["num_hidden_layers"] * block + h
    says("docs/tutorials/causal-lm.md", f"{2 * weights / GIB:.1f} GiB instead of {4 * weights / GIB:.1f} GiB")
    says("docs/how-to/plan-memory.md", f"{2 * weights / MIB:,.1f} MiB instead of {4 * weights / MIB:,.1f} MiB")


def test_benchmarks_page_gives_the_trainer_ratios_as_bench_train_recorded_them():
    """benchmarks.md's headline: "0.98x its step time and 1.00x its wall time in fp32 on an AVX2 host", "1.01x and
    0.98x on the steps in fp32 and bf16 on an AVX-512 BF16 host", fastest fp32 "0.87x the Trainer's step time and
    0.88x its wall time", bf16 "0.78x of its step time", accuracy "(88.75% vs 88.62%)". From
    benchmarks/bench_train_overhead.json and bench_train_results.json (their summaries)."""
    avx2 = evidence("bench_train_overhead.json")["summary"]
    avx512 = evidence("bench_train_results.json")["summary"]

    def ratio(runs: dict, ours: str, theirs: str, clock: str = "train_time_s") -> str:
        return f"{runs[ours][clock] / runs[theirs][clock]:.2f}x"

    trainer = "HF Trainer fp32"
    says(
        "docs/reference/benchmarks.md",
        f"{ratio(avx2, 'bucketing', trainer)} its step time and {ratio(avx2, 'bucketing', trainer, 'wall_time_s')} its"
        " wall time in fp32 on an AVX2 host",
        f"{ratio(avx512, 'bucketing', trainer)} and {ratio(avx512, 'bucketing+bf16', 'HF Trainer bf16')} on the steps",
        f"takes {ratio(avx2, 'bucketing+fast dropout', trainer)} the Trainer's step time and"
        f" {ratio(avx2, 'bucketing+fast dropout', trainer, 'wall_time_s')} its wall time",
        f"fast dropout took {ratio(avx512, 'bucketing+bf16+fast dropout', 'HF Trainer bf16')} of its step time",
        f"({100 * avx2['bucketing+fast dropout']['accuracy']:.2f}% vs {100 * avx2[trainer]['accuracy']:.2f}%)",
    )


def test_troubleshooting_gives_minilms_compile_figures_as_bench_compile_recorded_them():
    """troubleshooting.md's compile bullet: "MiniLM compiled in 75 s (15 s from the cache), but with a dynamic width
    its steps ran at 1.02-1.10x of eager's time". From benchmarks/bench_compile_results.json (MiniLM: medians of the
    rounds; steps loaded warm, from the blob and from the cache, against eager's)."""
    minilm = evidence("bench_compile_results.json")["minilm"]

    def middle(run: str, key: str) -> float:
        return median([row[key] for row in minilm[run]])

    eager = middle("eager", "train_time_s")
    warm = sorted(middle(run, "train_time_s") / eager for run in ("blob", "cached"))
    says(
        "docs/how-to/troubleshooting.md",
        f"MiniLM compiled in {middle('cold', 'compile_time_s'):.0f} s ({middle('cached', 'compile_time_s'):.0f} s from"
        " the cache)",
        f"its steps ran at {warm[0]:.2f}-{warm[-1]:.2f}x of eager's time",
    )


def test_plan_memory_gives_lr_autos_result_as_bench_lr_recorded_it():
    """plan-memory.md, LR range test: "it picked 3.0e-3 and matched the best rate of the grid ... (78.3% against
    78.2%), for 17% of a training's time". From benchmarks/bench_lr_results.json (the min_divided row against the
    grid's best; the sweep's seconds over the training's)."""
    rows = evidence("bench_lr_results.json")["rows"]
    auto = next(row for row in rows if row["rule"] == "min_divided")
    best = max((row for row in rows if not row["auto"]), key=lambda row: row["accuracy"])
    says(
        "docs/how-to/plan-memory.md",
        f"it picked {auto['lr']:.1e}".replace("e-0", "e-"),  # 3.0e-3, as the page writes it
        f"({100 * auto['accuracy']:.1f}% against {100 * best['accuracy']:.1f}%), for"
        f" {100 * auto['sweep_s'] / auto['train_time_s']:.0f}% of a training's time",
    )


def test_the_experiments_fixed_cost_is_quoted_as_bench_fixed_cost_recorded_it():
    """README.md's `dvc repro` line "~40 s on 2 CPU cores" (and RESULTS.md's "The README says "~40 s""),
    classification.md's "about 40 s on 2 CPU cores (35.5 s", stages.md's evaluate "in the pipeline 2.7 s", and the
    ratio in benchmarks/README.md. From benchmarks/bench_fixed_cost.json (`first_repro_s`, the evaluate stage's
    median, `ratio`, `head_ratio`)."""
    cost = evidence("bench_fixed_cost.json")
    assert cost["host"]["cores"] == 2 and abs(cost["first_repro_s"] - 40) <= 5, cost["first_repro_s"]
    says("README.md", "~40 s on 2 CPU cores")
    says("docs/tutorials/classification.md", f"about 40 s on 2 CPU cores ({cost['first_repro_s']:.1f} s")
    says("benchmarks/RESULTS.md", 'The README says "~40 s"')
    says("benchmarks/README.md", f"{cost['ratio']:.2f}x the plain script ({cost['head_ratio']:.2f}x with a Ray head")
    says("docs/reference/stages.md", f"in the pipeline {cost['split_median_s']['evaluate']:.1f} s")


def test_team_server_page_gives_the_stacks_cost_as_bench_team_server_recorded_it():
    """team-server.md, "What it costs": "+4.4% wall time on 2 cores". From benchmarks/bench_team_server.json
    (`ratio`, team over sqlite medians)."""
    ratio = evidence("bench_team_server.json")["ratio"]
    says("docs/how-to/team-server.md", f"+{100 * (ratio - 1):.1f}% wall time on 2 cores")
