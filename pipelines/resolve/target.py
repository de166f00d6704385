"""Which device a memory plan models (`target_device`), and that device's rules around the fake step.

`target_device: auto` is where the run trains: the CPU, or the card CUDA shows (its profile when listed in
`pipelines.gpu_profiles`, else one read from the device's properties). A card's name plans for that card from
any machine: `python -m stages.plan` and `memory_budget: <card>` use it before a GPU is rented. A trial's
own plan always models where it trains, since its `predicted_*` stand beside its measured peak.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from pipelines.errors import UserError
from pipelines.gpu_profiles import GPU_PROFILES, GpuProfile, gpu_profile, parse_cluster, profile_for_device
from pipelines.params import Params
from pipelines.resolve.cuda_plan import (
    CudaAttention,
    CudaAutocast,
    CudaDropout,
    allocation_rounding,
    plan_rules_class,
)
from pipelines.runtime import PrecisionCapability, ResolvedPrecision, autocast_rules, local_capability

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class PlanTarget:
    """The device a plan models: the CPU (`card` None) or a GPU card."""

    card: GpuProfile | None = None

    @property
    def name(self) -> str:
        """`cpu` or the card's profile name."""
        return "cpu" if self.card is None else self.card.name

    @property
    def device(self) -> torch.device:
        """The device type the modelled run trains on (padding, levers and precision are resolved for it)."""
        return CPU if self.card is None else CUDA

    @property
    def plan_key(self) -> str:
        """What a plan on this target depends on besides the params: the CPU, or the card's class for the fake step's
        rules and whether it has bf16 (its memory size only judges the plan). Targets with one key share plans."""
        if self.card is None:
            return "cpu"
        return f"cuda {plan_rules_class(self.card)} bf16={self.card.bf16_flops is not None}"

    def precision(self, params: Params) -> ResolvedPrecision:
        """`precision` resolved as a run on the target would resolve it; bf16 on a card without it is refused."""
        return self.capability().resolve(params.precision)

    def capability(self) -> PrecisionCapability:
        """The target's precision capability: the card's profile, or this CPU."""
        if self.card is None:
            return local_capability(CPU)
        return PrecisionCapability(
            True, self.card.bf16_flops is not None, f"target_device {self.card.name} has no bf16"
        )

    @contextmanager
    def rules(self) -> Iterator[None]:
        """Around the fake step: the card's autocast casts, SDPA backend, dropout and allocation rounding (none on
        CPU)."""
        if self.card is None:
            yield
            return
        autocast = CudaAutocast()
        with ExitStack() as stack:
            stack.enter_context(allocation_rounding())
            stack.enter_context(CudaAttention(self.card))
            stack.enter_context(CudaDropout())
            stack.enter_context(autocast)  # innermost: it casts, then attention routes the cast call
            stack.enter_context(autocast_rules(autocast.region))
            yield

    def recompute_context(self) -> tuple[AbstractContextManager[object], AbstractContextManager[object]] | None:
        """torch checkpoint's `context_fn` for this target's plan: the card's rules again in the recompute, which
        runs in backward without the forward's torch-function modes (None on the CPU)."""
        if self.card is None:
            return None
        return nullcontext(), self._recompute_rules()

    @contextmanager
    def _recompute_rules(self) -> Iterator[None]:
        assert self.card is not None
        with CudaAttention(self.card), CudaDropout(), CudaAutocast():  # no region: recompute casts uncached
            yield


CPU_TARGET = PlanTarget()


def target_named(name: str) -> PlanTarget:
    """`cpu` or a GPU profile's name (unknown names are refused listing the known ones); a cluster's name
    (`8xA100-80GB`, `pipelines.resolve.cluster`) is the card each of its workers trains on."""
    if name == "cpu":
        return CPU_TARGET
    cluster = parse_cluster(name)
    if cluster is not None:
        return PlanTarget(gpu_profile(cluster[2]))
    try:
        return PlanTarget(gpu_profile(name))
    except ValueError as err:
        raise UserError(f"target_device: {err}") from None


def visible_card() -> GpuProfile:
    """The profile of the CUDA device in use: listed by name, else read from its properties (relative peaks:
    16-bit counted 2x fp32, as the data sheets of every listed card from Ampere on have it)."""
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    listed = profile_for_device(properties.name)
    if listed is not None:
        return listed
    capability = (properties.major, properties.minor)
    bf16 = 2.0 if capability >= (8, 0) else None
    return GpuProfile(properties.name, properties.total_memory, capability, 1.0, None, bf16, 2.0)


def trial_target(params: Params, device: torch.device) -> tuple[PlanTarget, str | None]:
    """What a trial training on `device` plans for, and a note when `target_device` names something else."""
    target = CPU_TARGET if device.type == "cpu" else PlanTarget(visible_card())
    wanted = params.target_device
    if wanted in ("auto", target.name):
        return target, None
    return target, (
        f"target_device {wanted}: this trial trains on {target.name}, so its plan models {target.name} (its "
        f"predicted_* stand beside its measured peak); `python -m stages.plan` plans for {wanted}"
    )


def known_targets() -> list[str]:
    """Every name `target_device` accepts besides auto."""
    return ["cpu", *GPU_PROFILES]


def as_target(where: PlanTarget | torch.device) -> PlanTarget:
    """A target as given, or the one a run on `where` trains on (the CPU, or the visible card)."""
    if isinstance(where, PlanTarget):
        return where
    return CPU_TARGET if where.type == "cpu" else PlanTarget(visible_card())
