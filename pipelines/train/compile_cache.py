"""What a compiled run finds in the cache before it compiles: a fingerprint of what Inductor keys on, a manifest of the
fingerprints already compiled, and a Mega-Cache blob per fingerprint that carries the compiled graphs to another
process or machine.

Inductor's own caches (the FX graph cache, AOTAutograd's) key every graph on its code, the versions and the device,
and know nothing until a graph is traced; so whether a run will compile cold or load warm cannot be asked of them
before training. The fingerprint here is a coarser key over the same inputs, known before the model runs: torch,
Triton, CUDA and transformers versions, the device, the compile options (with the data-parallel strategy and world
size: a DDP replica's step compiles other graphs), the model's class, config, attention implementation (`to_dict()`
leaves it out, and eager and SDPA compile different graphs) and dtypes, what is trained, the batch shapes as the
graphs specialise on them (`graph_shapes`: every width and row count for a static compile; under a dynamic width
the tensors' names, dtypes and static dims, as one graph serves every width), and the constants baked into a graph
(dropout p, the loss's projection, precision). The learning rate is not one: it lives in the optimizer, outside the
graph. A model whose code specializes the width (the causal LM's mask helpers) compiles a graph per width even when
the width is marked dynamic, which the fingerprint cannot know before a compile: a manifest entry lists the shapes
its compiles compiled, and says whether one showed a graph serving several widths (`one_graph`); only then is a run
with a width none of them compiled predicted warm (`CompileCache.holds`).

The manifest (`compiled.json`) sits in Inductor's cache folder, so the two are kept or deleted together. A blob
(`mega/<fingerprint>.bin`, `torch.compiler.save_cache_artifacts`) is written after the first compile of a
fingerprint (and again after a compile that missed: the blob there did not hold its graphs) and loaded
(`load_cache_artifacts`) by a run that finds the blob but not the manifest's entry: a fresh cache folder, a Ray worker
on another node, another machine with the same torch and device (copy the file into `.cache/torch/mega/`, or take it
from the `compile_cache/` artifacts of the run the trial's `compile.blob_run` tag names). Both are written only when
the compile left its graphs in Inductor's caches (`CompileCache.record`), for an entry is the prediction "warm here".

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
from collections.abc import Iterable, Mapping
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
# A batch's shapes (`pipelines.train.compiled_step.shape_of`): each tensor's name, dims and dtype.
BatchShapes = tuple[tuple[str, tuple[int, ...], str], ...]


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


def attention_implementations(config: Any) -> dict[str, str | None]:
    """The attention implementation of `config` ('') and of each sub-config a composite model has (its text or
    vision part chooses its own). `config.to_dict()` leaves `_attn_implementation` out, so without this eager and SDPA
    shared a fingerprint: predicted warm, compiled cold."""
    found = {"": getattr(config, "_attn_implementation", None)}
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            found[name] = getattr(sub, "_attn_implementation", None)
    return found


def _model_parts(model: nn.Module) -> dict[str, Any]:
    """The model as its graphs bake it in: class, config, attention implementation, parameter dtypes, what is
    trained, dropout rates."""
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    listed = "\n".join(f"{name}:{p.dtype}:{p.requires_grad}:{tuple(p.shape)}" for name, p in model.named_parameters())
    trained = hashlib.sha256(listed.encode()).hexdigest()[:16]
    dropout = sorted({float(m.p) for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)})
    return {
        "class": type(model).__name__,
        "config": {k: v for k, v in sorted(config_dict.items()) if k not in _NOT_COMPUTED},
        "attention": attention_implementations(config),
        "parameters": trained,
        "dropout": dropout,
    }


def marks_width(shape: tuple[int, ...]) -> bool:
    """Whether a compile with a dynamic width marks this tensor's dim 1 dynamic: 2-D or more and wider than 1 (Dynamo
    specialises a size of 1 whatever is marked). `compiled_step.with_dynamic_width` marks by this rule and
    `graph_shapes` keys by it, so the fingerprint generalises exactly the dims the graph does."""
    return len(shape) >= 2 and shape[1] > 1


def graph_shapes(shapes: Iterable[BatchShapes], dynamic_width: bool) -> list[str]:
    """The batch shapes as the compiled graphs specialise on them, distinct and sorted: each tensor's name, dims and
    dtype; exact for a static compile (one graph per shape), and under a dynamic width with dim 1 as '*' where it is
    marked (`marks_width`): one graph serves every width, so a run over other widths finds it warm. The row count
    (padded to one, `compiled_step.padded_rows`) and the other dims stay: the graph is specialised to them."""
    keyed = set()
    for batch in shapes:
        if dynamic_width:
            batch = tuple(
                (name, (dims[0], "*", *dims[2:]) if marks_width(dims) else dims, dtype) for name, dims, dtype in batch
            )
        keyed.add(str(batch))
    return sorted(keyed)


def compile_parts(
    model: nn.Module, device: torch.device, options: dict[str, Any], shapes: Iterable[Any]
) -> dict[str, Any]:
    """Everything the fingerprint keys on, readable (`options`: the compile options and the step's constants;
    `shapes`: the batch shapes as the graphs specialise on them, `graph_shapes`)."""
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

    def holds(self, key: str, shapes: Iterable[BatchShapes] | None = None) -> str | None:
        """How a compile of `key` over the batch `shapes` would find its graphs: 'cache' (compiled into this folder),
        'blob' (a blob to load), or None (cold). Unless the folder's compiles of `key` showed one graph serving
        several widths (`covers`), only the shapes they compiled are warm: a run with another is cold (a blob, which
        holds no more, is not loaded either)."""
        entry = self.manifest().get(key)
        if entry is not None:
            return "cache" if shapes is None or covers(entry, shapes) else None
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
        inter-process lock, so concurrent writers of other keys are not lost. The shapes compiled add up over the
        compiles of `key` (`merged`): Inductor's caches keep every one's graphs."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.folder / f"{MANIFEST}.lock", timeout=_LOCK_TIMEOUT_S)
        with lock.acquire(poll_interval=_LOCK_POLL_S):
            manifest = self.manifest()
            atomic_write_json(self.manifest_path, {**manifest, key: merged(manifest.get(key), entry)})

    def record(self, key: str, entry: dict[str, Any], found: Mapping[str, int]) -> Path | None:
        """After a compile of `key` that `found` this in Inductor's caches (`cache_counters`, their change over the
        compile): its manifest entry and its blob, where the compile left its graphs in this folder's caches; the
        blob's path, or None where nothing was recorded.

        An entry predicts "a compile of `key` here is warm", so it is written only when that holds. Not when no graph
        went through the caches (no hits and no misses: caches disabled), nor when one bypassed them or failed to be
        written (`uncached`): the next compile compiles those again. Not when torch has nothing to save. A miss
        rewrites the blob even where one exists: the blob there did not hold these graphs (a loaded blob that missed,
        one from another build), and kept, every fresh folder that loads it would compile cold, predicted warm. The
        blob saved is this process's artifacts so far (torch's Mega-Cache accumulates them), this compile's among
        them. The entry says whether the compile showed one graph serving several widths (`one_graph`: from its
        `graphs` and the shapes it `compiled`); where not, a later run with another width is predicted cold."""
        if found.get("uncached", 0) > 0 or found["hits"] + found["misses"] == 0:
            return None
        entry = {**entry, "one_graph": one_graph(entry)}
        path = self.blob(key)
        if found["misses"] > 0 or not path.is_file():
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return None
            path = self.write_blob(key, saved[0])
        self.add_entry(key, entry)
        return path


def one_graph(entry: Mapping[str, Any]) -> bool:
    """Whether the compile an entry records showed one graph serving several widths: fewer graphs (`graphs`, Dynamo's
    count) than the distinct batch shapes it `compiled`. Only then is a width it never compiled warm: a model whose
    code specializes the width compiles one graph per width under a dynamic width, as a static compile does, and a
    compile of one shape cannot tell the two apart. A step broken into as many graphs as it has shapes reads as one
    graph per width: predicted cold for a new width, found warm, the error on the safe side."""
    compiled = entry.get("compiled") or []
    return len(compiled) > 1 and int(entry.get("graphs", 0)) < len(compiled)


def covers(entry: Mapping[str, Any], shapes: Iterable[BatchShapes]) -> bool:
    """Whether the compiles an entry records hold the graphs of a run over `shapes`: every width where one graph
    served several (`one_graph`), else the shapes they compiled. An entry that does not list them (written before
    they were) is taken at its word."""
    if "compiled" not in entry or entry.get("one_graph"):
        return True
    return set(graph_shapes(shapes, dynamic_width=False)) <= set(entry["compiled"])


def merged(old: Mapping[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`new`, a compile's manifest entry, with what an earlier entry of its key says still holds: the shapes compiled
    before (their graphs stay in Inductor's caches) and one graph serving several widths, once a compile showed it."""
    if not old or "compiled" not in old or "compiled" not in new:
        return new
    shapes = sorted(set(old["compiled"]) | set(new["compiled"]))
    return {**new, "compiled": shapes, "one_graph": bool(old.get("one_graph")) or bool(new.get("one_graph"))}


def cache_counters() -> dict[str, int]:
    """Dynamo's and Inductor's cache counters so far in this process: FX graph and AOTAutograd hits and misses, and
    `uncached`: Inductor graphs that bypassed the FX graph cache or whose entry could not be pickled or written
    (compiled, not kept: the next compile generates their code again). An AOTAutograd bypass is not one: its graphs'
    code still comes from the FX graph cache, the costly part of a compile."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    uncached = ("fxgraph_cache_bypass", "fxgraph_cache_pickle_error", "fxgraph_cache_write_error")
    return {
        "hits": int(inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"]),
        "misses": int(inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"]),
        "uncached": int(sum(inductor[name] for name in uncached)),
    }
