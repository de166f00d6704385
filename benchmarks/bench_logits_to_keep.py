"""What projecting only the target positions saves: one LoRA micro-batch of SmolLM2-135M, with and without.

    python -m benchmarks.bench_logits_to_keep

A batch of 8 rows x 85 tokens whose last 3 tokens are the response (a short answer, as in
bench_instruct), bf16 autocast on CPU, forward + backward of the causal-LM task's loss. "keep"
is our default (`logits_to_keep` with the target mask: the vocabulary projection runs at 3
positions per row); "full" computes all logits and selects afterwards, the same loss. Alternated, 3 steps each.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.bench_instruct import GGUF_FILE, require_assets
from pipelines.adapters import apply_adapter
from pipelines.data.tokenization import load_pretrained_tokenizer
from pipelines.params import apply_overrides, load_params
from pipelines.tasks import causal_lm, get_task


def main() -> None:
    folder = require_assets()
    torch.set_num_threads(2)
    params = apply_overrides(
        load_params("params.yaml"),
        {
            "task": "causal_lm",
            "model.name_or_path": str(folder),
            "model.gguf_file": GGUF_FILE,
            "adapter.type": "lora",
            "adapter.r": 16,
            "adapter.alpha": 32,
            "adapter.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        },
    )
    task = get_task("causal_lm")
    tokenizer = load_pretrained_tokenizer(params.model, Path("."))
    model = apply_adapter(task.build_model(params, tokenizer, Path("."), Path(".")), params.adapter, task)
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (8, 85))
    labels = ids.clone()
    labels[:, :82] = causal_lm.IGNORE
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    supports = causal_lm._keeps_logits

    def step(keep: bool) -> float:
        causal_lm._keeps_logits = supports if keep else (lambda _model: False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, _ = task.loss(model, batch)
        total.backward()
        model.zero_grad(set_to_none=True)
        return float(total)

    times: dict[str, list[float]] = {"keep": [], "full": []}
    losses = {"keep": step(True), "full": step(False)}
    for _ in range(2):
        for name in ("keep", "full"):
            start = time.perf_counter()
            for _ in range(3):
                step(name == "keep")
            times[name].append((time.perf_counter() - start) / 3)
    keep, full = min(times["keep"]), min(times["full"])
    print(f"loss keep {losses['keep']:.4f} vs full {losses['full']:.4f}")
    print(f"keep {keep:.3f} s/micro-batch, full {full:.3f} s/micro-batch: {keep / full:.2f}x")


if __name__ == "__main__":
    main()
