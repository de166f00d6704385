"""Model FLOP/s and MFU count real tokens only, and a GPU is found by its exact model name."""

from __future__ import annotations

import pytest
import torch

from pipelines.train.flops import flops_metrics, gpu_model, gpu_peak_flops


def test_padding_earns_no_flops_the_same_tokens_give_the_same_figure():
    per_position = 6e9
    unpadded = flops_metrics(per_position, {"tokens_per_s": 1000.0, "padding_fraction": 0.0}, torch.device("cpu"),
                             "fp32", False)  # fmt: skip
    padded = flops_metrics(per_position, {"tokens_per_s": 1000.0, "padding_fraction": 0.5}, torch.device("cpu"),
                           "fp32", False)  # fmt: skip
    assert padded == unpadded == {"model_tflops_per_s": pytest.approx(6.0)}


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", None),  # not in the table: no guess from "L4"
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA H100 80GB HBM3", "H100 80GB HBM3"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200"),
        ("Tesla T4", "T4"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
    ],
)
def test_gpus_are_matched_by_their_whole_model_name(name, model):
    assert gpu_model(name) == model
    assert (gpu_peak_flops(name, "bf16", False) is None) == (model is None)
