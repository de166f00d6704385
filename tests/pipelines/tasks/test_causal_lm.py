"""The causal-LM task: window-normalized loss, prompt masking, LoRA, and save → reload → same answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from pipelines.adapters import BASE_DIR, apply_adapter, save_trained
from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit, train_causal_word_tokenizer
from pipelines.evaluation import evaluate_saved_model
from pipelines.params import Params
from pipelines.tasks import get_task
from pipelines.tasks.causal_lm import IGNORE, CausalLmCollator, mask_labels, target_counts, with_targets
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.windows import window_units
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import cpu_runtime, cpu_step

CPU = torch.device("cpu")
TASK = get_task("causal_lm")


def lm_params(base: Params, **overrides: object) -> Params:
    settings = {
        "task": "causal_lm",
        "model.config.hidden_size": 32,
        "model.config.intermediate_size": 64,
        "model.config.num_attention_heads": 2,
        "model.config.num_hidden_layers": 2,
        "model.config.dropout": 0.0,
        "adapter.target_modules": ["q_proj", "v_proj"],
    }
    return tiny_params(base, **{**settings, **overrides})


class WordTokenizer:
    """Just enough of a tokenizer for build_model: its size and special ids."""

    def __init__(self, size: int = 120):
        self.size, self.pad_token_id, self.bos_token_id, self.eos_token_id = size, 0, 2, 3

    def __len__(self) -> int:
        return self.size


def lm_split(rows: int = 12, seed: int = 0) -> TokenizedSplit:
    """Rows of unequal length, each a prompt of unequal length then a response ending in EOS (id 3)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, 15, size=rows)
    responses = rng.integers(2, 8, size=rows)
    ids = [
        np.concatenate([rng.integers(10, 120, size=p + r - 1), [3]]) for p, r in zip(prompts, responses, strict=True)
    ]
    lengths = (prompts + responses).astype(np.int32)
    return TokenizedSplit(np.concatenate(ids).astype(np.int32), lengths, prompt_lengths=prompts.astype(np.int32))


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_k_micro_batches_equal_one_batch_of_their_rows(default_params):
    params = lm_params(default_params)
    split = lm_split()
    units = TASK.loss_units(split, params)
    collate = CausalLmCollator(split, 0, train_on_prompt=False, fixed_length=None, pad_to_multiple_of=None)
    torch.manual_seed(0)
    model = TASK.build_model(params, WordTokenizer(), Path("."), Path("."))
    step = cpu_step(model, TASK, scaler=False)

    def run(window: list[list[int]]) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loader = iter(collate(batch) for batch in window)
        step.accumulate(list(loader), window_units(window, units))
        return gradients(model)

    one = run([list(range(12))])
    # Three micro-batches of unequal rows, lengths and target-token counts.
    many = run([[0, 1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]])
    assert len(set(units[[0, 1, 2, 3, 4]].tolist())) > 1
    for name in one:
        torch.testing.assert_close(many[name], one[name], atol=1e-5, rtol=0, msg=name)


def test_transformers_without_2d_logits_to_keep_get_full_logits_and_the_same_loss(default_params, monkeypatch):
    # transformers before `slice_logits_to_keep` (5.17 on the GPU machine) index `hidden[:, positions, :]`, which
    # broadcasts our 2-D positions to batch x batch rows: the loss then failed on a shape mismatch.
    from transformers import modeling_utils

    from pipelines.tasks.causal_lm import _keeps_logits, next_token_loss

    params, split = lm_params(default_params), lm_split()
    batch = CausalLmCollator(split, 0, train_on_prompt=False, fixed_length=None, pad_to_multiple_of=None)(range(6))
    torch.manual_seed(0)
    model = TASK.build_model(params, WordTokenizer(), Path("."), Path("."))
    assert _keeps_logits(model)
    kept = next_token_loss(model, dict(batch))
    monkeypatch.delattr(modeling_utils, "slice_logits_to_keep")
    assert not _keeps_logits(model)
    full = next_token_loss(model, dict(batch))
    torch.testing.assert_close(full[0], kept[0])
    assert full[1:] == kept[1:]


def test_only_response_tokens_count_unless_the_prompt_is_trained_on(default_params):
    params = lm_params(default_params)
    split = lm_split(rows=6, seed=1)
    torch.manual_seed(0)
    model = TASK.build_model(params, WordTokenizer(), Path("."), Path(".")).eval()
    batch = CausalLmCollator(split, 0, train_on_prompt=False, fixed_length=None, pad_to_multiple_of=None)(range(6))
    prompts = torch.from_numpy(split.prompt_lengths.astype(np.int64))

    def loss_with(label_tokens: torch.Tensor, train_on_prompt: bool) -> float:
        labels = mask_labels(label_tokens, batch["attention_mask"], prompts, train_on_prompt)
        return float(TASK.loss(model, with_targets({**batch, "labels": labels}))[0])

    tokens = batch["input_ids"]
    in_prompt, in_response = tokens.clone(), tokens.clone()
    in_prompt[0, int(prompts[0]) - 1] = 7  # another label for the prompt's last token
    in_response[0, int(prompts[0])] = 7  # another label for the response's first token
    with torch.no_grad():
        base = loss_with(tokens, False)
        assert loss_with(in_prompt, False) == base  # the prompt's labels have no effect
        assert loss_with(in_response, False) != base
        assert loss_with(in_prompt, True) != loss_with(tokens, True)  # unless the prompt is trained on
    # The count is the response tokens (padding never counts), known from lengths alone.
    assert int(TASK.loss(model, batch)[1]) == int(target_counts(split.lengths, split.prompt_lengths, False).sum())
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE).all()
    # And the loss is the hand-computed mean... summed: full logits, response positions only.
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=batch["attention_mask"]).logits[:, :-1]
        reference = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), reduction="sum"
        )
        torch.testing.assert_close(TASK.loss(model, batch)[0], reference, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("task_name", ["causal_lm", "classification"])
def test_lora_trains_only_the_adapter_and_saves_a_small_file(default_params, tmp_path, task_name):
    from tests.pipelines.train.helpers import tiny_split

    params = lm_params(
        default_params,
        **{
            "task": task_name,
            "adapter.type": "lora",
            "adapter.target_modules": None,  # peft's default for llama / bert: the attention's query and value
            "model.config.hidden_size": 128,
            "model.config.intermediate_size": 256,
            "epochs": 1,
            "batch_size": 4,
            "fast_dropout": False,
        },
    )
    task = get_task(task_name)
    torch.manual_seed(0)
    if task_name == "causal_lm":
        base, split = task.build_model(params, WordTokenizer(2000), tmp_path, tmp_path), lm_split(rows=16)
    else:
        (tmp_path / "labels.json").write_text(json.dumps({"names": ["a", "b", "c"]}))
        base, split = task.build_model(params, WordTokenizer(2000), tmp_path, tmp_path), tiny_split(rows=16)
    base.save_pretrained(tmp_path / "full")
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = apply_adapter(base, params.adapter, task)
    result = train_model(
        TrainRequest(model, split, None, params, pad_id=0, device=CPU, precision="fp32", say=lambda _: None)
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable), trainable
    for name, param in model.get_base_model().named_parameters():
        original = name.replace(".base_layer", "").replace("modules_to_save.default.", "")
        if "lora_" not in name and "classifier" not in name:
            assert torch.equal(param, before[original]), name  # frozen: not one bit changed
    trainable_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert result.metrics["trainable_param_bytes"] == trainable_bytes
    assert result.metrics["frozen_param_bytes"] > 10 * trainable_bytes
    assert result.metrics["optimizer_state_bytes"] == 2 * trainable_bytes  # AdamW: two moments, trainable only
    save_trained(model, tmp_path / "adapter", params)
    adapter_size = sum(f.stat().st_size for f in (tmp_path / "adapter").iterdir())
    full_size = sum(f.stat().st_size for f in (tmp_path / "full").iterdir())
    if task_name == "causal_lm":
        assert adapter_size < 0.05 * full_size, (adapter_size, full_size)
    else:  # the trained classifier head travels with the adapter
        assert adapter_size < 0.25 * full_size, (adapter_size, full_size)


def instruction_rows(rows: int) -> pd.DataFrame:
    from pipelines.data.synthetic import generate_instructions
    from pipelines.params import GeneratorParams

    return generate_instructions(GeneratorParams(num_rows=rows, num_classes=4, label_noise=0.0))


@pytest.mark.parametrize("merge", [False, True])
def test_saved_model_reloads_and_answers_the_same(default_params, tmp_path, merge):
    params = lm_params(
        default_params,
        **{"adapter.type": "lora", "adapter.merge": merge, "epochs": 1, "lr": 0.01, "eval.max_new_tokens": 4},
    )
    table = instruction_rows(200)
    tokenizer = train_causal_word_tokenizer((table["prompt"] + table["response"]).tolist(), 2000)
    tokenized = tmp_path / "tokenized"
    tokenizer.save_pretrained(tokenized / TOKENIZER_DIR)
    train = TASK.encode(tokenizer, table.iloc[:160], params, tokenized).split
    test = TASK.encode(tokenizer, table.iloc[160:], params, tokenized).split
    test.save(tokenized / "test")
    torch.manual_seed(0)
    model = TASK.build_model(params, tokenizer, tokenized, tmp_path)
    out = tmp_path / "model"
    if not merge:
        model.save_pretrained(out / BASE_DIR)
    model = apply_adapter(model, params.adapter, TASK)
    train_model(TrainRequest(model, train, None, params, pad_id=tokenizer.pad_token_id, device=CPU, precision="fp32"))
    before = TASK.evaluate(model, tokenizer, test, tokenized, params, cpu_runtime(pad_id=tokenizer.pad_token_id))
    save_trained(model, out, params)
    tokenizer.save_pretrained(out)
    (out / "params.json").write_text(json.dumps(params.model_dump(mode="json")))
    assert (out / "adapter_config.json").is_file() != merge
    after = evaluate_saved_model(out, tokenized)
    pd.testing.assert_frame_equal(after.predictions, before.predictions)
    for name in ("test_loss", "test_token_accuracy", "test_exact_match"):
        assert after.metrics[name] == pytest.approx(before.metrics[name], abs=1e-6), name
    assert list(after.predictions.columns) == ["row_id", "prompt", "reference", "generated", "exact_match"]
    assert after.predictions["reference"].str.len().gt(0).all()


def test_a_long_example_is_cut_in_its_prompt_so_its_answer_is_kept_whole():
    from pipelines.tasks.generation import fit_to_length

    bos, prompt, answer = 1, [1, 10, 11, 12, 13, 14, 15], [20, 21, 2]
    assert fit_to_length(prompt, answer, 20, bos) == (prompt, answer)  # fits: untouched
    # 8 tokens: the answer (3) whole, the prompt's BOS and its last 4 tokens (the question, a template's header).
    assert fit_to_length(prompt, answer, 8, bos) == ([1, 12, 13, 14, 15], answer)
    assert fit_to_length(prompt, answer, 5, None) == ([14, 15], answer)
    # An answer longer than the row keeps its start and one prompt token: never an empty target.
    assert fit_to_length(prompt, [20, 21, 22, 23, 2], 3, bos) == ([15], [20, 21])
