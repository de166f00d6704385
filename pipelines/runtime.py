"""Pick the device and the precision the run can really use, or say why not before training.

`Runtime` is what a trial's tensors run with (device, precision, TF32, the pad multiple and pad id), resolved once
per trial by `resolve_runtime`, the way accelerate's `Accelerator` is built once: the engine, the LR range test and
the batch-size probe read it, and none of them resolves an `auto` of its own.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from pipelines.errors import UserError
from pipelines.library_check import check_library_internals
from pipelines.optimizer_registry import OPTIMIZERS
from pipelines.params import Params, ray_address

if TYPE_CHECKING:
    from pipelines.data.batching import Padding, WidthSet

ResolvedPrecision = Literal["fp32", "fp16", "bf16"]


def resolve_device(params: Params) -> torch.device:
    """`auto` is CUDA when present, else CPU; `cuda` without CUDA is a user error."""
    if params.device == "cuda" and not torch.cuda.is_available():
        raise UserError("device = 'cuda' but no CUDA device is visible; use device: auto or cpu")
    if params.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


# The CPU features that give bf16 instructions of its own (x86: AVX512-BF16, AMX; Arm: BF16), as torch's cpuinfo
# names them; without one, oneDNN emulates bf16 in fp32 instructions. Not `get_cpu_capability()` (the ISA level
# torch dispatches to: "AVX512" on an AVX512-BF16 host too) nor `torch.ops.mkldnn._is_mkldnn_bf16_supported()`
# (true on any AVX512-BW core: "supported" there means emulated).
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")
CPU_BF16_BENCHMARK = "benchmarks/bench_cpu_bf16.py"


def cpu_bf16_feature() -> str | None:
    """The CPU feature that runs bf16 natively here (`amx_bf16`, `avx512_bf16`, Arm's `bf16`), as
    `torch.cpu.get_capabilities()` reports it; None where bf16 is only emulated."""
    capabilities = torch.cpu.get_capabilities()
    return next((name for name in NATIVE_BF16_FEATURES if capabilities.get(name) is True), None)


@dataclass(frozen=True)
class CpuBf16Measurement:
    """bf16 autocast against fp32 on one kind of CPU host (the native bf16 feature it has), measured by
    `benchmarks/bench_cpu_bf16.py`: each model's median fp32 training time over its bf16 one (above 1: bf16 faster),
    and the host it ran on."""

    feature: str
    speedups: dict[str, float]
    host: str

    @property
    def faster(self) -> bool:
        """bf16 ran faster for every model measured."""
        return bool(self.speedups) and all(speedup > 1 for speedup in self.speedups.values())

    def describe(self) -> str:
        """`default 1.31x, minilm 1.85x on <host>`: fp32 time over bf16 time per model."""
        return ", ".join(f"{model} {speedup:.2f}x" for model, speedup in self.speedups.items()) + f" on {self.host}"


# What `benchmarks/bench_cpu_bf16.py` measured per kind of host, run on a quiet one (it prints the line to add here;
# benchmarks/RESULTS.md has the table). AVX512-BF16 without AMX (2026-11-27): bf16 slower for the default pipeline's
# small BERT and 2.33x faster for MiniLM, so not faster for every model: `precision: auto` stays fp32 there.
CPU_BF16_MEASURED: tuple[CpuBf16Measurement, ...] = (
    CpuBf16Measurement("avx512_bf16", {"default": 0.81, "minilm": 2.33}, "AMD EPYC, 2 cores"),
)


@dataclass(frozen=True)
class CpuBf16:
    """bf16 on this CPU: the native feature detected (None: emulated) and the measurement for its kind of host."""

    feature: str | None
    measured: CpuBf16Measurement | None = None

    @property
    def native(self) -> bool:
        """bf16 has instructions of its own here."""
        return self.feature is not None

    @property
    def fast(self) -> bool:
        """`precision: auto`'s CPU rule: bf16 only where it is native AND was measured faster on such a host."""
        return self.native and self.measured is not None and self.measured.faster

    @property
    def speed(self) -> float:
        """bf16's speed against fp32 as the plan prices its matmuls: 1/EMULATED_BF16_SLOWDOWN where emulated; where
        native, the slowest speed-up measured on such a host (the figures `fast` reads), else 1 (not measured: no
        claim either way)."""
        if not self.native:
            return 1.0 / EMULATED_BF16_SLOWDOWN
        if self.measured is None or not self.measured.speedups:
            return 1.0
        return min(self.measured.speedups.values())

    def describe(self) -> str:
        """The detection and the measurement, as the `precision.reason` tag says them."""
        if not self.native:
            return (f"no native bf16 on this CPU (torch.cpu.get_capabilities() has none of "
                    f"{', '.join(NATIVE_BF16_FEATURES)}): bf16 is emulated here")  # fmt: skip
        supported = f"bf16 supported natively here ({self.feature})"
        if self.measured is None:
            return f"{supported} but not measured faster yet ({CPU_BF16_BENCHMARK})"
        verdict = "and measured faster" if self.measured.faster else "but measured not faster"
        return f"{supported} {verdict} on such a host ({self.measured.describe()}; {CPU_BF16_BENCHMARK})"


def cpu_bf16() -> CpuBf16:
    """This CPU's bf16: detected, with the measurement recorded for its kind of host (`CPU_BF16_MEASURED`)."""
    feature = cpu_bf16_feature()
    return CpuBf16(feature, next((m for m in CPU_BF16_MEASURED if m.feature == feature), None))


def cpu_has_fast_bf16() -> bool:
    """True where bf16 is native on this CPU and measured faster than fp32 on its kind of host (`CpuBf16.fast`)."""
    return cpu_bf16().fast


# A MiniLM-sized training step in emulated bf16 against fp32 (AMD EPYC, AVX2): the warning's figure and the
# budget's speed weight for bf16 on such a CPU.
EMULATED_BF16_SLOWDOWN = 17


def cpu_bf16_speed(bf16: CpuBf16 | None = None) -> float:
    """bf16's speed against fp32 on this CPU as the plan prices it (`CpuBf16.speed`; `bf16`: this CPU's when None).
    Native bf16 priced as emulated put BERT-base's bf16 step at 17x its fp32 one on an AVX512-BF16 host, where MiniLM
    measured 2.33x faster."""
    return (bf16 or cpu_bf16()).speed


def emulated_bf16_warning(
    precision: ResolvedPrecision, device: torch.device, bf16: CpuBf16 | None = None
) -> str | None:
    """A warning for bf16 on a CPU that only emulates it (`bf16`: this CPU's, detected when None), else None
    (`precision: auto` never picks it there)."""
    if precision != "bf16" or device.type != "cpu" or (bf16 or cpu_bf16()).native:
        return None
    return (
        f"precision: bf16 on a CPU without native bf16 (torch.cpu.get_capabilities() has no "
        f"{', '.join(NATIVE_BF16_FEATURES)}) is emulated and many times slower than fp32: a MiniLM-sized training "
        f"step (6 layers, width 384, 16 x 128 tokens) took {EMULATED_BF16_SLOWDOWN}x as long as in fp32 on such a "
        "host (AMD EPYC, AVX2); precision: auto picks fp32 here"
    )


@dataclass(frozen=True)
class PrecisionCapability:
    """What decides a precision on a device, a local one or a GPU profile alike: is it CUDA, and does it have bf16
    (on CUDA: supported at all; on a CPU: native and measured faster, `CpuBf16.fast`). `lacks_bf16` says so in a
    refusal, `why` how a CPU's bf16 was judged (the `precision.reason` tag)."""

    cuda: bool
    bf16: bool
    lacks_bf16: str = ""
    why: str = ""

    def resolve(self, requested: str) -> ResolvedPrecision:
        """The one rule: `auto` is bf16 where the device has it, else fp16 on CUDA and fp32 on a CPU; bf16 on a
        CUDA device without it is refused."""
        if requested == "auto":
            return "bf16" if self.bf16 else "fp16" if self.cuda else "fp32"
        if requested == "bf16" and self.cuda and not self.bf16:
            raise UserError(f"precision = 'bf16' but {self.lacks_bf16}; use fp16 or fp32")
        return requested  # type: ignore[return-value]

    def candidates(self) -> list[ResolvedPrecision]:
        """The precisions `strategy: auto` tries, fastest first on CUDA (auto's pick, then fp32); fp32 first on a
        CPU, where bf16 pays only with native support (the budget weighs it by `precision_speed`)."""
        return [self.resolve("auto"), "fp32"] if self.cuda else ["fp32", "bf16"]


def local_capability(device: torch.device, bf16: CpuBf16 | None = None) -> PrecisionCapability:
    """This machine's `device`, asked directly (`bf16`: the CPU's, detected when None)."""
    if device.type == "cuda":
        return PrecisionCapability(True, torch.cuda.is_bf16_supported(), "this GPU has no bf16 support (pre-Ampere)")
    bf16 = bf16 or cpu_bf16()
    return PrecisionCapability(False, bf16.fast, why=bf16.describe())


def resolve_precision(params: Params, device: torch.device) -> ResolvedPrecision:
    """Turn `auto` into a concrete precision for this device; reject what it can't run."""
    return local_capability(device).resolve(params.precision)


def check_runtime(params: Params) -> None:
    """Reject choices this machine cannot run (and libraries without the internals we use), before any data is read
    or model built."""
    check_library_internals()
    device = resolve_device(params)
    resolve_precision(params, device)
    if params.precision == "fp16" and device.type == "cpu":
        raise UserError(
            "precision = 'fp16' (with loss scaling) is for GPUs, and device: auto found none; "
            "use precision: bf16, fp32 or auto"
        )
    _check_worker_gpus(params)
    _check_optimizer(params.optim, device)
    if params.adapter.type == "qlora":
        if device.type != "cuda":
            raise UserError(QLORA_NEEDS_CUDA + "; device: auto found no GPU here")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise UserError("adapter.type = 'qlora' needs the bitsandbytes package: pip install bitsandbytes")


def _check_optimizer(name: str, device: torch.device) -> None:
    """The optimizer's needs (`pipelines.optimizer_registry`): CUDA, and its package."""
    entry = OPTIMIZERS[name]
    if entry.cuda_only and device.type != "cuda":
        allowed = ", ".join(n for n, e in OPTIMIZERS.items() if not e.cuda_only)
        raise UserError(f"optim = {name!r} needs CUDA ({entry.package}); allowed here: {allowed}")
    if entry.package is not None and importlib.util.find_spec(entry.package) is None:
        raise UserError(f"optim = {name!r} needs the {entry.package} package: pip install {entry.package}")


QLORA_NEEDS_CUDA = (
    "adapter.type = 'qlora' needs CUDA: its base model is quantized to 4-bit NF4 by bitsandbytes, whose 4-bit "
    "kernels run on GPUs only; on a CPU use adapter.type: lora"
)


def gpus_for_every_worker(params: Params) -> bool:
    """Whether GPU workers can all be placed: on a Ray cluster (its nodes' GPUs count), or here with a CUDA
    device per worker. A local Ray would otherwise wait forever for the missing GPUs."""
    return bool(ray_address(params)) or torch.cuda.device_count() >= params.distributed.num_workers


def _check_worker_gpus(params: Params) -> None:
    """Reject `use_gpu: true` with more workers than local GPUs (null use_gpu follows CUDA; see
    `pipelines.trials.resources.workers_use_gpu`)."""
    wanted = params.distributed.num_workers
    if wanted < 2 or not params.distributed.use_gpu or gpus_for_every_worker(params):
        return
    raise UserError(
        f"distributed.use_gpu = true with distributed.num_workers = {wanted} needs {wanted} GPUs; this machine "
        f"has {torch.cuda.device_count()} and no Ray cluster is set (tune.address or RAY_ADDRESS); lower "
        "num_workers or set use_gpu: false"
    )


# The memory plan of a GPU target swaps in CUDA's autocast rules on the CPU (`pipelines.resolve.cuda_plan`), for the
# step it runs: every autocast region of the task's code then follows them, with no CUDA-specific branch in the tasks.
_AUTOCAST_RULES: ContextVar[Callable[[torch.dtype], AbstractContextManager[object]] | None] = ContextVar(
    "autocast_rules", default=None
)


@contextmanager
def autocast_rules(region: Callable[[torch.dtype], AbstractContextManager[object]]) -> Iterator[None]:
    """Within this context, `autocast_context` opens `region(dtype)` instead of torch's autocast."""
    token = _AUTOCAST_RULES.set(region)
    try:
        yield
    finally:
        _AUTOCAST_RULES.reset(token)


def autocast_context(precision: ResolvedPrecision, device: torch.device) -> AbstractContextManager[object]:
    """Autocast for fp16/bf16; a no-op context for fp32 (nanoGPT's pattern)."""
    if precision == "fp32":
        return nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    rules = _AUTOCAST_RULES.get()
    if rules is not None:
        return rules(dtype)
    return torch.autocast(device_type=device.type, dtype=dtype)


def resolve_pad_multiple(params: Params, device: torch.device) -> int | None:
    """`data.pad_to_multiple_of: auto` is 8 on CUDA (tensor-core tiles) and none on CPU, where rounding only pads."""
    value = params.data.pad_to_multiple_of
    if value == "auto":
        return 8 if device.type == "cuda" else None
    return value


def resolve_tf32(params: Params, precision: ResolvedPrecision, device: torch.device) -> bool:
    """`tf32: auto` is on for CUDA runs in bf16/fp16 and off for fp32, so the fp32 baseline is real fp32."""
    if device.type != "cuda":
        return False
    if params.tf32 == "auto":
        return precision != "fp32"
    return bool(params.tf32)


def apply_tf32(enabled: bool) -> None:
    """Set TF32 for CUDA matmuls and cuDNN convolutions explicitly (cuDNN's default is on)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


@dataclass(frozen=True)
class LossImpl:
    """How a language model's loss projects to its vocabulary (`loss_impl`, resolved): the full projection (None),
    or `chunk_rows` target positions at a time (`pipelines.tasks.linear_ce`). Passed to the task's loss; never
    stored on the model."""

    chunk_rows: int | None = None

    def describe(self) -> str:
        """`full`, or `chunked (<rows> rows)`: the resolved choice as a tag."""
        return "full" if self.chunk_rows is None else f"chunked ({self.chunk_rows} rows)"


FULL_LOSS = LossImpl()


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode inside the block, its train/eval mode as it was after it."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class Runtime:
    """Where and how a trial's tensors run, every `auto` resolved: device, precision, TF32, pad multiple, pad id,
    and the loss's projection (full until the trial's model is known: `pipelines.train.memory_levers.resolve_loss`)."""

    device: torch.device
    precision: ResolvedPrecision
    tf32: bool
    pad_multiple: int | None
    pad_id: int
    loss: LossImpl = field(default=FULL_LOSS)
    widths: WidthSet | None = None  # a compiled step's padded widths (pipelines.train.compiled_step), else the multiple
    compile_key: str | None = None  # a compiled step's fingerprint (pipelines.train.compile_cache)
    precision_reason: str = ""  # how the precision was chosen where the device's bf16 was judged (a CPU), else ""

    @property
    def padding(self) -> Padding:
        """How batches are padded: to the compiled step's widths when set, else to the pad multiple."""
        return self.widths if self.widths is not None else self.pad_multiple

    def autocast(self) -> AbstractContextManager[object]:
        """Autocast in this runtime's precision (a no-op in fp32)."""
        return autocast_context(self.precision, self.device)

    def apply(self) -> None:
        """Set the process-wide CUDA switches this runtime stands for (TF32 explicitly; cuDNN's autotuner off)."""
        if self.device.type == "cuda":
            # The autotuner pays off for convolutions, which these models lack. With length bucketing every new
            # batch shape re-tunes cuDNN's attention: on an H100, BERT-base bucketing+bf16 trained at 308
            # samples/s with it on and 522 with it off (benchmarks/RESULTS.md, GPU).
            torch.backends.cudnn.benchmark = False
            apply_tf32(self.tf32)

    def notes(self) -> dict[str, str]:
        """The resolved switches as MLflow tags."""
        return {"tf32.resolved": str(self.tf32).lower(), "pad_to_multiple_of.resolved": str(self.pad_multiple),
                "loss_impl.resolved": self.loss.describe(),
                **({"pad_widths.resolved": self.widths.describe()} if self.widths is not None else {}),
                **({"precision.reason": self.precision_reason} if self.precision_reason else {})}  # fmt: skip


def resolve_runtime(
    params: Params, device: torch.device, pad_id: int, precision: str | None = None, bf16: CpuBf16 | None = None
) -> Runtime:
    """The runtime for `params` on `device`; `precision` when already resolved (else `params.precision`'s; `auto`
    either way is the device's pick; `bf16`: the CPU's, detected when None)."""
    capability = local_capability(device, bf16)
    requested = precision or params.precision
    # "auto" resolved here too: callers that pass `params.precision` as it is set get the device's pick.
    resolved = capability.resolve(requested)
    said = f"auto picked {resolved}: " if requested == "auto" else f"{resolved} as asked; "
    reason = said + capability.why if capability.why else ""
    return Runtime(device, resolved, resolve_tf32(params, resolved, device), resolve_pad_multiple(params, device),
                   pad_id, precision_reason=reason)  # fmt: skip
