"""The rules across fields of `Params`, as a table: when each combination is refused, and what to do instead.

A rule is a predicate on the whole params and a message that names both keys, the values and the fix. The
first rule that holds is reported; the order below is the order a user fixes things in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from pipelines.optimizer_registry import FSDP_OPTIMIZERS

# The rules read a schema.Params; typed Any so this module never imports the schema, which imports it.
Params = Any


class Rule(NamedTuple):
    """A refused combination: `when(params)` holds -> ValueError(`message(params)`)."""

    when: Callable[[Params], bool]
    message: Callable[[Params], str]


def _one_of_prompt_and_response(p: Params) -> bool:
    return (
        p.task == "causal_lm"
        and p.data.messages_column is None
        and ((p.data.prompt_column is None and p.data.prompt_template is None) != (p.data.response_column is None))
    )


def _fsdp(p: Params) -> bool:
    return p.distributed.strategy == "fsdp"


# What cannot combine with `distributed.strategy: fsdp` (FSDP2 `fully_shard`, pipelines/train/parallel.py), in one
# place: the parallelizing steps never branch on these. A chunked loss is refused above (loss_impl).
FSDP_RULES: tuple[Rule, ...] = (
    Rule(lambda p: _fsdp(p) and p.optim not in FSDP_OPTIMIZERS,
         lambda p: f"distributed.strategy: fsdp shards every weight across workers, and optim = {p.optim!r} "
                   "is not one whose update is known to run on sharded (DTensor) weights (Adafactor factors "
                   f"whole matrices); use optim: one of {', '.join(FSDP_OPTIMIZERS)} with fsdp, or "
                   "distributed.strategy: ddp"),
    # Why not: compile: true compiles the whole step (forward, loss, backward) once per batch shape and bounds its
    # graphs (pipelines/train/compiled_step.py). Under FSDP the step runs through each block's all-gather and
    # reduce-scatter hooks; torchtitan compiles each block instead, before fully_shard, which is not built here,
    # so a compiled FSDP step would be unmeasured: no speed or memory figure says it pays.
    Rule(lambda p: _fsdp(p) and p.compile is True,
         lambda p: "distributed.strategy: fsdp with compile: true: compile here compiles the whole step as one "
                   "graph per batch shape, and a sharded step gathers and reduces each block's weights in hooks "
                   "between the blocks; compiling each block under FSDP is not built (nor measured) yet. Use "
                   "compile: false or auto (auto trains eager under fsdp), or distributed.strategy: ddp to compile"),
    # Why not yet: FSDP2 turns bitsandbytes' Params4bit into plain tensors and can lose their quantization state
    # (bitsandbytes #1945, axolotl #2992, accelerate #3983, open). The engine shards QLoRA with a bf16 storage dtype
    # (adapters.quantization_config), but tests/gpu/test_fsdp_nccl.py, which compares its gradients with one
    # process's, has not run on two GPUs yet: until it has, a QLoRA run under FSDP could train to garbage unnoticed.
    Rule(lambda p: _fsdp(p) and p.adapter.type == "qlora",
         lambda p: "distributed.strategy: fsdp with adapter.type: qlora is not verified yet: FSDP2 can lose "
                   "bitsandbytes' 4-bit quantization state (bitsandbytes #1945), and the two-GPU check of its "
                   "gradients (tests/gpu/test_fsdp_nccl.py) has not run; use adapter.type: lora with fsdp, or "
                   "qlora with distributed.strategy: ddp"),
    Rule(lambda p: not _fsdp(p) and p.distributed.cpu_offload,
         lambda p: f"distributed.cpu_offload: true offloads FSDP's weight shards to host memory; with "
                   f"distributed.strategy: {p.distributed.strategy} there are no shards: set "
                   "distributed.strategy: fsdp, or distributed.cpu_offload: false"),
    Rule(lambda p: not _fsdp(p) and not p.distributed.reshard_after_forward,
         lambda p: f"distributed.reshard_after_forward: false keeps FSDP's gathered blocks from forward to "
                   f"backward; with distributed.strategy: {p.distributed.strategy} nothing is gathered: set "
                   "distributed.strategy: fsdp, or distributed.reshard_after_forward: true"),
)  # fmt: skip


RULES: tuple[Rule, ...] = (
    Rule(lambda p: p.batch_size == "auto" and p.effective_batch_size is None,
         lambda p: "batch_size: auto needs effective_batch_size (the rows per optimizer step to keep)"),
    Rule(lambda p: p.batch_size == "auto" and p.grad_accum_steps != 1,
         lambda p: "batch_size: auto chooses grad_accum_steps itself; set grad_accum_steps: 1 "
                   f"(got {p.grad_accum_steps})"),
    Rule(lambda p: p.batch_size != "auto" and p.effective_batch_size is not None,
         lambda p: f"effective_batch_size ({p.effective_batch_size}) is only used with batch_size: auto; "
                   f"with batch_size {p.batch_size} the effective batch is batch_size x grad_accum_steps; "
                   "set it to null"),
    Rule(lambda p: p.batch_size == "auto" and p.data.max_tokens_per_batch is not None,
         lambda p: "batch_size: auto and data.max_tokens_per_batch both size batches; choose one"),
    Rule(lambda p: p.adapter.type == "qlora" and p.device == "cpu",
         lambda p: "adapter.type = 'qlora' needs CUDA: its base model is quantized to 4-bit NF4 by bitsandbytes, "
                   "whose 4-bit kernels run on GPUs only; with device: cpu use adapter.type: lora"),
    Rule(lambda p: p.adapter.type == "qlora" and p.adapter.merge,
         lambda p: "adapter.merge: true with adapter.type: qlora would merge into a 4-bit base (rounding the "
                   "update away); save the adapter (adapter.merge: false), or merge into an fp32 base after "
                   "training"),
    Rule(lambda p: p.optim == "adamw_8bit" and p.device == "cpu",
         lambda p: "optim: adamw_8bit runs on CUDA only (bitsandbytes); device: cpu cannot use it"),
    Rule(lambda p: p.weights_dtype == "bf16" and p.precision in ("fp32", "fp16"),
         lambda p: f"weights_dtype: bf16 trains weights stored in bf16, under bf16 autocast; precision: {p.precision} "
                   "computes in another dtype: set precision: bf16 (or auto on a machine with bf16), or weights_dtype: "
                   "fp32"),
    Rule(lambda p: p.precision == "fp16" and p.device == "cpu",
         lambda p: "precision: fp16 (with loss scaling) is for GPUs; with device: cpu use precision: bf16, fp32 "
                   "or auto"),
    Rule(lambda p: p.grad_checkpointing_every > 1 and not p.grad_checkpointing,
         lambda p: f"grad_checkpointing_every: {p.grad_checkpointing_every} picks which blocks are checkpointed; "
                   "it needs grad_checkpointing: true (or set grad_checkpointing_every: 1)"),
    Rule(lambda p: p.activation_offload and p.device == "cpu",
         lambda p: "activation_offload: true moves saved activations from GPU memory to host memory; with "
                   "device: cpu they are already in host memory (set activation_offload: false)"),
    Rule(lambda p: p.kernels == "liger" and p.device == "cpu",
         lambda p: "kernels: liger runs Liger-Kernel's Triton kernels, which need CUDA; with device: cpu use "
                   "kernels: none"),
    Rule(lambda p: p.loss_impl == "chunked" and p.task == "classification",
         lambda p: "loss_impl: chunked chunks a vocabulary projection; task: classification has none (its head "
                   "has one output per class): use loss_impl: auto or full"),
    Rule(lambda p: p.loss_impl == "chunked" and (p.compile is True or p.distributed.strategy == "fsdp"),
         lambda p: "loss_impl: chunked calls the output head's weight outside the model's forward, which "
                   f"{'compile: true would retrace' if p.compile is True else 'FSDP keeps sharded'}; "
                   "use loss_impl: auto (full here) or full"),
    # Measured on an H100 (2026-11-25): Inductor fails on Liger's RMSNorm backward, logs a warning, and the run
    # trains to uniform predictions (the loss stuck at ln(vocab) from the second step).
    Rule(lambda p: p.kernels == "liger" and p.compile is True,
         lambda p: "kernels: liger with compile: true trains a broken model (Inductor cannot compile Liger's "
                   "RMSNorm backward, and the loss sticks at ln(vocabulary size)); use compile: auto or false "
                   "with kernels: liger, or kernels: none with compile: true"),
    Rule(lambda p: p.persistent_workers and p.num_workers == 0,
         lambda p: "persistent_workers: true needs num_workers > 0 (there are no workers to keep)"),
    Rule(lambda p: bool(p.distributed.use_gpu) and p.device == "cpu",
         lambda p: "distributed.use_gpu: true gives each worker a GPU; device: cpu cannot use it"),
    Rule(_one_of_prompt_and_response,
         lambda p: f"task: causal_lm needs data.prompt_column and data.response_column together (got "
                   f"{p.data.prompt_column!r} and {p.data.response_column!r}); set both (or data.prompt_template with "
                   "data.response_column), or neither for plain language modelling of data.text_column"),
    Rule(lambda p: p.data.packing and p.task != "causal_lm",
         lambda p: f"data.packing: true packs causal-LM examples; task: {p.task} keeps one example per row "
                   "(set data.packing: false, or task: causal_lm)"),
    Rule(lambda p: p.task == "causal_lm" and not isinstance(p.data.text_column, str),
         lambda p: "task: causal_lm reads one data.text_column (a string), not a list of columns"),
    Rule(lambda p: p.strategy == "auto" and p.memory_budget is None,
         lambda p: "strategy: auto chooses the fastest plan that fits memory_budget; set memory_budget "
                   "(e.g. '8GB'), or strategy: manual"),
    Rule(lambda p: p.distributed.num_workers > 1 and p.lr == "auto",
         lambda p: "lr: auto runs its range test in one process; with distributed.num_workers > 1 set lr "
                   "explicitly (run the test once with num_workers: 1, then use the lr_found it logs)"),
    *FSDP_RULES,
    Rule(lambda p: p.distributed.num_workers > 1 and p.batch_size == "auto",
         lambda p: "batch_size: auto probes one process's memory; with distributed.num_workers > 1 set "
                   "batch_size (per worker) explicitly"),
)  # fmt: skip


def first_broken_rule(params: Params) -> str | None:
    """The message of the first rule `params` break, or None when every combination is allowed."""
    for rule in RULES:
        if rule.when(params):
            return rule.message(params)
    return None
