"""The CUDA paths, on a real GPU: mixed precision, batch-size search, out-of-memory recovery, copies, peaks, compile.

Skipped without CUDA (tests/conftest.py). On a GPU machine: `pytest -m gpu tests/gpu` (it needs torch,
transformers and pydantic only; no mlflow, ray or dvc).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from pipelines.data.loader import make_loader, to_device
from pipelines.data.tokenization import TokenizedSplit
from pipelines.resolve import batch_size as auto
from pipelines.runtime import Runtime, resolve_runtime
from pipelines.tasks import get_task
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.step import TrainStep, make_scaler
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_split

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# fp16 autocast against fp32, per logged loss (a loss of about 1.1 on 3 classes): rounding, not a different run.
FP16_LOSS_TOLERANCE = 0.02
BF16_LOSS_TOLERANCE = 0.05


def bert(hidden: int = 64, layers: int = 2, vocab: int = 120, seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=hidden * 2, max_position_embeddings=512, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def long_split(rows: int, length: int, seed: int = 0) -> TokenizedSplit:
    """Rows of one length (activation memory is then the same for every batch)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, 100, size=rows * length).astype(np.int32)
    return TokenizedSplit(ids, np.full(rows, length, dtype=np.int32), rng.integers(0, 3, size=rows))


def train(params, model=None, split=None, precision=None, **kwargs):
    torch.manual_seed(0)
    return train_model(
        TrainRequest(
            model if model is not None else bert(),
            split if split is not None else tiny_split(rows=160, seed=3),
            None,
            params,
            pad_id=0,
            device=CUDA,
            precision=precision or params.precision,
            say=kwargs.pop("say", lambda _: None),
            **kwargs,
        )
    )


def cuda_params(default_params, **overrides):
    base = {"epochs": 2, "batch_size": 16, "lr": 1e-3, "log_every_n_steps": 1, "warmup_ratio": 0.0, "device": "cuda"}
    return tiny_params(default_params, **{**base, **overrides})


@contextmanager
def memory_cap(bytes_allowed: float) -> Iterator[None]:
    """Let the caching allocator hold at most `bytes_allowed` (beyond it, a real CUDA out-of-memory error)."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(CUDA).total_memory
    # An index, not torch.device('cuda'): torch 2.11 refuses a device without one here.
    torch.cuda.set_per_process_memory_fraction(min(1.0, bytes_allowed / total), torch.cuda.current_device())
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        torch.cuda.empty_cache()


def test_fp16_with_the_grad_scaler_matches_fp32_and_bf16_stays_close(default_params):
    fp32 = train(cuda_params(default_params, precision="fp32", tf32=False))
    fp16 = train(cuda_params(default_params, precision="fp16"))
    bf16 = train(cuda_params(default_params, precision="bf16"))
    assert fp16.metrics["skipped_steps"] <= 2  # the scale may back off from 2^16 once or twice at the start
    for a, b, c in zip(fp32.history, fp16.history, bf16.history, strict=True):
        assert abs(a["loss"] - b["loss"]) < FP16_LOSS_TOLERANCE, (a, b)
        assert abs(a["loss"] - c["loss"]) < BF16_LOSS_TOLERANCE, (a, c)
    assert fp32.history[-1]["loss"] < fp32.history[0]["loss"]


def test_fp16_skips_a_step_whose_gradients_overflow_and_backs_off_the_scale():
    model = bert().to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(
        model, optimizer, None, Runtime(CUDA, "fp16", False, 8, 0), make_scaler(Runtime(CUDA, "fp16", False, 8, 0)), 1.0
    )  # type: ignore[arg-type]
    scaler = step.scaler
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(10, 100, (4, 16), device=CUDA)
    scaler.scale(model(input_ids=ids).logits.float().sum()).backward()
    model.classifier.weight.grad.view(-1)[0] = float("inf")  # an overflow in one gradient
    skipped = step.update()
    assert bool(skipped) and scaler.get_scale() == 2.0**15
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the step was not applied"


def test_batch_size_auto_finds_a_size_that_trains_with_its_optimizer_state(default_params):
    params = cuda_params(default_params, batch_size="auto", effective_batch_size=256, epochs=1, optim="adamw")
    split = long_split(rows=512, length=256)
    model = bert(hidden=256, layers=4, vocab=30000).to(CUDA)  # weights, gradients and moments: about 150 MB
    static = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    with memory_cap(static + 600 * 2**20):  # room for the state and some activations, not for 256 rows
        resolved = auto.resolve_batch_size(
            params, model, 256, resolve_runtime(params, CUDA, 0, "fp32"), get_task(params.task)
        )
        assert resolved.batch_size < 256 and resolved.batch_size * resolved.grad_accum_steps == 256
        result = train(resolved, model=model, split=split)
    assert result.metrics["oom_halvings"] == 0 and math.isfinite(result.metrics["final_train_loss"])


def test_a_real_out_of_memory_halves_micro_batches_keeps_the_effective_batch_and_finishes(default_params):
    split = long_split(rows=256, length=256)
    small = cuda_params(default_params, batch_size=16, epochs=1)
    reference = train(small, model=bert(hidden=256, layers=4), split=split)
    peak16 = reference.metrics["peak_reserved_bytes"]
    params = cuda_params(default_params, batch_size=64, epochs=1)
    messages: list[str] = []
    with memory_cap(1.6 * peak16):  # 16 rows fit; 64 rows need about 4x the activations
        result = train(params, model=bert(hidden=256, layers=4), split=split, say=messages.append)
    assert result.metrics["oom_halvings"] >= 1, messages
    assert any("micro-batches halved" in m for m in messages)
    assert result.metrics["optimizer_steps"] == 256 // 64  # the effective batch is unchanged
    assert math.isfinite(result.metrics["final_train_loss"])


def test_batches_are_pinned_and_copied_without_blocking(default_params):
    params = cuda_params(default_params, pin_memory=True)
    split = tiny_split(rows=64, seed=1)
    runtime = Runtime(CUDA, "fp32", False, 8, 0)
    loader = make_loader(split, [list(range(16))], params, runtime, get_task("classification"))
    assert loader.pin_memory
    host = next(iter(loader))
    assert all(t.is_pinned() for t in host.values())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        on_device = to_device(host, CUDA)
        torch.cuda.synchronize()
    assert all(t.device.type == "cuda" for t in on_device.values())
    copies = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert copies and all("Pinned" in name for name in copies), copies


def test_peak_memory_is_each_trial_s_own(default_params):
    small = cuda_params(default_params, epochs=1)
    big = cuda_params(default_params, epochs=1, batch_size=64)
    split = long_split(rows=128, length=256)
    first = train(small, model=bert(hidden=128), split=split).metrics["peak_train_memory_bytes"]
    large = train(big, model=bert(hidden=512, layers=4), split=split).metrics["peak_train_memory_bytes"]
    again = train(small, model=bert(hidden=128), split=split).metrics["peak_train_memory_bytes"]
    assert large > 2 * first
    assert abs(again - first) <= 0.05 * first, (first, again)  # not the larger trial's peak


def test_compile_on_cuda_runs_the_step_as_cuda_graphs_within_its_shapes_and_trains_as_eager(default_params):
    # The whole step compiled (reduce-overhead: CUDA graphs), every shape warmed before the clocks; the losses stay
    # within bf16's reach of eager's on the same rows. A model of about 24M parameters (its embeddings mostly) and
    # short rows: weights, gradients and AdamW's state (16 bytes a parameter, about 380 MB) dwarf the activations and
    # the allocator's workspaces, so the two peaks compare.
    split = tiny_split(rows=160, seed=3)
    big = {"hidden": 512, "layers": 4, "vocab": 30000}
    same = {"epochs": 1, "precision": "bf16"}
    eager = train(cuda_params(default_params, compile=False, **same), model=bert(**big), split=split)
    result = train(cuda_params(default_params, compile=True, **same), model=bert(**big), split=split)
    m, e = result.metrics, eager.metrics
    widths = result.notes["pad_widths.resolved"].split(",")
    assert m["compile_graphs"] <= 2 and m["compile_shapes"] >= len(widths) and m["compile_graphs_in_loop"] == 0, m
    # Run as CUDA graphs: no graph skipped them, at compile or in a timed step, and nothing recompiled after warm-up.
    assert m["compile_cudagraph_skips"] == 0 and m["timed_cudagraph_skips"] == 0 and m["timed_recompiles"] == 0, m
    # A CUDA graph's replay never calls the allocator: the peak must have been read while the graphs were recorded
    # with the optimizer's state alive, so it holds at least weights + gradients + state. (The state is made before
    # the peak's window opens, so its own zeroed gradients cannot meet this floor in the recording's place.)
    floor = m["param_bytes"] + m["trainable_param_bytes"] + m["optimizer_state_bytes"]
    assert m["optimizer_state_bytes"] >= 2 * m["trainable_param_bytes"]  # AdamW's two moments
    assert m["peak_train_memory_bytes"] >= floor, (m["peak_train_memory_bytes"], floor)
    # And against eager's peak of the same run. A recording without the state would read about 8 of eager's 16-18
    # bytes a parameter (0.5), so 0.8 catches it with room for what compiling saves (Inductor keeps fewer
    # activations, and eager's autocast caches bf16 copies of the weights: 16/18 = 0.89 if the activations were
    # nothing). 1.3 bounds what the graphs' pool may hold beyond eager (a capture's own workspace, the static inputs);
    # more would be compile costing memory the plan does not predict. The H200 probe read 0.98 (2,120 / 2,153 MiB).
    ratio = m["peak_train_memory_bytes"] / e["peak_train_memory_bytes"]
    assert 0.8 <= ratio <= 1.3, (ratio, m["peak_train_memory_bytes"], e["peak_train_memory_bytes"], floor)
    assert e["peak_train_memory_bytes"] >= floor
    assert m["compile_time_s"] > 0
    losses, reference = [h["loss"] for h in result.history], [h["loss"] for h in eager.history]
    assert losses == pytest.approx(reference, rel=0.05)  # bf16, and Inductor draws its own dropout masks


def test_gradient_accumulation_compiled_on_cuda_gives_eager_losses(default_params):
    # Two micro-batches a step under CUDA graphs: a compiled backward's gradients live in the graphs' pool, which the
    # second micro-batch's replay writes again; the step accumulates into gradient buffers of its own instead
    # (pipelines.train.step.stable_gradients), and the accumulation path is warmed before the clocks. fp32 without
    # TF32: the compiled and eager steps then differ by rounding only.
    same = {"batch_size": 8, "grad_accum_steps": 2, "epochs": 1, "precision": "fp32", "tf32": False}
    eager = train(cuda_params(default_params, compile=False, **same))
    result = train(cuda_params(default_params, compile=True, **same))
    m = result.metrics
    assert m["timed_recompiles"] == 0 and m["timed_cudagraph_skips"] == 0 and m["compile_graphs_in_loop"] == 0, m
    assert m["compile_cudagraph_skips"] == 0, m
    losses, reference = [h["loss"] for h in result.history], [h["loss"] for h in eager.history]
    assert len(losses) == 160 // 16 and all(math.isfinite(loss) for loss in losses)
    assert losses == pytest.approx(reference, rel=1e-3)


def test_a_run_on_cuda_is_tagged_with_its_card():
    from pipelines.tracking.environment import cuda_device_tags  # imports no mlflow

    tags = cuda_device_tags(0)
    assert tags["env.device"] == torch.cuda.get_device_name(0)
    assert int(tags["env.device_memory_mib"]) > 1000
    assert tags["env.compute_capability"] == "{}.{}".format(*torch.cuda.get_device_capability(0))
    assert tags["env.cuda"] == str(torch.version.cuda)
    # A real version, from NVML, the kernel module's /proc file or nvidia-smi: never 'unknown' on a CUDA machine.
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", tags["env.driver"]), tags["env.driver"]


def test_a_cpu_trial_on_a_gpu_host_is_tagged_with_the_cpu():
    from pipelines.tracking.environment import environment_tags

    on_card, on_cpu = environment_tags(), environment_tags(cuda_allowed=False)
    assert on_card["env.device"] == torch.cuda.get_device_name(0)
    assert on_cpu["env.device"].startswith("cpu (") and "env.driver" not in on_cpu  # what `timed_on` reads
