"""Each FSDP rank loads only its shard (pipelines/train/shard_loading.py), on real gloo CPU ranks.

Correctness: the gathered weights equal the checkpoint (or rank 0's model) exactly, and one forward gives the
logits of the whole model loaded the ordinary way. The bound: 4 ranks loading a 0.37B Llama together peak at
under half of the host RAM four whole copies take, against one process loading it whole (`from_pretrained`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from pipelines.train.shard_loading import broadcast_from_rank0, build_on_meta, load_sharded_safetensors
from tests.pipelines.train.helpers import loopback_init_method, loopback_process_group, tiny_model
from tests.pipelines.train.test_ddp import _spawn_and_wait

CPU = torch.device("cpu")
TOKENS = torch.tensor([[1, 5, 9, 33, 70, 2, 11, 4], [3, 8, 13, 21, 34, 55, 89, 1]])


def tiny_llama(tied: bool) -> LlamaConfig:
    """Rows that 3 ranks cannot split evenly (vocab 101, hidden 30, MLP 50, 2 labels: the last rank holds none)."""
    return LlamaConfig(
        vocab_size=101, hidden_size=30, intermediate_size=50, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, tie_word_embeddings=tied, num_labels=2, pad_token_id=0, max_position_embeddings=64,
    )  # fmt: skip


def shard_blocks_and_root(model: torch.nn.Module, world_size: int) -> None:
    """FSDP2 per transformer block (`_no_split_modules`) and at the root, as torchtitan applies it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    blocks = set(model._no_split_modules)
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Activation checkpointing per block, by torch's wrapper (it renames the weights in `named_parameters`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    blocks = set(model._no_split_modules)
    apply_activation_checkpointing(model, checkpoint_wrapper, check_fn=lambda m: type(m).__name__ in blocks)


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank joins; rank 0 gets the whole state dict on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _load_from_checkpoints(rank: int, world_size: int, init_method: str, folders: list[str], out: str) -> None:
    torch.set_num_threads(1)
    results = {}
    with loopback_process_group(rank, world_size, init_method):
        for folder, cls in zip(folders, (LlamaForCausalLM, LlamaForSequenceClassification), strict=True):
            config = LlamaConfig.from_pretrained(folder)
            # As pipelines/model.py builds from a config (`weights=False`): fp32 master weights whatever the
            # checkpoint's dtype (a bf16 config alone would build the body in bf16 and the head in fp32).
            auto = AutoModelForCausalLM if cls is LlamaForCausalLM else AutoModelForSequenceClassification
            model = build_on_meta(lambda: auto.from_config(config, dtype=torch.float32))  # noqa: B023 (called at once)
            if cls is LlamaForSequenceClassification:  # torchtitan's order: checkpointing, then FSDP
                checkpoint_blocks(model)
            shard_blocks_and_root(model, world_size)
            load_sharded_safetensors(model, Path(folder), CPU)
            full = gathered(model)
            with torch.no_grad():
                logits = model.eval()(TOKENS).logits
            results[folder] = {"state": full, "logits": logits, "inv_freq": model.model.rotary_emb.inv_freq.clone()}
    if rank == 0:
        torch.save(results, out)


def test_each_rank_reads_its_rows_and_the_whole_equals_the_checkpoint(tmp_path: Path):
    from safetensors.torch import save_file

    folders = []
    for tied, cls, dtype in (
        (True, LlamaForCausalLM, torch.float32),
        (False, LlamaForSequenceClassification, torch.bfloat16),
    ):
        torch.manual_seed(1)
        folder = tmp_path / cls.__name__
        # Several files and an index (model.safetensors.index.json), as hub checkpoints of large models come;
        # the second in bf16, as most are, loaded into fp32 master weights.
        cls(tiny_llama(tied)).to(dtype).save_pretrained(folder, max_shard_size="20KB")
        folders.append(str(folder))
    assert (Path(folders[0]) / "model.safetensors.index.json").is_file()
    # A file the index does not name, beside the shards (as Mistral's `consolidated.safetensors`): never read.
    # Its tensor has another shape, so DCP, if it saw the file, would fail whatever order the folder lists.
    save_file({"model.embed_tokens.weight": torch.zeros(202, 30)}, Path(folders[0]) / "consolidated.safetensors")
    out = tmp_path / "results.pt"
    _spawn_and_wait(_load_from_checkpoints, args=(3, loopback_init_method(), folders, str(out)), nprocs=3, seconds=300)
    results = torch.load(out, weights_only=False)
    for folder, cls in zip(folders, (LlamaForCausalLM, LlamaForSequenceClassification), strict=True):
        shards = [f for f in Path(folder).glob("model-*.safetensors")]
        saved = {k: v.float() for f in shards for k, v in load_file(f).items()}
        state = results[folder]["state"]
        assert len(shards) > 1 and set(saved) <= set(state)
        assert all(torch.equal(state[k], v) for k, v in saved.items()), folder
        whole = cls.from_pretrained(folder, dtype=torch.float32).eval()  # the ordinary way
        if whole.config.tie_word_embeddings:
            assert "lm_head.weight" not in saved and torch.equal(
                state["lm_head.weight"], saved["model.embed_tokens.weight"]
            )
        assert torch.equal(results[folder]["inv_freq"], whole.model.rotary_emb.inv_freq)
        with torch.no_grad():
            expected = whole(TOKENS).logits
        torch.testing.assert_close(results[folder]["logits"], expected, rtol=0, atol=1e-6)


def _broadcast(rank: int, world_size: int, init_method: str, out: str) -> None:
    torch.set_num_threads(1)
    with loopback_process_group(rank, world_size, init_method):
        whole = tiny_model(layers=2, hidden=30, seed=7).eval() if rank == 0 else None  # random weights, rank 0 only
        model = build_on_meta(lambda: tiny_model(layers=2, hidden=30, seed=99))
        shard_blocks_and_root(model, world_size)
        broadcast_from_rank0(model, whole, CPU)
        full = gathered(model)
        with torch.no_grad():
            logits = model.eval()(TOKENS).logits
        if rank == 0:
            with torch.no_grad():
                expected = whole(TOKENS).logits
            buffers = {name: (buffer, whole.get_buffer(name)) for name, buffer in model.named_buffers()}
            torch.save(
                {"state": full, "whole": whole.state_dict(), "logits": (logits, expected), "buffers": buffers}, out
            )


def test_a_model_without_checkpoint_is_built_by_rank_0_and_broadcast(tmp_path: Path):
    out = tmp_path / "broadcast.pt"
    _spawn_and_wait(_broadcast, args=(3, loopback_init_method(), str(out)), nprocs=3, seconds=300)
    result = torch.load(out, weights_only=False)
    assert result["state"].keys() == result["whole"].keys()
    assert all(torch.equal(result["state"][k], v) for k, v in result["whole"].items())
    assert all(torch.equal(mine, theirs) for mine, theirs in result["buffers"].values())  # e.g. position_ids
    logits, expected = result["logits"]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


# The bound's model: Llama-shaped, 0.37B parameters (1.39 GiB in fp32), its vocab uneven over 4 ranks. Sized to
# fit a 2-core, 24 GiB CI host shared with other jobs: each rank peaks at about 1 GiB (0.4 of it loading), the
# baseline process at about 3.
BIG = {"vocab_size": 32003, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
       "num_attention_heads": 16, "num_key_value_heads": 16, "tie_word_embeddings": False}  # fmt: skip
RANKS = 4


def big_parameter_count() -> int:
    """By hand from the shapes: embeddings and head, then per block 4 attention projections, 3 MLP ones, 2 norms."""
    h, v, i, layers = BIG["hidden_size"], BIG["vocab_size"], BIG["intermediate_size"], BIG["num_hidden_layers"]
    return 2 * v * h + layers * (4 * h * h + 3 * h * i + 2 * h) + h


def rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def reset_peak() -> int:
    """Restart the kernel's peak-RSS counter (VmHWM) at the current RSS, and return that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kib("VmRSS") * 1024


def _save_big(rank: int, folder: str) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**BIG)).save_pretrained(folder, max_shard_size="200MB")


def _load_whole(rank: int, folder: str, out: str) -> None:
    import copy

    before = reset_peak()
    # What every rank does today: load the whole model, then FSDP shards a deep copy of it (parallel.shard).
    # transformers maps the file and reads a weight's pages only when touched: the copy touches them all.
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sharded_copy = copy.deepcopy(model)
    peak = rss_kib("VmHWM") * 1024 - before
    del sharded_copy
    torch.save({"peak": peak, "params": sum(p.numel() for p in model.parameters())}, out)


def _load_shard(rank: int, init_method: str, folder: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    with loopback_process_group(rank, RANKS, init_method):
        config = LlamaConfig.from_pretrained(folder)
        dist.barrier()
        before = reset_peak()
        model = build_on_meta(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        shard_blocks_and_root(model, RANKS)
        load_sharded_safetensors(model, Path(folder), CPU)
        peaks: list[int | None] = [None] * RANKS
        dist.all_gather_object(peaks, rss_kib("VmHWM") * 1024 - before)
        local = sum(p.to_local().numel() for p in model.parameters())
        locals_: list[int | None] = [None] * RANKS
        dist.all_gather_object(locals_, local)
    if rank == 0:
        torch.save({"peaks": peaks, "local_params": locals_}, out)


def test_four_ranks_loading_their_shards_take_under_half_of_four_whole_copies(tmp_path: Path):
    folder, gib = str(tmp_path / "llama"), 2**30
    _spawn_and_wait(_save_big, args=(folder,), nprocs=1, seconds=600)
    whole_out, shard_out = tmp_path / "whole.pt", tmp_path / "shards.pt"
    _spawn_and_wait(_load_whole, args=(folder, str(whole_out)), nprocs=1, seconds=600)
    _spawn_and_wait(_load_shard, args=(loopback_init_method(), folder, str(shard_out)), nprocs=RANKS, seconds=600)
    whole, shards = torch.load(whole_out), torch.load(shard_out)

    params = big_parameter_count()
    assert whole["params"] == params == sum(shards["local_params"])  # the ranks' rows cover the model once
    four_copies_by_hand, four_copies_measured = RANKS * params * 4, RANKS * whole["peak"]
    print(
        f"\n{params / 1e9:.2f}B parameters, fp32: four whole copies = {four_copies_by_hand / gib:.2f} GiB by hand, "
        f"{four_copies_measured / gib:.2f} GiB measured (one process loading it whole: {whole['peak'] / gib:.2f} "
        f"GiB peak over its start); {RANKS} ranks loading their shards: "
        f"{', '.join(f'{p / gib:.2f}' for p in shards['peaks'])} GiB, sum {sum(shards['peaks']) / gib:.2f} GiB"
    )
    assert sum(shards["peaks"]) <= 0.5 * min(four_copies_by_hand, four_copies_measured)
