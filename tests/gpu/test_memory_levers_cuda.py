"""The CUDA-only memory levers of issue 26 (activation offloading, Liger's kernels) and the chunked loss on CUDA:
each lowers the allocator's peak and leaves the training loss as it was. Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from pipelines.tasks import get_task
from pipelines.train.engine import TrainRequest, train_model
from tests.pipelines.test_memory_levers import llama, long_rows

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def trained(default_params, precision: str = "fp32", **overrides) -> dict[str, float]:
    """One epoch of a 4-layer Llama with a 40,000-word vocabulary on 8 rows of 384 tokens, on CUDA."""
    params, task, build = llama(
        default_params, device="cuda", precision=precision, batch_size=4, **{"data.max_length": 512, **overrides}
    )
    torch.manual_seed(params.seed)
    torch.cuda.empty_cache()
    result = train_model(TrainRequest(build(), long_rows(rows=8, length=384), None, params, pad_id=0, device=CUDA,
                         precision=precision, say=lambda _: None, task=get_task("causal_lm")))  # fmt: skip
    return result.metrics


def test_activation_offload_with_checkpointing_lowers_the_peak_and_keeps_the_loss(default_params):
    kept = trained(default_params, loss_impl="full", grad_checkpointing=True)
    offloaded = trained(default_params, loss_impl="full", grad_checkpointing=True, activation_offload=True)
    assert offloaded["peak_train_memory_bytes"] < kept["peak_train_memory_bytes"]
    assert offloaded["final_train_loss"] == pytest.approx(kept["final_train_loss"], rel=1e-5)


def test_activation_offload_alone_moves_every_saved_tensor_to_the_host(default_params):
    vanilla = trained(default_params, loss_impl="full")
    offloaded = trained(default_params, loss_impl="full", activation_offload=True)
    assert offloaded["peak_train_memory_bytes"] < vanilla["peak_train_memory_bytes"]
    assert offloaded["final_train_loss"] == pytest.approx(vanilla["final_train_loss"], rel=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunked_loss_on_cuda_holds_a_fraction_of_the_logits(default_params, precision):
    full = trained(default_params, precision, loss_impl="full")
    chunked = trained(default_params, precision, loss_impl="chunked")
    # 8 x 384 targets x 40,000 words: 491 MB of fp32 logits, before the bf16 copy and the gradient.
    assert chunked["peak_train_memory_bytes"] < 0.5 * full["peak_train_memory_bytes"]
    tolerance = 1e-5 if precision == "fp32" else 1e-3  # bf16: the same matmuls, summed in another order
    assert chunked["final_train_loss"] == pytest.approx(full["final_train_loss"], rel=tolerance)


def test_liger_kernels_train_to_the_same_loss_in_no_more_memory(default_params):
    pytest.importorskip("liger_kernel", reason="pip install liger-kernel to test kernels: liger")
    vanilla = trained(default_params, "bf16", loss_impl="full")
    fused = trained(default_params, "bf16", loss_impl="full", kernels="liger")
    assert fused["peak_train_memory_bytes"] <= vanilla["peak_train_memory_bytes"]
    assert fused["final_train_loss"] == pytest.approx(vanilla["final_train_loss"], rel=2e-2)
