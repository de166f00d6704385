"""The table a sceptic wants, on one GPU: ours at our defaults against the HF Trainer and a plain loop, eager and
compiled, round-robin, in parts that each fit one 10-minute call.

    python -m benchmarks.bench_gpu prepare                        # here, once (the classifier's rows)
    python -m benchmarks.bench_gpu_parts --part bert  [--rounds 3] [--json P] [--markdown P]   # on the GPU machine
    python -m benchmarks.bench_gpu_parts --part llama [--rounds 3] [--json P] [--markdown P]

- `bert`: BERT-base as a 4-class AG News classifier (3,200 rows, batch 32, bf16, AdamW lr 1e-4, clip 1.0): ours at
  our defaults (length bucketing, `compile: auto` decided by the plan's prediction), ours eager (`compile: false`),
  the Trainer eager with `group_by_length`, the Trainer with `torch_compile=True` with and without
  `group_by_length`, and a plain loop eager and compiled (`torch.compile(model)`, batches padded to a multiple of 8).
- `llama`: a Llama-shaped 1.1B (2048 x 16 layers, GQA 32/8, vocab 32,000), full fine-tune, 8 x 1024 tokens, bf16:
  the same six, MFU = tokens/s x (6 x non-embedding parameters + 12 x layers x hidden x sequence) / the card's peak.

Every configuration runs in this process, one after another, in the same order each round (round-robin); medians
and the spread (min-max) over rounds. Ours also reports the plan's predicted step time beside the measured one,
`compile.resolved`, `compile_time_s` and its loss curve, and the table says how far the compiled curve is from the
eager one. `--smoke` runs the eager configurations on tiny models on any device (the tests run it on CPU; compiling
on a CPU takes minutes, so the compiled ones are listed as skipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_gpu import DATA, bert_base, params_for
from benchmarks.bench_gpu_peer import free_device_memory, run_trainer
from benchmarks.common import cycled, subset
from pipelines.data.tokenization import TokenizedSplit

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8)  # fmt: skip
LLAMA_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2)  # fmt: skip
COMPILED = ("ours compiled", "trainer torch_compile", "trainer torch_compile, no grouping", "plain compiled")


class Bench:
    """One part's data, model maker and device; each configuration is a method returning its figures."""

    def __init__(self, part: str, data: Path, smoke: bool, rows: int | None = None) -> None:
        self.part, self.smoke = part, smoke
        self.device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
        if part == "bert":
            self.meta = json.loads((data / "meta.json").read_text())
            rows = rows or (64 if smoke else 3200)
            self.train = cycled(TokenizedSplit.load(data / "classification" / "train"), rows)
            self.test = subset(TokenizedSplit.load(data / "classification" / "test"), 32 if smoke else 256)
            self.base = {"precision": "bf16", "data.bucketing": True, "log_every_n_steps": 10}
        else:
            self.meta = {"pad_id": 0, "eos_id": 2}
            batch, seq, vocab, steps = (2, 64, 1000, 6) if smoke else (8, 1024, 32_000, 20)
            ids = np.random.default_rng(0).integers(5, vocab, size=(batch * (steps + 1), seq), dtype=np.int64)
            self.ids, self.vocab, self.seq = ids, vocab, seq
            self.train = TokenizedSplit(ids.reshape(-1).astype(np.int32), np.full(len(ids), seq, dtype=np.int32),
                                        prompt_lengths=np.zeros(len(ids), dtype=np.int32))  # fmt: skip
            self.test = self.train
            self.base = {"task": "causal_lm", "precision": "bf16", "batch_size": batch, "data.max_length": seq,
                         "lr": 1e-5, "data.bucketing": False, "log_every_n_steps": 2}  # fmt: skip

    def make(self) -> torch.nn.Module:
        """A fresh model of this part (random weights)."""
        if self.part == "bert":
            return bert_base(self.meta["vocab_size"], self.smoke)
        from transformers import LlamaConfig, LlamaForCausalLM

        size = LLAMA_SMOKE if self.smoke else LLAMA_1B
        config = LlamaConfig(vocab_size=self.vocab, max_position_embeddings=self.seq, tie_word_embeddings=False,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, **size)  # fmt: skip
        return LlamaForCausalLM(config)

    def flops_per_token(self, model: torch.nn.Module) -> float:
        """Model FLOPs per token (the 1.1B's MFU formula; BERT's without the attention term)."""
        embeddings = sum(p.numel() for n, p in model.named_parameters() if "embed" in n)
        dense = 6 * (sum(p.numel() for p in model.parameters()) - embeddings)
        if self.part == "llama":
            config = model.config
            dense += 12 * config.num_hidden_layers * config.hidden_size * self.seq
        return dense

    def ours(self, compile_setting: bool | str) -> dict[str, Any]:
        """The engine via `train_model`, `compile` as given; `auto` decided by the plan's prediction."""
        from pipelines.resolve.memory_plan import plan_memory
        from pipelines.resolve.step_time import predict_compile
        from pipelines.resolve.target import as_target
        from pipelines.tasks import get_task
        from pipelines.train.engine import TrainRequest, train_model

        free_device_memory()
        params = params_for({**self.base, "compile": compile_setting}, self.device, self.smoke)
        task, target = get_task(params.task), as_target(self.device)
        plan = plan_memory(params, task, self.train, self.make, lambda m: m, self.meta["pad_id"],
                           target.precision(params), target=target)  # fmt: skip
        step, prediction = predict_compile(plan, target.precision(params), target, params.tf32) or (None, None)
        torch.manual_seed(params.seed)
        model = self.make()
        result = train_model(
            TrainRequest(
                model,
                self.train,
                None,
                params,
                pad_id=self.meta["pad_id"],
                device=self.device,
                precision=target.precision(params),
                say=lambda m: print(f"  {m}", file=sys.stderr),
                task=task,
                compile_prediction=prediction,
            )
        )
        m, compiled = result.metrics, result.notes["compile.resolved"].startswith("on")
        predicted = None if step is None else 1000 * (step.compiled_s if compiled else step.eager_s)
        # The trial's own peak (never a window of the bench's: after a CUDA graph's recording the allocator sees no
        # replay), beside the static floor it must not be under: weights + gradients + optimizer state.
        floor = m["param_bytes"] + m["trainable_param_bytes"] + m["optimizer_state_bytes"]
        return self.figures(m["samples_per_s"], m["tokens_per_s"], model, m["step_time_p50_ms"], {
            "predicted_step_ms": predicted, "compile_resolved": result.notes["compile.resolved"],
            "compile_time_s": m["compile_time_s"], "losses": [h["loss"] for h in result.history],
            "peak_allocated_mb": m["peak_train_memory_bytes"] / 2**20, "static_floor_mb": floor / 2**20,
            "predicted_compile_time_s": m.get("predicted_compile_time_s"),
            "compile_cache_hits": m.get("compile_cache_hits"), "compile_cache_misses": m.get("compile_cache_misses"),
        })  # fmt: skip

    def trainer(self, **arguments: Any) -> dict[str, Any]:
        """The HF Trainer, `group_by_length` unless `arguments` say otherwise."""
        params = params_for(self.base, self.device, self.smoke)
        model_box: list[torch.nn.Module] = []

        def make() -> torch.nn.Module:
            model_box.append(self.make())
            return model_box[-1]

        if self.part == "llama":
            return self.causal_trainer(params.batch_size, **arguments)
        r = run_trainer(params, make, self.train, self.test, self.meta, self.device, **arguments)
        step_ms = 1000 * r["train_time_s"] / max(1, len(self.train) // params.batch_size - 1)
        return self.figures(r["samples_per_s"], r["tokens_per_s"], model_box[-1], step_ms, {})

    def causal_trainer(self, batch: int, **arguments: Any) -> dict[str, Any]:
        """The Trainer on the 1.1B's fixed-length rows (fused AdamW, bf16), timed from its first step's end (its
        third under compile) to its last."""
        import tempfile

        from transformers import Trainer, TrainerCallback, TrainingArguments

        compiled, device = bool(arguments.get("torch_compile")), self.device
        ends: list[float] = []

        class Clock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 - the Trainer's signature
                ends.append(sync(device))

        free_device_memory()
        torch.manual_seed(0)
        model = self.make()
        rows = [{"input_ids": torch.as_tensor(r), "labels": torch.as_tensor(r)} for r in self.ids]
        collate = lambda f: {k: torch.stack([x[k] for x in f]) for k in ("input_ids", "labels")}  # noqa: E731
        with tempfile.TemporaryDirectory() as out:
            options = {"output_dir": out, "per_device_train_batch_size": batch, "num_train_epochs": 1,
                       "learning_rate": 1e-5, "weight_decay": 0.01, "max_grad_norm": 1.0,
                       "bf16": device.type == "cuda", "use_cpu": device.type == "cpu", "optim": "adamw_torch_fused",
                       "report_to": "none", "save_strategy": "no", "eval_strategy": "no", "logging_strategy": "no",
                       "disable_tqdm": True, "dataloader_num_workers": 2, **arguments}  # fmt: skip
            Trainer(model=model, args=TrainingArguments(**options), train_dataset=rows, data_collator=collate,
                    callbacks=[Clock()]).train()  # fmt: skip
        first = 2 if compiled else 0
        steps, seconds = len(ends) - 1 - first, ends[-1] - ends[first]
        tokens = steps * batch * self.seq
        return self.figures(steps * batch / seconds, tokens / seconds, model, 1000 * seconds / steps, {})

    def plain(self, compiled: bool) -> dict[str, Any]:
        """A plain loop: fused AdamW, clip, bf16 autocast, batches on the device first (padded to a multiple of 8)."""
        free_device_memory()
        torch.manual_seed(42)
        model = self.make().to(self.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        forward = torch.compile(model) if compiled else model
        batches = self.plain_batches(self.base.get("batch_size", 32))
        dtype = torch.bfloat16

        def step(batch: dict[str, torch.Tensor]) -> None:
            with torch.autocast(self.device.type, dtype=dtype):
                loss = forward(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        warm = 1 if self.smoke else 8 if compiled else 2
        for batch in batches[:warm]:
            step(batch)
        start = sync(self.device)
        for batch in batches[warm:]:
            step(batch)
        seconds = sync(self.device) - start
        n = len(batches) - warm
        rows = sum(len(b["input_ids"]) for b in batches[warm:])
        tokens = sum(int(b["attention_mask"].sum()) for b in batches[warm:])
        return self.figures(rows / seconds, tokens / seconds, model, 1000 * seconds / max(n, 1), {})

    def plain_batches(self, size: int) -> list[dict[str, torch.Tensor]]:
        """The training rows in order, `size` at a time, on the device."""
        split, pad, out = self.train, self.meta["pad_id"], []
        for start in range(0, len(split) - size + 1, size):
            rows = [split.input_ids[split.offsets[i] : split.offsets[i] + split.lengths[i]] for i in
                    range(start, start + size)]  # fmt: skip
            ids = torch.full((size, -(-max(len(r) for r in rows) // 8) * 8), pad, dtype=torch.long)
            for j, row in enumerate(rows):
                ids[j, : len(row)] = torch.as_tensor(np.asarray(row, dtype=np.int64))
            batch = {"input_ids": ids, "attention_mask": (ids != pad).long()}
            labels = split.labels[start : start + size] if split.labels is not None else None
            batch["labels"] = torch.as_tensor(labels) if labels is not None else ids
            out.append({k: v.to(self.device) for k, v in batch.items()})
        return out

    def figures(self, samples: float, tokens: float, model: torch.nn.Module, step_ms: float,
                extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        """The figures every configuration reports."""
        peak = torch.cuda.max_memory_allocated() / 2**20 if self.device.type == "cuda" else float("nan")
        out = {"samples_per_s": samples, "tokens_per_s": tokens, "step_ms": step_ms, "peak_allocated_mb": peak,
               **extra}  # fmt: skip
        if self.device.type == "cuda":
            from pipelines.train.flops import gpu_peak_flops

            card_peak = gpu_peak_flops(torch.cuda.get_device_name(self.device), "bf16", True)
            out["mfu"] = tokens * self.flops_per_token(model) / card_peak if card_peak else None
        return out

    def configurations(self) -> dict[str, Callable[[], dict[str, Any]]]:
        """Name -> run, in round-robin order."""
        return {
            "ours defaults": lambda: self.ours("auto"),
            "ours compiled": lambda: self.ours(True),
            "ours eager": lambda: self.ours(False),
            "trainer eager": lambda: self.trainer(),
            "trainer torch_compile": lambda: self.trainer(torch_compile=True),
            "trainer torch_compile, no grouping": lambda: self.trainer(torch_compile=True,
                                                                        train_sampling_strategy="random"),
            "plain eager": lambda: self.plain(False),
            "plain compiled": lambda: self.plain(True),
        }  # fmt: skip


def sync(device: torch.device) -> float:
    """The host clock after the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Median and spread of each configuration's samples/s, tokens/s, step and MFU over rounds."""
    out = {}
    for name, rounds in runs.items():
        done = [r for r in rounds if "error" not in r]
        entry: dict[str, Any] = {"rounds": len(done), "errors": [r["error"] for r in rounds if "error" in r]}
        for key in ("samples_per_s", "tokens_per_s", "step_ms", "mfu", "predicted_step_ms", "compile_time_s"):
            values = [r[key] for r in done if r.get(key) is not None]
            if values:
                entry[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        if done and "compile_resolved" in done[0]:
            entry["compile_resolved"] = done[0]["compile_resolved"]
        out[name] = entry
    eager, defaults = runs.get("ours eager", []), runs.get("ours defaults", [])
    if eager and defaults and "losses" in eager[0] and "losses" in defaults[0]:
        gaps = [abs(a - b) / abs(b) for a, b in zip(defaults[0]["losses"], eager[0]["losses"], strict=False) if b]
        out["ours defaults"]["loss_curve_max_rel_gap_to_eager"] = max(gaps, default=0.0)
    return out


def _median(entry: dict[str, Any], key: str) -> str:
    return f"{entry[key]['median']:,.1f}" if key in entry else "—"


def markdown(part: str, device: str, table: dict[str, dict[str, Any]]) -> str:
    """The summary as a table: medians with the spread, ratios against the Trainer eager."""
    base = table.get("trainer eager", {}).get("samples_per_s", {}).get("median")
    lines = [f"bench_gpu_parts --part {part} on {device}", "",
             "| configuration | samples/s (min-max) | vs Trainer eager | step ms | predicted step ms | MFU |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, entry in table.items():
        if "samples_per_s" not in entry:
            lines.append(f"| {name} | {'; '.join(entry['errors'])[:120] or 'skipped'} | | | | |")
            continue
        s = entry["samples_per_s"]
        ratio = f"{s['median'] / base:.2f}x" if base else "—"
        mfu = f"{100 * entry['mfu']['median']:.1f}%" if "mfu" in entry else "—"
        lines.append(f"| {name} | {s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f}) | {ratio} | "
                     f"{_median(entry, 'step_ms')} | {_median(entry, 'predicted_step_ms')} | {mfu} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["bert", "llama"], required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--smoke", action="store_true", help="tiny models, eager configurations, any device")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these configurations (in this order)")
    parser.add_argument("--rows", type=int, help="bert: training rows (past the prepared rows, they repeat in order)")
    parser.add_argument("--deadline", type=float, help="seconds after which no configuration starts (each recorded)")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args()
    begun = time.perf_counter()
    bench = Bench(args.part, args.data, args.smoke, args.rows)
    configurations = chosen(bench.configurations(), args.only)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configurations}
    for _ in range(1 if args.smoke else args.rounds):
        for name, run in configurations.items():
            if args.smoke and name in COMPILED:
                continue
            start = time.perf_counter()
            if args.deadline is not None and start - begun > args.deadline:
                runs[name].append({"error": f"not started: --deadline {args.deadline:g} s had passed", "call_s": 0.0})
                continue
            try:
                figures = run()
            except Exception as err:  # noqa: BLE001 - a benchmark records what failed, goes on, and exits non-zero
                figures = {"error": f"{type(err).__name__}: {err}"[:300]}
            runs[name].append({**figures, "call_s": time.perf_counter() - start})
            print(name, json.dumps({k: v for k, v in runs[name][-1].items() if k != "losses"}), flush=True)
            if args.json:  # after every configuration: a run killed at a caller's deadline keeps what it measured
                write_json(args.json, bench, runs)
    device = torch.cuda.get_device_name() if bench.device.type == "cuda" else "cpu"
    text = markdown(args.part, device, summary(runs))
    print(text)
    if args.json:
        write_json(args.json, bench, runs)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    failed = sorted({name for name, rounds in runs.items() for r in rounds if "error" in r})
    if failed:
        sys.exit(f"bench_gpu_parts: {len(failed)} configuration(s) failed: {', '.join(failed)}")


def write_json(path: Path, bench: Bench, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Every run so far and their summary, to `path`."""
    device = torch.cuda.get_device_name() if bench.device.type == "cuda" else "cpu"
    path.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": len(bench.train), "runs": runs,
                                "summary": summary(runs)}, indent=1))  # fmt: skip


def chosen(configurations: dict[str, Callable[[], dict[str, Any]]], only: list[str] | None) -> dict[str, Any]:
    """The configurations `--only` names, in its order (all when None); an unknown name is refused with the list."""
    if not only:
        return configurations
    unknown = [name for name in only if name not in configurations]
    if unknown:
        sys.exit(f"bench_gpu_parts: --only {unknown} unknown; the configurations are {list(configurations)}")
    return {name: configurations[name] for name in only}


if __name__ == "__main__":
    main()
