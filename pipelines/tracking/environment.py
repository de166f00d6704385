"""Tags that tell runs on different machines apart: the device (a CUDA card's name, memory, compute capability and
driver; a CPU's ISA level), the host's cores and the library versions."""

from __future__ import annotations

import os
import platform


def environment_tags() -> dict[str, str]:
    """Device and library versions, so runs on different machines can be told apart."""
    import torch
    import transformers

    tags = {
        "env.python": platform.python_version(),
        "env.torch": torch.__version__,
        "env.transformers": transformers.__version__,
        "env.platform": platform.platform(),
        "env.cpu_count": str(os.cpu_count()),
    }
    if torch.cuda.is_available():
        tags.update(cuda_device_tags(0))
    else:
        tags["env.device"] = f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    return tags


def cuda_device_tags(index: int) -> dict[str, str]:
    """The CUDA device a run trained on: its name, memory (MiB), compute capability, driver, and torch's CUDA."""
    import torch

    properties = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    return {
        "env.device": properties.name,
        "env.device_memory_mib": str(properties.total_memory // 2**20),
        "env.compute_capability": f"{major}.{minor}",
        "env.cuda": str(torch.version.cuda),
        "env.driver": cuda_driver_version(),
    }


def cuda_driver_version() -> str:
    """The NVIDIA driver's version through NVML (nvidia-ml-py, the `gpu` extra), else 'unknown'."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - no NVML library or package: the tag says so, the run goes on
        return "unknown"
