"""One GPU's memory and step time in a data-parallel cluster, from the plan of the whole model on one GPU.

The single-card plan (`pipelines.resolve.memory_plan`, the trial's own step on fake tensors) gives the whole model's
weights, gradients and optimizer state, and what the step adds on top of them at its peak (activations and
temporaries: the *working* bytes). What N workers change is arithmetic on those parts and the model's units (its
transformer blocks and the root: embeddings, head, final norm; `ModelUnits`), as each strategy holds them:

- **DDP**: every GPU holds everything, plus DDP's gradient buckets (a flat copy of every gradient, which
  `DistributedDataParallel` allocates unless `gradient_as_bucket_view`); one all-reduce of the gradients per
  optimizer step (2 (N-1)/N of their bytes sent per GPU), hidden behind backward (2/3 of the step's FLOPs) but for
  its last 25 MiB bucket.
- **FSDP** (FSDP2 `fully_shard` per block and at the root): weights, gradients and state divided by N, plus the
  gathered units: the root whole for the step (FSDP2 keeps the root unsharded between forward and backward), the
  block running and the next one prefetched (in the compute dtype: the MixedPrecisionPolicy casts trainable fp32
  weights to bf16 when it gathers them; frozen weights are gathered as stored, NF4 under QLoRA), and one block's
  unsharded fp32 gradient before its reduce-scatter. Per micro-batch: an all-gather of every unit in forward, again
  in backward (`reshard_after_forward: true`), and a reduce-scatter of the trainable gradients, each (N-1)/N of its
  bytes per GPU. The plan assumes each block's transfers hide behind the block before it, so one block's share of
  them is exposed, plus whatever the transfers take beyond the compute.
- **FSDP, reshard_after_forward: false**: the gathered weights stay for backward (every block, in the compute
  dtype), and backward gathers nothing.
- **FSDP + CPU offload**: the shards of weights, gradients and state live in the node's host RAM (pinned); each unit
  is copied to the GPU before its all-gather and its gradient back after the reduce-scatter (over PCIe, hidden like
  the collectives), and the optimizer steps on the host (`HOST_OPTIMIZER_PARAMS_PER_S`, an assumption).

Which moment sets the peak changes with the sharding: a full fine-tune's single-GPU peak is its optimizer step
(every gradient beside the state, plus the update's temporaries), which shrinks with the shards, while the
activations' moment (mid-backward, some gradients alive) does not. So an FSDP worker's peak is not arithmetic on the
single-GPU peak's parts (that summed maxima of different moments: 5-12% above gloo ranks' measured peaks); it is
read off the traced step op by op (`fsdp_worker_peak`: the moments of `counted_step.StepTimeline`, each with its
shard and the strategy's gathered units), as the trial's own FSDP plan reads it (`MemoryPlan.sharded`; both held
against 2 and 4 gloo ranks in tests/pipelines/test_plan_multiprocess.py).

The reserve beside the peak is the card's (`GpuProfile.reserve_bytes`: CUDA context and allocator slack). The
largest per-GPU batch scales the working bytes' activations with the rows (activations grow with rows x width; the
width is fixed), which the single-card plans are linear in (checked in tests/pipelines/test_cluster_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pipelines.resolve.cluster import Cluster
from pipelines.resolve.counted_step import Point, WorkerPeak
from pipelines.resolve.interconnects import HOST_OPTIMIZER_PARAMS_PER_S
from pipelines.resolve.memory_plan import MemoryPlan

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default: its last bucket is not hidden
BACKWARD_SHARE = 2 / 3  # of a step's FLOPs: what DDP's all-reduce can hide behind
LARGEST_BATCH = 4096  # rows: the search for the largest per-GPU batch stops here


@dataclass(frozen=True)
class ModelUnits:
    """The model as FSDP shards it: `layers` identical blocks and the root, in stored bytes (as the plan counts them:
    frozen weights in the compute dtype or NF4, trainable ones as `trainable_bytes` per weight)."""

    layers: int
    block_params: int
    block_trainable: int
    root_params: int
    root_trainable: int
    weights: int  # every weight of the model (its element count): what loading it reads
    compute_bytes: int  # 2 under bf16/fp16 (FSDP gathers in the compute dtype), else 4
    trainable_bytes: int  # 4 (fp32 masters) or 2 (weights_dtype: bf16)
    # The fake steps traced (blocks, and their moments that can be a worker's peak: counted_step.StepTimeline): the
    # whole model's, or two shallow depths' for a plan by depth.
    traced: tuple[tuple[int, tuple[Point, ...]], ...] = field(default=(), repr=False)

    def _gathered(self, stored: int, trainable: int) -> int:
        return stored - trainable + trainable * self.compute_bytes // self.trainable_bytes

    @property
    def block_gathered(self) -> int:
        """One block's weights as FSDP gathers them (the compute dtype for trainable weights)."""
        return self._gathered(self.block_params, self.block_trainable)

    @property
    def root_gathered(self) -> int:
        """The root's weights as gathered."""
        return self._gathered(self.root_params, self.root_trainable)

    @property
    def block_gradient(self) -> int:
        """One block's unsharded gradient, reduced in fp32."""
        return self.block_trainable * 4 // self.trainable_bytes

    @property
    def all_gathered(self) -> int:
        """Every unit's weights as gathered: what one all-gather pass moves."""
        return self.root_gathered + self.layers * self.block_gathered

    @property
    def all_gradients(self) -> int:
        """Every trainable weight's fp32 gradient: what one reduce-scatter pass moves."""
        return (self.root_trainable + self.layers * self.block_trainable) * 4 // self.trainable_bytes


@dataclass(frozen=True)
class Strategy:
    """How the workers share the model: ddp, or fsdp with its two knobs."""

    name: str  # "ddp" or "fsdp"
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    @property
    def label(self) -> str:
        """As the table prints it."""
        if self.name == "ddp":
            return "DDP"
        return "FSDP" + ("" if self.reshard_after_forward else ", no reshard") + (" + CPU offload" if self.cpu_offload
                                                                                  else "")  # fmt: skip

    def overrides(self, workers: int) -> dict[str, object]:
        """The `distributed.*` settings that run it (`-S` overrides)."""
        settings: dict[str, object] = {"distributed.strategy": self.name, "distributed.num_workers": workers}
        if self.name == "fsdp":
            settings |= {"distributed.reshard_after_forward": self.reshard_after_forward,
                         "distributed.cpu_offload": self.cpu_offload}  # fmt: skip
        return settings


STRATEGIES = (Strategy("ddp"), Strategy("fsdp"), Strategy("fsdp", reshard_after_forward=False),
              Strategy("fsdp", cpu_offload=True))  # fmt: skip


@dataclass(frozen=True)
class GpuShare:
    """One GPU's predicted peak in parts (bytes), its node's host RAM, whether it fits, and its step time."""

    resident: int  # this GPU's weights, gradients and optimizer state at the peak (its shard under FSDP; 0 offloaded)
    gathered: int  # units held whole at the peak (FSDP; 0 when it falls in the update), or DDP's gradient buckets
    working: int  # beyond weights, gradients and state at the peak: activations and temporaries
    peak: int
    reserve: int
    room: int  # bytes to spare on the card, reserve counted (negative: over)
    largest_batch: int  # rows per GPU whose predicted peak fits (0: not even one)
    host_offloaded: int  # per node: the shards kept in host RAM (CPU offload)
    host_loading: int  # per node: the weights every worker builds whole before sharding (fp32, as loaded here)
    compute_s: float
    collective_bytes: int  # sent by each GPU per optimizer step
    collective_s: float  # at the link's rate
    host_copy_s: float  # CPU offload's copies over PCIe (part of what is hidden behind compute)
    exposed_s: float  # the part of collectives and copies not hidden behind compute, plus the host optimizer
    step_s: float

    @property
    def fits(self) -> bool:
        """Peak and reserve within the card."""
        return self.room >= 0


def share_of_gpu(
    base: MemoryPlan, units: ModelUnits, cluster: Cluster, strategy: Strategy, compute_s: float, rows: int
) -> GpuShare:  # fmt: skip
    """One GPU of `cluster` training `base`'s step (the whole model's plan on one GPU, `rows` rows per
    micro-batch) under `strategy`, with `compute_s` of arithmetic and launches per optimizer step."""
    workers, card = cluster.workers, cluster.card
    whole = base.parameters + base.gradients + base.optimizer_state
    if strategy.name == "ddp" or workers == 1:
        # Beyond every weight, gradient and state tensor: the activations' moment, or the optimizer step's
        # temporaries (a full fine-tune's step holds every gradient beside the state).
        resident, gathered, working = whole, (base.gradients if workers > 1 else 0), max(0, base.peak - whole)
    else:
        worker = fsdp_worker_peak(units, workers, strategy)
        resident, gathered, working = worker.resident, worker.gathered, worker.working
        shard = 0 if strategy.cpu_offload else -(-whole // workers)
        if resident + gathered + working < shard:  # extrapolated below the update, which holds the whole shard
            resident, gathered, working = shard, 0, 0
    peak = resident + gathered + working
    largest = _largest_batch(peak, base.activations / max(rows, 1), rows, card.budget_bytes())
    offloaded = cluster.gpus_per_node * -(-(base.parameters + base.gradients + base.optimizer_state) // workers)
    sent, collective_s, copy_s, exposed = _collectives(base, units, cluster, strategy, compute_s)
    return GpuShare(
        resident=resident, gathered=gathered, working=working, peak=peak, reserve=card.reserve_bytes(peak),
        room=card.memory_bytes - peak - card.reserve_bytes(peak), largest_batch=largest,
        host_offloaded=offloaded if strategy.cpu_offload and strategy.name == "fsdp" and workers > 1 else 0,
        host_loading=cluster.gpus_per_node * units.weights * 4, compute_s=compute_s, collective_bytes=sent,
        collective_s=collective_s, host_copy_s=copy_s, exposed_s=exposed, step_s=compute_s + exposed,
    )  # fmt: skip


def fsdp_worker_peak(units: ModelUnits, workers: int, strategy: Strategy) -> WorkerPeak:
    """One FSDP worker's peak in parts, read off the traced steps' moments (`counted_step.WorkerPeak`): the highest
    moment once the shards are 1/`workers` and the strategy's units are held whole through forward and backward (the
    root, two blocks or, without resharding, every block, and one block's gradient; under CPU offload no shard, and a
    unit's shard copied in). Traced at two shallow depths, each part grows linearly to the model's."""

    def at(depth: int, moments: tuple[Point, ...]) -> WorkerPeak:
        held = units.root_gathered + depth * units.block_gathered if not strategy.reshard_after_forward else (
            units.root_gathered + 2 * units.block_gathered)  # fmt: skip
        held += units.block_gradient + (units.block_params // workers if strategy.cpu_offload else 0)
        return WorkerPeak.at(moments, workers, held, offloaded=strategy.cpu_offload)

    peaks = [(depth, at(depth, moments)) for depth, moments in units.traced]
    if len(peaks) == 1:
        return peaks[0][1]
    (a, shallow), (b, deeper) = peaks

    def grow(name: str) -> int:
        at_a, at_b = getattr(shallow, name), getattr(deeper, name)
        return round(at_a + (at_b - at_a) / (b - a) * (units.layers - a))

    return WorkerPeak(**{part.name: grow(part.name) for part in fields(WorkerPeak)})


def _largest_batch(peak: int, per_row: float, rows: int, budget: int) -> int:
    """The most rows per GPU whose peak (activations linear in the rows) fits `budget`; 0 when one row does not."""
    if per_row <= 0:
        return LARGEST_BATCH if peak <= budget else 0
    return max(0, min(LARGEST_BATCH, rows + int((budget - peak) // per_row)))


def _collectives(
    base: MemoryPlan, units: ModelUnits, cluster: Cluster, strategy: Strategy, compute_s: float
) -> tuple[int, float, float, float]:
    """Bytes each GPU sends per optimizer step, their seconds at the link's rate, CPU offload's copy seconds, and
    what of both is exposed (not hidden behind compute), the host optimizer's step included."""
    workers = cluster.workers
    if workers == 1:
        return 0, 0.0, 0.0, 0.0
    share = (workers - 1) / workers
    _, rate = cluster.collective_link()
    if strategy.name == "ddp":
        sent = int(2 * share * base.gradients)
        seconds = sent / rate
        last_bucket = 2 * share * min(DDP_BUCKET_BYTES, base.gradients) / rate
        return sent, seconds, 0.0, max(0.0, seconds - BACKWARD_SHARE * compute_s) + last_bucket
    passes = 2 if strategy.reshard_after_forward else 1  # forward's all-gather, and backward's when resharded
    gathers = units.all_gathered * passes - (units.root_gathered if passes == 2 else 0)  # the root stays gathered
    sent = int(base.micro_batches * share * (gathers + units.all_gradients))
    seconds = sent / rate
    copy_s, host_optimizer_s = 0.0, 0.0
    if strategy.cpu_offload:
        shard = (units.root_params + units.layers * units.block_params) / workers
        copied = base.micro_batches * (passes * shard + units.all_gradients / workers)
        copy_s = copied / cluster.host_link().bytes_per_s
        trainable_weights = base.trainable_parameters / units.trainable_bytes
        host_optimizer_s = trainable_weights / workers / HOST_OPTIMIZER_PARAMS_PER_S
    moved = seconds + copy_s
    exposed = moved / (units.layers + 1) + max(0.0, moved - compute_s) + host_optimizer_s
    return sent, seconds, copy_s, exposed
