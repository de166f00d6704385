"""Tags that tell runs on different machines apart: the device (a CUDA card's name, memory, compute capability and
driver; a CPU's ISA level), the host's cores and identity, and the library versions."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import socket
import subprocess
from pathlib import Path

# The kernel module's own line: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu ..." (or "... Open
# Kernel Module for x86_64  580.159.04  Release Build ..."): the first dotted number after "NVRM version:".
_PROC_VERSION = re.compile(r"^NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)(?:\s|$)", re.MULTILINE)
_VERSION = re.compile(r"^\d+\.\d+(?:\.\d+)?$")
PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")


def environment_tags(cuda_allowed: bool = True) -> dict[str, str]:
    """Device and library versions, so runs on different machines can be told apart. The device is the one the run
    trains on: the CUDA card where CUDA is visible and `cuda_allowed` (the run's `device` is not `cpu`), else the CPU
    (a `device: cpu` trial on a GPU host trained on the CPU, and its `timed_on` must say so)."""
    import torch
    import transformers

    tags = {
        "env.python": platform.python_version(),
        "env.torch": torch.__version__,
        "env.transformers": transformers.__version__,
        "env.platform": platform.platform(),
        "env.cpu_count": str(os.cpu_count()),
        "env.host_id": host_id(),
    }
    if cuda_allowed and torch.cuda.is_available():
        tags.update(cuda_device_tags(0))
    else:
        tags["env.device"] = f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    return tags


# What tells two machines apart when their names and devices are alike (two cloud VMs named `vm`, each "cpu (AVX512),
# 2 cores"): the OS install's machine id, and the kernel's id of this boot, which differs between two VMs made from
# one image (they share the machine id). A reboot changes it too: a time taken before one is then not assumed
# comparable, which errs on the side of saying so.
IDENTITY_FILES = (Path("/etc/machine-id"), Path("/proc/sys/kernel/random/boot_id"))


def host_id(files: tuple[Path, ...] = IDENTITY_FILES) -> str:
    """8 hex digits naming this machine since its last boot: a hash of its host name, machine id and boot id (those
    of the files that exist), never the ids themselves."""
    parts = [socket.gethostname()]
    for path in files:
        try:
            parts.append(path.read_text(encoding="utf-8").strip())
        except OSError:
            parts.append("")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


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
    """The NVIDIA driver's version: through NVML (nvidia-ml-py, the `gpu` extra), else the kernel module's
    /proc/driver/nvidia/version, else `nvidia-smi`; 'unknown' when none answers."""
    for read in (_nvml_driver_version, _proc_driver_version, _smi_driver_version):
        try:
            version = read()
        except Exception:  # noqa: BLE001 - no NVML, no /proc entry, no nvidia-smi: the next source is asked
            version = None
        if version is not None and _VERSION.match(version):
            return version
    return "unknown"


def driver_version_from_proc(text: str) -> str | None:
    """The driver's version in the text of /proc/driver/nvidia/version, None if it names none."""
    found = _PROC_VERSION.search(text)
    return found.group(1) if found else None


def _nvml_driver_version() -> str:
    import pynvml

    pynvml.nvmlInit()
    version = pynvml.nvmlSystemGetDriverVersion()
    return version.decode() if isinstance(version, bytes) else str(version)


def _proc_driver_version() -> str | None:
    return driver_version_from_proc(PROC_DRIVER_VERSION.read_text(encoding="utf-8", errors="replace"))


def _smi_driver_version() -> str | None:
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=20, check=True)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else None
