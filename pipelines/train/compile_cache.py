"""What a compiled run finds in the cache before it compiles: a fingerprint of what Inductor keys on, a manifest of the
fingerprints already compiled, and a Mega-Cache blob per fingerprint that carries the compiled graphs to another
process or machine.

Inductor's own caches (the FX graph cache, AOTAutograd's) key every graph on its code, the versions and the device,
and know nothing until a graph is traced; so whether a run will compile cold or load warm cannot be asked of them
before training. The fingerprint here is a coarser key over the same inputs, known before the model runs: torch,
Triton, CUDA and transformers versions, the device, the compile options, the model's class, config and dtypes, what
is trained, the batch shapes (its widths and row counts), and the constants baked into a graph (dropout p, the
loss's projection, precision). The learning rate is not one: it lives in the optimizer, outside the graph.

The manifest (`compiled.json`) sits in Inductor's cache folder, so the two are kept or deleted together. A blob
(`mega/<fingerprint>.bin`, `torch.compiler.save_cache_artifacts`) is written after the first compile of a
fingerprint and loaded (`load_cache_artifacts`) by a run that finds the blob but not the manifest's entry: a fresh
cache folder, a Ray worker on another node, another machine with the same torch and device (copy the file into
`.cache/torch/mega/`, or take it from the trial's MLflow artifacts, `compile_cache/`).

Writers are safe across processes: packed trials on one GPU share a fingerprint (they differ by the learning rate)
and record it at the same time. Each writes its blob to a name of its own in `mega/` (`<key>.<pid>.<random>.partial`)
and renames it into place, so a reader sees one writer's whole blob and the last rename wins (all hold the same
graphs). The manifest is read, merged and rewritten (atomically) under an inter-process lock (`compiled.json.lock`,
`filelock`), so no writer drops another's entry.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from torch import nn

from pipelines.atomic import atomic_write_json

MANIFEST = "compiled.json"
BLOBS = "mega"
# A writer holds the manifest's lock for one small JSON rewrite: poll often, and fail loudly rather than wait forever
# on a lock that can go stale (filelock's fallback where the file system has no fcntl locks).
_LOCK_POLL_S = 0.005
_LOCK_TIMEOUT_S = 60.0
# Config entries that name where a model came from, not what it computes.
_NOT_COMPUTED = {"_name_or_path", "transformers_version", "_commit_hash", "name_or_path", "architectures"}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def device_name(device: torch.device) -> str:
    """The device as a compiled graph depends on it: a card's name and compute capability, a CPU's ISA level."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def _model_parts(model: nn.Module) -> dict[str, Any]:
    """The model as its graphs bake it in: class, config, parameter dtypes, what is trained, dropout rates."""
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    listed = "\n".join(f"{name}:{p.dtype}:{p.requires_grad}:{tuple(p.shape)}" for name, p in model.named_parameters())
    trained = hashlib.sha256(listed.encode()).hexdigest()[:16]
    dropout = sorted({float(m.p) for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)})
    return {
        "class": type(model).__name__,
        "config": {k: v for k, v in sorted(config_dict.items()) if k not in _NOT_COMPUTED},
        "parameters": trained,
        "dropout": dropout,
    }


def compile_parts(
    model: nn.Module, device: torch.device, options: dict[str, Any], shapes: Iterable[Any]
) -> dict[str, Any]:
    """Everything the fingerprint keys on, readable (`options`: the compile options and the step's constants)."""
    return {
        "torch": torch.__version__,
        "triton": _version("triton") if device.type == "cuda" else "n/a",
        "cuda": torch.version.cuda or "none",
        "transformers": _version("transformers"),
        "device": device_name(device),
        "options": options,
        "model": _model_parts(model),
        "shapes": sorted(str(shape) for shape in shapes),
    }


def fingerprint(parts: dict[str, Any]) -> str:
    """A short stable key of `compile_parts`."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class CompileCache:
    """The manifest and blobs beside Inductor's caches in `folder`."""

    folder: Path

    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST

    def manifest(self) -> dict[str, dict[str, Any]]:
        """Fingerprints compiled into this folder, with what was measured when they were (empty when unreadable)."""
        try:
            return dict(json.loads(self.manifest_path.read_text()))
        except (OSError, ValueError):
            return {}

    def blob(self, key: str) -> Path:
        """Where the Mega-Cache blob of `key` is (or would be) kept."""
        return self.folder / BLOBS / f"{key}.bin"

    def holds(self, key: str) -> str | None:
        """How a compile of `key` would find its graphs: 'cache' (compiled into this folder), 'blob' (a blob to load),
        or None (cold)."""
        if key in self.manifest():
            return "cache"
        return "blob" if self.blob(key).is_file() else None

    def load_blob(self, key: str) -> bool:
        """Load `key`'s blob into Inductor's caches when this folder has not compiled it; True when loaded."""
        if key in self.manifest() or not self.blob(key).is_file():
            return False
        return torch.compiler.load_cache_artifacts(self.blob(key).read_bytes()) is not None

    def write_blob(self, key: str, data: bytes) -> Path:
        """Put `data` as `key`'s blob, whole: written under a name no other writer uses, then renamed into place (the
        last of concurrent writers wins); the blob's path."""
        path = self.blob(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A shared temporary name would let one writer's rename take another's file away mid-write.
        temporary = path.with_name(f"{key}.{os.getpid()}.{secrets.token_hex(6)}.partial")
        try:
            with temporary.open("xb") as out:
                out.write(data)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return path

    def add_entry(self, key: str, entry: dict[str, Any]) -> None:
        """Set `key`'s manifest entry, keeping every other's: the read, merge and atomic rewrite run under an
        inter-process lock, so concurrent writers of other keys are not lost."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.folder / f"{MANIFEST}.lock", timeout=_LOCK_TIMEOUT_S)
        with lock.acquire(poll_interval=_LOCK_POLL_S):
            atomic_write_json(self.manifest_path, {**self.manifest(), key: entry})

    def record(self, key: str, entry: dict[str, Any]) -> Path | None:
        """After a compile of `key`: its manifest entry, and its blob unless one exists; the blob's path (None when
        torch had nothing to save)."""
        path = self.blob(key)
        if not path.is_file():
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return None
            path = self.write_blob(key, saved[0])
        self.add_entry(key, entry)
        return path


def cache_counters() -> dict[str, int]:
    """Dynamo's and Inductor's cache counters so far in this process: FX graph and AOTAutograd hits and misses."""
    from torch._dynamo.utils import counters

    return {
        "hits": int(counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]),
        "misses": int(counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]),
    }
